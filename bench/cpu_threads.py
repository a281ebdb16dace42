#!/usr/bin/env python3
"""smoe vs llama.cpp on the CPU at several thread counts (issue 23's table), fully cached.

    bench/cpu_threads.py [--threads 2,4,8,16] [--layers 12] [--reps 3] [--rounds 1] [--work DIR]
                         [--smoe BIN] [--llama-src DIR|ARCHIVE] [--variant NAME:VAR=VAL,...]

Builds llama.cpp's llama-bench for this CPU (GGML_NATIVE=ON, CPU only) from the llama-cpp-python
sdist that bench/run uses — or from a directory or an archive of it (bench/pack_llama_src.sh
makes one for a machine with no network, such as the GPU machine's host) — synthesises a
Qwen3-30B-A3B-shape model cut to --layers (Q4_K experts, Q8_0 dense, random valid blocks, the
real Qwen2 vocabulary) and exports the same blocks as a GGUF; then, for each thread count:
the RAM read bandwidth (`smoe mem-bandwidth`), `smoe bench --cache resident --prompt-tokens 512
--gen-tokens 64 --reps R` and `llama-bench -p 512 -n 64 -r R` plus `llama-bench -p 0 -n 64 -d 512
-r R`, each the best of its repetitions (and, with `--rounds N`, of N passes over the thread
counts with the engines' order swapped each pass, every pass's ratios logged: a host whose
speed swings over minutes then moves both engines' best figures alike). smoe decodes after its 512-token prompt (positions
512-575), so the decode ratio is taken against llama.cpp's tg64 at depth 512, the same positions;
llama.cpp's tg64 from an empty context is printed beside it (until 2026-12-04 the ratio was
taken against that one, which left out the attention over the prompt: on the 2-core EPYC at 48
layers, 11.2 tok/s empty against 8.7 at depth 512).
Prints the table (ratios, decode as a share of the bandwidth limit, prefill scaling from the
smallest thread count) and writes cpu_threads.json and cpu_threads.md into the work directory.
`--variant` adds a smoe column run with extra environment variables (e.g. `avx2:SMOE_ISA=avx2`),
or with another build (`before:SMOE_BIN=/path/to/smoe`), in the same run as the others.
No GPU is used: on the GPU machine it can run while the GPU is idle.
"""

import argparse
import json
import os
import shutil
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import ROOT, build_smoe, cpu_name, llama_source, log, mem_bandwidth, run  # noqa: E402


