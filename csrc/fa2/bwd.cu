// The two small kernels around the FA2 backward (compiled once per library, any arch):
// dsum = rowsum(dO * O) before the main kernels (the "D" of dS = P * (dP - D)), which also
// zeroes dq_accum for the main kernels' atomics, and the fp16 dQ from the fp32 dq_accum they
// summed (not deterministic). Both are memory-bound: each thread moves one 16-byte chunk of
// a (row, head), and a row takes as many lanes as it has chunks, rounded up to a power of two
// (d32: 4, d64: 8, d80-d128: 16, d256: 32), so that at d64 every lane of a warp loads
// (one warp per row left 24 of 32 idle) and the rowsum is a butterfly over aligned lanes.
// A row never takes more than a warp (the butterfly stays inside one): d512's 64 chunks
// are two per lane.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace {

constexpr int kThreads = 256;

int lanes_per_row(int head_dim) {
  const int chunks = (head_dim + 7) / 8;
  int lanes = 1;
  while (lanes < chunks && lanes < 32) lanes <<= 1;
  return lanes;
}

// This thread's chunks: row t of q's rows (batched t = b * seqlen_q + i; varlen b = 0, i = t),
// head blockIdx.y, columns c * 8 .. c * 8 + 7 for c = c0, c0 + lanes, ... inside head_dim.
// Grid: (rows / rows per block, heads).
struct Chunk {
  int64_t b, i;
  int h, c0;
  bool row;  // t is a row
};
__device__ __forceinline__ Chunk chunk_of(const BwdParams& p, int lanes) {
  Chunk k;
  const int64_t t = (int64_t)blockIdx.x * (kThreads / lanes) + threadIdx.x / lanes;
  k.h = blockIdx.y;
  k.c0 = threadIdx.x & (lanes - 1);
  k.row = t < p.total_q;
  k.b = 0;
  k.i = t;
  if (k.row && p.cu_seqlens_q == nullptr) {  // t < total_q: 32-bit division
    k.b = static_cast<int>(t) / p.seqlen_q;
    k.i = t - k.b * p.seqlen_q;
  }
  return k;
}
// Chunk c's 8 floats of dq_accum (contiguous like q: head stride head_dim).
__device__ __forceinline__ float* accum_of(const BwdParams& p, const Chunk& k, int c) {
  return p.dq_accum + k.b * p.acc_batch_stride + k.i * p.acc_row_stride +
         (int64_t)k.h * p.head_dim + c * 8;
}

__global__ void __launch_bounds__(kThreads) preprocess_kernel(const BwdParams p, int lanes) {
  const Chunk k = chunk_of(p, lanes);
  float acc = 0.f;
  for (int c = k.c0; k.row && c * 8 < p.head_dim; c += lanes) {
    const uint4 ov = __ldg(reinterpret_cast<const uint4*>(
        static_cast<const __half*>(p.o) + k.b * p.o_batch_stride + k.i * p.o_row_stride +
        k.h * p.o_head_stride + c * 8));
    const uint4 dv = __ldg(reinterpret_cast<const uint4*>(
        static_cast<const __half*>(p.dout) + k.b * p.do_batch_stride + k.i * p.do_row_stride +
        k.h * p.do_head_stride + c * 8));
    const __half2* oh = reinterpret_cast<const __half2*>(&ov);
    const __half2* dh = reinterpret_cast<const __half2*>(&dv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = __half22float2(oh[j]), c = __half22float2(dh[j]);
      acc = fmaf(a.x, c.x, fmaf(a.y, c.y, acc));
    }
    if (!p.deterministic) {  // the deterministic dQ kernel leaves dq_accum untouched
      float4* a = reinterpret_cast<float4*>(accum_of(p, k, c));
      a[0] = a[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // every lane takes part (lanes of rows past the end add zeros)
  for (int m = lanes >> 1; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (k.row && k.c0 == 0) p.dsum[k.b * p.dsum_batch_stride + k.h * p.dsum_head_stride + k.i] = acc;
}

__global__ void __launch_bounds__(kThreads) convert_dq_kernel(const BwdParams p, int lanes) {
  const Chunk k = chunk_of(p, lanes);
  for (int c = k.c0; k.row && c * 8 < p.head_dim; c += lanes) {
    const float* a = accum_of(p, k, c);
    const float4 x = *reinterpret_cast<const float4*>(a);
    const float4 y = *reinterpret_cast<const float4*>(a + 4);
    const float s = p.scale;
    uint4 out;
    __half2* oh = reinterpret_cast<__half2*>(&out);
    oh[0] = __floats2half2_rn(x.x * s, x.y * s);
    oh[1] = __floats2half2_rn(x.z * s, x.w * s);
    oh[2] = __floats2half2_rn(y.x * s, y.y * s);
    oh[3] = __floats2half2_rn(y.z * s, y.w * s);
    *reinterpret_cast<uint4*>(static_cast<__half*>(p.dq) + k.b * p.dq_batch_stride +
                              k.i * p.dq_row_stride + k.h * p.dq_head_stride + c * 8) = out;
  }
}

template <class Kernel>
int launch_rows(Kernel kernel, const BwdParams& p, cudaStream_t stream) {
  if (p.total_q == 0 || p.heads == 0) return 0;
  const int lanes = lanes_per_row(p.head_dim), rows = kThreads / lanes;
  const auto blocks = static_cast<unsigned>(((int64_t)p.total_q + rows - 1) / rows);
  kernel<<<dim3(blocks, p.heads), kThreads, 0, stream>>>(p, lanes);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int run_bwd_preprocess(const BwdParams& p, cudaStream_t stream) {
  return launch_rows(preprocess_kernel, p, stream);
}

int run_bwd_convert_dq(const BwdParams& p, cudaStream_t stream) {
  return launch_rows(convert_dq_kernel, p, stream);
}

}  // namespace fa2
}  // namespace sm7x
