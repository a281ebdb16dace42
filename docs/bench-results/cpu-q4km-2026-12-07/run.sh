#!/bin/bash
# smoe against llama.cpp 0.3.36 on llama.cpp's Q4_K_M layout, on this 2-core VM, 48 layers
# fully cached, as bench/run's cached rounds (a 512-token prefill, then 128 tokens decoded from
# an empty context, three samples each), interleaved three times. The GGUF: `smoe synth --shape
# qwen3-30b-a3b --gguf m.gguf --mix Q4_K_M --random-blocks` (17.28 GiB). llama.cpp built from
# the sdist with GGML_NATIVE=ON (bench/run's flags), run as shipped (its CPU repack on).
S=${SMOE:-/work/main/target/release/smoe}
L=${LLAMA_BIN:-/work/main/target/bench/llama-cuda/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
G=${1:-/work/benchm/m.gguf}
out=${2:-results.txt}
{ grep -m1 "model name" /proc/cpuinfo; nproc; free -g | sed -n 2p; date; } > "$out"
for r in 1 2 3; do
  echo "== round $r $(date +%T)" >> "$out"
  $S bench "$G" --cache resident --threads 2 --prompt-tokens 512 --gen-tokens 1 --json 2>/dev/null | tail -1 >> "$out"
  $S bench "$G" --cache resident --threads 2 --prompt-tokens 1 --gen-tokens 128 --reps 3 --json 2>/dev/null | tail -1 >> "$out"
  "$L/llama-bench" -m "$G" -t 2 -p 512 -n 128 -r 3 -o jsonl 2>/dev/null >> "$out"
done
date >> "$out"
