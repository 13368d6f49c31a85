#!/usr/bin/env bash
# Repack one output ($PKG_NAME) into conda-forge's CUDA layout; see recipe.yaml.
set -euo pipefail
T="$PREFIX/targets/x86_64-linux"

link_into_lib() {  # conda-forge keeps the files in targets/ and symlinks them into lib/
  mkdir -p "$PREFIX/lib"
  for f in "$@"; do ln -s "../targets/x86_64-linux/lib/$f" "$PREFIX/lib/$f"; done
}

case "$PKG_NAME" in
cuda-cudart)
  mkdir -p "$T/lib"
  unzip -q nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' -d whl
  install -m755 whl/nvidia/cuda_runtime/lib/libcudart.so.12 "$T/lib/libcudart.so.$PKG_VERSION"
  ln -s "libcudart.so.$PKG_VERSION" "$T/lib/libcudart.so.12"
  link_into_lib "libcudart.so.$PKG_VERSION" libcudart.so.12
  ;;
cuda-cudart-static)
  mkdir -p "$T/lib"
  unzip -q nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/*.a' -d whl
  install -m644 whl/nvidia/cuda_runtime/lib/{libcudart_static,libculibos}.a "$T/lib/"
  # empty archive: nvlink 12.4 rejects the 12.9 device runtime (see recipe.yaml)
  printf '!<arch>\n' > "$T/lib/libcudadevrt.a"
  link_into_lib libcudart_static.a libculibos.a libcudadevrt.a
  ;;
cuda-cudart-dev)
  mkdir -p "$T/include" "$T/lib"
  unzip -q nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/include/*' -d whl
  unzip -q nvidia_cuda_cccl_cu12-*.whl 'nvidia/cuda_cccl/include/*' 'nvidia/cuda_cccl/lib/cmake/*' -d whl
  unzip -q nvidia_cuda_nvcc_cu12-*.whl 'nvidia/cuda_nvcc/include/crt/*' 'nvidia/cuda_nvcc/include/fatbinary_section.h' -d whl
  cp -r whl/nvidia/{cuda_runtime,cuda_cccl,cuda_nvcc}/include/. "$T/include/"
  cp -r whl/nvidia/cuda_cccl/lib/cmake "$T/lib/"  # cccl-config.cmake finds ../../../include
  find "$T" -name __init__.py -delete
  ln -s libcudart.so.12 "$T/lib/libcudart.so"
  link_into_lib libcudart.so
  ;;
cuda-nvcc_linux-64)
  dpkg-deb -x nvidia-cuda-toolkit_*.deb deb
  tk=deb/usr/lib/nvidia-cuda-toolkit
  # nvdisasm is cuda-nvdisasm; compute-sanitizer and the profilers are left out
  install -Dm755 -t "$PREFIX/bin" "$tk/bin/nvcc" \
    deb/usr/bin/{ptxas,nvlink,fatbinary,cudafe++,bin2c,cuobjdump,nvprune,cu++filt,__nvcc_device_query}
  install -Dm644 -t "$PREFIX/bin/crt" "$tk"/bin/crt/*.stub
  install -Dm755 -t "$PREFIX/nvvm/bin" "$tk/bin/cicc"
  install -Dm644 -t "$PREFIX/nvvm/libdevice" "$tk/libdevice/libdevice.10.bc"
  # Debian's profile names /usr paths; ours is relative to nvcc itself ($(_HERE_))
  install -m644 "$RECIPE_DIR/nvcc.profile" "$PREFIX/bin/nvcc.profile"
  "$PREFIX/bin/nvcc" --version | grep "release 12.4" || { echo "error: the repacked nvcc does not run" >&2; exit 1; }
  # "~" sorts after the compilers' activate-*.sh, so $CXX is set when this runs
  install -Dm644 "$RECIPE_DIR/activate.sh" "$PREFIX/etc/conda/activate.d/~cuda-nvcc_activate.sh"
  install -Dm644 "$RECIPE_DIR/deactivate.sh" "$PREFIX/etc/conda/deactivate.d/~cuda-nvcc_deactivate.sh"
  ;;
cuda-nvdisasm)
  dpkg-deb --fsys-tarfile nvidia-cuda-toolkit_*.deb | tar -x ./usr/bin/nvdisasm
  install -Dm755 -t "$PREFIX/bin" usr/bin/nvdisasm
  ;;
*)
  echo "repack.sh: no rule for $PKG_NAME" >&2; exit 1 ;;
esac
