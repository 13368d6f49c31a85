# cuda-nvcc_linux-64 (sm7x bootstrap): the variables conda-forge's CUDA compiler
# activation provides, for CMake (CUDACXX, CUDAHOSTCXX) and other build systems.
for _v in CUDA_HOME CUDA_PATH CUDACXX NVCC CUDAHOSTCXX NVCC_PREPEND_FLAGS NVCC_APPEND_FLAGS; do
  if eval "[ -n \"\${$_v+x}\" ]"; then eval "export CONDA_BACKUP_$_v=\"\$$_v\""; fi
done
export CUDA_HOME="$CONDA_PREFIX" CUDA_PATH="$CONDA_PREFIX"
export CUDACXX="$CONDA_PREFIX/bin/nvcc" NVCC="$CONDA_PREFIX/bin/nvcc"
if [ -n "${CXX:-}" ]; then
  # nvcc 12.4 has no NVCC_CCBIN; CMake passes the same -ccbin, which nvcc accepts twice
  export CUDAHOSTCXX="$CXX" NVCC_PREPEND_FLAGS="${NVCC_PREPEND_FLAGS:-} -ccbin=$CXX"
fi
if [ "${CONDA_BUILD:-0}" = 1 ] && [ -n "${PREFIX:-}" ] && [ "$PREFIX" != "$CONDA_PREFIX" ]; then
  # nvcc lives in the build env; headers and libraries of the host env come last
  export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$PREFIX/targets/x86_64-linux/include -L$PREFIX/targets/x86_64-linux/lib"
fi
unset _v
