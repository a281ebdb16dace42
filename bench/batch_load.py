"""Load generator for continuous batching (issue #25): N concurrent streaming clients with the
official `openai` package against one OpenAI-compatible server (`smoe serve`, or llama.cpp's
`llama-server -np N` on the same GGUF), each client sending one request at a time for a fixed
number of rounds. Starts nothing: point it at a running server.

    python bench/batch_load.py http://127.0.0.1:8080 --model q30b --clients 1,4,16 \
        [--key KEY] [--max-tokens 64] [--prompt-words 32] [--rounds 2] [--json]

Reports per client count: aggregate decode tok/s (completion tokens of all streams over the
wall time), per-stream tok/s (each request's tokens after the first over its own time), time
to first token p50/p99, and inter-token latency p50/p99 (gaps between streamed chunks, each
chunk one token as both servers stream them). Prompts are random words, different for every
request, so prefix caches do not shortcut the prefill; greedy (temperature 0) so that both
servers decode the same kind of text, and `max_tokens` is what they generate unless a stop
comes first (counted from each reply's `usage`, or chunks where a server sends none).
Where the server exposes smoe's `/metrics`, also the expert bytes it read from disk per
completion token (prompt reads included: the clients' prompts are read in the same steps).
Before anything is timed, `--warmup N` requests (default 1) run untimed, one after another: a
server that opens its model at the first request (`smoe serve` does) or compiles on first use
would otherwise put that into the first client count's time to first token.
"""

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request

from openai import OpenAI

WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they you were her she there".split()


def percentile(xs, p):
    """The p-th percentile (nearest rank) of xs; NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, round(p / 100 * len(xs) + 0.5) - 1))
    return xs[k]


def one_request(client, model, prompt, max_tokens):
    """One streamed completion: (tokens, ttft_s, gaps_s, total_s, decode_s)."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, last, gaps, chunks, usage = None, None, [], 0, None
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage.completion_tokens
        if not ev.choices or not (ev.choices[0].delta.content or getattr(ev.choices[0].delta, "reasoning_content", None)):
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
        chunks += 1
    end = time.perf_counter()
    tokens = usage if usage is not None else chunks
    return tokens, (first or end) - t0, gaps, end - t0, (end - (first or end))


def read_bytes(base, key):
    """smoe's `smoe_read_bytes_total` from /metrics, or None (another server, or none there)."""
    req = urllib.request.Request(base.rstrip("/") + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("smoe_read_bytes_total "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def connect(base, key):
    """An `openai` client of the server at `base`: no retries (a failure is reported)."""
    return OpenAI(base_url=base.rstrip("/") + "/v1", api_key=key or "none", max_retries=0, timeout=3600)


def run(base, key, model, clients, rounds, max_tokens, prompt_words, seed):
    client = connect(base, key)
    rng = random.Random(seed)
    prompts = [[" ".join(rng.choice(WORDS) for _ in range(prompt_words)) for _ in range(rounds)] for _ in range(clients)]
    results, errors = [], []
    lock = threading.Lock()

    def worker(i):
        for r in range(rounds):
            try:
                res = one_request(client, model, prompts[i][r], max_tokens)
            except Exception as e:  # noqa: BLE001 - every failure is reported, not raised
                with lock:
                    errors.append(f"client {i} round {r}: {e}")
                continue
            with lock:
                results.append(res)

    bytes0 = read_bytes(base, key)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    bytes1 = read_bytes(base, key)
    tokens = sum(r[0] for r in results)
    read_mib = (bytes1 - bytes0) / 2**20 / max(tokens, 1) if bytes0 is not None and bytes1 is not None else None
    ttft = [r[1] for r in results]
    gaps = [g for r in results for g in r[2]]
    per_stream = [(r[0] - 1) / r[4] for r in results if r[0] > 1 and r[4] > 0]
    return {
        "clients": clients,
        "requests": len(results),
        "errors": errors,
        "completion_tokens": tokens,
        "wall_s": wall,
        "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
        "per_stream_tok_s": statistics.mean(per_stream) if per_stream else float("nan"),
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "read_mib_per_token": read_mib,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="server address, e.g. http://127.0.0.1:8080")
    ap.add_argument("--model", required=True)
    ap.add_argument("--key", default=None)
    ap.add_argument("--clients", default="1,4,16", help="client counts, comma-separated, run in turn")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON line per client count")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before the first client count")
    a = ap.parse_args()
    if a.warmup > 0:
        warm = connect(a.base, a.key)
        for _ in range(a.warmup):
            one_request(warm, a.model, "warm up", 8)
    failed = False
    for n in [int(x) for x in a.clients.split(",")]:
        r = run(a.base, a.key, a.model, n, a.rounds, a.max_tokens, a.prompt_words, a.seed + n)
        failed |= bool(r["errors"])
        if a.json:
            print(json.dumps(r))
            continue
        print(
            f"{n:>3} clients: {r['aggregate_tok_s']:.2f} tok/s aggregate, {r['per_stream_tok_s']:.2f} per stream; "
            f"ttft p50/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms; itl p50/p99 {r['itl_p50_ms']:.0f}/{r['itl_p99_ms']:.0f} ms; "
            f"{r['requests']} requests, {len(r['errors'])} errors"
            + (f"; {r['read_mib_per_token']:.1f} MiB read per token" if r["read_mib_per_token"] is not None else "")
        )
        for e in r["errors"][:5]:
            print("   ", e)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
