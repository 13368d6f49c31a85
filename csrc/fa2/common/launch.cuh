// Host side of both kernels: one CTA per (m-block, head, batch) with the config's dynamic
// shared memory on the caller's stream (torch's current stream: CUDA-graph capturable).
#pragma once

#include <cuda_runtime.h>

#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace detail {

template <class C, class Kernel>
int launch(Kernel kernel, const FwdParams& p, cudaStream_t stream) {
  const int mblocks = (p.seqlen_q + C::kBlockM - 1) / C::kBlockM;
  if (mblocks == 0 || p.batch == 0 || p.heads == 0) return 0;
  if (C::kSmemBytes > 48 * 1024) {  // above the default limit: opt in, per kernel
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         C::kSmemBytes);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  dim3 grid(mblocks, p.heads, p.batch);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
