#!/bin/bash
# One device call for the fused decode launches (SMOE_CUDA_FUSED_ROUTE, SMOE_CUDA_FUSED_NORM;
# docs/benchmarks.md, "the fused decode launches measured"): their GPU tests first, then
# `smoe bench` with the four settings of the two variables alternated (two rounds; decode
# after a 512-token prompt with both off and both on), then the rest of the GPU tests, then ncu
# over one layer.
#
#   bench/cuda_device.sh pack && cp bench/cuda_fused_ab.sh target/peercarry/call.sh
#   (device, carrying target/peercarry and target/ptxcache) bash target/peercarry/call.sh
#   bench/cuda_device.sh restore
#
# target/ptxcache: the kernels' PTX made here with NVRTC (the nvrtc wheel), as smoe caches it
# under $XDG_CACHE_HOME/smoe, so that the call spends no time compiling them.
cd "$(dirname "$0")/../.."
bash target/peercarry/cuda_device.sh unpack
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn $PWD /work/main
export XDG_CACHE_HOME=$PWD/target/ptxcache; unxz target/ptxcache/smoe/*.xz 2>/dev/null
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "^CPU\(s\)|Model name"; date; } > $L
P=$PWD/target/peercarry
(cd crates/cuda && timeout 120 $P/backend --test-threads 1 fused_ every_op_matches_on_int8_activations > $OUT/tests-new.txt 2>&1; echo "new tests rc=$? $(date +%T)" >> $L)
$P/smoe synth --shape qwen3-30b-a3b --vault /tmp/q30.smoe --experts Q4_K --dense Q8_0 --random-blocks > /dev/null 2>> $L; echo "synth $(date +%T)" >> $L
B=$OUT/bench.txt
for round in 1 2; do
  for cfg in "SMOE_CUDA_FUSED_ROUTE=off SMOE_CUDA_FUSED_NORM=off" "SMOE_CUDA_FUSED_ROUTE=on SMOE_CUDA_FUSED_NORM=off" "SMOE_CUDA_FUSED_ROUTE=off SMOE_CUDA_FUSED_NORM=on" "SMOE_CUDA_FUSED_ROUTE=on SMOE_CUDA_FUSED_NORM=on"; do
    echo "== round $round $cfg" >> $B
    env $cfg $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1,8,16 --prompt-tokens 16 --gen-tokens 33 --reps 2 >> $B 2>&1
    echo "bench $round $cfg rc=$? $(date +%T)" >> $L
  done
  for cfg in "SMOE_CUDA_FUSED_ROUTE=off SMOE_CUDA_FUSED_NORM=off" "SMOE_CUDA_FUSED_ROUTE=on SMOE_CUDA_FUSED_NORM=on"; do
    echo "== round $round prompt 512 $cfg" >> $B
    env $cfg $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1 --prompt-tokens 512 --gen-tokens 65 --reps 2 >> $B 2>&1
    echo "bench512 $round $cfg rc=$? $(date +%T)" >> $L
  done
done
(cd crates/cuda && for t in smoe_cuda gpu backend; do
   timeout 200 $P/$t --test-threads 1 --skip kernels_compile_for_every_architecture --skip fused_ --skip every_op_matches_on_int8_activations > $OUT/tests-$t.txt 2>&1; echo "$t rc=$? $(date +%T)" >> $L
 done)
SMOE_CUDA_FUSED_ROUTE=on SMOE_CUDA_FUSED_NORM=on timeout 60 /usr/local/cuda/bin/ncu --csv --page raw --metrics gpu__time_duration.sum --launch-skip 3000 --launch-count 24 $P/smoe bench /tmp/q30.smoe --device cuda --cache resident --batch 1 --prompt-tokens 1 --gen-tokens 16 --reps 1 > $OUT/ncu-on.csv 2>&1
echo "ncu rc=$? $(date +%T)" >> $L