def llama_bench_bin(src_arg, work):
    """llama-bench built for this CPU from `src_arg` (a directory, an archive) or the sdist."""
    if src_arg and os.path.isfile(src_arg):
        dest = os.path.join(work, "llama-src")
        if not os.path.isdir(os.path.join(dest, "llama.cpp")):
            os.makedirs(dest, exist_ok=True)
            with tarfile.open(src_arg) as t:
                t.extractall(dest)
        src = os.path.join(dest, "llama.cpp")
    else:
        src = src_arg or llama_source(work)
    build = os.path.join(src, "build-cpu")
    binary = os.path.join(build, "bin", "llama-bench")
    if not os.path.exists(binary):
        t = time.time()
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        run(["cmake", "-S", src, "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CUDA=OFF"])
        run(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", "llama-bench"])
        log(f"built llama-bench in {time.time() - t:.0f} s")
    return src, binary


def model(smoe, llama_src, work, layers):
    vault = os.path.join(work, f"qwen3-30b-a3b-l{layers}-rb.smoe")
    gguf = vault[:-5] + ".gguf"
    if not os.path.exists(vault):
        run([smoe, "synth", "--shape", "qwen3-30b-a3b", "--layers", layers, "--vault", vault, "--random-blocks",
             "--vocab-gguf", os.path.join(llama_src, "models/ggml-vocab-qwen2.gguf")])
    if not os.path.exists(gguf):
        run([smoe, "export-gguf", vault, "-o", gguf])
    return vault, gguf


def smoe_row(smoe, vault, threads, reps, env):
    env = dict(env)
    smoe = env.pop("SMOE_BIN", smoe)
    cmd = [smoe, "bench", vault, "--device", "cpu", "--cache", "resident", "--threads", threads, "--json",
           "--prompt-tokens", "512", "--gen-tokens", "64", "--reps", reps]
    j = json.loads(run(cmd, env={**os.environ, **env}).stdout.strip().splitlines()[-1])
    return {"prefill": j["prefill_tok_s"], "decode": j["decode_tok_s"], "prefill_samples": j.get("prefill_tok_s_samples"),
            "decode_samples": j.get("decode_tok_s_samples"), "active_bytes_per_token": j["active_bytes_per_token"],
            "backend": j["backend"]}


def llama_row(binary, gguf, threads, reps):
    """prefill(512), decode of 64 at depth 512 (smoe's positions), and decode of 64 from an
    empty context ("decode_empty")."""
    out = {}
    for depth, args in ((0, ["-p", "512", "-n", "64"]), (512, ["-p", "0", "-n", "64", "-d", "512"])):
        rows = json.loads(run([binary, "-m", gguf, "-t", threads, *args, "-r", reps, "-o", "json"]).stdout)
        for r in rows:
            kind = "prefill" if r["n_prompt"] > 0 else ("decode" if depth else "decode_empty")
            samples = r.get("samples_ts", [r["avg_ts"]])
            out[kind], out[kind + "_samples"] = max(samples), samples
    return out


def best(row, got):
    """Folds one round's figures into the row's best: each engine's prefill and decode at their
    fastest over all rounds (the harness's best-of protocol), the RAM bandwidth likewise."""
    row["ram_bytes_per_s"] = max(row.get("ram_bytes_per_s", 0), got["ram_bytes_per_s"])
    for name, figs in got.items():
        if isinstance(figs, dict):
            # The per-repetition samples stay in each round's record, beside the figures they gave.
            b = row.setdefault(name, {k: v for k, v in figs.items() if not k.endswith("_samples")})
            for k in ("prefill", "decode", "decode_empty"):
                if k in figs:
                    b[k] = max(b.get(k, 0), figs[k])


def table(res):
    lines = [f"CPU: {res['cpu']} ({res['cores']} logical CPUs); {res['layers']}-layer Qwen3-30B-A3B shape, Q4_K experts, "
             f"Q8_0 dense; best of {res['reps']} x {res.get('rounds', 1)} round(s); decode limit = RAM read bandwidth / active bytes per token", "",
             "| threads | smoe prefill | llama.cpp prefill | ratio | smoe decode | llama.cpp decode at depth 512 | ratio | "
             "llama.cpp decode, empty context | RAM GB/s | decode / limit | prefill scaling |"
             + "".join(f" {v} prefill | {v} decode |" for v in res["variants"]),
             "|---" * (11 + 2 * len(res["variants"])) + "|"]
    base = res["rows"][0]
    for r in res["rows"]:
        s, l = r["smoe"], r["llama"]
        limit = r["ram_bytes_per_s"] / s["active_bytes_per_token"]
        scale = (s["prefill"] / base["smoe"]["prefill"]) / (int(r["threads"]) / int(base["threads"]))
        lines.append(f"| {r['threads']} | {s['prefill']:.1f} | {l['prefill']:.1f} | {s['prefill'] / l['prefill']:.2f} | "
                     f"{s['decode']:.1f} | {l['decode']:.1f} | {s['decode'] / l['decode']:.2f} | {l.get('decode_empty', 0):.1f} | "
                     f"{r['ram_bytes_per_s'] / 1e9:.1f} | {s['decode'] / limit:.2f} | {scale:.2f} |"
                     + "".join(f" {r[v]['prefill']:.1f} | {r[v]['decode']:.1f} |" for v in res["variants"]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2,4,8,16")
    ap.add_argument("--layers", default="12")
    ap.add_argument("--reps", default="3")
    ap.add_argument("--rounds", default="1", help="repeat every thread count this many times, engines in swapped order")
    ap.add_argument("--work", default=os.path.join(ROOT, "target/bench"))
    ap.add_argument("--smoe", help="a built smoe binary (default: cargo build --release)")
    ap.add_argument("--llama-src", help="llama.cpp's source: a directory or a .tar.xz of it (default: the sdist from PyPI)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:VAR=VAL[,VAR=VAL]: another smoe column; SMOE_BIN=PATH runs another binary (an A/B of two builds)")
    args = ap.parse_args()
    if int(args.rounds) < 1:
        ap.error("--rounds must be at least 1")
    os.makedirs(args.work, exist_ok=True)
    smoe = args.smoe or build_smoe()
    llama_src, binary = llama_bench_bin(args.llama_src, args.work)
    vault, gguf = model(smoe, llama_src, args.work, args.layers)
    variants = {}
    for v in args.variant:
        name, _, assigns = v.partition(":")
        variants[name] = dict(a.split("=", 1) for a in assigns.split(",") if a)
    res = {"cpu": cpu_name(), "cores": os.cpu_count(), "layers": int(args.layers), "reps": int(args.reps), "rounds": int(args.rounds),
           "date": time.strftime("%Y-%m-%d %H:%M"), "variants": list(variants), "variant_settings": variants, "rows": []}
    # Rounds over the whole list of thread counts, the engines' order swapped each round: a
    # host whose speed swings over minutes then moves both engines' best figures alike.
    rows = {t: {"threads": t, "rounds": []} for t in args.threads.split(",")}
    for rnd in range(int(args.rounds)):
        for t, row in rows.items():
            got = {"ram_bytes_per_s": mem_bandwidth(smoe, t)}
            engines = [("smoe", lambda: smoe_row(smoe, vault, t, args.reps, {})), ("llama", lambda: llama_row(binary, gguf, t, args.reps))]
            engines += [(name, lambda env=env: smoe_row(smoe, vault, t, args.reps, env)) for name, env in variants.items()]
            for name, measure in engines[::-1] if rnd % 2 else engines:
                got[name] = measure()
            row["rounds"].append(got)
            best(row, got)
            # Written as it goes (whole, through a rename): a run cut short by a time limit keeps
            # what it measured.
            path = os.path.join(args.work, "cpu_threads.json")
            with open(path + ".tmp", "w") as f:
                json.dump({**res, "rows": [r for r in rows.values() if r["rounds"]]}, f, indent=1)
            os.replace(path + ".tmp", path)
            log(f"round {rnd + 1}, {t} threads: smoe {got['smoe']['prefill']:.1f}/{got['smoe']['decode']:.1f}, "
                f"llama.cpp {got['llama']['prefill']:.1f}/{got['llama']['decode']:.1f} (prefill/decode tok/s; ratios "
                f"{got['smoe']['prefill'] / got['llama']['prefill']:.2f}/{got['smoe']['decode'] / got['llama']['decode']:.2f})")
    res["rows"] = list(rows.values())
    text = table(res)
    print(text)
    with open(os.path.join(args.work, "cpu_threads.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.work, "cpu_threads.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
