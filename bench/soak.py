"""Soak test for a running `smoe serve` (issue #22). Starts nothing: point it at a server on
loopback and give it the server's PID and the file its stderr goes to.

    python bench/soak.py http://127.0.0.1:18100 --key k --pid PID --server-log serve.log \
        --seconds 600 [--clients 16] [--warmup 30] [--sample 5] [--oversize-mib 17] [--out soak.json]

16 concurrent clients (threads) loop over a weighted mix of requests, each to a model picked at
random from /v1/models (so consecutive requests switch models):

- openai chat, streamed, short prompt (4-40 words) or long prompt (300-900 words);
- openai chat, streamed, with `tools` offered (and sometimes a tool-result history);
- openai completions, streamed;
- openai chat cancelled mid-stream (the stream closed after 1-3 chunks);
- anthropic messages, streamed: raw events (order checked) or the SDK's accumulator;
- anthropic messages with `tools`; anthropic cancelled mid-stream;
- raw HTTP chat streamed (the SSE checked byte for byte to `data: [DONE]`);
- raw HTTP malformed JSON (expects 400), oversized body (expects 413), unknown model (404).

Every completed stream is checked to its last event (see check_* below). The server's RSS,
open file descriptors and threads are sampled from /proc/PID every --sample seconds. Prints a
summary and a JSON line; exits 1 on an unexpected 5xx, a panic in the server log, a malformed
stream or a client-side failure other than the expected statuses.
"""

import argparse
import http.client
import json
import os
import random
import re
import threading
import time
import urllib.parse
from collections import Counter

import anthropic
import openai
from anthropic import Anthropic
from openai import OpenAI

ap = argparse.ArgumentParser()
ap.add_argument("base")
ap.add_argument("--key", default="")
ap.add_argument("--pid", type=int, required=True)
ap.add_argument("--server-log", help="the server's stderr, grepped for panics")
ap.add_argument("--clients", type=int, default=16)
ap.add_argument("--seconds", type=float, default=600)
ap.add_argument("--warmup", type=float, default=30, help="RSS 'after warm-up' is the first sample after this")
ap.add_argument("--sample", type=float, default=5)
ap.add_argument("--oversize-mib", type=float, default=17, help="body size sent to expect 413 (over --body-limit-mib)")
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--out", help="write the summary and the samples as JSON here")
args = ap.parse_args()

