#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry (bench/cuda_device.sh
# pack) and target/ptxcache (bench/ptx_cache.py). The few-token Q8_0 products on int8 tensor
# cores (mvqm_q8_0): its bit test, batched decode with it (SMOE_CUDA_FEW_MMA=on) and without
# alternated, with the backend suite between the rounds. Trimmed to fit what was left of the
# session's device time after the refused starts, and never run: no device could be started.
P=$PWD/target/peercarry
bash $P/cuda_device.sh unpack
chmod +x $P/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt; B=$OUT/bench.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
( cd crates/cuda && timeout 100 $P/backend few_token --nocapture > $OUT/tests-new.txt 2>&1; echo "new test rc=$? $(date +%T)" >> $L )
[ -e /tmp/q30.smoe ] || $P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks > /dev/null 2>> $L
echo "synth $(date +%T)" >> $L
bench() {
  echo "== round $1 SMOE_CUDA_FEW_MMA=$2" >> $B
  SMOE_CUDA_FEW_MMA=$2 timeout 60 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1,8,16,64 --prompt-tokens 16 --gen-tokens 33 --reps 2 >> $B 2>&1
  echo "bench $1 $2 rc=$? $(date +%T)" >> $L
}
bench 1 on; bench 1 off
( cd crates/cuda && timeout 150 $P/backend > $OUT/tests.txt 2>&1; echo "backend rc=$? $(date +%T)" >> $L )
bench 2 on; bench 2 off
