#!/bin/bash
# Run on the device from the repository root, carrying target/peercarry: the smoe binaries of
# e594290 (before) and ebeeec2 (after: attention's weighted sums in 8x2 tiles with AVX-512 VL)
# and the smoe-kernels lib tests of ebeeec2, stripped and xz'd. Prefill at 4,096 tokens of a
# 12-layer Qwen3-30B-A3B cut and prefill 8,192 + decode 32 of a 2-layer cut, before and after,
# alternated, on the host's 16 cores and on 2.
B=$PWD/target/peercarry
ls $B/*.xz >/dev/null 2>&1 && unxz -T4 $B/*.xz; chmod +x $B/*
lscpu | grep -E "Model name|^CPU\(s\)"; grep -o "avx512_vnni\|amx_int8" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; date
[ -e /tmp/q12.smoe ] || $B/smoe-after synth --shape qwen3-30b-a3b --layers 12 --vault /tmp/q12.smoe --random-blocks 2>&1 | tail -1
[ -e /tmp/q2.smoe ] || $B/smoe-after synth --shape qwen3-30b-a3b --layers 2 --vault /tmp/q2.smoe --random-blocks 2>&1 | tail -1
(cd crates/kernels && $B/smoe_kernels attention_tiles 2>&1 | grep -E "test |result")
for r in 1 2; do for b in before after; do
  echo "$b q12 prefill4096 t16: $($B/smoe-$b bench /tmp/q12.smoe --device cpu --cache resident --threads 16 --prompt-tokens 4096 --gen-tokens 1 2>&1 | grep 'prefill 4096')"
  echo "$b q2 prefill8192+decode t16: $($B/smoe-$b bench /tmp/q2.smoe --device cpu --cache resident --threads 16 --prompt-tokens 8192 --gen-tokens 32 2>&1 | grep -E 'prefill 8192|decode  32' | tr -s ' ' | tr '\n' ' ')"
done; done
for b in before after; do
  echo "$b q2 prefill8192+decode t2: $($B/smoe-$b bench /tmp/q2.smoe --device cpu --cache resident --threads 2 --prompt-tokens 8192 --gen-tokens 32 2>&1 | grep -E 'prefill 8192|decode  32' | tr -s ' ' | tr '\n' ' ')"
done
date
