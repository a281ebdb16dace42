#!/bin/bash
# Run from the repository root on the device, carrying target/llamacarry (smoe at d700106 and
# llama.cpp 0.3.36's llama-batched-bench, stripped and xz'd) and target/ptxcache (smoe's
# kernels). GGUF B of calls 2 and 3 (Q4_K gate/up, Q6_K down experts, Q4_K dense): smoe with
# Q6_K on the kept-expert tiles against llama.cpp on one machine, alternated twice.
C=$PWD/target/llamacarry
unxz -T4 $C/*.xz 2>/dev/null; chmod +x $C/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt; B=$OUT/bench.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/b.gguf --experts Q4_K,down=Q6_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
for r in 1 2; do
  echo "== round $r smoe b" >> $B
  timeout 60 $C/smoe bench /tmp/b.gguf --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "smoe $r rc=$? $(date +%T)" >> $L
  echo "== round $r llama.cpp b" >> $B
  timeout 60 $C/llama-batched-bench -m /tmp/b.gguf -ngl 99 -c 20480 -b 2048 -ub 512 -npp 16 -ntg 32 -npl 1,2,4,8,16,32,64 -fa on >> $B 2>&1
  echo "llama $r rc=$? $(date +%T)" >> $L
done
