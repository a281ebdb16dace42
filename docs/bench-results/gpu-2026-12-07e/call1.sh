#!/bin/bash
# Run from the repository root on the device, carrying target/peercarry (bench/cuda_device.sh
# pack: the build under test and its three GPU test suites) and target/ptxcache (its kernels,
# compiled here by bench/ptx_cache.py). The GPU suites: the first run of Q6_K's int8 kernels
# (mvq/mvqn/kept/add-norm on dp4a, mmq on tensor cores), the few-token bit test with Q6_K, and the
# Q4_K_M-mix fixture cases; then, if time is left, one quick round of batched decode.
P=$PWD/target/peercarry
bash $P/cuda_device.sh unpack
chmod +x $P/*
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; date; } > $L
( cd crates/cuda
  for t in smoe_cuda gpu backend; do
    timeout 330 $P/$t --nocapture > $OUT/tests-$t.txt 2>&1; echo "$t rc=$? $(date +%T)" >> $L
  done )
