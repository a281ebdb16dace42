#!/bin/bash
# Packs llama.cpp's source from the llama-cpp-python sdist (the same one bench/run builds) into
# one small archive for a machine with no network (the GPU machine's CPU, bench/cpu_threads.py):
# the sdist is 76 MB, the archive about 8 MB — without docs, tests, examples, model files (but
# the Qwen2 vocabulary smoe synth reads) and the web UI bundle, none of which llama-bench needs;
# with the converter and gguf-py (bench/peer.py's DeepSeek-V4 rows convert a hub checkpoint there).
#
#   bench/pack_llama_src.sh OUT.tar.xz [WORK]     # WORK: where the sdist is fetched (target/bench)
set -euo pipefail
out=$(realpath -m "$1")
work=$(realpath -m "${2:-target/bench}")
ver=0.3.36
mkdir -p "$work"
src="$work/llama_cpp_python-$ver/vendor/llama.cpp"
if [ ! -d "$src" ]; then
    python3 -m venv "$work/sk" && "$work/sk/bin/pip" install -q scikit-build-core cmake
    PATH="$work/sk/bin:$PATH" "$work/sk/bin/pip" download --no-deps --no-binary :all: --no-build-isolation -q \
        "llama-cpp-python==$ver" -d "$work/sdist"
    tar xzf "$work/sdist/llama_cpp_python-$ver.tar.gz" -C "$work"
fi
cd "$(dirname "$src")"
tar -cf "$out.tar" --exclude='llama.cpp/build*' --exclude=llama.cpp/docs --exclude=llama.cpp/tests \
    --exclude=llama.cpp/benches --exclude=llama.cpp/examples --exclude=llama.cpp/tools/ui \
    --exclude=llama.cpp/tools/server/public --exclude='llama.cpp/models/*' \
    llama.cpp
tar -rf "$out.tar" llama.cpp/models/ggml-vocab-qwen2.gguf
xz -T0 -c "$out.tar" > "$out" && rm "$out.tar"
ls -la "$out"
