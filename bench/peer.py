#!/usr/bin/env python3
"""smoe and llama.cpp as peers: random-weight models of published shapes, the same tokens, both engines.

For each shape, `smoe synth` writes a vault of its first --layers layers (Q4_K experts — gpt-oss's
MXFP4, as published —, Q8_0 dense; with --random-blocks the Q4_K/Q8_0 tensors are random valid
blocks of the same spread instead of quantized generated values, written at disk speed,
synth's small byte-level BPE tokenizer padded to the shape's vocabulary) and `smoe export-gguf`
writes the same quantized blocks as a GGUF. --prompt-tokens ids, drawn uniformly from the
vocabulary with a fixed seed, go through each engine in one prefill that keeps the logits of every
position; then each continues greedily for --gen tokens:

  smoe score VAULT --ids-file IDS --out OUT.safetensors --fast --greedy GEN   (int8 production kernels)
  llama_logits MODEL.gguf IDS OUT.f32 THREADS GEN                            (bench/llama_logits.c)

Per shape, llama.cpp's [T, vocab] logits b against smoe's a: rel_t = max_v |a - b| / max_v |b| (its
maximum and median over positions t), top-1 agreement, mean KL(llama.cpp || smoe) (float64 softmax),
whether the greedy continuations are equal (and where they first differ), and the near-tie share:
the fraction of top-1 disagreements at positions where llama.cpp's own top-1 minus top-2 logit is
below 0.1 x its median over positions (disagreements there are ties, not errors). To tell
activation-quantization noise from a real difference, smoe also scores the same ids in f32 on
the dequantized weights (`smoe score` without --fast, checked against transformers on every
fixture family), and each engine's distance from that reference is reported beside the other's:
an engine whose int8 activations explain its disagreement is as far from the reference as its
peer. --no-reference skips it. Times are each
command's wall clock (model load included; the files were just written, so mostly page-cached);
the engines' own prefill/greedy times, where they print them, are in the JSON.

Usage:
  bench/peer.py [--shapes qwen3-30b-a3b,mixtral-8x7b] [--layers 2] [--prompt-tokens 2000] [--gen 64]
                [--threads N] [--work target/peer] [--smoe PATH] [--llama-bin DIR] [--random-blocks] [--keep] [--out-json FILE]
  bench/peer.py --build-llama-only [--jobs 1]      # only build WORK/llama-bin, then stop

Without --smoe, smoe is built with cargo (as bench/run does). Without --llama-bin, llama.cpp is
fetched as bench/run fetches it (LLAMA_CPP_DIR overrides the source), built in its own build-peer
directory as shared libraries (library target only, portable AVX-512 flags, under nice), and
WORK/llama-bin is filled with llama_logits, libllama, libggml* and libgomp, all with RUNPATH
$ORIGIN: that folder runs on another x86-64 Linux (glibc >= this one's) with AVX-512 VNNI/BF16, so
on a machine without Rust or a compiler pass a release smoe binary as --smoe and the folder as
--llama-bin. Needs python3 with numpy. Model files and logits are deleted after each shape unless
--keep (at 2 layers, deepseek-v3 is about 7 GB per model file; 2000 x 151936 logits are 1.2 GB).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

try:
    import numpy as np
except ImportError:
    raise SystemExit("bench/peer.py needs numpy (python3 -m pip install numpy)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as harness  # noqa: E402

ROOT = harness.ROOT
SHAPES = "qwen3-30b-a3b,qwen3-235b-a22b,qwen2-57b-a14b,mixtral-8x7b,mixtral-8x22b,olmoe-1b-7b,glm-4.5,glm-4.5-air,deepseek-v3,glm-5,qwen3-next-80b-a3b"
IDS_SEED = 7
# Expert formats other than synth's Q4_K default: gpt-oss as its hub checkpoints ship it.
EXPERTS = {"gpt-oss-20b": "MXFP4", "gpt-oss-120b": "MXFP4"}
# CPU features both the build machine and the one the comparison runs on have (Zen 4 and
# Sapphire Rapids): no -march=native, so the binaries travel.
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_FMA=ON",
    "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    # Every library and llama_logits find each other in whatever folder they are copied to.
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
]
log = harness.log


def sh(cmd, **kw):
    return harness.run(cmd, **kw)


# --- llama.cpp --------------------------------------------------------------------------------

def llama_source(work):
    """The llama.cpp source bench/run builds (bench/run.py's llama_source)."""
    return harness.llama_source(work)


def needed_libs(path):
    """The DT_NEEDED names of an ELF file."""
    out = sh(["readelf", "-d", path]).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def build_llama_bin(work, jobs):
    """Builds llama.cpp's library (src/build-peer, nice'd) and llama_logits against it; gathers the
    program and the shared libraries it loads, bar the C and C++ runtimes, in WORK/llama-bin."""
    src = llama_source(work)
    build = os.path.join(src, "build-peer")
    cmake = shutil.which("cmake")
    if not cmake:
        sh([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], capture=False)
        cmake = shutil.which("cmake") or os.path.join(os.path.dirname(sys.executable), "cmake")
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    sh([*nice, cmake, "-S", src, "-B", build, *LLAMA_CMAKE_FLAGS], capture=False)
    sh([*nice, cmake, "--build", build, "-j", str(jobs), "--target", "llama"], capture=False)
    libs = os.path.join(build, "bin")
    out = os.path.join(work, "llama-bin")
    os.makedirs(out, exist_ok=True)
    prog = os.path.join(out, "llama_logits")
    sh([*nice, "cc", "-O2", "-o", prog, os.path.join(ROOT, "bench/llama_logits.c"), f"-I{src}/include", f"-I{src}/ggml/include",
        f"-L{libs}", "-lllama", "-Wl,-rpath,$ORIGIN", f"-Wl,-rpath-link,{libs}"])
    # The closure of llama_logits' libraries that come from this build, plus the OpenMP runtime
    # (a bare system may lack it); each is copied as a plain file under the name asked for.
    todo, seen = [prog], set()
    while todo:
        for name in needed_libs(todo.pop()):
            if name in seen:
                continue
            seen.add(name)
            here = os.path.join(libs, name)
            if not os.path.exists(here) and name.startswith("libgomp"):
                here = sh(["cc", f"-print-file-name={name}"]).stdout.strip()
            if os.path.isabs(here) and os.path.exists(here):
                dst = os.path.join(out, name)
                if os.path.lexists(dst):
                    os.remove(dst)
                shutil.copy(here, dst)
                todo.append(dst)
    with open(os.path.join(out, "BUILD.txt"), "w") as f:
        f.write(f"llama.cpp vendored in llama-cpp-python {harness.LLAMA_VERSION} ({src}), built by bench/peer.py\n"
                f"cmake {' '.join(LLAMA_CMAKE_FLAGS)}\nlibraries: {' '.join(sorted(os.listdir(out)))}\n")
    missing = [line.strip() for line in sh(["ldd", prog]).stdout.splitlines() if "not found" in line]
    if missing:
        raise SystemExit(f"{prog} misses libraries: {missing}")
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    log(f"{out}: {', '.join(sorted(os.listdir(out)))} ({size / 2**20:.1f} MiB)")
    return out


# --- reading and comparing logits -------------------------------------------------------------

def safetensors_arrays(path):
    """Every tensor of a safetensors file as a read-only memory map."""
    dtypes = {"F32": "<f4", "I32": "<i4", "F16": "<f2", "I64": "<i8"}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    out = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        start, end = t["data_offsets"]
        if end > start:
            out[name] = np.memmap(path, dtype=dtypes[t["dtype"]], mode="r", offset=8 + n + start, shape=tuple(t["shape"]))
        else:
            out[name] = np.zeros(t["shape"], dtype=dtypes[t["dtype"]])
    return out


def log_softmax(x):
    m = x.max(1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))


