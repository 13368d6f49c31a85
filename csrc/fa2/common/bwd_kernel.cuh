// The two backward passes of both archs, written once: the main pass (dK, dV and atomic
// dQ of one key block) and the deterministic dQ pass. The bodies hold the work split, the
// tile walk and every barrier; the arch's math is behind an Ops policy (sm75/bwd_kernel.cuh:
// mma.m16n8k8 + ldmatrix fragments in registers; sm70/bwd_kernel.cuh: WMMA fragments
// through per-warp scratch), as flash-attention keeps its kernel bodies apart from the MMA
// atom its traits pick. Algorithm: common/bwd_common.cuh.
//
// Main-pass Ops<C, MODE> (one object per thread, its accumulators live in it):
//   Ops(scratch, warp, lane)   scratch: the shared memory past dS^T (sm70: its per-warp
//                              fp32 scratch and P^T tiles; Ops::kScratchBytes of it)
//   zero()                     dK, dV accumulators
//   begin(p, rows, hk, n0, sk, smem_raw)   per-CTA setup before the query loop
//   scores(sK, sV, sQ, sdO)    S^T = K Q^T and (dK passes) dP^T = V dO^T
//   probs(flags, ...)          P^T and dS^T elementwise (with_score_flags picks flags)
//   accumulate(sQ, sdO, sdS, dq_atomic)   dV += P^T dO, dK += dS^T Q; dS^T to sdS
//   dq_atomic(...)             dQ += dS K for this tile, fp32 atomics (after a barrier)
//   store(p, rows, hk, n0, sk) dK (times the scale) and dV to global memory
// dQ-pass Ops<C>: Ops(scratch, warp, lane), row_stats(...) (LSE, dsum of this thread's rows),
// begin(), scores(sQ, sdO, sK, sV), ds(flags, ...), accumulate(sK, part), store(...).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/bwd_common.cuh"
#include "common/mask.cuh"
#include "common/softmax.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace detail {

