#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry (bench/cuda_device.sh
# pack: the build under test and its three GPU test suites) and target/ptxcache (its kernels,
# compiled here by bench/ptx_cache.py). The GPU suites again after call 2: Q6_K on the kept-expert
# tiles too (staged 16 bits at a time), the gate-and-up-only tile path of the call before removed.
# Then batched decode of call 2's GGUF B (Q4_K gate/up, Q6_K down experts, Q4_K dense), this build
# against smoe-mid (7137f86, call 2's `smoe`: gate and up on the tiles, Q6_K down pair by pair),
# alternated twice, and GGUF A (all Q4_K) once for scale.
P=$PWD/target/peercarry
bash $P/cuda_device.sh unpack
chmod +x $P/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
( cd crates/cuda
  for t in smoe_cuda gpu backend; do
    timeout 330 $P/$t --nocapture > $OUT/tests-$t.txt 2>&1; echo "$t rc=$? $(date +%T)" >> $L
  done )
C=$P; B=$OUT/bench.txt
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/a.gguf --experts Q4_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/b.gguf --experts Q4_K,down=Q6_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
smoe() {  # round, gguf, binary
  echo "== round $1 $3 $2" >> $B
  timeout 90 $C/$3 bench /tmp/$2.gguf --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "$3 $1 $2 rc=$? $(date +%T)" >> $L
}
for r in 1 2; do smoe $r b smoe; smoe $r b smoe-mid; done
smoe 1 a smoe
