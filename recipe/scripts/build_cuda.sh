#!/usr/bin/env bash
# Staging build of the Python-independent native libraries (the stable-ABI core and the
# FA2 libraries): compiled once per CUDA variant, for the archs in $SM7X_CUDA_ARCHS.
# CMake builds one FA2 library per arch of python/sm7x/targets.json in that list, and
# refuses an arch the variant's nvcc cannot target (targets.json: cuda_max_major).
set -euo pipefail
# Reproducible libraries: rattler-build exports LD_RUN_PATH=$PREFIX/lib, which the linker
# writes into the library (and hashes into its GNU build-id) before rattler-build rewrites
# it to $ORIGIN/..; it adds that same rpath when packaging either way (rpaths: lib/).
unset LD_RUN_PATH
cmake -S csrc -B _build_cuda -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DSM7X_BUILD_EXT=OFF \
  -DSM7X_BUILD_CORE=ON \
  -DSM7X_CORE_CUDA=ON \
  -DSM7X_BUILD_FA2=ON \
  -DSM7X_CUDA_ARCHS="$SM7X_CUDA_ARCHS" \
  -DSM7X_TORCH_INCLUDE_DIR="$PREFIX/include" \
  -DPython_EXECUTABLE="$PYTHON" \
  -DCMAKE_INSTALL_PREFIX="$SP_DIR"
cmake --build _build_cuda --parallel "${CPU_COUNT:-2}"
cmake --install _build_cuda
