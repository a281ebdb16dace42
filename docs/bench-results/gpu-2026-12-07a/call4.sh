#!/bin/bash
# ncu: a one-token step's fused output product + norm and mix + norm against the kernels they replace.
cd "$(dirname "$0")/../.."
P=$PWD/target/peercarry; unxz -T4 $P/smoe.xz 2>/dev/null; chmod +x $P/smoe
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
L=$OUT/log.txt; date > $L
[ -e /tmp/q30.smoe ] || $P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks > /dev/null 2>> $L; echo "synth $(date +%T)" >> $L
for cfg in on off; do
  SMOE_CUDA_FUSED_NORM=$cfg timeout 50 /usr/local/cuda/bin/ncu --csv --page raw --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active --launch-skip 2000 --launch-count 40 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1 --prompt-tokens 1 --gen-tokens 12 --reps 1 > $OUT/ncu-$cfg.csv 2>&1
  echo "ncu $cfg rc=$? $(date +%T)" >> $L
done
