// The prologue both kernels share: where the sequence of batch b lies (batched or
// varlen), the offsets of the head's Q/K/V rows (GQA/MQA: query heads share a K/V head)
// and the key tiles a CTA visits once the attention window is applied.
//
// Same expressions in the same order as when they were written inline in each kernel,
// __forceinline__, returning plain values: the SASS is unchanged. Pointers leave these
// helpers as element offsets that the kernel adds to p.q / p.k / p.v itself: returning
// the pointers (out-parameters) cost 17 instructions at sm70 d=256, where the compiler
// then formed the tile-load predicates and addresses differently.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace detail {

// Lengths of sequence b and the element offsets of its first Q and K/V rows. Only what
// the key loop needs: the output and LSE offsets are derived again in the epilogue
// (out_offsets), so fewer registers stay live across the loop.
struct Sequence {
  int sq, sk;
  int64_t q_off, k_off, v_off;
};

__device__ __forceinline__ Sequence sequence(const FwdParams& p, int b) {
  Sequence s;
  if (p.cu_seqlens_q != nullptr) {
    const int qs = p.cu_seqlens_q[b], ks = p.cu_seqlens_k[b];
    s.sq = p.cu_seqlens_q[b + 1] - qs;
    s.sk = p.cu_seqlens_k[b + 1] - ks;
    s.q_off = (int64_t)qs * p.q_row_stride;
    s.k_off = (int64_t)ks * p.k_row_stride;
    s.v_off = (int64_t)ks * p.v_row_stride;
  } else {
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
    s.q_off = (int64_t)b * p.q_batch_stride;
    s.k_off = (int64_t)b * p.k_batch_stride;
    s.v_off = (int64_t)b * p.v_batch_stride;
  }
  return s;
}

// Element offsets of the Q and K/V rows of head h in p.q / p.k / p.v: query head h reads
// K/V head h / (heads / kv_heads) (GQA/MQA).
__device__ __forceinline__ void head_offsets(const FwdParams& p, const Sequence& s, int h,
                                             int64_t& q_off, int64_t& k_off, int64_t& v_off) {
  const int hk = h / (p.heads / p.kv_heads);
  q_off = s.q_off + (int64_t)h * p.q_head_stride;
  k_off = s.k_off + (int64_t)hk * p.k_head_stride;
  v_off = s.v_off + (int64_t)hk * p.v_head_stride;
}

// Keys row i may see (bottom-right aligned): [i + off - left, i + off + right], off =
// sk - sq. The key tiles [t_lo, t_hi) of a CTA with rows [m0, last_row] are those that
// hold a key one of its rows may see; empty (t_lo == t_hi) when none does.
struct KeyTiles {
  int off, last_row;
  int t_lo, t_hi;
};

template <int BR, int BC>
__device__ __forceinline__ KeyTiles key_tiles(const FwdParams& p, int m0, int sq, int sk) {
  KeyTiles r;
  r.off = sk - sq;
  r.last_row = min(m0 + BR, sq) - 1;
  int n_lo = 0, n_hi = sk;
  if (p.window_left >= 0) n_lo = max(0, m0 + r.off - p.window_left);
  if (p.window_right >= 0) n_hi = min(sk, r.last_row + r.off + p.window_right + 1);
  r.t_lo = n_lo / BC;
  r.t_hi = n_hi > n_lo ? (n_hi + BC - 1) / BC : r.t_lo;
  return r;
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
