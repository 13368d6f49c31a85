#!/usr/bin/env bash
# Test of cuda-nvcc_linux-64: nvcc and CMake build sm_70/sm_75 code with static cudart.
set -euxo pipefail
cd "$(dirname "$0")"

# the activation variables, and this env's nvcc ahead of any CUDA on the machine
test "$CUDA_HOME" = "$CONDA_PREFIX" && test "$CUDA_PATH" = "$CONDA_PREFIX"
test "$CUDACXX" = "$CONDA_PREFIX/bin/nvcc" && test "$NVCC" = "$CUDACXX" && test "$CUDAHOSTCXX" = "$CXX"
test "$(command -v nvcc)" = "$CONDA_PREFIX/bin/nvcc"
nvcc --version | grep "release 12.4"

check() {  # sm_70 and sm_75 SASS, compute_75 PTX, no libcudart.so dependency
  cuobjdump --list-elf "$1" | tee elf.txt
  grep -q 'sm_70\.cubin' elf.txt && grep -q 'sm_75\.cubin' elf.txt
  cuobjdump --list-ptx "$1" | tee ptx.txt
  grep -q 'sm_75\.ptx' ptx.txt && ! grep -q 'sm_70\.ptx' ptx.txt
  ! readelf -d "$1" | grep -q libcudart
}

gencode="-gencode arch=compute_70,code=sm_70 -gencode arch=compute_75,code=[sm_75,compute_75]"
nvcc $gencode -cudart static -Xcompiler -fPIC -shared kernel.cu -o libkernel.so
nvcc $gencode -cudart static main.cu kernel.cu -o probe
check libkernel.so
check probe
./probe  # without a GPU it reports the CUDA error; it fails only on wrong results

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build
check build/libkernel.so
./build/probe
./build/host_only

cmake -S cxx_only -B build-cxx -G Ninja
cmake --build build-cxx
./build-cxx/host_only