u = urllib.parse.urlparse(args.base)
HOST, PORT = u.hostname, u.port
WORDS = (
    "alpha beta gamma delta memory cache expert router token stream disk model layer the of and to "
    "def class return import for while if else print value list dict"
).split()
TOOLS_OAI = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}},
        },
    },
]
TOOLS_ANT = [
    {"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]}
    for t in TOOLS_OAI
]

lock = threading.Lock()
outcome = Counter()  # scenario -> served
status = Counter()  # HTTP status (or failure kind) -> count
expected_4xx = Counter()
problems = []  # (kind, detail), the first 30 kept
malformed = 0
unexpected = 0
started = time.time()
stop_at = started + args.seconds


def problem(kind, detail):
    global unexpected
    with lock:
        unexpected += 1
        if len(problems) < 30:
            problems.append((round(time.time() - started, 1), kind, str(detail)[:400]))


def bad_stream(detail):
    global malformed
    with lock:
        malformed += 1
        if len(problems) < 30:
            problems.append((round(time.time() - started, 1), "malformed stream", str(detail)[:400]))


def served(scenario, st=200):
    with lock:
        outcome[scenario] += 1
        status[st] += 1


def prompt(rng, long=False):
    n = rng.randint(300, 900) if long else rng.randint(4, 40)
    return " ".join(rng.choice(WORDS) for _ in range(n))


# --- stream checks -------------------------------------------------------------------------------


def check_oai_chat(chunks, model, tools=False):
    """Every chunk a chat.completion.chunk of one id and the model asked for; exactly one choice
    chunk with a finish_reason, and it is the last choice chunk; the usage chunk (asked for) is last
    and counts the generated tokens."""
    if not chunks:
        return "no chunks"
    ids = {c.id for c in chunks}
    if len(ids) != 1:
        return f"{len(ids)} ids"
    if any(c.object != "chat.completion.chunk" for c in chunks):
        return "object is not chat.completion.chunk"
    if any(c.model != model for c in chunks):
        return f"model {chunks[0].model} != {model}"
    with_choices = [c for c in chunks if c.choices]
    fins = [i for i, c in enumerate(with_choices) if c.choices[0].finish_reason]
    if len(fins) != 1 or fins[0] != len(with_choices) - 1:
        return f"finish_reason at {fins} of {len(with_choices)} choice chunks"
    fin = with_choices[-1].choices[0].finish_reason
    if fin not in ("stop", "length", "tool_calls"):
        return f"finish_reason {fin}"
    if fin == "tool_calls" and not tools:
        return "tool_calls without tools"
    last = chunks[-1]
    if last.choices or last.usage is None or last.usage.completion_tokens is None:
        return "no usage chunk last"
    return None


def check_oai_completion(chunks, model):
    if not chunks:
        return "no chunks"
    if any(c.model != model for c in chunks):
        return "model mismatch"
    with_choices = [c for c in chunks if c.choices]
    fins = [i for i, c in enumerate(with_choices) if c.choices[0].finish_reason]
    if len(fins) != 1 or fins[0] != len(with_choices) - 1:
        return f"finish_reason at {fins} of {len(with_choices)}"
    return None


def check_ant_events(events, model):
    """message_start first; content blocks opened, given deltas and closed in index order, never
    overlapping; then message_delta with a stop_reason and usage; message_stop last."""
    types = [e.type for e in events]
    if not types or types[0] != "message_start" or types[-1] != "message_stop":
        return f"starts {types[:1]} ends {types[-1:]}"
    if events[0].message.model != model:
        return f"model {events[0].message.model}"
    if types.count("message_delta") != 1 or types[-2] != "message_delta":
        return "message_delta not once, just before message_stop"
    md = events[-2]
    if md.delta.stop_reason not in ("end_turn", "max_tokens", "stop_sequence", "tool_use"):
        return f"stop_reason {md.delta.stop_reason}"
    open_ix, next_ix = None, 0
    for e in events[1:-2]:
        if e.type == "content_block_start":
            if open_ix is not None or e.index != next_ix:
                return f"block {e.index} opened with {open_ix} open, expected {next_ix}"
            open_ix = e.index
        elif e.type == "content_block_delta":
            if e.index != open_ix:
                return f"delta for {e.index} while {open_ix} open"
        elif e.type == "content_block_stop":
            if e.index != open_ix:
                return f"stop for {e.index} while {open_ix} open"
            open_ix, next_ix = None, next_ix + 1
        elif e.type == "ping":
            pass
        else:
            return f"unexpected event {e.type}"
    if open_ix is not None:
        return f"block {open_ix} never closed"
    return None


# --- raw HTTP ------------------------------------------------------------------------------------


def raw(method, path, body, headers=None, read=True):
    c = http.client.HTTPConnection(HOST, PORT, timeout=120)
    h = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    if args.key:
        h["Authorization"] = f"Bearer {args.key}"
    h.update(headers or {})
    try:
        c.putrequest(method, path)
        for k, v in h.items():
            c.putheader(k, v)
        c.endheaders()
        try:
            # The server may answer 413 before reading a large body; a broken pipe is fine then.
            for i in range(0, len(body), 1 << 20):
                c.send(body[i : i + (1 << 20)])
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = c.getresponse()
        data = r.read() if read else None
        return r.status, data, r
    finally:
        if read:
            c.close()


def raw_sse_chat(rng, model):
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": rng.randint(8, 48), "stream": True}
    ).encode()
    st, data, _ = raw("POST", "/v1/chat/completions", body)
    if st != 200:
        return st, None
    text = data.decode("utf-8")
    if not text.endswith("data: [DONE]\n\n"):
        return st, f"SSE does not end with data: [DONE]: ...{text[-80:]!r}"
    events = [e for e in text.split("\n\n") if e]
    for e in events[:-1]:
        if not e.startswith("data: "):
            return st, f"event not data: {e[:80]!r}"
        try:
            v = json.loads(e[6:])
        except ValueError as x:
            return st, f"bad JSON in event ({x}): {e[:80]!r}"
        if v.get("object") != "chat.completion.chunk":
            return st, f"object {v.get('object')}"
    last = json.loads(events[-2][6:])
    if not last["choices"] or not last["choices"][0].get("finish_reason"):
        return st, "last chunk before [DONE] has no finish_reason"
    return st, None


