#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry (bench/cuda_device.sh
# pack: the build under test and its three GPU test suites, plus llama.cpp's own K-quant files
# in testdata/gguf-kquant) and target/ptxcache (its kernels, from bench/ptx_cache.py). The GPU
# suites at the thirty-third session's build: mixed-quantization vaults whose layers' blobs
# take their own sizes (layer-blob-sizes) read through the store into the GPU, and the CPU's
# new AVX2 Q8_0 group kernels beside them (the host CPU is AVX-512: its VNNI table runs).
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
cat $L
tail -n 4 $OUT/tests-*.txt  # (the call ran `tail -4`, which refuses several files: rc 1 after every suite passed)
