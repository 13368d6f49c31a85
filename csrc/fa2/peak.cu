// The tensor-core ceiling the benchmark measures FA2 against (python -m sm7x.bench fa2):
// a register-only loop of the MMA instruction this library's kernels use (sm_75:
// mma.m16n8k8, sm_70: mma.m8n8k4), with independent accumulators so that no dependency
// chain limits it. It runs in the same process as the benchmark, on the same GPU and
// through the same PTX JIT, so "% of ceiling" compares like with like (a constant from a
// datasheet would not hold for a forced library on a newer GPU).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/ptx.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace {

constexpr int kChains = 8;  // independent accumulators per thread

__global__ void __launch_bounds__(kMmaPeakThreads) mma_peak_kernel(float* out, int iters) {
  // small operands: the accumulators stay finite over any iteration count
  const uint32_t a = detail::pack_half2(1e-3f, 2e-3f), b = detail::pack_half2(3e-3f, 1e-3f);
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 750
  float acc[kChains][4] = {};
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int c = 0; c < kChains; ++c) detail::mma_m16n8k8(acc[c], a, a, b);
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
#else
  float acc[kChains][8] = {};
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int c = 0; c < kChains; ++c)
      asm volatile(
          "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0, %1, %2, %3, %4, %5, %6, %7}, "
          "{%8, %9}, {%10, %11}, {%0, %1, %2, %3, %4, %5, %6, %7};\n"
          : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3]),
            "+f"(acc[c][4]), "+f"(acc[c][5]), "+f"(acc[c][6]), "+f"(acc[c][7])
          : "r"(a), "r"(a), "r"(b), "r"(b));
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j) s += acc[c][j];
#endif
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the loop from being removed
}

}  // namespace

// Both instructions do 2048 FLOP per warp: m16n8k8 is 2 x 16 x 8 x 8, m8n8k4 is four
// 8x8x4 products (one per quad pair) of 2 x 8 x 8 x 4.
int run_mma_peak(float* out, int blocks, int iters, cudaStream_t stream, int64_t* flop) {
  mma_peak_kernel<<<blocks, kMmaPeakThreads, 0, stream>>>(out, iters);
  *flop = static_cast<int64_t>(blocks) * (kMmaPeakThreads / 32) * iters * kChains * 2048;
  return static_cast<int>(cudaGetLastError());
}

}  // namespace fa2
}  // namespace sm7x
