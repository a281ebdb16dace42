#!/usr/bin/env python3
"""K-quants made by llama.cpp itself, imported by smoe (docs/gguf.md).

A synthetic qwen3-30b-a3b-shape checkpoint of a few layers is written as a bf16 vault and
exported as a bf16 GGUF; llama.cpp's quantizer (llama-quantize, the same llama_model_quantize
that llama-cpp-python wraps) makes Q4_K_M and Q2_K files from it; smoe imports them (peak RSS
recorded), and three sets of logits on the same 64 tokens are compared:
smoe on the quantized file vs. smoe on the bf16 weights, llama.cpp on the quantized file vs.
the same bf16 logits, and smoe vs. llama.cpp on the quantized file.

Usage: bench/gguf_quant.py [--layers 2] [--work target/gguf-quant]   (LLAMA_CPP_DIR as bench/run)
"""

import argparse
import json
import os
import struct
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as harness  # noqa: E402

ROOT = harness.ROOT


def sh(cmd, **kw):
    return harness.run(cmd, **kw)


def peak_rss_of(cmd):
    """Runs cmd; returns its own peak RSS in bytes (from wait4's rusage of that child)."""
    harness.log("$ " + " ".join(map(str, cmd)))
    p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        raise SystemExit(f"failed: {cmd}")
    return ru.ru_maxrss * 1024


def logits_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        t = head["logits"]
        f.seek(8 + n + t["data_offsets"][0])
        return np.frombuffer(f.read(t["data_offsets"][1] - t["data_offsets"][0]), dtype="<f4").reshape(t["shape"])


def compare(a, ref):
    """max |a - ref| / max |ref|, top-1 agreement, mean KL(ref || a) over rows."""
    rel = float(np.abs(a - ref).max() / np.abs(ref).max())
    top1 = float((a.argmax(1) == ref.argmax(1)).mean())

    def logp(x):
        x = x.astype(np.float64)
        m = x.max(1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))

    lr, la = logp(ref), logp(a)
    kl = float((np.exp(lr) * (lr - la)).sum(1).mean())
    return {"max_rel_err": rel, "top1": top1, "mean_kl": kl}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="2")
    ap.add_argument("--work", default=os.path.join(ROOT, "target/gguf-quant"))
    ap.add_argument("--formats", default="Q4_K_M,Q2_K")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    w = lambda name: os.path.join(args.work, name)
    smoe = harness.build_smoe()
    llama_src, bins = harness.llama_cpp(args.work)
    vocab = os.path.join(llama_src, "models/ggml-vocab-qwen2.gguf")
    bf16 = w(f"q30-l{args.layers}.bf16.smoe")
    if not os.path.exists(bf16):
        sh([smoe, "synth", "--shape", "qwen3-30b-a3b", "--layers", args.layers, "--vault", bf16, "--experts", "BF16", "--dense", "BF16",
            "--vocab-gguf", vocab], capture=False)
    bf16_gguf = w(f"q30-l{args.layers}.bf16.gguf")
    if not os.path.exists(bf16_gguf):
        sh([smoe, "export-gguf", bf16, "-o", bf16_gguf], capture=False)
    # llama.cpp's own logits, through a small program against its library.
    prog = w("llama_logits")
    if not os.path.exists(prog):
        sh(["cc", "-O2", "-o", prog, os.path.join(ROOT, "bench/llama_logits.c"), f"-I{llama_src}/include", f"-I{llama_src}/ggml/include",
            f"-L{bins}", "-lllama", f"-Wl,-rpath,{bins}"])
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 151643, size=64)
    ids_file = w("ids.txt")
    with open(ids_file, "w") as f:
        f.write(" ".join(map(str, ids)))
    ids_arg = ",".join(map(str, ids))

    def smoe_logits(model, tag, fast=False):
        out = w(f"{tag}.safetensors")
        sh([smoe, "score", model, "--ids", ids_arg, "--out", out, "--cache", "resident", *(["--fast"] if fast else [])])
        return logits_safetensors(out)

    def llama_logits(model, tag):
        out = w(f"{tag}.llama.f32")
        sh([prog, model, ids_file, out, "2"])
        return np.fromfile(out, dtype="<f4").reshape(len(ids), -1)

    ref = smoe_logits(bf16, "bf16")
    res = {"layers": int(args.layers), "tokens": len(ids), "bf16_llama_vs_smoe": compare(llama_logits(bf16_gguf, "bf16"), ref)}
    # The model's error gain: how much a known, uniform weight error (smoe's own Q8_0 of the same
    # weights, relative RMS 0.0054 on Gaussian data, docs/quantization.md) moves these logits.
    q8 = w(f"q30-l{args.layers}.q8_0.smoe")
    if not os.path.exists(q8):
        sh([smoe, "synth", "--shape", "qwen3-30b-a3b", "--layers", args.layers, "--vault", q8, "--experts", "Q8_0", "--dense", "Q8_0",
            "--vocab-gguf", vocab], capture=False)
    res["q8_0_vs_bf16"] = compare(smoe_logits(q8, "q8_0"), ref)
    for fmt in args.formats.split(","):
        q = w(f"q30-l{args.layers}.{fmt}.gguf")
        if not os.path.exists(q):
            sh([os.path.join(bins, "llama-quantize"), bf16_gguf, q, fmt], capture=False)
        vault = w(f"q30-l{args.layers}.{fmt}.smoe")
        if os.path.exists(vault):
            os.remove(vault)
        rss = peak_rss_of([smoe, "shatter", q, "-o", vault])
        info = json.loads(sh([smoe, "inspect", vault, "--json"]).stdout)
        ours = smoe_logits(vault, fmt)
        in_place = smoe_logits(q, fmt + ".inplace")
        fast = smoe_logits(vault, fmt + ".fast", fast=True)
        theirs = llama_logits(q, fmt)
        res[fmt] = {
            "gguf_bytes": os.path.getsize(q),
            "shatter_peak_rss_bytes": rss,
            "expert_formats": sorted({p["format"] for p in info.get("expert_parts", [])}),
            "in_place_equals_shattered": bool(np.array_equal(in_place, ours)),
            "smoe_vs_bf16": compare(ours, ref),
            "llama_vs_bf16": compare(theirs, ref),
            "smoe_vs_llama": compare(ours, theirs),
            "smoe_fast_vs_llama": compare(fast, theirs),
        }
        print(json.dumps({fmt: res[fmt]}, indent=1))
    with open(w("results.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