# --- one client ----------------------------------------------------------------------------------

SCENARIOS = [
    ("oai_short", 22),
    ("oai_long", 6),
    ("oai_tools", 8),
    ("oai_completion", 6),
    ("oai_cancel", 8),
    ("ant_events", 10),
    ("ant_accumulate", 6),
    ("ant_tools", 6),
    ("ant_cancel", 6),
    ("raw_sse", 8),
    ("malformed_json", 6),
    ("oversized", 2),
    ("unknown_model", 2),
]


def client_loop(i, models):
    rng = random.Random(args.seed * 1000 + i)
    oai = OpenAI(base_url=args.base + "/v1", api_key=args.key or "none", max_retries=0, timeout=120)
    ant = Anthropic(base_url=args.base, api_key=args.key or "none", max_retries=0, timeout=120)
    names, weights = zip(*SCENARIOS)
    while time.time() < stop_at:
        sc = rng.choices(names, weights)[0]
        model = rng.choice(models)
        mt = rng.randint(8, 64)
        try:
            run_one(sc, rng, oai, ant, model, mt)
        except (openai.RateLimitError, anthropic.RateLimitError):
            with lock:
                status[429] += 1
            time.sleep(0.05 + rng.random() * 0.1)
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            with lock:
                status[e.status_code] += 1
            problem(f"{sc} {model}: HTTP {e.status_code}", e.message)
        except (openai.APIConnectionError, anthropic.APIConnectionError, OSError, http.client.HTTPException) as e:
            with lock:
                status["connection"] += 1
            problem(f"{sc} {model}: connection", repr(e))
        except Exception as e:  # noqa: BLE001 — any other failure is a finding
            with lock:
                status["client exception"] += 1
            problem(f"{sc} {model}: {type(e).__name__}", repr(e))


def run_one(sc, rng, oai, ant, model, mt):
    msgs = [{"role": "user", "content": prompt(rng, long=(sc == "oai_long"))}]
    if sc in ("oai_short", "oai_long", "oai_tools"):
        kw = {}
        if sc == "oai_tools":
            kw["tools"] = TOOLS_OAI
            if rng.random() < 0.5:
                msgs += [
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
                ]
        s = oai.chat.completions.create(
            model=model, messages=msgs, max_tokens=mt, temperature=0.8, stream=True,
            stream_options={"include_usage": True}, **kw,
        )
        chunks = list(s)
        err = check_oai_chat(chunks, model, tools=sc == "oai_tools")
        if err:
            bad_stream(f"{sc} {model}: {err}")
        served(sc)
    elif sc == "oai_completion":
        chunks = list(oai.completions.create(model=model, prompt=prompt(rng), max_tokens=mt, stream=True))
        err = check_oai_completion(chunks, model)
        if err:
            bad_stream(f"{sc} {model}: {err}")
        served(sc)
    elif sc == "oai_cancel":
        s = oai.chat.completions.create(model=model, messages=msgs, max_tokens=2000, stream=True)
        k = rng.randint(1, 3)
        for n, _ in enumerate(s):
            if n + 1 >= k:
                break
        s.close()
        served(sc)
    elif sc in ("ant_events", "ant_tools", "ant_cancel"):
        kw = {"tools": TOOLS_ANT} if sc == "ant_tools" else {}
        s = ant.messages.create(
            model=model, max_tokens=2000 if sc == "ant_cancel" else mt, messages=msgs, stream=True, **kw
        )
        if sc == "ant_cancel":
            k = rng.randint(2, 5)
            for n, _ in enumerate(s):
                if n + 1 >= k:
                    break
            s.close()
        else:
            events = list(s)
            err = check_ant_events(events, model)
            if err:
                bad_stream(f"{sc} {model}: {err}")
        served(sc)
    elif sc == "ant_accumulate":
        with ant.messages.stream(model=model, max_tokens=mt, messages=msgs) as s:
            text = "".join(s.text_stream)
            m = s.get_final_message()
        if m.model != model or m.stop_reason is None or "".join(b.text for b in m.content if b.type == "text") != text:
            bad_stream(f"{sc} {model}: accumulated message disagrees with the text stream ({m.stop_reason})")
        served(sc)
    elif sc == "raw_sse":
        st, err = raw_sse_chat(rng, model)
        if st == 429:
            with lock:
                status[429] += 1
            return
        if st != 200:
            with lock:
                status[st] += 1
            problem(f"{sc} {model}: HTTP {st}", "")
            return
        if err:
            bad_stream(f"{sc} {model}: {err}")
        served(sc)
    elif sc == "malformed_json":
        body = rng.choice([
            b'{"model": "' + model.encode() + b'", "messages": [',
            b"not json at all",
            b'{"model": 5, "messages": "x"}',
            b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}',
            b"\xff\xfe\x00garbage",
        ])
        path = rng.choice(["/v1/chat/completions", "/v1/messages", "/v1/completions"])
        st, _, _ = raw("POST", path, body)
        expect4(sc, st, (400, 422))
    elif sc == "oversized":
        n = int(args.oversize_mib * (1 << 20))
        body = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * n + b'"}]}'
        st, _, _ = raw("POST", rng.choice(["/v1/chat/completions", "/v1/messages"]), body)
        expect4(sc, st, (413,))
    elif sc == "unknown_model":
        body = json.dumps({"model": "no-such-model", "messages": msgs, "max_tokens": 4}).encode()
        st, _, _ = raw("POST", "/v1/chat/completions", body)
        expect4(sc, st, (404,))


