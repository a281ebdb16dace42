#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry and target/ptxcache (see
# call1.sh). Call 2 found every mvqm variant that reads its weights from global memory slower
# than mvqn at 2-8 sequences (q/k/v 25 µs whatever the warps). Here the staged variants
# (s4, s8: the block's 16 rows and the tokens' inputs copied to shared memory first): the bit
# test of all variants, batched decode alternated, ncu of an 8-sequence step's dense products,
# and the backend suite with SMOE_CUDA_FEW_MMA=on SMOE_CUDA_FEW_MMA_KERNEL=s4.
P=$PWD/target/peercarry
bash $P/cuda_device.sh unpack
chmod +x $P/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt; B=$OUT/bench.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
( cd crates/cuda && timeout 150 $P/backend few_token --nocapture > $OUT/tests-new.txt 2>&1; echo "new test rc=$? $(date +%T)" >> $L )
[ -e /tmp/q30.smoe ] || $P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks > /dev/null 2>> $L
echo "synth $(date +%T)" >> $L
bench() {
  echo "== round $1 $2" >> $B
  env $2 timeout 60 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "bench $1 $2 rc=$? $(date +%T)" >> $L
}
for r in 1 2; do
  for k in s4 s8 4; do bench $r "SMOE_CUDA_FEW_MMA=on SMOE_CUDA_FEW_MMA_KERNEL=$k"; [ $k = s8 ] && bench $r SMOE_CUDA_FEW_MMA=off; done
  bench $r SMOE_CUDA_FEW_MMA=off
done
for k in off s4 s8; do
  if [ $k = off ]; then e="SMOE_CUDA_FEW_MMA=off"; else e="SMOE_CUDA_FEW_MMA=on SMOE_CUDA_FEW_MMA_KERNEL=$k"; fi
  env $e timeout 60 /usr/local/cuda/bin/ncu --csv --page raw --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active --kernel-name regex:"^mvq" --launch-skip 400 --launch-count 20 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 8 --prompt-tokens 4 --gen-tokens 6 --reps 1 > $OUT/ncu-$k.csv 2>&1
  echo "ncu $k rc=$? $(date +%T)" >> $L
done
( cd crates/cuda && SMOE_CUDA_FEW_MMA=on SMOE_CUDA_FEW_MMA_KERNEL=s4 timeout 240 $P/backend > $OUT/tests-backend-s4.txt 2>&1; echo "backend s4 rc=$? $(date +%T)" >> $L )
