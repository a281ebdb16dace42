#!/bin/bash
# NOT RUN: every device start between 00:53 and 01:55 was refused. Kept for the next session.
# Device call (2026-12-08, thirty-fifth session), on the host's CPU only, carrying
# target/peercarry: smoe and the batch test binary (crates/engine/tests/batch.rs) of 6efe7f3,
# stripped and xz'd, and testdata/hf as testdata.tar.xz (testdata/ and models/ moved aside
# here so that the call carries under 64 MiB).
#  1. The int8 batch test (exact bits by the kernel rule) and the f16 KV test on the best
#     table; the int8 batch test with AMX (SMOE_AMX=on).
#  2. f32 against f16 KV on a 2-layer cut of Qwen3-30B-A3B, 16 threads: 8,192- and
#     32,768-token prompts, decode after them, alternated.
B=$PWD/target/peercarry
tar xJf $B/testdata.tar.xz && rm $B/testdata.tar.xz
unxz -T4 $B/*.xz; chmod +x $B/batch $B/smoe
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
lscpu | grep -E "Model name|^CPU\(s\)"; grep -o "avx512_vnni\|amx_int8\|avx512_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
( cd crates/engine
echo "== batch test, default table"
timeout 150 $B/batch --nocapture batched_logits_match_alone_with_int8_products f16_kv_cache 2>&1 | grep -E "batched vs alone|f16 KV|test result|panicked" | sed 's/largest relative logit error/err/' | head -40
echo "== batch test, SMOE_AMX=on"
SMOE_AMX=on timeout 150 $B/batch --nocapture batched_logits_match_alone_with_int8_products 2>&1 | grep -E "batched vs alone|test result|panicked" | sed 's/largest relative logit error/err/' | head -40
)
$B/smoe synth --shape qwen3-30b-a3b --layers 2 --vault /tmp/q2.smoe --random-blocks 2>&1 | tail -1
for P in 8192 32768; do
  G=$([ $P = 8192 ] && echo 32 || echo 16)
  for r in 1 2; do for kv in f32 f16; do
    echo "== prompt $P, $kv, round $r"
    timeout 120 $B/smoe bench /tmp/q2.smoe --device cpu --cache resident --threads 16 --prompt-tokens $P --gen-tokens $G --kv-type $kv --instrument 2>&1 | grep -E "^prefill [0-9]|^decode  |per token: att|kv cache" | sed 's/, routing.*//'
  done; done
done