// One CTA per (BN keys, kv head, batch): walks the query tiles of every query head of the
// kv head's group (QueryTile), dK/dV in Ops' accumulators. MODE (BwdMode): everything, or
// the dV / dK+dQ pass of a split backward.
template <class Ops>
__device__ __forceinline__ void bwd_main_body(const BwdParams& p, unsigned char* smem_raw) {
  using C = typename Ops::Config;
  constexpr int MODE = Ops::kMode;
  constexpr int D = C::kHeadDim, BN = C::kBlockN, BM = C::kBlockM, ST = C::kStride;
  constexpr int SD = C::kDsStride, T = C::kThreads;
  constexpr bool kDk = MODE != kBwdDv;
  // the layout of BwdConfig::smem_bytes(MODE): K, V, Q, dO, dS^T, the arch's scratch, LSE, dsum
  // (k_rows, v_rows, ds_rows: 0 where the mode has no such tile)
  __half* const sK = reinterpret_cast<__half*>(smem_raw);
  __half* const sV = sK + C::k_rows(MODE) * ST;
  __half* const sQ = sV + C::v_rows(MODE) * ST;
  __half* const sdO = sQ + BM * ST;
  __half* const sdS = sdO + BM * ST;
  unsigned char* const scratch = reinterpret_cast<unsigned char*>(sdS + C::ds_rows(MODE) * SD);
  float* const sL = reinterpret_cast<float*>(scratch + Ops::kScratchBytes);
  float* const sD = sL + BM;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  Ops ops(scratch, warp, lane);
  const int hk = blockIdx.y, b = blockIdx.z, n0 = blockIdx.x * BN;
  const BwdSequence rows = bwd_sequence(p, b);
  const int sq = rows.sq, sk = rows.sk;
  if (n0 >= sk) return;
  const int head_dim = p.head_dim;
  const int group = p.heads / p.kv_heads;
  const int off = sk - sq, n_last = min(n0 + BN, sk) - 1;
  const int left = p.window_left, right = p.window_right;
  const SoftmaxScale sc = softmax_scale(p);
  // dQ by atomics in this kernel, or (C::kDqPass, p.deterministic) by the dQ kernel after it
  constexpr bool kDqAtomics = kDk && !C::kDqPass;
  const bool dq_atomic = kDqAtomics && !p.deterministic;

  if constexpr (C::k_rows(MODE) > 0)  // (the dV pass with K in registers has no K tile)
    copy_tile<BN, T, D, ST, C::kCopyBatch>(sK, static_cast<const __half*>(p.k) +
                                    k_like(rows, hk, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                            p.k_row_stride, n0, sk, head_dim, tid);
  if constexpr (C::v_rows(MODE) > 0)
    copy_tile<BN, T, D, ST, C::kCopyBatch>(sV, static_cast<const __half*>(p.v) +
                                    k_like(rows, hk, p.v_batch_stride, p.v_row_stride, p.v_head_stride),
                            p.v_row_stride, n0, sk, head_dim, tid);

  int m_lo, m_hi;
  query_range(p, n0, n_last, sq, off, m_lo, m_hi);
  const int t_lo = m_lo / BM, t_hi = m_hi > m_lo ? (m_hi + BM - 1) / BM : t_lo;

  ops.zero();
  ops.begin(p, rows, hk, n0, sk, head_dim, smem_raw);

  // One flat loop over (query head of the group, query tile): offsets are recomputed from
  // the parameters each step instead of held across it (registers: dK/dV need them).
  const int ntiles = t_hi - t_lo, nsteps = group * ntiles;
  QueryTile<C, kDk> tile;
  if (nsteps > 0) tile.load(p, rows, hk * group, t_lo * BM, tid);
  for (int it = 0; it < nsteps; ++it) {
    const int h = tile.h, m0 = tile.m0;
    __syncthreads();  // every warp is done with the previous tile's Q, dO, dS
    tile.store(p, rows, sQ, sdO, sL, sD, tid);
    __syncthreads();
    // the next tile: in flight while this one computes (kPrefetch)
    if (it + 1 < nsteps) tile.load_next(p, rows, t_lo, t_hi, tid);

    typename Ops::Scores s;
    ops.scores(s, sK, sV, sQ, sdO);
    const int last_row = min(m0 + BM, sq) - 1;
    const bool masked = SM7X_FA2_TILE_NEEDS_MASK(p, BN, n0, m0, last_row, sk, off);
    const typename Ops::Pos pos = ops.pos();
    with_score_flags(p.softcap > 0.f, masked, [&](auto flags) {
      Ops::probs(pos, s, flags, p, sc, sL, sD, sdS, n0, m0, sk, off, left, right);
    });
    ops.accumulate(s, sQ, sdO, sdS, dq_atomic);

    // ---- dQ += dS K over this CTA's BN keys, fp32 atomics (one writer order per run
    // is not fixed: p.deterministic runs the dQ pass instead)
    if constexpr (kDqAtomics) {
      if (dq_atomic) {
        __syncthreads();  // dS^T of every warp stored
        ops.dq_atomic(p, rows, h, m0, sq, sK, sdS);
      }
    }
  }
  ops.store(p, rows, hk, n0, sk, head_dim);
}

// Deterministic dQ: one CTA per (DQ_BM queries, head, batch), rows [m0, m0 + DQ_BM) of query
// head h, key tiles in ascending order; columns [part * kDqCols, + kDqCols) of dQ (d = 256:
// two CTAs per query block).
template <class Ops>
__device__ __forceinline__ void bwd_dq_body(const BwdParams& p, unsigned char* smem_raw) {
  using C = typename Ops::Config;
  constexpr int D = C::kHeadDim, BM = C::kDqBlockM, BN = C::kDqBlockN, ST = C::kStride;
  constexpr int T = C::kDqThreads;
  // (kDqQInRegs: no Q or dO tile; the Ops hold their fragments)
  constexpr int QROWS = C::kDqQInRegs ? 0 : BM;
  __half* const sQ = reinterpret_cast<__half*>(smem_raw);
  __half* const sdO = sQ + QROWS * ST;
  __half* const sK = sdO + QROWS * ST;
  __half* const sV = sK + BN * ST;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  Ops ops(reinterpret_cast<unsigned char*>(sV + BN * ST), warp, lane);
  const int h = blockIdx.y, b = blockIdx.z;
  // (query block, column part): longest (causal) blocks first
  constexpr int NPART = D / C::kDqCols;
  const int part = blockIdx.x % NPART;
  const int m0 = (gridDim.x / NPART - 1 - blockIdx.x / NPART) * BM;
  const BwdSequence rows = bwd_sequence(p, b);
  const int sq = rows.sq, sk = rows.sk;
  if (m0 >= sq) return;
  const int head_dim = p.head_dim;
  const int hk = h / (p.heads / p.kv_heads);
  const int left = p.window_left, right = p.window_right;
  const SoftmaxScale sc = softmax_scale(p);

  if constexpr (!C::kDqQInRegs) {
    copy_tile<BM, T, D, ST, C::kDqCopyBatch>(sQ, static_cast<const __half*>(p.q) +
                                    q_like(rows, h, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                            p.q_row_stride, m0, sq, head_dim, tid);
    copy_tile<BM, T, D, ST, C::kDqCopyBatch>(sdO, static_cast<const __half*>(p.dout) +
                                     q_like(rows, h, p.do_batch_stride, p.do_row_stride, p.do_head_stride),
                            p.do_row_stride, m0, sq, head_dim, tid);
  }
  const __half* const kg = static_cast<const __half*>(p.k) +
                           k_like(rows, hk, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  const __half* const vg = static_cast<const __half*>(p.v) +
                           k_like(rows, hk, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  ops.row_stats(p, rows, h, m0, sq);

  const int off = sk - sq, last_row = min(m0 + BM, sq) - 1;
  int n_lo = 0, n_hi = sk;
  if (left >= 0) n_lo = max(0, m0 + off - left);
  if (right >= 0) n_hi = min(sk, last_row + off + right + 1);
  const int t_lo = n_lo / BN, t_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : t_lo;
  ops.begin();
  if constexpr (C::kDqQInRegs)
    ops.q_fragments(static_cast<const __half*>(p.q) +
                        q_like(rows, h, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                    p.q_row_stride,
                    static_cast<const __half*>(p.dout) +
                        q_like(rows, h, p.do_batch_stride, p.do_row_stride, p.do_head_stride),
                    p.do_row_stride, sq, head_dim);

  // C::kDqPrefetch: the next key tile's K and V in registers while this one computes
  struct NoTiles {};
  using Held = typename std::conditional<C::kDqPrefetch, KeyTilesInRegs<BN, T, D>, NoTiles>::type;
  Held next;
  if constexpr (C::kDqPrefetch)
    if (t_lo < t_hi) next.load(kg, vg, p.k_row_stride, p.v_row_stride, t_lo * BN, sk, head_dim, tid);
  for (int t = t_lo; t < t_hi; ++t) {
    const int n0 = t * BN;
    __syncthreads();  // every warp is done with the previous K, V
    if constexpr (C::kDqPrefetch) {
      next.template store<ST>(sK, sV, tid);
    } else {
      copy_tile<BN, T, D, ST, C::kDqCopyBatch>(sK, kg, p.k_row_stride, n0, sk, head_dim, tid);
      if constexpr (C::kDqVInRegs)  // the Ops read V's fragments from global memory
        ops.v_tile(vg, p.v_row_stride, n0, sk, head_dim);
      else
        copy_tile<BN, T, D, ST, C::kDqCopyBatch>(sV, vg, p.v_row_stride, n0, sk, head_dim, tid);
    }
    __syncthreads();
    if constexpr (C::kDqPrefetch)
      if (t + 1 < t_hi) next.load(kg, vg, p.k_row_stride, p.v_row_stride, n0 + BN, sk, head_dim, tid);
    // kDqPass: a warp whose rows see none of this tile's keys skips it (the causal diagonal;
    // no barrier follows in this iteration). Measured: MEASUREMENTS.md, "d128: dK/dV in one pass"
    if constexpr (C::kDqPass)
      if (ops.sees_none(n0, sq, sk, off, left, right)) continue;
    typename Ops::Scores s;
    ops.scores(s, sQ, sdO, sK, sV);
    const bool masked = SM7X_FA2_TILE_NEEDS_MASK(p, BN, n0, m0, last_row, sk, off);
    const typename Ops::Pos pos = ops.pos();
    with_score_flags(p.softcap > 0.f, masked, [&](auto flags) {
      Ops::ds(pos, s, flags, p, sc, n0, sk, off, left, right);
    });
    ops.accumulate(s, sK, part);
  }
  ops.store(p, rows, h, m0, sq, part);
}

// The launches of one head dim, for either arch: K (the arch's BwdKernels) names its
// kernels. Main: dK/dV (+ dQ atomics), or with C::kSplit dV and then dK (+ dQ) in two
// passes, the dV pass with CDv (C with its own block_n: targets.json dv_block_n).
template <class K, class C, class CDv>
int run_bwd_main(const BwdParams& p, cudaStream_t stream) {
  if constexpr (C::kSplit) {
    static_assert(same_but_block_n<C, CDv>(), "the dV pass's config differs only in block_n");
    if (const int e = launch_bwd<CDv, kBwdDv>(K::template main_kernel<CDv, kBwdDv>(), p, stream)) return e;
    return launch_bwd<C, kBwdDkDq>(K::template main_kernel<C, kBwdDkDq>(), p, stream);
  } else {
    return launch_bwd<C, kBwdAll>(K::template main_kernel<C, kBwdAll>(), p, stream);
  }
}

template <class K, class C>
int run_bwd_dq(const BwdParams& p, cudaStream_t stream) {
  return launch_bwd_dq<C>(K::template dq_kernel<C>(), p, stream);
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x

// An arch's backward kernels and launchers, written once: expanded inside namespace
// sm7x::fa2::<arch> after its BwdMainOps / BwdDqOps, so the kernels' names (which the
// tools and package tests read) carry the arch. SMEM_ALIGN: the alignment its shared
// layout needs (WMMA tiles: 128 bytes; ldmatrix rows: 16).
#define SM7X_FA2_BWD_KERNELS(SMEM_ALIGN)                                                     \
  template <class C, int MODE>                                                              \
  __global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) bwd_kernel(const BwdParams p) { \
    extern __shared__ __align__(SMEM_ALIGN) unsigned char smem_raw[];                       \
    detail::bwd_main_body<BwdMainOps<C, MODE>>(p, smem_raw);                                \
  }                                                                                         \
  template <class C>                                                                        \
  __global__ void __launch_bounds__(C::kDqThreads) bwd_dq_kernel(const BwdParams p) {       \
    extern __shared__ __align__(SMEM_ALIGN) unsigned char smem_raw[];                       \
    detail::bwd_dq_body<BwdDqOps<C>>(p, smem_raw);                                          \
  }                                                                                         \
  /* the kernels of each pass, for detail::run_bwd_main / run_bwd_dq */                     \
  struct BwdKernels {                                                                       \
    template <class C, int MODE>                                                            \
    static auto main_kernel() { return bwd_kernel<C, MODE>; }                               \
    template <class C>                                                                      \
    static auto dq_kernel() { return bwd_dq_kernel<C>; }                                    \
  };                                                                                        \
  template <class C, class CDv = C>                                                         \
  int run_bwd_main(const BwdParams& p, cudaStream_t stream) {                               \
    return detail::run_bwd_main<BwdKernels, C, CDv>(p, stream);                             \
  }                                                                                         \
  template <class C>                                                                        \
  int run_bwd_dq(const BwdParams& p, cudaStream_t stream) {                                 \
    return detail::run_bwd_dq<BwdKernels, C>(p, stream);                                    \
  }
