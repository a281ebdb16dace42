#!/bin/bash
# one device call: GPU tests (both attention modes), batch bench on/off, prefill crossover, kept tokens
T0=$(date +%s); left() { [ $(( $(date +%s) - T0 )) -lt ${1:-340} ]; }
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
b=$PWD/target/peercarry; cd $b && xz -d -T4 *.xz && cd - >/dev/null
out=$OUT; log=$out/log.txt; date >$log
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1; lscpu | grep -E "Model name|^CPU\(s\)" >>"$out/gpu.txt"
v=/tmp/q30.smoe
( "$b/smoe" synth --shape qwen3-30b-a3b --vault $v --experts Q4_K --dense Q8_0 --random-blocks >$out/synth.txt 2>&1 ) & sp=$!
( cd crates/cuda
  for t in smoe_cuda backend gpu; do timeout 120 "$b/$t" >>"$out/tests.txt" 2>&1; echo "$t rc=$? $(date +%T)" >>$log; done )
wait $sp; echo "synth rc=$? $(date +%T)" >>$log
bench() { left || return; echo "=== $*" >>$out/bench.txt; timeout 100 "$b/smoe" bench $v --device cuda --cache resident "$@" >>$out/bench.txt 2>&1; echo "bench $* rc=$? $(date +%T)" >>$log; }
for m in off on; do echo "BATCH_ATTENTION=$m" >>$out/bench.txt; SMOE_CUDA_BATCH_ATTENTION=$m bench --batch 1,2,4,8,16,32 --prompt-tokens 16 --gen-tokens 33 --reps 2; done
for f in 8 1; do echo "FEW_MV=$f" >>$out/bench.txt; SMOE_CUDA_FEW_MV=$f bench --prompt-tokens 512 --gen-tokens 1 --reps 2; done
for kt in 8 16 32; do echo "BATCH_ATTENTION=on KEPT_TOKENS=$kt" >>$out/bench.txt; SMOE_CUDA_KEPT_TOKENS=$kt SMOE_CUDA_BATCH_ATTENTION=on bench --batch 8,16,32 --prompt-tokens 16 --gen-tokens 33 --reps 2; done
echo "FEW_MV_JOIN=off" >>$out/bench.txt; SMOE_CUDA_FEW_MV_JOIN=off bench --prompt-tokens 512 --gen-tokens 1 --reps 2
echo "BATCH_ATTENTION=on FEW_MV_JOIN=off" >>$out/bench.txt; SMOE_CUDA_FEW_MV_JOIN=off SMOE_CUDA_BATCH_ATTENTION=on bench --batch 16,32 --prompt-tokens 16 --gen-tokens 33 --reps 2
left 360 && { SMOE_CUDA_BATCH_ATTENTION=on SMOE_CUDA_PROFILE=1 timeout 40 "$b/smoe" bench $v --device cuda --cache resident --batch 16 --prompt-tokens 1 --gen-tokens 9 >$out/profile-on16.txt 2>&1; echo "prof16 rc=$? $(date +%T)" >>$log; }
for f in on off; do left 375 && { SMOE_CUDA_FEW_MV_JOIN=$f SMOE_CUDA_PROFILE=1 timeout 30 "$b/smoe" bench $v --device cuda --cache resident --prompt-tokens 512 --gen-tokens 1 --reps 1 >$out/profile-prefill-$f.txt 2>&1; echo "profp$f rc=$? $(date +%T)" >>$log; }; done
date >>$log
