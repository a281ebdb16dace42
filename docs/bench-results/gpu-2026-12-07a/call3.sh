#!/bin/bash
# The norms held in registers (norm_row_held): the GPU tests, then SMOE_CUDA_FUSED_NORM=off|on alternated.
cd "$(dirname "$0")/../.."
bash target/peercarry/cuda_device.sh unpack
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn $PWD /work/main
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "^CPU\(s\)|Model name"; date; } > $L
P=$PWD/target/peercarry
(cd crates/cuda && timeout 120 $P/backend --test-threads 1 fused_ every_op_matches_on_int8_activations > $OUT/tests-new.txt 2>&1; echo "new tests rc=$? $(date +%T)" >> $L)
[ -e /tmp/q30.smoe ] || $P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks > /dev/null 2>> $L; echo "synth $(date +%T)" >> $L
B=$OUT/bench.txt
for round in 1 2; do
  for cfg in "SMOE_CUDA_FUSED_NORM=off" "SMOE_CUDA_FUSED_NORM=on" ; do
    echo "== round $round $cfg" >> $B
    env $cfg timeout 60 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1 --prompt-tokens 16 --gen-tokens 65 --reps 2 >> $B 2>&1
    echo "bench $round $cfg rc=$? $(date +%T)" >> $L
    echo "== round $round prompt 512 $cfg" >> $B
    env $cfg timeout 60 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1 --prompt-tokens 512 --gen-tokens 65 --reps 2 >> $B 2>&1
    echo "bench512 $round $cfg rc=$? $(date +%T)" >> $L
  done
done
