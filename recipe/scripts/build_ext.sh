#!/usr/bin/env bash
# Staging build of the pybind11 modules for the host Python ($PYTHON), installed into
# its site-packages; the sm7x-ext output picks them up with its file globs.
set -euo pipefail
# Reproducible libraries: rattler-build exports LD_RUN_PATH=$PREFIX/lib, which the linker
# writes into the library (and hashes into its GNU build-id) before rattler-build rewrites
# it to $ORIGIN/..; it adds that same rpath when packaging either way (rpaths: lib/).
unset LD_RUN_PATH
cmake -S csrc -B _build_ext -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DSM7X_BUILD_EXT=ON \
  -DPython_EXECUTABLE="$PYTHON" \
  -Dpybind11_DIR="$("$PYTHON" -m pybind11 --cmakedir)" \
  -DCMAKE_INSTALL_PREFIX="$SP_DIR"
cmake --build _build_ext --parallel "${CPU_COUNT:-2}"
cmake --install _build_ext
