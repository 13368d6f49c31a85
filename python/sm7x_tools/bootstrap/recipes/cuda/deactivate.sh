# Restore what ~cuda-nvcc_activate.sh replaced.
for _v in CUDA_HOME CUDA_PATH CUDACXX NVCC CUDAHOSTCXX NVCC_PREPEND_FLAGS NVCC_APPEND_FLAGS; do
  if eval "[ -n \"\${CONDA_BACKUP_$_v+x}\" ]"; then
    eval "export $_v=\"\$CONDA_BACKUP_$_v\"; unset CONDA_BACKUP_$_v"
  else
    unset "$_v"
  fi
done
unset _v
