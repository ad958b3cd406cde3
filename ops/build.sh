#!/usr/bin/env bash
# Build libdflash_ops.so (the TreeAttention and quantized MatMul ops) into ops/build/.
#   bash ops/build.sh                          release build -> ops/build/libdflash_ops.so
#   DFLASH_OPS_SANITIZE=1 bash ops/build.sh    ASan+UBSan build -> ops/build-asan/libdflash_ops.so
#                                              (load it with LD_PRELOAD=$(gcc -print-file-name=libasan.so))
# ORT_INCLUDE_DIR=<dir> picks the ONNX Runtime headers; otherwise get_ort_headers.sh finds or
# fetches them.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

command -v cmake >/dev/null || { echo "build.sh: cmake not found (apt-get install cmake g++)" >&2; exit 1; }
command -v c++ >/dev/null || command -v g++ >/dev/null \
    || { echo "build.sh: no C++ compiler found (apt-get install g++)" >&2; exit 1; }

inc="$(bash "$here/get_ort_headers.sh")"

if [ "${DFLASH_OPS_SANITIZE:-0}" != "0" ]; then
    build_dir="$here/build-asan"
    cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DDFLASH_OPS_SANITIZE=ON)
else
    build_dir="$here/build"
    cmake_args=(-DCMAKE_BUILD_TYPE=Release -DDFLASH_OPS_SANITIZE=OFF)
fi

cmake -S "$here" -B "$build_dir" -DORT_INCLUDE_DIR="$inc" "${cmake_args[@]}" >&2
cmake --build "$build_dir" -j "$(nproc 2>/dev/null || echo 2)" >&2
lib="$build_dir/libdflash_ops.so"
[ -f "$lib" ] || { echo "build.sh: build finished but $lib is missing" >&2; exit 1; }
echo "built $lib"
