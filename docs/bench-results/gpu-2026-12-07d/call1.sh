#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry (the build under test,
# its three GPU test suites, and smoe-old: the build of 2ffb038) and target/ptxcache (both builds'
# kernels, compiled here by bench/ptx_cache.py). The GPU suites on the new build, then batched
# decode on two 48-layer Qwen3-30B-A3B-shape vaults (Q4_K experts; dense Q4_K, then Q8_0): the new
# build by default, with SMOE_CUDA_FEW_MMA=off (mvqn), and the old build, alternated twice.
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
$P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30k.smoe --experts Q4_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
$P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks 2>&1 | tail -1 >> $L
echo "synth $(date +%T)" >> $L
bench() {  # round, vault, binary, env
  echo "== round $1 $2 $3 $4" >> $B
  env $4 timeout 60 $P/$3 bench /tmp/$2.smoe --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "bench $1 $2 $3 $4 rc=$? $(date +%T)" >> $L
}
for r in 1 2; do
  for v in q30k q30; do
    bench $r $v smoe X=1; bench $r $v smoe SMOE_CUDA_FEW_MMA=off; bench $r $v smoe-old X=1
  done
done
# Which kernels a Q4_K-dense step of eight sequences launches (synchronized, per op).
SMOE_CUDA_PROFILE=1 timeout 60 $P/smoe bench /tmp/q30k.smoe --device cuda --cache resident --batch 8 --prompt-tokens 16 --gen-tokens 9 --reps 1 > $OUT/profile.txt 2>&1
echo "profile rc=$? $(date +%T)" >> $L
