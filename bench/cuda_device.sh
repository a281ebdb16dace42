#!/bin/bash
# The GPU tests and the CUDA benchmarks on a lent device machine that has a GPU but no Rust and
# no network (docs/benchmarks.md, GPU section). Three steps:
#
#   bench/cuda_device.sh pack       # here: build, strip into target/peercarry, trim testdata
#   (device) bash target/peercarry/cuda_device.sh run   # there, carrying target/peercarry
#                                       (`unpack` alone for a call's own script)
#   bench/cuda_device.sh restore    # here: put the full testdata back
#
# `pack` moves testdata/ aside (to $SMOE_TESTDATA_ASIDE, default /tmp/smoe-testdata-aside) and
# leaves only the fixtures the GPU tests read (models/ goes aside too), so that the working tree and the binaries fit
# in what a device call carries; `restore` undoes it (a build needs the full testdata: traces
# and templates are compiled in). `run` writes at most five files under $OUT, as a device call
# returns only a few: tests.txt, bench.txt, profile.txt, log.txt, gpu.txt.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
aside=${SMOE_TESTDATA_ASIDE:-/tmp/smoe-testdata-aside}
fixtures="qwen3_moe qwen3_moe_k qwen2_moe mixtral olmoe qwen3_moe_yarn glm4_moe deepseek_v3 deepseek_v3_yarn glm_moe_dsa gpt_oss gpt_oss_mxfp4 qwen3_next minimax_m2 glm_moe_dsa_fp8 qwen3_5_moe deepseek_v4 deepseek_v4_fp4"

case "${1:-}" in
pack)
    cd "$here"
    [ -d "$aside" ] && { echo "testdata is already aside in $aside: run restore first" >&2; exit 1; }
    cargo build --release -p smoe
    bins=$(cargo test --release -p smoe-cuda --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"] in (["test"], ["lib"]):
        print(m["target"]["name"], m["executable"])')
    rm -rf target/peercarry  # what an earlier pack left there (scripts strip would refuse)
    mkdir -p target/peercarry
    # The CLI keeps its symbols (a profile on the device names functions); all is xz'd, as are
    # the fixtures: a call carries at most 64 MiB, the working tree included.
    strip --strip-debug -o target/peercarry/smoe target/release/smoe
    while read -r name exe; do cp "$exe" "target/peercarry/$name" && strip "target/peercarry/$name"; done <<<"$bins"
    xz -T2 -6 target/peercarry/*
    cp bench/cuda_device.sh target/peercarry/
    mv testdata "$aside"
    mv models "$aside.models"  # the bundled trained model: no GPU test reads it
    mkdir -p testdata/hf
    for f in $fixtures; do cp -r "$aside/hf/$f" testdata/hf/; done
    cp -r "$aside/gguf-kquant" testdata/  # llama.cpp's own K-quant files, run in place
    tar cf - testdata | xz -T2 -6 >target/peercarry/testdata.tar.xz
    rm -rf testdata
    du -sh target/peercarry
    ;;
restore)
    cd "$here"
    [ -d "$aside" ] || { echo "nothing aside in $aside" >&2; exit 1; }
    rm -rf testdata target/peercarry/testdata.tar.xz
    mv "$aside" testdata
    [ -d "$aside.models" ] && mv "$aside.models" models
    git status --short testdata | head -3
    ;;
unpack)
    # On the device, from the repository root: the fixtures and the binaries `pack` compressed.
    [ -e target/peercarry/testdata.tar.xz ] && tar xJf target/peercarry/testdata.tar.xz && rm target/peercarry/testdata.tar.xz
    ls target/peercarry/*.xz >/dev/null 2>&1 && unxz -T4 target/peercarry/*.xz
    exit 0
    ;;
run)
    # On the device, from the repository root: the test binaries look for fixtures at the path
    # they were built in (/work/main).
    bash "$0" unpack
    mkdir -p /work target/tmp  # the fixture vaults the tests make
    [ -e /work/main ] || ln -sfn "$PWD" /work/main
    b=$PWD/target/peercarry
    out=${OUT:?the device call sets OUT}
    nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1 || true
    lscpu | grep -E "Model name|^CPU\(s\)" >>"$out/gpu.txt" || true
    log=$out/log.txt
    date >"$log"
    ( cd crates/cuda
      for t in smoe_cuda backend gpu; do  # the library's own tests, then tests/
          timeout 300 "$b/$t" >>"$out/tests.txt" 2>&1; echo "$t rc=$? $(date +%T)" >>"$log"
      done )
    vault=/tmp/q30.smoe
    [ -e "$vault" ] || "$b/smoe" synth --shape qwen3-30b-a3b --vault "$vault" --experts Q4_K --dense Q8_0 --random-blocks >/dev/null
    bench() {
        echo "=== $*" >>"$out/bench.txt"
        timeout 120 "$b/smoe" bench "$vault" --device cuda --cache resident "$@" >>"$out/bench.txt" 2>&1
        echo "bench $* rc=$? $(date +%T)" >>"$log"
    }
    bench --prompt-tokens 512 --gen-tokens 64 --reps 3
    bench --prompt-tokens 2048 --gen-tokens 1 --reps 2
    bench --prompt-tokens 1 --gen-tokens 128 --reps 3
    SMOE_CUDA_PROFILE=1 timeout 120 "$b/smoe" bench "$vault" --device cuda --cache resident \
        --prompt-tokens 512 --gen-tokens 1 --reps 1 >"$out/profile.txt" 2>&1 || true
    date >>"$log"
    ;;
*)
    echo "usage: $0 pack | unpack | run | restore" >&2
    exit 2
    ;;
esac
