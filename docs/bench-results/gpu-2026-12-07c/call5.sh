#!/bin/bash
# Run from the repository root on the device, carrying target/llamacarry (smoe and
# llama-batched-bench, stripped and xz'd; bench/build_llama_cuda.sh builds the latter) and
# target/ptxcache. smoe as committed (mvqm on), smoe with SMOE_CUDA_FEW_MMA=off (mvqn), and
# llama.cpp on the same GGUF, alternated twice.
C=$PWD/target/llamacarry
unxz -T4 $C/*.xz 2>/dev/null; chmod +x $C/smoe $C/llama-batched-bench
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
L=$OUT/log.txt; B=$OUT/smoe-vs-llama.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
[ -e /tmp/q30.smoe ] || $C/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks > /dev/null 2>> $L
[ -e /tmp/q30.gguf ] || $C/smoe export-gguf /tmp/q30.smoe -o /tmp/q30.gguf > /dev/null 2>> $L
rm -f /tmp/q30.smoe
echo "vault+gguf $(date +%T)" >> $L
for round in 1 2; do
  for cfg in SMOE_CUDA_FEW_MMA=on SMOE_CUDA_FEW_MMA=off; do
    echo "== round $round smoe $cfg" >> $B
    env $cfg timeout 60 $C/smoe bench /tmp/q30.gguf --device cuda --cache resident --batch 1,8,16,32,64 --prompt-tokens 16 --gen-tokens 33 --reps 1 >> $B 2>&1
    echo "smoe $round $cfg rc=$? $(date +%T)" >> $L
  done
  echo "== round $round llama.cpp" >> $B
  timeout 60 $C/llama-batched-bench -m /tmp/q30.gguf -ngl 99 -c 20480 -b 2048 -ub 512 -npp 16 -ntg 32 -npl 1,8,16,32,64 -fa on >> $B 2>&1
  echo "llama $round rc=$? $(date +%T)" >> $L
done
