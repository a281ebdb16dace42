"""Open WebUI, the real client, against `smoe serve`, in headless Chromium (see openwebui.sh).

usage: openwebui_drive.py OPENWEBUI_URL SMOE_URL SCREENSHOT [CHECKS]

CHECKS is a comma-separated list (default `defaults`):
- `defaults`: with Open WebUI's defaults (its built-in tools sent with every chat, title and tag requests
after each reply): the smoe models appear in its picker; a message streams a reply (the text
grows over several samples); a follow-up turn reuses the server's cached prefix (from
smoe's /v1/smoe/stats: prompt tokens computed vs prompt tokens); and the time to first token
of a first and a second new conversation, in the browser (Enter to the first reply text) and
as the server measured it.
- `tool`: the model set, in Open WebUI's per-model settings, to send a `tool_choice` naming its
  built-in `get_current_timestamp` (a custom parameter): a new conversation's reply is that
  call, which Open WebUI runs and shows (smoe holds the reply to the tool-call grammar).
- `reasoning`: a reply that opens in reasoning (smoe serve started with a thinking chat
  template) shows as Open WebUI's folded reasoning block.
Prints one line per figure; exits non-zero when a check fails. Screenshots: SCREENSHOT, and
SCREENSHOT with -tool / -reasoning before its extension.
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
checks = (sys.argv[4] if len(sys.argv) > 4 else "defaults").split(",")
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


def last_reply(prop="innerText"):
    # The reply bubbles of Open WebUI 0.12 carry their text in elements under #response-content-container.
    # Read in one script: the bubble is re-rendered as tokens arrive.
    return d.execute_script(
        f"const e = document.querySelectorAll('#response-content-container'); return e.length ? e[e.length - 1].{prop} : ''")


def assistant_text():
    return last_reply()


def send(text):
    box = d.find_element(By.ID, "chat-input")
    box.click()
    box.send_keys(text)
    t0 = time.time()
    box.send_keys(Keys.ENTER)
    return t0


def wait_first_text(t0, before, timeout=1800):
    while time.time() - t0 < timeout:
        t = assistant_text()
        if t.strip() and t != before:
            return time.time() - t0
        time.sleep(0.05)
    return None


def wait_done(timeout=1800):
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


def shot_as(suffix):
    stem, dot, ext = shot.rpartition(".")
    return f"{stem}-{suffix}.{ext}" if dot else f"{shot}-{suffix}"


def set_custom_params(model_id, custom):
    # What Workspace → Models → (model) → Advanced Params → custom parameter does: a model entry
    # over the connection's model, saved through Open WebUI's API with the page's own token.
    return d.execute_async_script("""
        const [id, custom, done] = arguments;
        fetch('/api/v1/models/create', {method: 'POST', headers: {'Content-Type': 'application/json',
              Authorization: 'Bearer ' + localStorage.token},
              body: JSON.stringify({id, name: id, base_model_id: null, meta: {}, params: {custom_params: custom}})})
          .then(r => r.text().then(t => done(r.status + ' ' + t.slice(0, 200)))).catch(e => done('error ' + e));
    """, model_id, custom)


def show(phase, samples):
    # Every generation the server ran for the phase: Open WebUI's task requests and the chat.
    for r in samples:
        print(f"     {phase}: prompt {r['prompt_tokens']}, computed {r['prefilled_tokens']}, generated {r['generated_tokens']}, "
              f"TTFT {r['ttft_ms']:.0f} ms", flush=True)


def tool():
    # Open WebUI's built-in tools ride on every chat (native function calling); the model's
    # custom parameter makes smoe hold the reply to a call of one of them. Named, and one
    # without parameters: under plain `required` random weights pick tools with string
    # arguments and write them past the reply's token cap (seen: a 64-token reply cut inside
    # the string), which a trained model would close.
    model = stats()["models"][0]["id"]
    choice = {"type": "function", "function": {"name": "get_current_timestamp"}}
    saved = set_custom_params(model, {"tool_choice": choice, "parallel_tool_calls": False})
    report("per-model custom parameters tool_choice, parallel_tool_calls saved", saved.startswith("200"), saved[:80])
    new_chat()
    n0 = len(stats()["recent"])
    t0 = send("What time is it?")
    got, html = None, ""
    while time.time() - t0 < 900 and got is None:
        html = last_reply("innerHTML")
        # Open WebUI renders a call it ran as a <details type="tool_calls"> block.
        if 'type="tool_calls"' in html or "get_current_timestamp" in html:
            got = time.time() - t0
        time.sleep(0.2)
    wait_done()
    html = last_reply("innerHTML")
    with open(shot_as("tool") + ".html", "w") as f:
        f.write(html)
    for e in d.find_elements(By.XPATH, "//*[contains(text(), 'get_current_timestamp')]"):
        try:
            e.click()  # unfold the calls and their results for the screenshot
            time.sleep(1)
            break
        except Exception:
            continue
    d.save_screenshot(shot_as("tool"))
    recent = stats()["recent"][n0:]
    show("tool call", recent)
    text = assistant_text()
    # Shown means run: Open WebUI lists the call with its result.
    report("a tool call shows in Open WebUI", got is not None and "View Result from get_current_timestamp" in text,
           f"after {got:.1f} s: {text[:200]!r}" if got else html[:400])
    report("per-model custom parameter removed", delete_model_entry(model))


def delete_model_entry(model_id):
    r = d.execute_async_script("""
        const [id, done] = arguments;
        fetch('/api/v1/models/model/delete', {method: 'POST', headers: {'Content-Type': 'application/json',
              Authorization: 'Bearer ' + localStorage.token}, body: JSON.stringify({id})})
          .then(r => done(r.status)).catch(e => done(0));
    """, model_id)
    return r == 200


def reasoning():
    new_chat()
    n0 = len(stats()["recent"])
    t0 = send("Why is the sky blue?")
    got = None
    while time.time() - t0 < 600 and got is None:
        html = last_reply("innerHTML")
        if 'type="reasoning"' in html or "Thinking" in html or "Thought for" in html:
            got = time.time() - t0
        time.sleep(0.1)
    wait_done()
    html = last_reply("innerHTML")
    for b in d.find_elements(By.TAG_NAME, "button"):
        if "Thought for" in b.text or "Thinking" in b.text:
            b.click()  # unfold it for the screenshot
            time.sleep(1)
            break
    d.save_screenshot(shot_as("reasoning"))
    show("reasoning", stats()["recent"][n0:])
    text = assistant_text()
    # Folded means Open WebUI's block, which says how long the model thought.
    report("a reply's reasoning shows folded in Open WebUI", got is not None and "Thought for" in text,
           f"after {got:.1f} s: {text[:200]!r}" if got else html[:400])


def defaults():
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
try:
    d.get(owui + "/")
    time.sleep(8)
    click_text("Let's Go")
    time.sleep(1)
    picker = [b.text for b in d.find_elements(By.TAG_NAME, "button") if (b.get_attribute("aria-label") or "").startswith("Selected model")]
    models = [m["id"] for m in stats()["models"]]
    report("the smoe models appear in Open WebUI's picker", any(m in " ".join(picker) for m in models), f"picker {picker}, smoe {models}")
    for check in checks:
        {"defaults": defaults, "tool": tool, "reasoning": reasoning}[check]()
except Exception:
    import traceback

    traceback.print_exc()
    failed = True
finally:
    d.quit()
sys.exit(1 if failed else 0)
