#!/bin/bash
b=$PWD/target/peercarry; cd $b && xz -d -f -T4 *.xz && cd - >/dev/null
out=$OUT; log=$out/log.txt; date >$log; v=/tmp/q30.smoe; mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
export SMOE_CUDA_BATCH_ATTENTION=on SMOE_CUDA_KEPT_TOKENS=64
( cd crates/cuda
  timeout 100 "$b/smoe_cuda" >$out/tests.txt 2>&1; echo "lib rc=$? $(date +%T)" >>$log
  timeout 200 "$b/backend" --skip kernels_compile --nocapture >>$out/tests.txt 2>&1; echo "backend rc=$? $(date +%T)" >>$log
  timeout 100 "$b/gpu" --nocapture >>$out/tests.txt 2>&1; echo "gpu rc=$? $(date +%T)" >>$log )
[ -e $v ] || exit 0
SMOE_CUDA_PROFILE=1 timeout 40 "$b/smoe" bench $v --device cuda --cache resident --batch 16 --prompt-tokens 1 --gen-tokens 9 >$out/profile16.txt 2>&1; echo "prof rc=$? $(date +%T)" >>$log
timeout 60 "$b/smoe" bench $v --device cuda --cache resident --prompt-tokens 512 --gen-tokens 1 --reps 2 >$out/bench.txt 2>&1; echo "prefill rc=$? $(date +%T)" >>$log
SMOE_CUDA_FEW_MV_JOIN=off timeout 60 "$b/smoe" bench $v --device cuda --cache resident --prompt-tokens 512 --gen-tokens 1 --reps 2 >>$out/bench.txt 2>&1; echo "prefill-off rc=$? $(date +%T)" >>$log
date >>$log