def expect4(sc, st, ok):
    with lock:
        status[st] += 1
    if st in ok:
        with lock:
            outcome[sc] += 1
            expected_4xx[st] += 1
    else:
        problem(f"{sc}: HTTP {st}, expected {ok}", "")


# --- /proc sampling ------------------------------------------------------------------------------


def proc_sample(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            st = dict(line.split(":", 1) for line in f if ":" in line)
        sample = {
            "t": round(time.time() - started, 1),
            "rss_kib": int(st["VmRSS"].split()[0]),
            # Anonymous memory is the heap (what could leak); file-backed is mapped weights.
            "rss_anon_kib": int(st["RssAnon"].split()[0]),
            "rss_file_kib": int(st["RssFile"].split()[0]),
            "threads": int(st["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
        }
    except (OSError, KeyError):
        return None
    # What the server holds by design and lets grow to a budget: its sessions' KV caches.
    try:
        stats = json.loads(raw("GET", "/v1/smoe/stats", b"")[1])
        sample["session_kv_kib"] = sum(m.get("session_kv_bytes", 0) for m in stats["models"]) // 1024
        sample["session_kv_budget_kib"] = sum(m.get("session_kv_budget_bytes", 0) for m in stats["models"]) // 1024
    except Exception:  # a sample without it is still a sample
        pass
    return sample


def main():
    raw_models = json.loads(raw("GET", "/v1/models", b"")[1])
    models = sorted(m["id"] for m in raw_models["data"])
    assert len(models) >= 2, f"serve at least two models to switch between: {models}"
    samples = [proc_sample(args.pid)]
    threads = [threading.Thread(target=client_loop, args=(i, models), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    next_sample = time.time() + args.sample
    while any(t.is_alive() for t in threads):
        time.sleep(0.2)
        if time.time() >= next_sample:
            next_sample += args.sample
            s = proc_sample(args.pid)
            if s is None:
                problem("server", "process gone")
                break
            samples.append(s)
            if len(samples) % 12 == 0:
                with lock:
                    n = sum(outcome.values())
                print(f"  {s['t']:7.1f} s  served {n}  rss {s['rss_kib'] / 1024:.1f} MiB (anon {s['rss_anon_kib'] / 1024:.1f}, "
                      f"session KV {s.get('session_kv_kib', 0) / 1024:.1f})  fds {s['fds']}  threads {s['threads']}", flush=True)
    for t in threads:
        t.join(timeout=130)
    time.sleep(2)
    idle = proc_sample(args.pid)
    health = raw("GET", "/health", b"")
    panics = 0
    if args.server_log:
        with open(args.server_log, errors="replace") as f:
            panics = sum(1 for line in f if "panicked" in line)
    samples = [s for s in samples if s]
    warm = next((s for s in samples if s["t"] >= args.warmup), samples[-1])
    end = samples[-1]
    drift = (end["rss_kib"] - warm["rss_kib"]) / warm["rss_kib"] * 100
    fives = {k: v for k, v in status.items() if isinstance(k, int) and k >= 500}
    summary = {
        "models": models,
        "clients": args.clients,
        "seconds": args.seconds,
        "served": sum(outcome.values()),
        "by_scenario": dict(sorted(outcome.items())),
        "statuses": {str(k): v for k, v in sorted(status.items(), key=lambda kv: str(kv[0]))},
        "expected_4xx": {str(k): v for k, v in expected_4xx.items()},
        "unexpected_5xx": sum(fives.values()),
        "unexpected_other": unexpected - sum(fives.values()),
        "malformed_streams": malformed,
        "panics": panics,
        "rss_mib": {"start": round(samples[0]["rss_kib"] / 1024, 1), "after_warmup": round(warm["rss_kib"] / 1024, 1),
                    "end": round(end["rss_kib"] / 1024, 1), "max": round(max(s["rss_kib"] for s in samples) / 1024, 1),
                    "idle_after": round(idle["rss_kib"] / 1024, 1) if idle else None},
        "rss_drift_pct": round(drift, 2),
        "rss_anon_mib": {"after_warmup": round(warm["rss_anon_kib"] / 1024, 1), "end": round(end["rss_anon_kib"] / 1024, 1)},
        "session_kv_mib": {"after_warmup": round(warm.get("session_kv_kib", 0) / 1024, 1), "end": round(end.get("session_kv_kib", 0) / 1024, 1),
                           "budget": round(end.get("session_kv_budget_kib", 0) / 1024, 1)},
        "fds": {"first": samples[0]["fds"], "last": end["fds"], "max": max(s["fds"] for s in samples), "idle_after": idle and idle["fds"]},
        "threads": {"first": samples[0]["threads"], "last": end["threads"], "max": max(s["threads"] for s in samples),
                    "idle_after": idle and idle["threads"]},
        "samples": len(samples),
        "health_after": health[0],
        "problems": problems,
    }
    print(f"served {summary['served']} requests in {args.seconds:.0f} s by {args.clients} clients over {models}")
    print(f"  by scenario: {summary['by_scenario']}")
    print(f"  statuses: {summary['statuses']}  (expected 4xx: {summary['expected_4xx']})")
    print(f"  unexpected 5xx {summary['unexpected_5xx']}, other unexpected {summary['unexpected_other']}, "
          f"malformed streams {malformed}, panics {panics}")
    r = summary["rss_mib"]
    print(f"  RSS MiB: start {r['start']}, after warm-up ({warm['t']} s) {r['after_warmup']}, end {r['end']}, "
          f"max {r['max']}, idle after {r['idle_after']}; drift {summary['rss_drift_pct']}%")
    a, kv = summary["rss_anon_mib"], summary["session_kv_mib"]
    print(f"  anonymous RSS MiB after warm-up {a['after_warmup']}, end {a['end']}; sessions' KV MiB after warm-up "
          f"{kv['after_warmup']}, end {kv['end']} (budget {kv['budget']})")
    print(f"  fds first/last/max {summary['fds']['first']}/{summary['fds']['last']}/{summary['fds']['max']} "
          f"(idle after {summary['fds']['idle_after']}); threads first/last/max {summary['threads']['first']}/"
          f"{summary['threads']['last']}/{summary['threads']['max']} (idle after {summary['threads']['idle_after']})")
    print(f"  /health after: {health[0]}")
    for p in problems:
        print("  problem:", p)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "samples": samples}, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "problems"}))
    bad = summary["unexpected_5xx"] or summary["unexpected_other"] or malformed or panics or health[0] != 200
    raise SystemExit(1 if bad else 0)


main()
