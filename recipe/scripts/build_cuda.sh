#!/usr/bin/env bash
# Staging build of the Python-independent native libraries (the stable-ABI core and the
# FA2 libraries): compiled once per CUDA variant, for the archs in $SM7X_CUDA_ARCHS.
set -euo pipefail
# each FA2 library exists only where the variant builds for its arch
case ";$SM7X_CUDA_ARCHS;" in *";75;"*) fa2_sm75=ON ;; *) fa2_sm75=OFF ;; esac
case ";$SM7X_CUDA_ARCHS;" in *";70;"*) fa2_sm70=ON ;; *) fa2_sm70=OFF ;; esac
cmake -S csrc -B _build_cuda -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DSM7X_BUILD_EXT=OFF \
  -DSM7X_BUILD_CORE=ON \
  -DSM7X_CORE_CUDA=ON \
  -DSM7X_CUDA_ARCHS="$SM7X_CUDA_ARCHS" \
  -DSM7X_BUILD_FA2="$fa2_sm75" \
  -DSM7X_BUILD_FA2_SM70="$fa2_sm70" \
  -DSM7X_TORCH_INCLUDE_DIR="$PREFIX/include" \
  -DPython_EXECUTABLE="$PYTHON" \
  -DCMAKE_INSTALL_PREFIX="$SP_DIR"
cmake --build _build_cuda --parallel "${CPU_COUNT:-2}"
cmake --install _build_cuda
