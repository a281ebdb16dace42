#!/bin/bash
b=$PWD/target/peercarry; cd $b && xz -d -f -T4 *.xz && cd - >/dev/null
out=$OUT; log=$out/log.txt; date >$log; v=/tmp/q30.smoe; mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main; [ -e $v ] || "$b/smoe" synth --shape qwen3-30b-a3b --vault $v --experts Q4_K --dense Q8_0 --random-blocks >/dev/null 2>&1; ls -la $v >>$log 2>&1
( cd crates/cuda
  timeout 230 "$b/backend" every_op_matches_on_int8_activations batched_steps_match >$out/tests1.txt 2>&1; echo "t1 rc=$? $(date +%T)" >>$log )
bench() { echo "=== $*" >>$out/bench.txt; timeout 60 "$b/smoe" bench $v --device cuda --cache resident "$@" >>$out/bench.txt 2>&1; echo "bench $* rc=$? $(date +%T)" >>$log; }
[ -e $v ] && for kt in 64 4; do echo "BATCH_ATTENTION=on KEPT_TOKENS=$kt" >>$out/bench.txt; SMOE_CUDA_KEPT_TOKENS=$kt SMOE_CUDA_BATCH_ATTENTION=on bench --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 2; done
( cd crates/cuda
  timeout 150 "$b/backend" --skip kernels_compile --skip every_op_matches_on_int8 --skip batched_steps_match >$out/tests2.txt 2>&1; echo "t2 rc=$? $(date +%T)" >>$log )
date >>$log
