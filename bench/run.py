#!/usr/bin/env python3
"""smoe vs llama.cpp vs the machine's physical limits, on a synthetic Qwen3-30B-A3B-shape model.

One command (see docs/benchmarks.md):  bench/run  [--layers 48] [--threads 2] [--reps 3]
(`bench/run --shape qwen3-235b-a22b`: the full-scale run larger than RAM, in big.py.)

Steps: build smoe; fetch and build llama.cpp from the llama-cpp-python source distribution
(outside the repository, under the work directory); synthesise a qwen3-30b-a3b-shape vault
with the real Qwen2 vocabulary and export the same quantized blocks as a GGUF; measure RAM and
O_DIRECT random-read bandwidth; run both engines fully cached and under a cgroup memory cap of
about a third of the model; print one table and write results.json, results.md and results.png.
"""

import argparse
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_VERSION = "0.3.36"


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd, capture=True, check=True, **kw):
    log("$ " + " ".join(str(c) for c in cmd))
    r = subprocess.run([str(c) for c in cmd], capture_output=capture, text=True, **kw)
    if check and r.returncode != 0:
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}")
    return r


def build_smoe():
    run(["cargo", "build", "--release", "--bin", "smoe"], capture=False, cwd=ROOT)
    return os.path.join(ROOT, "target/release/smoe")


def llama_source(work):
    """llama.cpp's source: $LLAMA_CPP_DIR if given, else the one vendored in llama-cpp-python's
    source distribution, fetched from PyPI once into `work`."""
    src = os.environ.get("LLAMA_CPP_DIR") or os.path.join(work, f"llama_cpp_python-{LLAMA_VERSION}/vendor/llama.cpp")
    if not os.path.isdir(src):
        dl = os.path.join(work, "sdist")
        os.makedirs(dl, exist_ok=True)
        py = sys.executable
        run([py, "-m", "pip", "install", "--quiet", "scikit-build-core", "cmake"], capture=False)
        run([py, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
             f"llama-cpp-python=={LLAMA_VERSION}", "-d", dl], capture=False)
        tgz = glob.glob(os.path.join(dl, "llama_cpp_python-*.tar.gz"))[0]
        with tarfile.open(tgz) as t:
            t.extractall(work)
    return src


