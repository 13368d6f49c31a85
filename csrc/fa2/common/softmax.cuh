// The online softmax in fp32 that both kernels run per key tile, in pieces that do not
// depend on how an arch lays scores out over the lanes (sm75: a quad of lanes per row
// pair, from the mma accumulators; sm70: 2 lanes per row, from a shared-memory scratch).
//
//   m  = max(m_old, max_j s_j)             row_allreduce_max over the lanes of a row
//   p_j = exp2(s_j * sl2 - m * sl2)        exp2_scaled; log2(e) is folded into sl2
//   alpha = exp2((m_old - m) * sl2)        online_rescale: O and l shrink by alpha
//   l  = l * alpha + sum_j p_j             per-lane partial sums, reduced in the epilogue
#pragma once

#include <cuda_runtime.h>

#include "common/ptx.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace detail {

// sl2: the factor of the exponent in base 2 (log2(e) * scale; log2(e) alone with
// softcap, whose tanh already took the scale); cap_in: scale / softcap (0 without); nat:
// the factor of a row max in the natural-log LSE (scale; 1 with softcap).
struct SoftmaxScale {
  float sl2, cap_in, nat;
};

// key_factor: what the scores computed from the keys as stored still need (an 8-bit
// cache's descale, common/serving.cuh kv_scales); 1 for fp16 keys.
__device__ __forceinline__ SoftmaxScale softmax_scale(const FwdParams& p, float key_factor = 1.f) {
  const float scale = p.scale * key_factor;
  return {p.softcap > 0.f ? 1.4426950408889634f : scale * 1.4426950408889634f,
          p.softcap > 0.f ? scale / p.softcap : 0.f, p.softcap > 0.f ? 1.f : scale};
}

// s = softcap * tanh(s * scale / softcap) on every score of a thread, when softcap is on.
template <int N>
__device__ __forceinline__ void softcap_scores(float (&s)[N][4], const FwdParams& p,
                                               float cap_in) {
  if (p.softcap > 0.f) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = p.softcap * fast_tanh(s[i][e] * cap_in);
  }
}

// Max / sum over the LANES lanes that hold one row (LANES a power of 2): adjacent lanes,
// or STRIDE apart (the decode kernel's rows are columns of its accumulators: lanes
// tig, tig + 4, .. tig + 28).
template <int LANES, int STRIDE = 1>
__device__ __forceinline__ float row_allreduce_max(float x) {
#pragma unroll
  for (int m = STRIDE; m < LANES * STRIDE; m *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

template <int LANES, int STRIDE = 1>
__device__ __forceinline__ float row_allreduce_sum(float x) {
#pragma unroll
  for (int m = STRIDE; m < LANES * STRIDE; m *= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// One row's step once its new max mx (over the lanes) is known: sets row_max = mx and the
// bias of this tile's exponentials, returns alpha. A row that has seen no key yet (mx =
// -inf) uses 0 in place of its max so that exp2 stays finite (its scores are all -inf).
__device__ __forceinline__ float online_rescale(float& row_max, float mx, float sl2,
                                                float& bias) {
  const float m_use = mx == -INFINITY ? 0.f : mx;
  const float alpha = fast_exp2((row_max - m_use) * sl2);
  row_max = mx;
  bias = -m_use * sl2;
  return alpha;
}

__device__ __forceinline__ float exp2_scaled(float s, float sl2, float bias) {
  return fast_exp2(fmaf(s, sl2, bias));
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
