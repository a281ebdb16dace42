"""Open WebUI, the real client, against `smoe serve`, in headless Chromium (see openwebui.sh).

usage: openwebui_drive.py OPENWEBUI_URL SMOE_URL SCREENSHOT

With Open WebUI's defaults (its built-in tools sent with every chat, title and tag requests
after each reply): the smoe models appear in its picker; a message streams a reply (the text
grows over several samples); a follow-up turn reuses the server's cached prefix (from
smoe's /v1/smoe/stats: prompt tokens computed vs prompt tokens); and the time to first token
of a first and a second new conversation, in the browser (Enter to the first reply text) and
as the server measured it. Prints one line per figure; exits non-zero when a check fails.
"""

import json
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

owui, smoe, shot = sys.argv[1:4]
opts = Options()
for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"]:
    opts.add_argument(a)
d = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
failed = False


def report(what, ok, detail=""):
    global failed
    failed |= not ok
    print(("ok   " if ok else "FAIL ") + what + (": " + detail if detail else ""), flush=True)


def stats():
    with urllib.request.urlopen(smoe + "/v1/smoe/stats") as r:
        return json.load(r)


def click_text(text):
    for b in d.find_elements(By.TAG_NAME, "button"):
        if text in b.text:
            b.click()
            return True
    return False


def assistant_text():
    # The reply bubbles of Open WebUI 0.12 carry their text in elements under #response-content-container.
    # Read in one script: the bubble is re-rendered as tokens arrive.
    return d.execute_script(
        "const e = document.querySelectorAll('#response-content-container'); return e.length ? e[e.length - 1].innerText : ''")


def send(text):
    box = d.find_element(By.ID, "chat-input")
    box.click()
    box.send_keys(text)
    t0 = time.time()
    box.send_keys(Keys.ENTER)
    return t0


def wait_first_text(t0, before, timeout=600):
    while time.time() - t0 < timeout:
        t = assistant_text()
        if t.strip() and t != before:
            return time.time() - t0
        time.sleep(0.05)
    return None


def wait_done(timeout=600):
    # The reply and Open WebUI's requests after it (title, tags, follow-ups) have finished: the
    # server's queue is empty and the reply has not changed for three seconds.
    t0, last, since = time.time(), None, time.time()
    while time.time() - t0 < timeout:
        text, busy = assistant_text(), any(m["queue_depth"] for m in stats()["models"])
        if text != last or busy:
            last, since = text, time.time()
        elif time.time() - since > 3:
            return
        time.sleep(0.2)


def new_chat():
    d.get(owui + "/")
    time.sleep(5)


def show(phase, samples):
    # Every generation the server ran for the phase: Open WebUI's task requests and the chat.
    for r in samples:
        print(f"     {phase}: prompt {r['prompt_tokens']}, computed {r['prefilled_tokens']}, generated {r['generated_tokens']}, "
              f"TTFT {r['ttft_ms']:.0f} ms", flush=True)


try:
    d.get(owui + "/")
    time.sleep(8)
    click_text("Let's Go")
    time.sleep(1)
    picker = [b.text for b in d.find_elements(By.TAG_NAME, "button") if (b.get_attribute("aria-label") or "").startswith("Selected model")]
    models = [m["id"] for m in stats()["models"]]
    report("the smoe models appear in Open WebUI's picker", any(m in " ".join(picker) for m in models), f"picker {picker}, smoe {models}")

    # A first new conversation: streamed, timed, stopped after a few seconds of streaming.
    n0 = len(stats()["recent"])
    # Every change of the reply's text, recorded in the page (a short reply streams faster than
    # WebDriver can poll).
    d.execute_script("""
        window.__lens = [];
        new MutationObserver(() => {
            const e = document.querySelectorAll('#response-content-container');
            if (e.length) window.__lens.push(e[e.length - 1].innerText.length);
        }).observe(document.body, {childList: true, subtree: true, characterData: true});
    """)
    t0 = send("What does the len function return?")
    ttft1 = wait_first_text(t0, "")
    wait_done()
    steps = len(set(d.execute_script("return window.__lens")))
    report("a chat message streams a reply", ttft1 is not None and steps >= 3,
           f"first text after {ttft1:.2f} s in the browser; the reply grew in {steps} steps")
    d.save_screenshot(shot)
    wait_done()
    show("first new conversation", stats()["recent"][n0:])

    # A follow-up turn in the same conversation: the server's cached prefix.
    n1 = len(stats()["recent"])
    before = assistant_text()
    t1 = send("And for a dict?")
    wait_first_text(t1, before)
    wait_done()
    recent = stats()["recent"][n1:]
    reused = [r for r in recent if r["prefilled_tokens"] < r["prompt_tokens"] / 2]
    report("a follow-up turn reuses the cached prefix", bool(reused),
           "; ".join(f"prompt {r['prompt_tokens']} computed {r['prefilled_tokens']}" for r in recent))

    # A second new conversation.
    new_chat()
    n2 = len(stats()["recent"])
    t2 = send("How do I sort a list?")
    ttft2 = wait_first_text(t2, "")
    wait_done()
    report("second new conversation", ttft2 is not None, f"first text after {ttft2:.2f} s in the browser" if ttft2 else "no reply")
    show("second new conversation", stats()["recent"][n2:])
finally:
    d.quit()
sys.exit(1 if failed else 0)
