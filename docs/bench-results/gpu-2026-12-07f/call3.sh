#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry (bench/cuda_device.sh
# pack: the build under test and its three GPU test suites, plus llama.cpp's own K-quant files
# in testdata/gguf-kquant) and target/ptxcache (its kernels, from bench/ptx_cache.py). The GPU
# suites at 96ef046: the kernel-compile test comparing entry points (7ad18f7), all else as call 1.
P=$PWD/target/peercarry
bash $P/cuda_device.sh unpack
chmod +x $P/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
( cd crates/cuda
  for t in smoe_cuda gpu backend; do
    timeout 420 $P/$t --nocapture > $OUT/tests-$t.txt 2>&1; echo "$t rc=$? $(date +%T)" >> $L
  done )
