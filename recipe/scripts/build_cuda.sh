#!/usr/bin/env bash
# Staging build of the Python-independent native libraries (the stable-ABI core and the
# FA2 libraries): compiled once per CUDA variant, for the archs in $SM7X_CUDA_ARCHS.
# CMake builds one FA2 library per arch of python/sm7x/targets.json in that list, and
# refuses an arch the variant's nvcc cannot target (targets.json: cuda_max_major).
set -euo pipefail

# Once per build, not once per output. rattler-build runs a staging script again for each
# output that inherits it (sm7x-core, sm7x-fa2-sm70, sm7x-fa2-sm75): py-rattler-build gives
# each output its own build directory, and the host prefix is part of its staging cache
# key, so its own cache never hits. The first run here keeps what it installed under a key
# of everything the compile reads (this script, the variant's archs, csrc/ and
# targets.json, the build and host environments' packages); a later run with the same key
# installs that instead of compiling. The entries live next to rattler-build's build
# directories ($SRC_DIR is <output dir>/bld/rattler-build_<output>_<time>/work), so they
# go with the output directory (./build.sh removes its own when the build ends). Any
# other layout: every run compiles, as before.
cache_entry=
bld=$(cd "$SRC_DIR/../.." && pwd)
# This file from the recipe, not ${BASH_SOURCE[0]}: rattler-build runs a per-output copy
# with that output's environment written in, which would make every key differ.
self=${RECIPE_DIR:-}/scripts/build_cuda.sh
if [[ ${bld##*/} == bld && -f $bld/../.condapackageignore && -f $self ]]; then
  mkdir -p "$bld/sm7x-cuda-staging"
  inputs=$(mktemp "$bld/sm7x-cuda-staging/inputs.XXXXXX")
  {
    sha256sum < "$self"
    echo "archs=$SM7X_CUDA_ARCHS"
    (cd "$SRC_DIR" && find csrc python/sm7x/targets.json -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    for env in "$BUILD_PREFIX" "$PREFIX"; do ls "$env/conda-meta" | LC_ALL=C sort; done
  } > "$inputs"
  key=$(sha256sum < "$inputs" | cut -c1-32)
  mv "$inputs" "$bld/sm7x-cuda-staging/$key.inputs"  # what made the key: diff two to see a miss
  cache_entry=$bld/sm7x-cuda-staging/$key.tar
  if [[ -f $cache_entry ]]; then
    echo "sm7x: same inputs as an earlier output of this build (key $key): installing its libraries"
    mkdir -p "$SP_DIR"
    tar -C "$SP_DIR" -xf "$cache_entry"
    exit 0
  fi
  # a miss after an earlier output: say what changed (diff against the newest entry's inputs)
  last=$(ls -t "$bld"/sm7x-cuda-staging/*.inputs | grep -v "/$key.inputs$" | head -n 1 || true)
  if [[ -n $last ]]; then
    echo "sm7x: compiling: the inputs differ from ${last##*/}:"
    diff "$last" "$bld/sm7x-cuda-staging/$key.inputs" | head -n 20 || true
  fi
fi

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

if [[ -n $cache_entry ]]; then  # written whole, then renamed: a partial entry is never read
  mkdir -p "${cache_entry%/*}"
  tar -C "$SP_DIR" -cf "$cache_entry.partial" sm7x
  mv "$cache_entry.partial" "$cache_entry"
fi
