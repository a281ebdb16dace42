"""The chat page of `smoe serve` in headless Chromium, driven by WebDriver (selenium).

usage: page_test.py BASE_URL KEYED_BASE_URL KEY SCREENSHOT

BASE_URL serves the demo vault (and a fixture) without a key; KEYED_BASE_URL the same with
API key KEY. Checks: the model picker lists the server's models; a message streams a reply
that grows in several steps; Stop ends a long generation mid-stream; a reload finds the
conversation; a keyed server makes the page ask for the key, and with it the models load.
Saves a screenshot of the page after a reply. Prints one line per check.
"""

import atexit
import shutil
import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select, WebDriverWait

base, keyed, key, shot = sys.argv[1:5]

opts = Options()
for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,860"]:
    opts.add_argument(a)
# A profile of our own, removed at exit: Chromium's default one stays behind in /tmp.
profile = tempfile.mkdtemp(prefix="smoe-page-")
atexit.register(shutil.rmtree, profile, True)
opts.add_argument("--user-data-dir=" + profile)
driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
wait = WebDriverWait(driver, 60)


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what + (": " + detail if detail else ""), flush=True)
    if not ok:
        driver.save_screenshot(shot + ".failed.png")
        driver.quit()
        sys.exit(1)


def options():
    return [o.get_attribute("value") for o in Select(driver.find_element(By.ID, "model")).options]


def set_field(id_, value):
    el = driver.find_element(By.ID, id_)
    el.clear()
    el.send_keys(str(value))
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", el)


def watch_last_reply():
    # Records the text length of the messages box at every DOM change, with its time.
    driver.execute_script(
        """
        window.__lens = [];
        const box = document.getElementById('messages');
        new MutationObserver(() => window.__lens.push(box.innerText.length))
            .observe(box, {childList: true, subtree: true, characterData: true});
        """
    )


def send(text):
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


try:
    driver.get(base + "/")
    wait.until(lambda d: len(options()) >= 2)
    models = options()
    check("the picker lists the server's models", "demo" in models and "qwen3" in models, ", ".join(models))
    Select(driver.find_element(By.ID, "model")).select_by_value("demo")

    # A short reply, streamed: the reply grows over several DOM updates and ends with its stats.
    # The tiny demo model writes 48 tokens in well under a frame's worth of milliseconds on a
    # fast machine, and the browser may take the whole stream in one or two reads (a CI run
    # saw 3 DOM updates): the network is throttled (~10 KB of events at 8 KB/s) so the stream
    # arrives in pieces however fast the model is.
    driver.find_element(By.ID, "toggle-settings").click()
    set_field("max_tokens", 48)
    set_field("temperature", 0)
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.emulateNetworkConditions",
                           {"offline": False, "latency": 0, "downloadThroughput": 8000, "uploadThroughput": 100000})
    watch_last_reply()
    send("What does the len function return?")
    wait.until(lambda d: "tokens in" in d.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .meta").text
               if d.find_elements(By.CSS_SELECTOR, ".msg.assistant:last-child .meta") else False)
    lens = driver.execute_script("return window.__lens")
    steps = len(set(lens))
    reply = driver.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .body").text
    check("the reply arrives incrementally", steps >= 5, f"{steps} distinct lengths over {len(lens)} DOM updates")
    check("the reply has text", len(reply.strip()) > 0, repr(reply[:80]))
    wait.until(lambda d: d.find_element(By.ID, "m-decode").text.endswith("tok/s"))
    check("the live panel shows the reply's decode speed", True, driver.find_element(By.ID, "m-decode").text)
    driver.save_screenshot(shot)

    # Stop: a long reply stopped once its first tokens are on the page. The stream is throttled
    # to 3 KB/s by the browser's network emulation, so the click always lands mid-stream however
    # fast the model is (the server's side of a hang-up is tested in serve.rs).
    set_field("max_tokens", 400)
    set_field("temperature", 1)
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.emulateNetworkConditions",
                           {"offline": False, "latency": 0, "downloadThroughput": 3000, "uploadThroughput": 100000})
    send("Write a long story about a list and a dict.")
    wait.until(lambda d: len(d.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .body").text) > 0)
    driver.find_element(By.ID, "stop").click()
    wait.until(EC.invisibility_of_element_located((By.ID, "stop")))
    driver.execute_cdp_cmd("Network.emulateNetworkConditions",
                           {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    meta = driver.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .meta").text
    check("Stop ends the generation mid-stream", meta == "stopped", repr(meta))

    # Regenerate replaces the last reply with a new one.
    Select(driver.find_element(By.ID, "model")).select_by_value("demo")
    n_before = len(driver.find_elements(By.CSS_SELECTOR, ".msg"))
    set_field("max_tokens", 16)
    driver.find_element(By.ID, "regen").click()
    wait.until(lambda d: "tokens in" in d.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .meta").text
               if d.find_elements(By.CSS_SELECTOR, ".msg.assistant:last-child .meta") else False)
    n_after = len(driver.find_elements(By.CSS_SELECTOR, ".msg"))
    check("Regenerate replaces the last reply", n_after == n_before, f"{n_before} messages before, {n_after} after")

    # The picker says the model is loaded now, with its cache.
    wait.until(lambda d: "loaded, cache" in Select(d.find_element(By.ID, "model")).first_selected_option.text)
    check("the picker shows the loaded model's cache", True, Select(driver.find_element(By.ID, "model")).first_selected_option.text)

    # An error is shown as the server words it: a prompt longer than the demo's context.
    driver.execute_script("document.getElementById('input').value = arguments[0]", "list dict tuple set " * 2000)
    driver.find_element(By.ID, "send").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant:last-child .error"))
    err = driver.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .error").text
    check("a too-long prompt shows the server's message", "context" in err, repr(err))

    # Reload: the conversation is still there.
    driver.refresh()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.user"))
    users = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".msg.user .body")]
    check("a reload finds the conversation", "What does the len function return?" in users, f"{len(users)} user messages")
    check("and its error", len(driver.find_elements(By.CSS_SELECTOR, ".msg .error")) == 1)

    # A keyed server: the page asks for the key; with it, the models load.
    driver.get(keyed + "/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    wait.until(EC.visibility_of_element_located((By.ID, "keybox")))
    check("a keyed server makes the page ask for the key", True)
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#keyform button").click()
    wait.until(lambda d: len(options()) >= 2)
    check("with the key the models load", True, ", ".join(options()))
finally:
    driver.quit()
