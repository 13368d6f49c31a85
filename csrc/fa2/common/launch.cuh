// Host side of both kernels: prefill runs one CTA per (m-block, head, batch), serving one
// per (m-block, kv head, partition), with the config's dynamic
// shared memory on the caller's stream (torch's current stream: CUDA-graph capturable).
#pragma once

#include <cuda_runtime.h>

#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace detail {

// The launch's dynamic shared memory (bytes, or padded by the occupancy emulation, fa2.h),
// opted in per kernel above the default 48 KB limit. Every FA2 launch goes through it.
template <class Kernel>
int set_launch_smem(Kernel kernel, int bytes, int threads, int& smem) {
  smem = launch_smem_bytes(bytes, threads);
  if (smem > 48 * 1024)
    return static_cast<int>(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return 0;
}
template <class C, class Kernel>
int set_smem(Kernel kernel, int& smem) {
  return set_launch_smem(kernel, C::kSmemBytes, C::kThreads, smem);
}

// kernel<<<grid, threads, that shared memory, stream>>>(p); the launch error, or 0.
template <class Kernel, class Params>
int launch_on(Kernel kernel, dim3 grid, int threads, int smem_bytes, const Params& p,
              cudaStream_t stream) {
  int smem;
  if (const int e = set_launch_smem(kernel, smem_bytes, threads, smem)) return e;
  kernel<<<grid, threads, smem, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <class C, class Kernel>
int launch(Kernel kernel, const FwdParams& p, cudaStream_t stream) {
  const int mblocks = (p.seqlen_q + C::kBlockM - 1) / C::kBlockM;
  if (mblocks == 0 || p.batch == 0 || p.heads == 0) return 0;
  return launch_on(kernel, dim3(mblocks, p.heads, p.batch), C::kThreads, C::kSmemBytes, p, stream);
}

// Resident CTAs per SM of a kernel (what the split planner counts on); 0 on error.
template <class C, class Kernel>
int occupancy(Kernel kernel) {
  int n = 0, smem;
  if (set_smem<C>(kernel, smem) != 0 ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, C::kThreads, smem) !=
          cudaSuccess)
    return 0;
  return n;
}

// The serving grid: (m-blocks of one sequence's packed rows, kv heads, partitions).
template <class C, class Kernel>
int launch_serving(Kernel kernel, const FwdParams& p, cudaStream_t stream) {
  const int rows = p.seqlen_q * p.group;
  const int mblocks = (rows + C::kBlockM - 1) / C::kBlockM;
  if (mblocks == 0 || p.num_partitions == 0 || p.kv_heads == 0) return 0;
  return launch_on(kernel, dim3(mblocks, p.kv_heads, p.num_partitions), C::kThreads,
                   C::kSmemBytes, p, stream);
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
