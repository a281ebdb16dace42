#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry: bench/cuda_device.sh
# pack's fixtures, with the CPU test binaries of 8320c46 in place of its CUDA ones (smoe-engine's
# lib and batch tests, smoe-kernels' lib tests, stripped and xz'd). The device host's CPU has
# AVX-512 VNNI: the batched-vs-alone int8 test now asks for the same bits on every family there
# (DeepSeek-V4 had measured 2.86e-3 on Zen 4), on the VNNI table, and with SMOE_ISA=avx2.
# NOT RUN: from 20:02 to 20:35 every start was refused, then no machine was lent for the rest
# of the session. Kept for the next session (repack: the binaries are the test builds of the
# tree, from `cargo test --release -p smoe-engine -p smoe-kernels --no-run`).
P=$PWD/target/peercarry
bash $P/cuda_device.sh unpack
chmod +x $P/*
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt
{ lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-60; grep -o "avx512vnni\|amx_int8" /proc/cpuinfo | sort -u; date; } > $L
( cd crates/kernels && timeout 200 $P/smoe_kernels > $OUT/tests-kernels.txt 2>&1; echo "kernels rc=$?" >> $L )
( cd crates/engine
  timeout 200 $P/smoe_engine > $OUT/tests-engine-lib.txt 2>&1; echo "engine lib rc=$?" >> $L
  timeout 200 $P/batch --nocapture > $OUT/tests-batch-vnni.txt 2>&1; echo "batch (best table) rc=$?" >> $L
  SMOE_ISA=avx2 timeout 200 $P/batch --nocapture > $OUT/tests-batch-avx2.txt 2>&1; echo "batch avx2 rc=$?" >> $L )
cat $L
grep -h "backend\|batched vs alone\|test result" $OUT/tests-batch-*.txt | head -40
