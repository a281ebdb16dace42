"""Load test for `smoe serve`: N concurrent streaming clients (the official `openai` package) for
a while; prints a JSON summary on its last line.

Usage: python load_test.py BASE_URL API_KEY [--clients 16] [--seconds 60] [--warmup 5]
       [--model qwen3] [--max-tokens 32] [--pid PID]
With --pid, the server's resident memory is sampled once a second (after the warm-up)."""

import argparse
import json
import random
import threading
import time

import openai
from openai import OpenAI

ap = argparse.ArgumentParser()
ap.add_argument("base")
ap.add_argument("key")
ap.add_argument("--clients", type=int, default=16)
ap.add_argument("--seconds", type=float, default=60)
ap.add_argument("--warmup", type=float, default=5)
ap.add_argument("--model", default="qwen3")
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--pid", type=int)
args = ap.parse_args()

WORDS = "alpha beta gamma delta memory cache expert router token stream disk model layer".split()
lock = threading.Lock()
stats = {"ok": 0, "rate_limited": 0, "failures": 0, "tokens": 0, "errors": []}
ttfts = []
start = time.time()
measure_from = start + args.warmup
stop_at = measure_from + args.seconds


def client_loop(i):
    client = OpenAI(base_url=args.base + "/v1", api_key=args.key, max_retries=0, timeout=120)
    rng = random.Random(i)
    while time.time() < stop_at:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
        t0 = time.time()
        first = None
        n = 0
        try:
            stream = client.chat.completions.create(
                model=args.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=args.max_tokens,
                temperature=0.8,
                stream=True,
            )
            for chunk in stream:
                for c in chunk.choices:
                    if c.delta.content or getattr(c.delta, "reasoning_content", None):
                        n += 1
                        if first is None:
                            first = time.time() - t0
            counted = t0 >= measure_from
            with lock:
                if counted:
                    stats["ok"] += 1
                    stats["tokens"] += n
                    if first is not None:
                        ttfts.append(first)
        except openai.RateLimitError:
            with lock:
                stats["rate_limited"] += 1
            time.sleep(0.05 + rng.random() * 0.1)
        except Exception as e:  # any other failure counts
            with lock:
                stats["failures"] += 1
                if len(stats["errors"]) < 5:
                    stats["errors"].append(repr(e))


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None


threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
for t in threads:
    t.start()
rss = []
while any(t.is_alive() for t in threads):
    time.sleep(1)
    if args.pid and time.time() >= measure_from:
        r = rss_kib(args.pid)
        if r:
            rss.append(r)
for t in threads:
    t.join()
ttfts.sort()
pct = lambda p: round(ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] * 1000, 1) if ttfts else None
out = {
    "clients": args.clients,
    "seconds": args.seconds,
    "ok": stats["ok"],
    "rate_limited": stats["rate_limited"],
    "failures": stats["failures"],
    "errors": stats["errors"],
    "streamed_pieces": stats["tokens"],
    "pieces_per_s": round(stats["tokens"] / args.seconds, 1),
    "requests_per_s": round(stats["ok"] / args.seconds, 2),
    "ttft_p50_ms": pct(0.5),
    "ttft_p95_ms": pct(0.95),
    "rss_first_kib": rss[0] if rss else None,
    "rss_last_kib": rss[-1] if rss else None,
    "rss_max_kib": max(rss) if rss else None,
}
print(json.dumps(out))
