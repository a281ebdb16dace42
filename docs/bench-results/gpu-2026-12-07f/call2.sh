#!/bin/bash
# Run from the repository root on the device, carrying target/llamacarry (smoe as built now and
# llama.cpp 0.3.36's llama-batched-bench from bench/build_llama_cuda.sh; stripped and xz'd) and
# target/ptxcache (smoe's kernels). Two GGUFs smoe synth writes directly (48-layer Qwen3-30B-A3B
# shape, random blocks): M with llama.cpp's Q4_K_M layout (`--mix Q4_K_M`: Q6_K output head,
# Q6_K v and expert down in 24 of 48 layers, Q4_K elsewhere), and B as the last session's
# (Q4_K dense, Q4_K gate/up and Q6_K down experts in every layer). smoe against llama.cpp,
# alternated twice on M, once on B; then a 512-token prefill of M on both.
C=$PWD/target/llamacarry
unxz -T4 $C/*.xz 2>/dev/null; chmod +x $C/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt; B=$OUT/bench.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
smoe() {  # round, gguf
  echo "== round $1 smoe $2" >> $B
  timeout 70 $C/smoe bench /tmp/$2.gguf --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "smoe $1 $2 rc=$? $(date +%T)" >> $L
}
llama() {  # round, gguf
  echo "== round $1 llama.cpp $2" >> $B
  timeout 90 $C/llama-batched-bench -m /tmp/$2.gguf -ngl 99 -c 20480 -b 2048 -ub 512 -npp 16 -ntg 32 -npl 1,2,4,8,16,32,64 -fa on >> $B 2>&1
  echo "llama $1 $2 rc=$? $(date +%T)" >> $L
}
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/m.gguf --mix Q4_K_M --random-blocks 2>&1 | tail -1 >> $L
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/b.gguf --experts Q4_K,down=Q6_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
for r in 1 2; do smoe $r m; llama $r m; done
smoe 1 b; llama 1 b
P=$OUT/prefill.txt
for r in 1 2; do
  echo "== smoe m 512" >> $P
  timeout 60 $C/smoe bench /tmp/m.gguf --device cuda --cache resident --prompt-tokens 512 --gen-tokens 1 --reps 2 >> $P 2>&1
  echo "prefill smoe rc=$? $(date +%T)" >> $L
  timeout 90 $C/llama-batched-bench -m /tmp/m.gguf -ngl 99 -c 4096 -b 2048 -ub 512 -npp 512 -ntg 1 -npl 1,1 -fa on >> $P 2>&1
  echo "prefill llama rc=$? $(date +%T)" >> $L
done
