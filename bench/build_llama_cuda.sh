#!/bin/bash
# Builds llama.cpp's llama-bench and llama-batched-bench with CUDA (compute 9.0, the H200) from the llama-cpp-python
# 0.3.36 sdist, on a machine with no GPU and no CUDA toolkit: the compiler, headers and libraries
# come from NVIDIA's PyPI wheels. The binary then runs on the GPU machine against its own CUDA
# 13 runtime (LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib there).
#
#   bench/build_llama_cuda.sh [WORK]      # default WORK: target/bench/llama-cuda
#
# About 55 minutes on the 2-core development VM (the CUDA template instances dominate).
# GGML_CUDA_NO_VMM=ON: without a driver here there is no libcuda.so to link against; llama.cpp
# then uses its legacy memory pool instead of virtual-memory management (it says "VMM: no").
# CPU code for the H200 machine's host (Sapphire Rapids: AVX-512, VNNI, BF16, AMX), for the
# `-ot exps=CPU` runs.
set -euo pipefail
WORK=$(realpath -m "${1:-target/bench/llama-cuda}")
mkdir -p "$WORK/wheels"
cd "$WORK/wheels"
python3 -m pip download --no-deps -q "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-cublas==13.0.*"
for w in *.whl; do unzip -q -o "$w" -d "$WORK/cuda"; done
CU="$WORK/cuda/nvidia/cu13"
ln -sfn lib "$CU/lib64"
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$CU/lib/lib$l.so"; done
cd "$WORK"
if [ ! -d llama_cpp_python-0.3.36 ]; then
    python3 -m pip install -q scikit-build-core cmake
    python3 -m pip download --no-deps --no-binary :all: --no-build-isolation -q "llama-cpp-python==0.3.36" -d .
    tar xzf llama_cpp_python-0.3.36.tar.gz
fi
SRC="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
export PATH="$CU/bin:$PATH" CUDA_PATH="$CU"
cmake -S "$SRC" -B "$SRC/build-cuda" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$CU/bin/nvcc" -DCUDAToolkit_ROOT="$CU" \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$SRC/build-cuda" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server
echo "built llama-bench, llama-batched-bench and llama-server in $SRC/build-cuda/bin"
