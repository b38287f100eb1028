#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench and llama-server from the sources vendored in the
# llama-cpp-python sdist (on PyPI), for `zhuzi bench decode | offline --compare llama.cpp`, and prints the
# folder of the binaries (the tools look there by default). 10-25 minutes on 2 cores.
#   benchmarks/build-llamacpp.sh [VERSION]        # LLAMA_CPP_HOME overrides ~/.cache/llama.cpp
# On Intel CPUs with AMX, llama.cpp's weight repacking has crashed in a VM: run its tools with --repack 0.
set -euo pipefail
version="${1:-0.3.36}"
home="${LLAMA_CPP_HOME:-$HOME/.cache/llama.cpp}"
src="$home/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -x "$src/build/bin/llama-bench" ] || [ ! -x "$src/build/bin/llama-batched-bench" ]; then
  command -v cmake > /dev/null || { echo "cmake is needed (e.g. apt-get install cmake)" >&2; exit 1; }
  mkdir -p "$home"
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$home"
  tar -xzf "$home/llama_cpp_python-$version.tar.gz" -C "$home"
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > /dev/null
  cmake --build "$src/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server > /dev/null
fi
echo "$src/build/bin"
