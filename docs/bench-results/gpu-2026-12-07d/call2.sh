#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry and target/ptxcache (the
# build of call 1). Where the few-token products on tensor cores start to pay for Q4_K rows: batched
# decode of 2 to 8 sequences with mvqm (default) and mvqn (SMOE_CUDA_FEW_MMA=off), alternated three
# times, on the Q4_K-dense vault, then on the Q8_0-dense one.
P=$PWD/target/peercarry
bash $P/cuda_device.sh unpack
chmod +x $P/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
L=$OUT/log.txt; B=$OUT/bench.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
$P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30k.smoe --experts Q4_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
$P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks 2>&1 | tail -1 >> $L
bench() {  # round, vault, env
  echo "== round $1 $2 $3" >> $B
  env $3 timeout 60 $P/smoe bench /tmp/$2.smoe --device cuda --cache resident --batch 2,3,4,5,6,8 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "bench $1 $2 $3 rc=$? $(date +%T)" >> $L
}
for v in q30k q30; do
  for r in 1 2 3; do
    bench $r $v X=1; bench $r $v SMOE_CUDA_FEW_MMA=off
  done
done
