// The score exchange of a dim split (sm75, targets.json "dim_split" 2 or 4): warps that share
// rows (forward) or keys (backward) each hold half of the head dim, so each computes a
// partial score tile over its half. Each writes its partials to its own shared-memory slot
// (a float4 per lane and n8 tile, in the accumulator layout, so the partner's lane reads
// exactly its own elements), the pair meets at a named barrier, and each adds the partner's
// slot: both warps then hold the same sum (fp32 addition commutes) and run the same softmax.
// The kernels rewrite a slot only after a CTA barrier that the partner reaches after its read.
#pragma once

#include <cuda_runtime.h>

#include "common/ptx.cuh"

namespace sm7x {
namespace fa2 {
namespace detail {

// This lane's first float4 in its warp's slot and in the partner's (warp ^ 1); slots of
// `slot` float4s each from `base` (16-byte aligned).
struct PairSlots {
  float4* mine;
  const float4* peer;
};
__device__ __forceinline__ PairSlots pair_slots(unsigned char* base, int warp, int slot, int lane) {
  float4* const slots = reinterpret_cast<float4*>(base);
  return {slots + warp * slot + lane, slots + (warp ^ 1) * slot + lane};
}

__device__ __forceinline__ float4 as_float4(const float (&a)[4]) {
  return make_float4(a[0], a[1], a[2], a[3]);
}
__device__ __forceinline__ void add_float4(float (&a)[4], const float4 x) {
  a[0] += x.x;
  a[1] += x.y;
  a[2] += x.z;
  a[3] += x.w;
}

// Partial accumulators a[0..N) -> the slot from `at` (one float4 per n8 tile, 32 lanes
// apart); with b, b[0..N) after them, tile by tile (the backward's S^T and dP^T).
template <int N>
__device__ __forceinline__ void put_partial(float4* at, const float (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) at[i * 32] = as_float4(a[i]);
}
template <int N>
__device__ __forceinline__ void put_partial(float4* at, const float (&a)[N][4], const float (&b)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    at[i * 32] = as_float4(a[i]);
    at[(N + i) * 32] = as_float4(b[i]);
  }
}

// a[0..N) (and b) += the partner's partials from `at` (after the pair's barrier).
template <int N>
__device__ __forceinline__ void add_partial(float (&a)[N][4], const float4* at) {
#pragma unroll
  for (int i = 0; i < N; ++i) add_float4(a[i], at[i * 32]);
}
template <int N>
__device__ __forceinline__ void add_partial(float (&a)[N][4], float (&b)[N][4], const float4* at) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    add_float4(a[i], at[i * 32]);
    add_float4(b[i], at[(N + i) * 32]);
  }
}

// Four warps (KS = 4, d512) share the rows: each sums all four slots of its group, its own
// included, in warp order, so that all four hold the same sum (fp32 addition is not
// associative: one order for all). `first`: this lane's float4 in the group's first slot;
// slots of `slot` float4s each.
template <int KS, int N>
__device__ __forceinline__ void sum_partials(float (&a)[N][4], const float4* first, int slot) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float4 x = first[i * 32];
#pragma unroll
    for (int j = 1; j < KS; ++j) {
      const float4 y = first[j * slot + i * 32];
      x.x += y.x;
      x.y += y.y;
      x.z += y.z;
      x.w += y.w;
    }
    a[i][0] = x.x;
    a[i][1] = x.y;
    a[i][2] = x.z;
    a[i][3] = x.w;
  }
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
