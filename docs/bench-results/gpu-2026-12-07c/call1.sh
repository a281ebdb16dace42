#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry (bench/cuda_device.sh
# pack) and target/ptxcache (bench/ptx_cache.py). The few-token Q8_0 products on int8 tensor
# cores (mvqm_q8_0): its bit test; the three GPU suites (q8_term changed the default one-token
# Q8_0 rounding); batched decode with the kernel (SMOE_CUDA_FEW_MMA=on) and without, alternated;
# and ncu over the dense product kernels of an 8-sequence step, on and off.
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
  SMOE_CUDA_FEW_MMA=$2 timeout 90 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 2 >> $B 2>&1
  echo "bench $1 $2 rc=$? $(date +%T)" >> $L
}
bench 1 on; bench 1 off
( cd crates/cuda
  for t in smoe_cuda gpu backend; do
    timeout 240 $P/$t > $OUT/tests-$t.txt 2>&1; echo "$t rc=$? $(date +%T)" >> $L
  done )
bench 2 off; bench 2 on
bench 3 on; bench 3 off
for cfg in on off; do
  SMOE_CUDA_FEW_MMA=$cfg timeout 60 /usr/local/cuda/bin/ncu --csv --page raw --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active --kernel-name regex:"^mvq" --launch-skip 400 --launch-count 60 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 8 --prompt-tokens 4 --gen-tokens 6 --reps 1 > $OUT/ncu-$cfg.csv 2>&1
  echo "ncu $cfg rc=$? $(date +%T)" >> $L
done
