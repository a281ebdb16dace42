#!/usr/bin/env python3
"""Why smoe's and llama.cpp's greedy tokens part ways on a random-weight model (docs/benchmarks.md).

Both engines score the same sequence — the prompt followed by smoe's greedy tokens — in one
prefill: smoe through `smoe score --fast` (the path `smoe run` uses), llama.cpp through
bench/llama_logits.c. At the first position where llama.cpp's argmax differs from smoe's token,
it prints both engines' logits for the two candidates, and, over all positions, how far the two
engines' logits are from each other. A top-2 margin smaller than that distance is a coin flip.

Usage: bench/greedy_margin.py VAULT GGUF [--prompt TEXT] [--tokens 12]   (LLAMA_CPP_DIR as bench/run)
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as harness  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("vault")
    ap.add_argument("gguf")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--tokens", default="12")
    ap.add_argument("--work", default=os.path.join(harness.ROOT, "target/bench"))
    args = ap.parse_args()
    smoe = os.path.join(harness.ROOT, "target/release/smoe")
    src, bins = harness.llama_cpp(args.work)
    prog = os.path.join(args.work, "llama_logits")
    if not os.path.exists(prog):
        harness.run(["cc", "-O2", "-o", prog, os.path.join(harness.ROOT, "bench/llama_logits.c"), f"-I{src}/include",
                     f"-I{src}/ggml/include", f"-L{bins}", "-lllama", f"-Wl,-rpath,{bins}"])
    out = json.loads(harness.run([smoe, "run", args.vault, "-p", args.prompt, "--raw", "--temperature", "0", "--max-tokens",
                                  args.tokens, "--json", "--cache", "resident"]).stdout)
    prompt, gen = out["prompt_ids"], out["tokens"]
    ids = prompt + gen
    ids_file = os.path.join(args.work, "greedy-ids.txt")
    with open(ids_file, "w") as f:
        f.write(" ".join(map(str, ids)))
    st = os.path.join(args.work, "greedy-smoe.safetensors")
    harness.run([smoe, "score", args.vault, "--ids", ",".join(map(str, ids)), "--out", st, "--fast", "--cache", "resident"])
    ours = load_logits(st)
    lf = os.path.join(args.work, "greedy-llama.f32")
    harness.run([prog, args.gguf, ids_file, lf, "2"])
    theirs = np.fromfile(lf, dtype="<f4").reshape(len(ids), -1)
    # Row p predicts token p + 1; the generated tokens are predicted by rows len(prompt)-1 ...
    rows = range(len(prompt) - 1, len(ids) - 1)
    diff = np.abs(ours[list(rows)] - theirs[list(rows)])
    scale = np.abs(theirs[list(rows)]).max()
    report = {"prompt_ids": prompt, "smoe_tokens": gen, "logit_abs_diff_median": float(np.median(diff)),
              "logit_abs_diff_p99": float(np.quantile(diff, 0.99)), "logit_abs_diff_max": float(diff.max()),
              "logit_scale_max": float(scale), "steps": []}
    for step, r in enumerate(rows):
        want = ids[r + 1]
        lt = int(theirs[r].argmax())
        o2 = np.argsort(ours[r])[::-1][:2]
        report["steps"].append({
            "step": step, "smoe_token": want, "llama_argmax": lt,
            "smoe_top2_margin": float(ours[r][o2[0]] - ours[r][o2[1]]),
        })
        if lt != want:
            report["divergence"] = {
                "step": step, "smoe_token": want, "llama_token": lt,
                "smoe_logits": [float(ours[r][want]), float(ours[r][lt])],
                "llama_logits": [float(theirs[r][want]), float(theirs[r][lt])],
            }
            break
    print(json.dumps(report, indent=1))


def load_logits(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
        t = head["logits"]
        f.seek(8 + n + t["data_offsets"][0])
        return np.frombuffer(f.read(t["data_offsets"][1] - t["data_offsets"][0]), dtype="<f4").reshape(t["shape"])


if __name__ == "__main__":
    main()