def llama_cpp(work):
    """A llama.cpp build (see llama_source), built once."""
    src = llama_source(work)
    bins = os.path.join(src, "build/bin")
    need = ["llama-bench", "llama-completion"]
    if all(os.path.exists(os.path.join(bins, b)) for b in need):
        return src, bins
    cmake = shutil.which("cmake") or "cmake"
    run([cmake, "-S", src, "-B", os.path.join(src, "build"), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"], capture=False)
    run([cmake, "--build", os.path.join(src, "build"), "-j", str(os.cpu_count() or 2), "--target", *need, "llama-quantize"],
        capture=False)
    return src, bins


def model_files(smoe, llama_src, work, layers, mix=None):
    """The vault and its GGUF: smoe's default formats (Q4_K experts, Q8_0 dense), or with
    `mix` a llama.cpp file type's (`--mix Q4_K_M`: the layout of the files people download)."""
    tag = f"qwen3-30b-a3b-l{layers}" + (f"-{mix}" if mix else "")
    vault = os.path.join(work, f"{tag}.smoe")
    gguf = os.path.join(work, f"{tag}.gguf")
    vocab = os.path.join(llama_src, "models/ggml-vocab-qwen2.gguf")
    if not os.path.exists(vault):
        t = time.time()
        formats = ["--mix", mix] if mix else []
        run([smoe, "synth", "--shape", "qwen3-30b-a3b", "--layers", layers, "--vault", vault, "--vocab-gguf", vocab, *formats],
            capture=False)
        log(f"synthesised the vault in {time.time() - t:.0f} s")
    if not os.path.exists(gguf):
        run([smoe, "export-gguf", vault, "-o", gguf], capture=False)
    return vault, gguf


def mem_bandwidth(smoe, threads, tries=3):
    """Best of a few runs: on a shared machine other tenants only ever lower the figure."""
    return max(json.loads(run([smoe, "mem-bandwidth", "--threads", threads]).stdout)["read_bytes_per_s"] for _ in range(tries))


def fio(path, bs, depth, seconds=15):
    r = run(["fio", "--name=smoe", f"--filename={path}", "--readonly", "--direct=1", "--rw=randread", f"--bs={bs}",
             f"--iodepth={depth}", "--ioengine=io_uring", f"--runtime={seconds}", "--time_based", "--output-format=json"])
    j = json.loads(r.stdout)
    return j["jobs"][0]["read"]["bw_bytes"]


DEVICE = "cpu"


def smoe_bench(smoe, vault, threads, args, cache="resident", prefix=()):
    cmd = [*prefix, smoe, "bench", vault, "--device", DEVICE, "--threads", threads, "--json", "--cache", cache, *args]
    out = run(cmd).stdout.strip().splitlines()[-1]
    return json.loads(out)


def llama_bench(bins, gguf, threads, p, n, reps, extra=(), prefix=()):
    """llama-bench's figures: the mean of its repetitions per test, and every repetition."""
    cmd = [*prefix, os.path.join(bins, "llama-bench"), "-m", gguf, "-t", threads, "-p", p, "-n", n, "-r", reps, "-o", "json", *extra]
    rows = json.loads(run(cmd).stdout)
    out = {}
    for row in rows:
        kind = "prefill" if row["n_prompt"] > 0 else "decode"
        out[kind] = row["avg_ts"]
        out[kind + "_samples"] = row.get("samples_ts", [row["avg_ts"]])
    return out


# --- memory caps -------------------------------------------------------------------------------

class Cgroup:
    """A memory-limited cgroup (v2 or v1) that commands are started in."""

    def __init__(self, limit):
        self.limit = limit
        v2 = "/sys/fs/cgroup/cgroup.controllers"
        if os.path.exists(v2) and "memory" in open(v2).read():
            self.path = "/sys/fs/cgroup/smoe-bench"
            os.makedirs(self.path, exist_ok=True)
            write(os.path.join(self.path, "memory.max"), limit)
            write(os.path.join(self.path, "memory.swap.max"), 0)
            got = open(os.path.join(self.path, "memory.max")).read().strip()
        elif os.path.isdir("/sys/fs/cgroup/memory"):
            self.path = "/sys/fs/cgroup/memory/smoe-bench"
            os.makedirs(self.path, exist_ok=True)
            # memory+swap may not be below memory, so lift it first (the group may be left
            # over from an earlier run with a smaller cap), then set both.
            memsw = os.path.join(self.path, "memory.memsw.limit_in_bytes")
            has_memsw = os.path.exists(memsw)
            if has_memsw:
                write(memsw, -1)
            write(os.path.join(self.path, "memory.limit_in_bytes"), limit)
            if has_memsw:
                write(memsw, limit)
            got = open(os.path.join(self.path, "memory.limit_in_bytes")).read().strip()
        else:
            raise SystemExit("no writable cgroup memory controller (v1 or v2)")
        # The kernel rounds to pages; anything else means the limit did not take.
        if abs(int(got) - limit) > 1 << 16:
            raise SystemExit(f"cgroup memory limit is {got}, not {limit}")
        log(f"cgroup {self.path}: memory limit {limit / 2**30:.2f} GiB")

    def prefix(self):
        # The shell joins the group, then becomes the command.
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "cgexec"]


def write(path, value):
    """Writes a control file, failing loudly (a buffered write's error would surface only at close)."""
    with open(path, "w") as f:
        f.write(f"{value}\n")


def drop_caches():
    subprocess.run(["sync"])
    try:
        open("/proc/sys/vm/drop_caches", "w").write("3\n")
    except OSError as e:
        log(f"cannot drop the page cache ({e}); capped numbers are optimistic")


# --- the run ------------------------------------------------------------------------------------

def greedy_evidence(smoe, bins, vault, gguf):
    prompt = "The capital of France is"
    llama = run([os.path.join(bins, "llama-completion"), "-m", gguf, "-p", prompt, "-n", "12", "--temp", "0", "-t", "2",
                 "--no-display-prompt", "-no-cnv", "--seed", "1"], check=False)
    ours = run([smoe, "run", vault, "--device", DEVICE, "-p", prompt, "--raw", "--temperature", "0", "--max-tokens", "12", "--json",
                "--cache", "resident"])
    ours_j = json.loads(ours.stdout)
    return {"prompt": prompt, "llama_text": llama.stdout, "llama_ok": llama.returncode == 0, "smoe_text": ours_j["text"],
            "smoe_ids": ours_j["tokens"], "same_text": llama.stdout.strip() == ours_j["text"].strip()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="48")
    ap.add_argument("--threads", default=str(os.cpu_count() or 2))
    ap.add_argument("--reps", default="3")
    ap.add_argument("--cap-fraction", type=float, default=1 / 3)
    ap.add_argument("--work", default=os.path.join(ROOT, "target/bench"))
    ap.add_argument("--capped-tokens", default="16", help="llama.cpp's decode tokens under the cap (it is slow there)")
    ap.add_argument("--capped-tokens-smoe", default="64")
    ap.add_argument("--mix", help="a llama.cpp file type for both engines' weights (Q4_K_M; default: Q4_K experts, Q8_0 dense)")
    ap.add_argument("--device", default="cpu", help="smoe's device: cpu, cuda or cuda:N (llama.cpp runs as it was built)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "qwen3-235b-a22b"],
                    help="qwen3-235b-a22b: the full-scale run of bench/big.py instead (a file larger than RAM, no cap)")
    ap.add_argument("--ram-ratio", type=float, default=2.5, help="235B run: the file's size over physical memory")
    ap.add_argument("--gen-tokens", default="64", help="235B run: smoe's decode tokens")
    ap.add_argument("--llama-gen-tokens", default="16", help="235B run: llama.cpp's decode tokens")
    ap.add_argument("--keep-model", action="store_true", help="235B run: keep the GGUF afterwards")
    args = ap.parse_args()
    if args.shape == "qwen3-235b-a22b":
        import big
        return big.main(args)
    global DEVICE
    DEVICE = args.device
    os.makedirs(args.work, exist_ok=True)
    t_start = time.time()
    smoe = build_smoe()
    llama_src, bins = llama_cpp(args.work)
    vault, gguf = model_files(smoe, llama_src, args.work, args.layers, args.mix)
    info = json.loads(run([smoe, "inspect", vault, "--json"]).stdout)
    blob = info["expert_blob_bytes"]
    model_bytes = os.path.getsize(vault)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') >> 30} GiB",
           "cpu": cpu_name(), "layers": int(args.layers), "threads": int(args.threads), "model_bytes": model_bytes,
           "gguf_bytes": os.path.getsize(gguf), "blob_bytes": blob}

    # Ceilings.
    res["ram_read_bytes_per_s"] = mem_bandwidth(smoe, args.threads)
    res["fio"] = {qd: fio(vault, blob, qd) for qd in (1, 8, 32)}
    log(f"ceilings: RAM {res['ram_read_bytes_per_s'] / 1e9:.1f} GB/s, fio {res['fio']}")

    # Evidence that llama.cpp runs the exported file, and the first greedy tokens of both.
    res["greedy"] = greedy_evidence(smoe, bins, vault, gguf)
    log(f"greedy: llama.cpp {res['greedy']['llama_text']!r} / smoe {res['greedy']['smoe_text']!r}")

    # Fully cached, interleaved rounds. As llama-bench does, prefill is a 512-token prompt and
    # decode 128 tokens from an empty context (tg128), measured separately. Each round runs
    # smoe's prefill once, smoe's decode `--reps` times in one process (after a short warm-up)
    # and llama-bench with `-r <reps>` (after its own warm-up), so both engines get the same
    # number of decode samples, close together in time: this VM's memory bandwidth moves by 2x
    # over tens of seconds, and the best of each engine's samples is what it can do. Each
    # round's pair of bests is kept too.
    best_s, best_l, rounds = {}, {}, []
    for _ in range(int(args.reps)):
        pp = smoe_bench(smoe, vault, args.threads, ["--prompt-tokens", "512", "--gen-tokens", "1"])
        tg = smoe_bench(smoe, vault, args.threads, ["--prompt-tokens", "1", "--gen-tokens", "128", "--reps", args.reps])
        if pp["prefill_tok_s"] > best_s.get("prefill_tok_s", 0):
            best_s.update(prefill_tok_s=pp["prefill_tok_s"], ttft_ms=pp["ttft_ms"])
        if tg["decode_tok_s"] > best_s.get("decode_tok_s", 0):
            best_s.update({k: v for k, v in tg.items() if k not in ("prefill_tok_s", "ttft_ms", "prefill_tok_s_samples")})
        l = llama_bench(bins, gguf, args.threads, "512", "128", args.reps)
        for k in ("prefill", "decode"):
            best_l[k] = max(best_l.get(k, 0), max(l[k + "_samples"]))
        rounds.append({"smoe_prefill": pp["prefill_tok_s"], "smoe_decode": tg["decode_tok_s_samples"],
                       "llama_prefill": l["prefill_samples"], "llama_decode": l["decode_samples"]})
        log(f"round {len(rounds)}: smoe prefill {pp['prefill_tok_s']:.2f}, decode {tg['decode_tok_s_samples']}; "
            f"llama.cpp prefill {l['prefill_samples']}, decode {l['decode_samples']}")
    res["cached"] = {"smoe": best_s, "llama": best_l, "rounds": rounds}

    # Under a memory cap of about a third of the model: llama.cpp through mmap (--repack 0, so
    # the weights stay file-backed and evictable), smoe streaming with its automatic cache.
    # RAM bandwidth once more, now that the machine has settled: the best figure is the ceiling.
    res["ram_read_bytes_per_s"] = max(res["ram_read_bytes_per_s"], mem_bandwidth(smoe, args.threads))
    cap = int(model_bytes * args.cap_fraction)
    cg = Cgroup(cap)
    res["cap_bytes"] = cap
    drop_caches()
    s = smoe_bench(smoe, vault, args.threads, ["--prompt-tokens", "32", "--gen-tokens", args.capped_tokens_smoe], cache="auto",
                   prefix=cg.prefix())
    drop_caches()
    t0 = time.time()
    l = llama_bench(bins, gguf, args.threads, "0", args.capped_tokens, "1", extra=["--repack", "0", "-lm", "mmap", "--no-warmup"],
                    prefix=cg.prefix())
    res["capped"] = {"smoe": s, "llama": l, "llama_wall_s": time.time() - t0}
    # The same, with the routing of a trained MoE replayed (random weights route without its
    # locality); llama.cpp cannot replay it, so this row has no peer.
    drop_caches()
    res["capped"]["smoe_trace"] = smoe_bench(smoe, vault, args.threads, ["--prompt-tokens", "32", "--gen-tokens",
                                                                          args.capped_tokens_smoe, "--routing-trace"],
                                             cache="auto", prefix=cg.prefix())
    res["total_minutes"] = (time.time() - t_start) / 60
    report(res, args.work)


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def report(r, work):
    c, cap = r["cached"], r["capped"]
    ram, fio_bw = r["ram_read_bytes_per_s"], r["fio"][32]
    # Active bytes per decoded token (smoe bench computes it): every dense tensor but the
    # embedding table (one row of it) plus top-k expert blobs per MoE layer.
    active = c["smoe"]["active_bytes_per_token"]
    limit_cached = ram / active
    missed = cap["smoe"]["bytes_read_per_token"]
    limit_capped = fio_bw / max(missed, 1) if missed > 0 else float("inf")
    rows = [
        ("prefill tok/s (512, cached)", c["smoe"]["prefill_tok_s"], c["llama"].get("prefill"), None),
        ("decode tok/s (128, cached)", c["smoe"]["decode_tok_s"], c["llama"].get("decode"), limit_cached),
        (f"decode tok/s (capped at {r['cap_bytes'] / 2**30:.1f} GiB)", cap["smoe"]["decode_tok_s"], cap["llama"].get("decode"),
         limit_capped),
        *([(f"decode tok/s (capped, trace routing; hit rate {cap['smoe_trace']['hit_rate']:.2f} vs "
             f"{cap['smoe']['hit_rate']:.2f})", cap["smoe_trace"]["decode_tok_s"], None,
             fio_bw / max(cap["smoe_trace"]["bytes_read_per_token"], 1))] if "smoe_trace" in cap else []),
        ("time to first token, ms (512, cached)", c["smoe"]["ttft_ms"], None, None),
    ]
    lines = [
        f"{r['date']}, {r['cpu']} ({r['machine']}), {r['threads']} threads, qwen3-30b-a3b shape with {r['layers']} of 48 layers "
        f"({r['model_bytes'] / 2**30:.2f} GiB vault, {r['gguf_bytes'] / 2**30:.2f} GiB GGUF, Q4_K experts, Q8_0 dense), "
        f"{r['total_minutes']:.0f} min in all.",
        "",
        f"Ceilings: RAM read {ram / 1e9:.1f} GB/s; O_DIRECT random reads of {r['blob_bytes'] / 2**20:.2f} MiB (one expert blob): "
        + ", ".join(f"QD{q} {bw / 1e9:.2f} GB/s" for q, bw in r["fio"].items())
        + f". Active bytes per token {active / 2**20:.0f} MiB; missed bytes per token under the cap {missed / 2**20:.0f} MiB.",
        "",
        "| figure | smoe | llama.cpp | smoe / llama.cpp | physical limit | smoe / limit |",
        "|---|---|---|---|---|---|",
    ]
    for name, s, l, lim in rows:
        ratio = f"{s / l:.2f}" if l else "—"
        lim_s = f"{lim:.2f}" if lim else "—"
        of_lim = f"{s / lim:.2f}" if lim else "—"
        lines.append(f"| {name} | {s:.2f} | {l:.2f} | {ratio} | {lim_s} | {of_lim} |" if l else f"| {name} | {s:.2f} | — | — | {lim_s} | {of_lim} |")
    lines += ["", "Cached decode by round (tok/s, every sample; each engine's best of a round, and their ratio):", ""]
    for i, rd in enumerate(c.get("rounds", []), 1):
        sb, lb = max(rd["smoe_decode"]), max(rd["llama_decode"])
        lines.append(f"- round {i}: smoe {', '.join(f'{v:.2f}' for v in rd['smoe_decode'])}; llama.cpp "
                     f"{', '.join(f'{v:.2f}' for v in rd['llama_decode'])}; best {sb:.2f} vs {lb:.2f} = {sb / lb:.2f}")
    lines += [
        "",
        f"Under the cap smoe chose a cache of {cap['smoe']['cache_experts']} of {cap['smoe']['total_experts']} experts "
        f"({cap['smoe']['cache_bytes'] / 2**30:.2f} GiB); its hit rate was {cap['smoe']['hit_rate']:.3f}, reads ran at "
        f"{cap['smoe']['read_bytes_per_s'] / 1e9:.2f} GB/s while outstanding; llama.cpp's capped run took {cap['llama_wall_s']:.0f} s.",
        "",
        f"Greedy, raw prompt {r['greedy']['prompt']!r}, 12 tokens: llama.cpp wrote {r['greedy']['llama_text']!r}; "
        f"smoe wrote {r['greedy']['smoe_text']!r} (ids {r['greedy']['smoe_ids']}); identical: {r['greedy']['same_text']}.",
    ]
    md = "\n".join(lines)
    print(md)
    with open(os.path.join(work, "results.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(r, f, indent=1, default=str)
    chart(rows, os.path.join(work, "results.png"))
    log(f"wrote {work}/results.{{md,json,png}}")


def chart(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is missing: no chart")
        return
    rows = [r for r in rows if "tok/s" in r[0]]
    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 4))
    for ax, (name, s, l, lim) in zip(axes, rows):
        names, vals, colors = ["smoe"], [s], ["#2a7"]
        if l:
            names.append("llama.cpp"); vals.append(l); colors.append("#888")
        if lim:
            names.append("limit"); vals.append(lim); colors.append("#ccc")
        ax.bar(names, vals, color=colors)
        ax.set_title(name, fontsize=9)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
