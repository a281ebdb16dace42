#!/bin/bash
# Perplexity of a freshly trained K-quant-width model (bench/train_moe.py OUT --minutes 4 on an
# H100: 3,373 steps, held-out loss 2.702) with experts quantized as smoe's table does (dense
# BF16), and as whole llama.cpp file types (--mix: dense weights too, per llama.cpp's rules).
# Held-out text and settings as docs/quality.md. Usage: run.sh MODEL_DIR [OUT]
S=${SMOE:-/work/main/target/release/smoe}
M=${1:?model dir}; out=${2:-results.txt}; w=$(mktemp -d)
ids=/work/main/testdata/traces/trained_moe_48x6.safetensors
{ grep -m1 "model name" /proc/cpuinfo; date; cat "$M/TRAINING.json"; echo; } > "$out"
row() {  # label, shatter args...
  local label=$1; shift
  $S shatter "$M" -o "$w/e.smoe" "$@" > "$w/shatter.txt" 2>&1 || { echo "$label: shatter failed" >> "$out"; cat "$w/shatter.txt" >> "$out"; return; }
  bytes=$($S inspect "$w/e.smoe" --json | python3 -c 'import json,sys; j=json.load(sys.stdin); print("dense", j["dense_bytes"], "blob", j["expert_blob_bytes"], "dense formats", {k: v["tensors"] for k, v in j["dense_formats"].items()})')
  echo "== $label ($bytes) $(grep -i "used\|note" "$w/shatter.txt" | head -2 | tr '\n' ' ')" >> "$out"
  $S perplexity "$w/e.smoe" --ids-file "$ids" --ctx 1024 2>&1 | tail -2 >> "$out"
  rm -f "$w/e.smoe"
}
for e in BF16 Q8_0 Q6_K Q5_K Q4_K Q4_0 Q3_K_MIX Q3_K Q2_K_MIX Q2_K; do row "experts $e, dense BF16" --experts $e --dense BF16; done
for m in Q8_0 Q6_K Q5_K_M Q4_K_M Q3_K_M Q2_K; do row "llama.cpp $m (--mix)" --mix $m; done
rm -rf "$w"; date >> "$out"
