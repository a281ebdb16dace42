"""The headline at full scale: a Qwen3-235B-A22B-shape GGUF at least 2.5x this machine's RAM,
decoded by smoe and by llama.cpp from the same file, with no memory cap.

    bench/run --shape qwen3-235b-a22b [--ram-ratio 2.5] [--threads 2] [--gen-tokens 24]

Steps: build smoe and llama.cpp (see run.py); size the file (layers of the 235B shape, 94 at most,
so that the GGUF is at least --ram-ratio times physical memory, and fits on the disk with room
to spare); write it with `smoe synth --gguf --random-blocks` (Q2_K_MIX experts: gate/up Q2_K, down
Q3_K; Q4_K dense; the real Qwen2 vocabulary); measure O_DIRECT random reads of 2 MiB (about one expert
matrix) with fio; then, each from a cold page cache:

- smoe, time to first token of a 512-token prompt from process start (load + prefill);
- smoe decode with the router's own choice, and with the bundled trained-MoE routing trace
  (`--routing-trace`: realistic locality; I/O and cache figures only);
- llama.cpp (mmap, --repack 0) decode, and its 512-token prefill from a cold start.

Bytes read from the disk per token come from /proc/diskstats around each run (smoe's own count
too). Results: results.json and results.md in the work directory's big-<layers>/ folder. The
model file is deleted at the end unless --keep-model.
"""

import json
import math
import os
import shutil
import time

import run as h

SHAPE = "qwen3-235b-a22b"
FULL_LAYERS = 94


