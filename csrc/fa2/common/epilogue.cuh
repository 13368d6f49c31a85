// The end of both kernels: 1 / l and the LSE per row, the output and LSE offsets, and
// the write-out of O. Each warp stages its 16 output rows as fp16 in shared memory (rows
// of the Q tile that only it read; the staging writes follow each arch's register
// layout) so that global memory sees whole 128-bit stores.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/softmax.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace detail {

// Rows that saw no key (l = 0) write 0 and lse = +inf (flash-attn's convention).
__device__ __forceinline__ float inv_row_sum(float l) { return l > 0.f ? 1.f / l : 0.f; }

// lse in natural log of the scaled scores (of the capped scores with softcap).
__device__ __forceinline__ float row_lse(const SoftmaxScale& sc, float l, float row_max) {
  return l > 0.f ? row_max * sc.nat + __logf(l) : INFINITY;
}

// A row's final 1 / l and LSE, with the sink s_h of its query head where sinks is not
// null: the denominator gains exp(s_h), which in the row's own scale (m, its max as a
// natural-log score) is exp(s_h - m) added to l; the LSE is logaddexp(lse, s_h), taken
// from the larger side so that neither overflows. A row that saw no key: 0 and lse = s_h
// (+inf without a sink).
struct RowEnd {
  float inv, lse;
};
__device__ __forceinline__ RowEnd row_end(const SoftmaxScale& sc, float l, float row_max,
                                          const float* sinks, int head) {
  if (sinks == nullptr) return {inv_row_sum(l), row_lse(sc, l, row_max)};
  const float s = sinks[head];
  if (!(l > 0.f)) return {0.f, s};
  const float m = row_max * sc.nat, d = s - m;
  const float denom = l + __expf(d);  // +inf past d = 88: the output is then 0
  return {1.f / denom, d > 0.f ? s + __logf(1.f + l * __expf(-d)) : m + __logf(denom)};
}

// Element offsets of the first output row (in p.o) and of the LSE row (in p.lse) of
// (batch b, head h). Offsets, not pointers: added to p.o / p.lse at the stores they keep
// the base computed once; a pointer from here made the compiler re-add the head offset
// at every 128-bit store (+37 instructions at sm75 d=256).
__device__ __forceinline__ void out_offsets(const FwdParams& p, int b, int h, int64_t& o_off,
                                            int64_t& lse_off) {
  if (p.cu_seqlens_q != nullptr) {
    const int qs = p.cu_seqlens_q[b];
    o_off = (int64_t)qs * p.o_row_stride;
    lse_off = qs;
  } else {
    o_off = (int64_t)b * p.o_batch_stride;
    lse_off = (int64_t)b * p.lse_batch_stride;
  }
  o_off += (int64_t)h * p.o_head_stride;
  lse_off += (int64_t)h * p.lse_head_stride;
}

// The 16 rows of m16 slice `slice` of the CTA (warp * kSlices + the warp's slice),
// staged fp16 [16][C::kStride] at sO, to the output rows m0 + 16 slice + 0..15 of the
// `rows` rows; row_offset(grow) is the element offset of row
// grow in p.o (the serving kernels' packed GQA rows, OutRows; prefill: OffsetRows).
// 128-bit stores; rows past `rows` and chunks past the real head dim are skipped. PARTS
// warps that staged one slice together (a dim split) each store part `part` of its chunks.
template <class C, class RowOffset, int PARTS = 1>
__device__ __forceinline__ void store_o_rows_at(const FwdParams& p, const RowOffset& row_offset,
                                                const __half* sO, int m0, int slice, int rows,
                                                int lane, int part = 0) {
  constexpr int kN = 16 * C::kChunks / 32;  // chunks per lane of the whole slice
  static_assert(kN % PARTS == 0, "a slice's chunks split evenly over the warps that store it");
  // Read up front: a load inside the && below is conditional and made the second test a
  // branch of its own (4 more BRA at d=96).
  const int head_dim = p.head_dim;
  __half* const o = static_cast<__half*>(p.o);
#pragma unroll
  for (int i = 0; i < kN / PARTS; ++i) {
    const int idx = lane + (part * (kN / PARTS) + i) * 32;
    const int r = idx / C::kChunks, c = idx % C::kChunks;
    const int grow = m0 + slice * 16 + r;
    if (grow < rows && c * 8 < head_dim)
      *reinterpret_cast<uint4*>(o + row_offset(grow) + c * 8) =
          *reinterpret_cast<const uint4*>(sO + r * C::kStride + c * 8);
  }
}

// Output row grow at o_off + grow * stride (o_off: out_offsets).
struct OffsetRows {
  int64_t base, stride;
  __device__ __forceinline__ int64_t operator()(int r) const { return base + (int64_t)r * stride; }
};

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
