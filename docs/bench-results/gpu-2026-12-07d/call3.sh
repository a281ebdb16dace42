#!/bin/bash
# Run from the repository root on the device, carrying target/llamacarry (smoe as of 0be1f0c, its
# `backend` test binary, and llama.cpp 0.3.36's llama-batched-bench built by
# bench/build_llama_cuda.sh; stripped and xz'd) and target/ptxcache. smoe against llama.cpp on two
# GGUFs that smoe synth writes directly (48-layer Qwen3-30B-A3B shape, Q4_K dense weights): A with
# Q4_K experts, B with Q4_K gate/up and Q6_K down experts (Q4_K_M gives half the layers' down
# projections Q6_K); smoe by default, alternated twice with llama.cpp (mvqn against mvqm: calls 1
# and 2). Then the few-token bit test on this build (Q4_K from 4 tokens). Ordered so that what
# matters most comes back first if the device time runs out.
C=$PWD/target/llamacarry
unxz -T4 $C/*.xz 2>/dev/null; chmod +x $C/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt; B=$OUT/smoe-vs-llama.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
smoe() {  # round, gguf
  echo "== round $1 smoe $2" >> $B
  timeout 60 $C/smoe bench /tmp/$2.gguf --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "smoe $1 $2 rc=$? $(date +%T)" >> $L
}
llama() {  # round, gguf
  echo "== round $1 llama.cpp $2" >> $B
  timeout 60 $C/llama-batched-bench -m /tmp/$2.gguf -ngl 99 -c 20480 -b 2048 -ub 512 -npp 16 -ntg 32 -npl 1,2,4,8,16,32,64 -fa on >> $B 2>&1
  echo "llama $1 $2 rc=$? $(date +%T)" >> $L
}
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/a.gguf --experts Q4_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
smoe 1 a; llama 1 a
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/b.gguf --experts Q4_K,down=Q6_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
smoe 1 b; llama 1 b
smoe 2 a; llama 2 a; smoe 2 b; llama 2 b
( cd crates/cuda && timeout 120 $C/backend few_token_products --nocapture > $OUT/tests-few.txt 2>&1; echo "bit test rc=$? $(date +%T)" >> $L )
