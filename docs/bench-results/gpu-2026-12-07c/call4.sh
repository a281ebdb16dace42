#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry and target/ptxcache (see
# call1.sh). The build as committed: mvqm_q8_0 staged (4 warps, or 8), on by default. The three
# GPU suites on the defaults, then batched decode by default, with SMOE_CUDA_FEW_MMA_WARPS=8 and
# with SMOE_CUDA_FEW_MMA=off (mvqn), alternated.
P=$PWD/target/peercarry
bash $P/cuda_device.sh unpack
chmod +x $P/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt; B=$OUT/bench.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
( cd crates/cuda
  for t in smoe_cuda gpu backend; do
    timeout 240 $P/$t --nocapture > $OUT/tests-$t.txt 2>&1; echo "$t rc=$? $(date +%T)" >> $L
  done )
[ -e /tmp/q30.smoe ] || $P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks > /dev/null 2>> $L
echo "synth $(date +%T)" >> $L
bench() {
  echo "== round $1 $2" >> $B
  env $2 timeout 60 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "bench $1 $2 rc=$? $(date +%T)" >> $L
}
for r in 1 2; do
  bench $r SMOE_CUDA_FEW_MMA_WARPS=4; bench $r SMOE_CUDA_FEW_MMA=off; bench $r SMOE_CUDA_FEW_MMA_WARPS=8
done