def compare(ours, theirs, rows=32):
    """smoe's logits against llama.cpp's, row block by row block (float64 only for `rows` rows)."""
    t = theirs.shape[0]
    rel, kl, margin = np.empty(t), np.empty(t), np.empty(t)
    top_ours, top_theirs = np.empty(t, np.int64), np.empty(t, np.int64)
    for s in range(0, t, rows):
        e = min(t, s + rows)
        a = np.asarray(ours[s:e], dtype=np.float64)
        b = np.asarray(theirs[s:e], dtype=np.float64)
        rel[s:e] = np.abs(a - b).max(1) / np.abs(b).max(1)
        top_ours[s:e], top_theirs[s:e] = a.argmax(1), b.argmax(1)
        two = np.partition(b, -2, axis=1)[:, -2:]
        margin[s:e] = two[:, 1] - two[:, 0]
        lb, la = log_softmax(b), log_softmax(a)
        kl[s:e] = (np.exp(lb) * (lb - la)).sum(1)
    differ = top_ours != top_theirs
    tie = 0.1 * float(np.median(margin))
    return {
        "max_rel": float(rel.max()),
        "median_rel": float(np.median(rel)),
        "worst_position": int(rel.argmax()),
        "top1": float(1 - differ.mean()),
        "top1_disagreements": int(differ.sum()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "median_margin": float(np.median(margin)),
        "near_tie_threshold": tie,
        "near_tie_share": float((margin[differ] < tie).mean()) if differ.any() else None,
    }


def greedy_compare(ours, theirs):
    ours, theirs = [int(x) for x in ours], [int(x) for x in theirs]
    first = next((i for i, (p, q) in enumerate(zip(ours, theirs)) if p != q), None)
    if first is None and len(ours) != len(theirs):
        first = min(len(ours), len(theirs))
    return {"greedy_equal": first is None, "greedy_first_divergence": first, "greedy_smoe": ours, "greedy_llama": theirs}


# --- one shape --------------------------------------------------------------------------------

def timed(cmd):
    t = time.monotonic()
    r = sh(cmd)
    return time.monotonic() - t, r.stderr


def seconds(pattern, text):
    m = re.search(pattern, text or "")
    return float(m.group(1)) if m else None


def remove(*paths):
    for p in paths:
        if os.path.lexists(p):
            os.remove(p)


def one_shape(shape, args, smoe, llama_bin):
    cut = f"l{args.layers}" + (f"from{args.first_layer}" if args.first_layer else "")
    w = lambda suffix: os.path.join(args.work, f"{shape}-{cut}{suffix}")
    vault, gguf, ids_file, ours_file, theirs_file = w(".smoe"), w(".gguf"), w(".ids.txt"), w(".smoe.safetensors"), w(".llama.f32")
    greedy_file, ref_file = theirs_file + ".greedy", w(".ref.safetensors")
    files = (vault, gguf, ids_file, ours_file, theirs_file, greedy_file, ref_file)
    hub = None
    res = {"shape": shape, "layers": args.layers, "first_layer": args.first_layer, "tokens": args.prompt_tokens, "gen": args.gen}
    log(f"{shape}: {shutil.disk_usage(args.work).free / 2**30:.1f} GiB free in {args.work}")
    try:
        if shape.startswith("deepseek-v4"):
            # llama.cpp takes DeepSeek-V4 only from deepseek-ai's own checkpoint (FP8 layers, FP4
            # experts) through its converter: bench/v4_hub.py writes one of the shape, the
            # converter makes the GGUF, and both engines run that file (smoe in place).
            hub = os.path.join(args.hub_dir, os.path.basename(w(".hub"))) if args.hub_dir else w(".hub")
            if not (args.keep and os.path.exists(gguf)):
                t = time.monotonic()
                sh([sys.executable, os.path.join(ROOT, "bench/v4_hub.py"), hub, "--shape", shape, "--layers", args.layers,
                    "--first-layer", str(args.first_layer)])
                log(f"wrote the hub checkpoint {hub} in {time.monotonic() - t:.0f} s")
                t = time.monotonic()
                remove(gguf)
                sh([sys.executable, os.path.join(ROOT, "bench/llama_convert.py"), hub, "--outtype", "bf16", "--outfile", gguf])
                log(f"llama.cpp's converter wrote {gguf} in {time.monotonic() - t:.0f} s")
                shutil.rmtree(hub, ignore_errors=True)
            vault = gguf
            res["vault_bytes"] = res["gguf_bytes"] = os.path.getsize(gguf)
            vocab = 129280
        else:
            if not (args.keep and os.path.exists(vault)):
                remove(vault)
                t = time.monotonic()
                sh([smoe, "synth", "--shape", shape, "--layers", args.layers, "--vault", vault,
                    "--experts", EXPERTS.get(shape, "Q4_K")] + (["--random-blocks"] if args.random_blocks else []))
                log(f"synthesised {vault} in {time.monotonic() - t:.0f} s")
            if not (args.keep and os.path.exists(gguf)):
                remove(gguf)
                sh([smoe, "export-gguf", vault, "-o", gguf])
            res["vault_bytes"], res["gguf_bytes"] = os.path.getsize(vault), os.path.getsize(gguf)
            vocab = json.loads(sh([smoe, "inspect", vault, "--json"]).stdout)["architecture"]["vocab_size"]
        res["vocab"] = vocab
        ids = np.random.default_rng(IDS_SEED).integers(0, vocab, size=args.prompt_tokens)
        with open(ids_file, "w") as f:
            f.write(" ".join(map(str, ids)) + "\n")

        res["smoe_s"], err = timed([smoe, "score", vault, "--ids-file", ids_file, "--out", ours_file, "--fast", "--greedy", args.gen,
                                    "--threads", args.threads, "--cache", "resident"])
        res["smoe_scored_s"] = seconds(r"scored \d+ tokens.*? in ([0-9.]+) s", err)
        if args.reference:
            # The same blocks in f32 on the dequantized weights: both engines' distance from it is
            # their activation quantization (and summation order), and nothing else.
            res["ref_s"], _ = timed([smoe, "score", vault, "--ids-file", ids_file, "--out", ref_file, "--greedy", args.gen,
                                     "--threads", args.threads, "--cache", "resident"])
        if not args.keep and vault != gguf:
            remove(vault)  # before llama.cpp runs: less disk and page cache in use
        res["llama_s"], err = timed([os.path.join(llama_bin, "llama_logits"), gguf, ids_file, theirs_file, args.threads, args.gen])
        res["llama_prefill_s"] = seconds(r"prefill \d+ tokens in ([0-9.]+) s", err)
        res["llama_greedy_s"] = seconds(r"greedy \d+ tokens .*? in ([0-9.]+) s", err)
        if not args.keep:
            remove(gguf)

        st = safetensors_arrays(ours_file)
        ours = st["logits"]
        theirs = np.memmap(theirs_file, dtype="<f4", mode="r")
        if ours.shape[0] != args.prompt_tokens or theirs.size != ours.size:
            raise SystemExit(f"logits shapes differ: smoe {ours.shape}, llama.cpp {theirs.size} values "
                             f"({theirs.size / args.prompt_tokens:g} per position)")
        res.update(compare(ours, theirs.reshape(ours.shape)))
        with open(greedy_file) as f:
            theirs_greedy = f.read().split()
        res.update(greedy_compare(st["greedy"] if "greedy" in st else [], theirs_greedy))
        if args.reference:
            ref = safetensors_arrays(ref_file)
            for who, logits, greedy in (("smoe", ours, st.get("greedy", [])), ("llama", theirs.reshape(ours.shape), theirs_greedy)):
                c = compare(logits, ref["logits"])
                res[f"{who}_vs_ref"] = {"median_rel": c["median_rel"], "max_rel": c["max_rel"], "top1": c["top1"], "mean_kl": c["mean_kl"],
                                        "greedy_first_divergence": greedy_compare(greedy, ref["greedy"])["greedy_first_divergence"]}
            del ref
        del ours, theirs, st
    except (SystemExit, Exception) as e:  # one shape's failure (an unknown shape, say) does not end the run
        res["error"] = "\n".join(line for line in (str(e) or repr(e)).splitlines() if line.strip() not in ("", "None"))[-2000:]
        log(f"{shape} failed: {res['error']}")
    finally:
        if not args.keep:
            remove(*files)
        if hub:  # a conversion that failed leaves the checkpoint (30 GB in /dev/shm, maybe)
            shutil.rmtree(hub, ignore_errors=True)
    return res


# --- report -----------------------------------------------------------------------------------

def table(results):
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    lines = ["| shape | layers | tokens | max rel | median rel | top-1 | KL | greedy | near-tie share | smoe s | llama.cpp s "
             "| smoe vs f32: median rel / top-1 / greedy | llama.cpp vs f32: median rel / top-1 / greedy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            last = [line for line in r["error"].splitlines() if line.strip()][-1:] or ["?"]
            lines.append(f"| {r['shape']} | {r['layers']} | {r['tokens']} | failed: {last[0].strip()[:100].replace('|', '/')} "
                         "| | | | | | | | | |")
            continue

        def vs_ref(who):
            v = r.get(f"{who}_vs_ref")
            if not v:
                return "—"
            g = v["greedy_first_divergence"]
            return f"{v['median_rel']:.4f} / {v['top1']:.3f} / {'equal' if g is None else f'differs at {g}'}"
        greedy = f"{r['gen']}/{r['gen']} equal" if r["greedy_equal"] else f"differs at {r['greedy_first_divergence']}"
        lines.append(f"| {r['shape']} | {r['layers']} | {r['tokens']} | {r['max_rel']:.4f} | {r['median_rel']:.4f} | {r['top1']:.4f} "
                     f"| {r['mean_kl']:.2e} | {greedy} | {f(r['near_tie_share'], '.2f')} | {r['smoe_s']:.1f} | {r['llama_s']:.1f} "
                     f"| {vs_ref('smoe')} | {vs_ref('llama')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--layers", default="2")
    ap.add_argument("--first-layer", type=int, default=0,
                    help="DeepSeek-V4 only: cut the published layers from this one on (bench/v4_hub.py --first-layer)")
    ap.add_argument("--hub-dir", help="DeepSeek-V4 only: where the hub checkpoint is written before conversion (default WORK; "
                    "/dev/shm keeps it off a disk that cannot hold it and the GGUF at once)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", default=str(os.cpu_count() or 2))
    ap.add_argument("--work", default=os.path.join(ROOT, "target/peer"))
    ap.add_argument("--smoe", help="an already built smoe binary (default: cargo build --release)")
    ap.add_argument("--llama-bin", help="a folder with llama_logits and its llama.cpp libraries (default: build WORK/llama-bin)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs of the llama.cpp build")
    ap.add_argument("--build-llama-only", action="store_true", help="build WORK/llama-bin and stop")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip smoe's f32 reference run (each engine's distance from the dequantized weights' exact logits)")
    ap.add_argument("--random-blocks", action="store_true",
                    help="synthesise quantized tensors as random valid blocks (smoe synth --random-blocks: disk speed; "
                         "a 4-layer 512-expert Qwen3.5 cut took ~450 s of quantization on 16 cores without it)")
    ap.add_argument("--keep", action="store_true", help="keep model files, ids and logits (and reuse kept models)")
    ap.add_argument("--out-json", help="default: WORK/peer.json")
    args = ap.parse_args()
    args.work = os.path.abspath(args.work)
    args.hub_dir = args.hub_dir and os.path.abspath(args.hub_dir)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if args.first_layer and not all(s.startswith("deepseek-v4") for s in shapes):
        raise SystemExit("--first-layer cuts only DeepSeek-V4 hub checkpoints (other shapes are synthesised from layer 0)")
    os.makedirs(args.work, exist_ok=True)
    llama_bin = args.llama_bin or build_llama_bin(args.work, args.jobs)
    if args.build_llama_only:
        return
    if not os.path.exists(os.path.join(llama_bin, "llama_logits")):
        raise SystemExit(f"no llama_logits in {llama_bin}")
    smoe = os.path.abspath(args.smoe) if args.smoe else harness.build_smoe()
    out_json = args.out_json or os.path.join(args.work, "peer.json")
    head = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": harness.cpu_name(), "cores": os.cpu_count(), "threads": int(args.threads),
            "layers": int(args.layers), "first_layer": args.first_layer, "prompt_tokens": args.prompt_tokens, "gen": args.gen, "ids_seed": IDS_SEED,
            "llama_cpp": f"vendored in llama-cpp-python {harness.LLAMA_VERSION}", "llama_bin": os.path.abspath(llama_bin),
            "smoe": smoe, "results": []}
    print("\n".join(table([]).splitlines()[:2]), flush=True)
    for shape in shapes:
        head["results"].append(one_shape(shape, args, smoe, llama_bin))
        with open(out_json, "w") as f:  # after every shape, so a long run that dies keeps what it did
            json.dump(head, f, indent=1)
        print(table(head["results"][-1:]).splitlines()[-1], flush=True)
    cut = f"{args.layers} layers" + (f" (published layers {args.first_layer}..{args.first_layer + int(args.layers) - 1})" if args.first_layer else "")
    print(f"\n{head['date']}, {head['cpu']}, {head['threads']} threads ({head['cores']} cores); {cut}, "
          f"{args.prompt_tokens} random prompt tokens (seed {IDS_SEED}), {args.gen} greedy tokens; smoe --fast vs llama.cpp "
          f"(llama-cpp-python {harness.LLAMA_VERSION}'s); rel = max|smoe - llama.cpp| / max|llama.cpp| per position; "
          f"KL(llama.cpp || smoe) mean over positions; seconds are wall clock per command.\n")
    print(table(head["results"]))
    log(f"wrote {out_json}")


if __name__ == "__main__":
    main()