def disk_read_bytes(path):
    """Bytes read so far from the block device holding `path` (/proc/diskstats, 512-byte sectors)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    for line in open("/proc/diskstats"):
        f = line.split()
        if int(f[0]) == major and int(f[1]) == minor:
            return int(f[5]) * 512
    # A partition's stats line may be missing (e.g. a whole-disk filesystem on a virtual disk).
    return 0


def measured(fn, path):
    """Runs fn(); returns (its result, wall seconds, bytes read meanwhile from the disk holding `path`)."""
    b0, t0 = disk_read_bytes(path), time.time()
    out = fn()
    return out, time.time() - t0, disk_read_bytes(path) - b0


def synth(smoe, path, layers, vocab):
    h.run([smoe, "synth", "--shape", SHAPE, "--layers", layers, "--gguf", path, "--experts", "Q2_K_MIX", "--dense", "Q4_K",
           "--random-blocks", "--vocab-gguf", vocab], capture=False)


def size_plan(smoe, work, vocab, ratio):
    """Layers to synthesise: the file size is affine in the layer count, measured on 1 and 2 layers."""
    sizes = []
    for n in (1, 2):
        p = os.path.join(work, f"probe-{n}.gguf")
        synth(smoe, p, str(n), vocab)
        sizes.append(os.path.getsize(p))
        os.remove(p)
    per_layer, base = sizes[1] - sizes[0], 2 * sizes[0] - sizes[1]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    want = math.ceil((ratio * ram - base) / per_layer)
    free = shutil.disk_usage(work).free
    room = (free - (4 << 30) - base) // per_layer  # keep 4 GiB free for everything else
    layers = max(1, min(FULL_LAYERS, want, room))
    h.log(f"size plan: {base / 2**30:.2f} GiB + {per_layer / 2**30:.3f} GiB/layer; RAM {ram / 2**30:.1f} GiB x {ratio} needs "
          f"{want} layers, the disk allows {room}: {layers}")
    return layers, base + layers * per_layer, ram


def smoe_json(smoe, gguf, threads, args):
    r = h.run([smoe, "bench", gguf, "--device", "cpu", "--threads", threads, "--json", "--cache", "auto", *args])
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_json(bins, gguf, threads, p, n, warmup):
    cmd = [os.path.join(bins, "llama-bench"), "-m", gguf, "-t", threads, "-p", p, "-n", n, "-r", "1", "-o", "json",
           "--repack", "0", "-lm", "mmap", *([] if warmup else ["--no-warmup"])]
    return json.loads(h.run(cmd).stdout)[0]


def bound(decode):
    """What a decode step's time went to, from smoe's instrumented breakdown."""
    total = decode["total_ms"] or 1
    parts = {"waiting for reads": decode["io_wait_ms"], "expert products": decode["expert_ms"],
             "attention": decode["attention_ms"], "other": decode["routing_ms"] + decode["sampling_ms"] + decode["other_ms"]}
    return {k: round(v / total, 3) for k, v in parts.items()}


def main(args):
    work = os.path.join(args.work, "big")
    os.makedirs(work, exist_ok=True)
    t_start = time.time()
    smoe = h.build_smoe()
    src, bins = h.llama_cpp(args.work)
    vocab = os.path.join(src, "models/ggml-vocab-qwen2.gguf")
    layers, _, ram = size_plan(smoe, work, vocab, args.ram_ratio)
    gguf = os.path.join(work, f"{SHAPE}-l{layers}-q2_k_mix.gguf")
    if not os.path.exists(gguf):
        t = time.time()
        synth(smoe, gguf, str(layers), vocab)
        synth_s = time.time() - t
    else:
        synth_s = None
    size = os.path.getsize(gguf)
    # One expert matrix of this shape: gate/up [1536, 4096] at Q2_K are 2.06 MB, down [4096, 1536]
    # at Q3_K 2.70 MB; GGUF stacks each matrix kind apart, so a miss is read as such pieces.
    part = 2 << 20
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": h.cpu_name(), "cores": os.cpu_count(), "ram_bytes": ram,
           "threads": int(args.threads), "shape": SHAPE, "layers": layers, "gguf_bytes": size, "ram_ratio": size / ram,
           "synth_seconds": synth_s, "expert_part_bytes": part, "experts": "Q2_K_MIX (gate/up Q2_K, down Q3_K)", "dense": "Q4_K"}
    # After the file is on the disk: writeback of a fresh 60 GB file would slow fio's reads.
    h.drop_caches()
    res["fio"] = {qd: h.fio(gguf, part, qd) for qd in (1, 8, 32)}
    # Sequential 8 MiB reads: what a page cache's readahead can get from this disk.
    r = h.run(["fio", "--name=seq", f"--filename={gguf}", "--readonly", "--direct=1", "--rw=read", "--bs=8M", "--iodepth=8",
               "--ioengine=io_uring", "--runtime=15", "--time_based", "--output-format=json"])
    res["fio_seq_8m"] = json.loads(r.stdout)["jobs"][0]["read"]["bw_bytes"]
    fio32 = res["fio"][32]
    h.log(f"{size / 2**30:.1f} GiB = {size / ram:.2f}x RAM; fio QD32 {fio32 / 1e9:.2f} GB/s")

    def cold(fn):
        h.drop_caches()
        return measured(fn, work)

    # smoe: cold start to first token of a 512-token prompt.
    ttft, wall, read = cold(lambda: smoe_json(smoe, gguf, args.threads, ["--prompt-tokens", "512", "--gen-tokens", "1"]))
    res["smoe_ttft"] = {"load_s": ttft["load_seconds"], "prefill_s": ttft["ttft_ms"] / 1e3,
                        "first_token_s": ttft["load_seconds"] + ttft["ttft_ms"] / 1e3, "wall_s": wall, "disk_read_bytes": read,
                        "prefill_tok_s": ttft["prefill_tok_s"], "cache_experts": ttft["cache_experts"],
                        "total_experts": ttft["total_experts"]}
    h.log(f"smoe cold TTFT {res['smoe_ttft']['first_token_s']:.1f} s")
    # smoe decode, the router's own routing and the trace's.
    for name, extra in (("smoe_router", []), ("smoe_trace", ["--routing-trace"])):
        r, wall, read = cold(lambda: smoe_json(smoe, gguf, args.threads,
                                               ["--prompt-tokens", "1", "--gen-tokens", args.gen_tokens, *extra]))
        res[name] = {"decode_tok_s": r["decode_tok_s"], "bytes_read_per_token": r["bytes_read_per_token"], "hit_rate": r["hit_rate"],
                     "read_bytes_per_s": r["read_bytes_per_s"], "cache_experts": r["cache_experts"],
                     "total_experts": r["total_experts"], "routing": r.get("routing"), "bound": bound(r["decode"]),
                     "disk_read_bytes": read, "wall_s": wall, "gen_tokens": r["gen_tokens"]}
        h.log(f"{name}: {r['decode_tok_s']:.3f} tok/s, hit {r['hit_rate']:.3f}, {r['bytes_read_per_token'] / 2**30:.2f} GiB/token")
    # llama.cpp from the same file.
    # Decode after llama-bench's own warm-up run (the dense weights faulted in, as smoe's load
    # reads them before its clock starts); the first token from a cold start is measured below.
    l, wall, read = cold(lambda: llama_json(bins, gguf, args.threads, "0", args.llama_gen_tokens, True))
    # Disk bytes include the warm-up's (one token), so per token they are over n + 1.
    res["llama_decode"] = {"decode_tok_s": l["avg_ts"], "gen_tokens": int(args.llama_gen_tokens), "wall_s": wall,
                           "disk_read_bytes": read, "bytes_read_per_token": read / (int(args.llama_gen_tokens) + 1)}
    h.log(f"llama.cpp decode {l['avg_ts']:.4f} tok/s")
    l, wall, read = cold(lambda: llama_json(bins, gguf, args.threads, "512", "0", False))
    res["llama_ttft"] = {"prefill_tok_s": l["avg_ts"], "first_token_s": wall, "disk_read_bytes": read}
    h.log(f"llama.cpp cold 512-token prefill: {wall:.1f} s wall")
    res["total_minutes"] = (time.time() - t_start) / 60
    if not args.keep_model:
        os.remove(gguf)
    report(res, work)


def report(r, work):
    scale = r["layers"] / FULL_LAYERS
    fio = r["fio"][32] / 1e9
    s, t, l = r["smoe_router"], r["smoe_trace"], r["llama_decode"]
    lines = [
        f"{r['date']}, {r['cpu']} ({r['cores']} cores, {r['ram_bytes'] / 2**30:.1f} GiB), {r['threads']} threads; "
        f"{r['shape']} shape with {r['layers']} of {FULL_LAYERS} layers: {r['gguf_bytes'] / 2**30:.1f} GiB GGUF "
        f"({r['ram_ratio']:.2f}x RAM), {r['experts']} experts, {r['dense']} dense; {r['total_minutes']:.0f} min in all.",
        "",
        "Disk: O_DIRECT random reads of 2 MiB (one expert matrix): "
        + ", ".join(f"QD{q} {bw / 1e9:.2f} GB/s" for q, bw in r["fio"].items())
        + f"; sequential 8 MiB reads at QD8: {r.get('fio_seq_8m', 0) / 1e9:.2f} GB/s.",
        "",
        "| | smoe, router | smoe, trace routing | llama.cpp (mmap) |",
        "|---|---|---|---|",
        f"| decode tok/s ({r['layers']} layers) | {s['decode_tok_s']:.3f} | {t['decode_tok_s']:.3f} | {l['decode_tok_s']:.4f} |",
        f"| decode tok/s, scaled to {FULL_LAYERS} layers | {s['decode_tok_s'] * scale:.3f} | {t['decode_tok_s'] * scale:.3f} | "
        f"{l['decode_tok_s'] * scale:.4f} |",
        f"| tok/s per GB/s of disk (94-layer figure / fio QD32) | {s['decode_tok_s'] * scale / fio:.3f} | "
        f"{t['decode_tok_s'] * scale / fio:.3f} | {l['decode_tok_s'] * scale / fio:.4f} |",
        f"| GiB read per token (engine's count / disk's) | {s['bytes_read_per_token'] / 2**30:.2f} / "
        f"{s['disk_read_bytes'] / s['gen_tokens'] / 2**30:.2f} | {t['bytes_read_per_token'] / 2**30:.2f} / "
        f"{t['disk_read_bytes'] / t['gen_tokens'] / 2**30:.2f} | – / {l['bytes_read_per_token'] / 2**30:.2f} |",
        f"| expert hit rate | {s['hit_rate']:.3f} | {t['hit_rate']:.3f} | – |",
        f"| cache | {s['cache_experts']} of {s['total_experts']} experts | {t['cache_experts']} of {t['total_experts']} | page cache |",
        f"| decode time: {', '.join(s['bound'])} | {', '.join(f'{v:.2f}' for v in s['bound'].values())} | "
        f"{', '.join(f'{v:.2f}' for v in t['bound'].values())} | – |",
        f"| cold start to first token, 512-token prompt | {r['smoe_ttft']['first_token_s']:.1f} s "
        f"(load {r['smoe_ttft']['load_s']:.1f} s) | – | {r['llama_ttft']['first_token_s']:.1f} s (wall) |",
        "",
        f"smoe vs llama.cpp decode: {s['decode_tok_s'] / max(l['decode_tok_s'], 1e-9):.1f}x with the router's routing, "
        f"{t['decode_tok_s'] / max(l['decode_tok_s'], 1e-9):.1f}x with the trace's (llama.cpp cannot replay a trace).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(work, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(r, f, indent=1)
