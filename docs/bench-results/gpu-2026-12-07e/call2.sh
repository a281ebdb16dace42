#!/bin/bash
# Run from the repository root on the device, carrying target/llamacarry (smoe as built now and
# smoe-old, the build of 6de9af5 before Q6_K had int8 kernels, plus llama.cpp 0.3.36's
# llama-batched-bench from bench/build_llama_cuda.sh; stripped and xz'd) and
# target/ptxcache (both builds' kernels). Two GGUFs that smoe synth writes directly (48-layer
# Qwen3-30B-A3B shape, Q4_K dense weights): A with Q4_K experts, B with Q4_K gate/up and Q6_K
# down experts (Q4_K_M's mix, in every layer). Batched decode, smoe (new, old, and new with
# the kept experts pair by pair instead of gate and up on tiles) against llama.cpp, alternated twice; then a 512-token prefill of B on both builds and on llama.cpp.
C=$PWD/target/llamacarry
unxz -T4 $C/*.xz 2>/dev/null; chmod +x $C/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt; B=$OUT/bench.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
smoe() {  # round, gguf, binary, env
  echo "== round $1 $3 $2 $4" >> $B
  env $4 timeout 60 $C/$3 bench /tmp/$2.gguf --device cuda --cache resident --batch 1,2,4,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
  echo "$3 $1 $2 $4 rc=$? $(date +%T)" >> $L
}
llama() {  # round, gguf
  echo "== round $1 llama.cpp $2" >> $B
  timeout 90 $C/llama-batched-bench -m /tmp/$2.gguf -ngl 99 -c 20480 -b 2048 -ub 512 -npp 16 -ntg 32 -npl 1,2,4,8,16,32,64 -fa on >> $B 2>&1
  echo "llama $1 $2 rc=$? $(date +%T)" >> $L
}
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/a.gguf --experts Q4_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
$C/smoe synth --shape qwen3-30b-a3b --gguf /tmp/b.gguf --experts Q4_K,down=Q6_K --dense Q4_K --random-blocks 2>&1 | tail -1 >> $L
for r in 1 2; do
  smoe $r b smoe X=1; smoe $r b smoe-old X=1; smoe $r b smoe SMOE_CUDA_KEPT_TILES_FROM=0; llama $r b
  smoe $r a smoe X=1; llama $r a
done
P=$OUT/prefill.txt
for bin in smoe smoe-old smoe smoe-old; do
  echo "== $bin b 512" >> $P
  timeout 60 $C/$bin bench /tmp/b.gguf --device cuda --cache resident --prompt-tokens 512 --gen-tokens 1 --reps 2 >> $P 2>&1
  echo "prefill $bin rc=$? $(date +%T)" >> $L
done
timeout 90 $C/llama-batched-bench -m /tmp/b.gguf -ngl 99 -c 4096 -b 2048 -ub 512 -npp 512 -ntg 1 -npl 1,1,1 -fa on >> $P 2>&1
echo "llama prefill rc=$? $(date +%T)" >> $L
