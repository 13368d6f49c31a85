// The two small kernels around the FA2 backward (compiled once per library, any arch):
// dsum = rowsum(dO * O) before the main kernels (the "D" of dS = P * (dP - D)), and the
// fp16 dQ from the fp32 dq_accum the main kernel's atomics summed (not deterministic).
// One warp per (query row, head): lane c handles 16-byte chunk c of the row.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace {

constexpr int kWarpsPerBlock = 4;

// Row t of q's rows (batched: t = b * seqlen_q + i) -> batch and row inside it.
__device__ __forceinline__ void split_row(const BwdParams& p, int64_t t, int64_t& b, int64_t& i) {
  if (p.cu_seqlens_q != nullptr) {
    b = 0;
    i = t;
  } else {
    b = t / p.seqlen_q;
    i = t - b * p.seqlen_q;
  }
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) preprocess_kernel(const BwdParams p) {
  const int64_t w = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= (int64_t)p.total_q * p.heads) return;
  const int64_t t = w / p.heads;
  const int h = static_cast<int>(w - t * p.heads);
  int64_t b, i;
  split_row(p, t, b, i);
  float acc = 0.f;
  if (lane * 8 < p.head_dim) {
    const __half* o = static_cast<const __half*>(p.o) + b * p.o_batch_stride +
                      i * p.o_row_stride + h * p.o_head_stride + lane * 8;
    const __half* d = static_cast<const __half*>(p.dout) + b * p.do_batch_stride +
                      i * p.do_row_stride + h * p.do_head_stride + lane * 8;
    const uint4 ov = __ldg(reinterpret_cast<const uint4*>(o));
    const uint4 dv = __ldg(reinterpret_cast<const uint4*>(d));
    const __half2* oh = reinterpret_cast<const __half2*>(&ov);
    const __half2* dh = reinterpret_cast<const __half2*>(&dv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = __half22float2(oh[j]), c = __half22float2(dh[j]);
      acc = fmaf(a.x, c.x, fmaf(a.y, c.y, acc));
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) p.dsum[b * p.dsum_batch_stride + h * p.dsum_head_stride + i] = acc;
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) convert_dq_kernel(const BwdParams p) {
  const int64_t w = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= (int64_t)p.total_q * p.heads || lane * 8 >= p.head_dim) return;
  const int64_t t = w / p.heads;
  const int h = static_cast<int>(w - t * p.heads);
  int64_t b, i;
  split_row(p, t, b, i);
  const float* a = p.dq_accum + b * p.acc_batch_stride + i * p.acc_row_stride +
                   (int64_t)h * p.head_dim + lane * 8;
  const float4 x = *reinterpret_cast<const float4*>(a);
  const float4 y = *reinterpret_cast<const float4*>(a + 4);
  const float s = p.scale;
  uint4 out;
  __half2* oh = reinterpret_cast<__half2*>(&out);
  oh[0] = __floats2half2_rn(x.x * s, x.y * s);
  oh[1] = __floats2half2_rn(x.z * s, x.w * s);
  oh[2] = __floats2half2_rn(y.x * s, y.y * s);
  oh[3] = __floats2half2_rn(y.z * s, y.w * s);
  *reinterpret_cast<uint4*>(static_cast<__half*>(p.dq) + b * p.dq_batch_stride +
                            i * p.dq_row_stride + h * p.dq_head_stride + lane * 8) = out;
}

int grid_of(const BwdParams& p) {
  const int64_t warps = (int64_t)p.total_q * p.heads;
  return static_cast<int>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

int run_bwd_preprocess(const BwdParams& p, cudaStream_t stream) {
  if (p.total_q == 0 || p.heads == 0) return 0;
  preprocess_kernel<<<grid_of(p), kWarpsPerBlock * 32, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int run_bwd_convert_dq(const BwdParams& p, cudaStream_t stream) {
  if (p.total_q == 0 || p.heads == 0) return 0;
  convert_dq_kernel<<<grid_of(p), kWarpsPerBlock * 32, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace fa2
}  // namespace sm7x
