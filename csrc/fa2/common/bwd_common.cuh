// What the backward kernels of both archs share (sm70/ and sm75/ bwd_kernel.cuh): the
// config, the row offsets of every tensor of a (batch, head), the query tiles a key block
// is seen by, synchronous tile copies, the query tiles (QueryTile: copied or prefetched) and
// the launchers. The algorithm is FA2's:
//   P  = exp(S - LSE)            recomputed from Q, K and the forward's LSE
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - dsum) [* (1 - tanh^2) with softcap]
//   dK = scale * dS^T Q,  dQ = scale * dS K
// with dsum = rowsum(dO * O) (bwd.cu). One CTA per (key block, kv head, batch) holds its
// dK/dV in registers and walks the query tiles of every query head of its GQA group, so
// dK/dV need no atomics. dQ: atomicAdd into fp32 dq_accum (then bwd.cu converts), or with
// p.deterministic a second kernel per query block that walks the key blocks in order.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "common/softmax.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {

namespace detail {
// What a main-kernel launch computes: everything, or (split) the dV pass, then dK and dQ.
enum BwdMode { kBwdAll = 0, kBwdDv = 1, kBwdDkDq = 2 };
}  // namespace detail

// BN keys per CTA (16 per warp), BM queries per tile; the deterministic dQ kernel: DQ_BM
// queries per CTA (16 per warp), DQ_BN keys per tile. SPLIT: dV in one pass, dK and dQ in a
// second (d = 256: dK and dV together would need 256 fp32 registers per thread).
// PREFETCH: the next query tile's Q, dO, LSE and dsum are loaded into registers while the
// current one computes (QueryTile), instead of synchronously at its start. MIN_BLOCKS: the
// main kernel's __launch_bounds__ minimum of resident CTAs per SM (caps its registers).
// V_IN_REGS: each warp holds its 16 keys of V as MMA A fragments in registers, loaded once
// from global memory; dP^T = V dO^T then needs no V tile in shared memory (sm75).
// KS > 1 (sm75 only, "dim_split"): KS warps share each 16 keys, each holding D / KS columns
// of their dK / dV (and V) and exchanging partial S^T / dP^T (sm75/bwd_kernel.cuh).
// DQ_PASS: dQ always comes from the dQ kernel (as with p.deterministic), never from atomics:
// the main kernel has no dS^T tile and no atomic code, and no fp32 dq_accum is zeroed or
// converted (where the main kernel's atomic dQ costs more than a second pass over the keys).
template <int D, int BN, int BM, int DQ_BM, int DQ_BN, bool SPLIT, bool PREFETCH = false,
          int MIN_BLOCKS = 1, bool V_IN_REGS = false, int KS = 1, bool DQ_PASS = false>
struct BwdShape {
  static constexpr int kHeadDim = D;
  static constexpr int kBlockN = BN;
  static constexpr int kBlockM = BM;
  static constexpr int kDqBlockM = DQ_BM;
  static constexpr int kDqBlockN = DQ_BN;
  static constexpr bool kSplit = SPLIT;
  static constexpr bool kPrefetch = PREFETCH;
  static constexpr int kMinBlocks = MIN_BLOCKS;
  static constexpr bool kVInRegs = V_IN_REGS;
  static constexpr bool kDqPass = DQ_PASS;
  // Rows of the main kernel's K, V and dS^T tiles in shared memory in mode `mode`: what both
  // the archs' smem_bytes(mode) and their kernels' layouts are made of. The dV pass of a
  // split backward needs no V or dS^T; with V_IN_REGS no mode has a V tile, and that dV pass
  // holds K the same way (its one use of K, S^T = K Q^T), so it has no K tile either. With
  // DQ_PASS no mode stages dS^T (it only feeds the dQ atomics).
  __host__ __device__ static constexpr int k_rows(int mode) {
    return mode == detail::kBwdDv && V_IN_REGS ? 0 : BN;
  }
  __host__ __device__ static constexpr int v_rows(int mode) {
    return mode == detail::kBwdDv || V_IN_REGS ? 0 : BN;
  }
  __host__ __device__ static constexpr int ds_rows(int mode) {
    return mode == detail::kBwdDv || DQ_PASS ? 0 : BN;
  }
  static constexpr int kDimSplit = KS;
  static constexpr int kWarps = BN / 16 * KS;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDqWarps = DQ_BM / 16;
  static constexpr int kDqThreads = kDqWarps * 32;
  static constexpr int kStride = D + 8;    // fp16 tile rows (16-byte pad: no bank conflicts)
  static constexpr int kDsStride = BM + 8;  // dS^T [BN][BM + 8]
  static constexpr int kChunks = D / 8;
  static_assert(D % 16 == 0 && D <= 512, "head dim: a multiple of 16, at most 512");
  static_assert(BN % 16 == 0 && BM % 16 == 0 && DQ_BM % 16 == 0 && DQ_BN % 16 == 0,
                "tiles: multiples of 16");
  static_assert(BM <= kThreads, "the LSE / dsum of a query tile: one thread per row");
  static_assert((KS == 1 || KS == 2 || KS == 4) && D % (16 * KS) == 0,
                "dim split: 1, 2 or 4 warps per 16 keys, each a multiple of 16 columns");
  // 16-byte loads per thread in flight while copying a tile (0: unbounded): next to the
  // d >= 112 accumulators, unbounded copies spilled registers
  static constexpr int kCopyBatch = D >= 112 ? 4 : 0;
  // (the dQ kernel at d512: one warp copies 16-row tiles, 32 loads per thread)
  static constexpr int kDqCopyBatch = D > 256 ? 4 : 0;
  // Columns of dQ a CTA of the deterministic dQ kernel accumulates (d = 256: half, in two
  // CTAs that both compute S and dP: 128 accumulators per thread instead of 256 fit; d = 512:
  // a quarter, in four)
  static constexpr int kDqCols = D > 256 ? D / 4 : D > 128 ? D / 2 : D;
  // Whether the dQ kernel reads V's B fragments straight from global memory instead of a V
  // tile (d = 512: Q, dO, K and V tiles of 16 rows are 66,560 bytes, over a T4's 64 KB per
  // block; without V 49,920)
  static constexpr bool kDqVInRegs = D > 256;
  // Whether the dQ kernel loads the next key tile's K and V into registers while the
  // current one computes (KeyTilesInRegs) instead of copying each tile at its start: with
  // DQ_PASS, where that kernel is on every backward's path
  static constexpr bool kDqPrefetch = DQ_PASS && !kDqVInRegs;
  // Whether each warp of the dQ kernel holds its 16 rows of Q and dO as MMA A fragments in
  // registers, loaded once from global memory, instead of Q and dO tiles in shared memory
  // (with DQ_PASS: its shared memory is then the K and V tiles alone, so more warps of it
  // share a Turing SM)
  static constexpr bool kDqQInRegs = DQ_PASS && !kDqVInRegs;
};

namespace detail {

// Element offsets of a (batch, head)'s first row: batched b * batch_stride, varlen the
// sequence's first token * row_stride.
struct BwdSequence {
  int sq, sk;
  int qb, kb;  // batch index (batched) or 0
  int qs, ks;  // first token (varlen) or 0
};
__device__ __forceinline__ BwdSequence bwd_sequence(const BwdParams& p, int b) {
  BwdSequence r;
  if (p.cu_seqlens_q != nullptr) {
    r.qs = p.cu_seqlens_q[b];
    r.ks = p.cu_seqlens_k[b];
    r.sq = p.cu_seqlens_q[b + 1] - r.qs;
    r.sk = p.cu_seqlens_k[b + 1] - r.ks;
    r.qb = r.kb = 0;
  } else {
    r.qs = r.ks = 0;
    r.sq = p.seqlen_q;
    r.sk = p.seqlen_k;
    r.qb = r.kb = b;
  }
  return r;
}
__device__ __forceinline__ int64_t q_like(const BwdSequence& r, int h, int64_t bs, int64_t rs,
                                          int64_t hs) {
  return (int64_t)r.qb * bs + (int64_t)r.qs * rs + (int64_t)h * hs;
}
__device__ __forceinline__ int64_t k_like(const BwdSequence& r, int h, int64_t bs, int64_t rs,
                                          int64_t hs) {
  return (int64_t)r.kb * bs + (int64_t)r.ks * rs + (int64_t)h * hs;
}

// The copies of bounded batches (BATCH > 0) store through generic addresses and load with
// plain ld.global: ptxas must then assume a store may alias the next batch's loads and
// keeps them behind it, so at most BATCH 16-byte loads (4 registers each) are in flight
// next to accumulators that fill the register file. (Empty asm dependencies do not reach
// ptxas; __ldg + st.shared are reordered freely.)
__device__ __forceinline__ uint4 ld_global_ordered(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(__cvta_generic_to_global(p))
               : "memory");
  return v;
}
__device__ __forceinline__ void st_generic_ordered(void* p, const uint4& v) {
  asm volatile("st.v4.u32 [%0], {%1, %2, %3, %4};\n"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Rows [r0, r0 + ROWS) x the head dim of a fp16 tile, global -> shared (row stride ST);
// rows >= n and chunks past head_dim are zeros. Synchronous: the caller syncs. BATCH > 0:
// at most BATCH 16-byte loads per thread in flight (see ld_global_ordered).
template <int ROWS, int THREADS, int D, int ST, int BATCH>
__device__ __forceinline__ void copy_tile(__half* s, const __half* g, int64_t row_stride,
                                          int r0, int n, int head_dim, int tid) {
  constexpr int CH = D / 8, TOTAL = ROWS * CH, IT = (TOTAL + THREADS - 1) / THREADS;
  constexpr int B = BATCH == 0 || BATCH > IT ? IT : BATCH;
  // unrolled in full up to 16 loads per thread; beyond (d512's dQ kernel, one warp: 32)
  // ptxas kept every load's address live across the key loop and spilled
#pragma unroll(IT > 16 ? 4 : IT)
  for (int i0 = 0; i0 < IT; i0 += B) {
    uint4 v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const int idx = tid + (i0 + j) * THREADS;
      v[j] = make_uint4(0, 0, 0, 0);
      if (i0 + j < IT && (TOTAL % THREADS == 0 || idx < TOTAL)) {
        const int row = idx / CH, c = idx % CH;
        if (r0 + row < n && c * 8 < head_dim) {
          const __half* src = g + (int64_t)(r0 + row) * row_stride + c * 8;
          if constexpr (BATCH != 0)
            v[j] = ld_global_ordered(src);
          else
            v[j] = __ldg(reinterpret_cast<const uint4*>(src));
        }
      }
    }
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const int idx = tid + (i0 + j) * THREADS;
      if (i0 + j < IT && (TOTAL % THREADS == 0 || idx < TOTAL)) {
        const int row = idx / CH, c = idx % CH;
        if constexpr (BATCH != 0)
          st_generic_ordered(s + row * ST + c * 8, v[j]);
        else
          *reinterpret_cast<uint4*>(s + row * ST + c * 8) = v[j];
      }
    }
  }
}

// A 16-byte / 4-byte load issued where it is written: volatile asm keeps it ahead of the
// tile's ldmatrix / mma (volatile too), so it is in flight while they run; nothing waits
// for it until its registers are stored.
__device__ __forceinline__ uint4 ld_global_early(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(__cvta_generic_to_global(p)));
  return v;
}
__device__ __forceinline__ float ld_global_early(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(v) : "l"(__cvta_generic_to_global(p)));
  return v;
}

// Rows [r0, r0 + ROWS) x the head dim of a fp16 tile held in registers between load
// (global) and store (shared, row stride ST); rows >= n and chunks past head_dim are zeros.
template <int ROWS, int THREADS, int D>
struct RowsInRegs {
  static constexpr int CH = D / 8, TOTAL = ROWS * CH, IT = (TOTAL + THREADS - 1) / THREADS;
  uint4 v[IT];
  __device__ __forceinline__ void load(const __half* g, int64_t row_stride, int r0, int n,
                                       int head_dim, int tid) {
#pragma unroll
    for (int j = 0; j < IT; ++j) {
      const int idx = tid + j * THREADS, row = idx / CH, c = idx % CH;
      v[j] = make_uint4(0, 0, 0, 0);
      if ((TOTAL % THREADS == 0 || idx < TOTAL) && r0 + row < n && c * 8 < head_dim)
        v[j] = ld_global_early(g + (int64_t)(r0 + row) * row_stride + c * 8);
    }
  }
  template <int ST>
  __device__ __forceinline__ void store(__half* s, int tid) const {
#pragma unroll
    for (int j = 0; j < IT; ++j) {
      const int idx = tid + j * THREADS;
      if (TOTAL % THREADS == 0 || idx < TOTAL)
        *reinterpret_cast<uint4*>(s + (idx / CH) * ST + (idx % CH) * 8) = v[j];
    }
  }
};

// The K and V rows [r0, r0 + ROWS) of the dQ kernel's next key tile, in registers
// (C::kDqPrefetch): loaded while the current tile computes, stored after the next barrier.
template <int ROWS, int THREADS, int D>
struct KeyTilesInRegs {
  RowsInRegs<ROWS, THREADS, D> k, v;
  __device__ __forceinline__ void load(const __half* kg, const __half* vg, int64_t k_stride,
                                       int64_t v_stride, int r0, int n, int head_dim, int tid) {
    k.load(kg, k_stride, r0, n, head_dim, tid);
    v.load(vg, v_stride, r0, n, head_dim, tid);
  }
  template <int ST>
  __device__ __forceinline__ void store(__half* sk, __half* sv, int tid) const {
    k.template store<ST>(sk, tid);
    v.template store<ST>(sv, tid);
  }
};

// The two per-tile conditions of the elementwise P / dS step, softcap (a run-time
// parameter) and the mask (SM7X_FA2_TILE_NEEDS_MASK): with_score_flags(cap, masked, f) calls
// f(ScoreFlags<CAP, MASK>{}) for the case at hand, so each case's loop is straight-line
// code. Tested per element inside one loop, the mask test compiled to one branch per
// element (each cutting the loop into blocks ptxas cannot schedule across) and softcap to
// predicated instructions issued even when it is off.
template <bool CAP, bool MASK>
struct ScoreFlags {
  __device__ __forceinline__ constexpr bool cap() const { return CAP; }
  __device__ __forceinline__ constexpr bool mask() const { return MASK; }
};
template <class F>
__device__ __forceinline__ void with_score_flags(bool cap, bool masked, F&& f) {
  if (cap) {
    if (masked) f(ScoreFlags<true, true>{}); else f(ScoreFlags<true, false>{});
  } else {
    if (masked) f(ScoreFlags<false, true>{}); else f(ScoreFlags<false, false>{});
  }
}
// P of one score in the elementwise P / dS step of every backward kernel: the score the
// softmax saw (softcap * tanh(s * cap_in) with softcap), -inf where the mask hides the key
// (visible() is only called in a masked case), exp2 against the row's LSE in base 2. deriv:
// the factor dS takes from the softcap (1 - tanh^2; 1 without softcap).
template <class Flags, class Visible>
__device__ __forceinline__ float score_prob(const Flags& flags, float s, const SoftmaxScale& sc,
                                            float softcap, float lse2, Visible&& visible,
                                            float& deriv) {
  deriv = 1.f;
  if (flags.cap()) {
    const float th = fast_tanh(s * sc.cap_in);
    deriv = 1.f - th * th;
    s = softcap * th;
  }
  if (flags.mask() && !visible()) s = -INFINITY;
  return fast_exp2(fmaf(s, sc.sl2, -lse2));
}

// LSE in base 2 for exp2: rows past the sequence and rows that saw no key (the forward
// writes +inf; -inf or NaN treated alike) get +inf, so that their P, and with it every
// gradient they add, is exactly 0.
__device__ __forceinline__ float lse_log2(float lse) {
  return (lse > -INFINITY && lse < INFINITY) ? lse * 1.4426950408889634f : INFINITY;
}

// Query rows [m_lo, m_hi) that see one of keys [n0, n_last] (bottom-right aligned window:
// row i sees key j iff i + off - left <= j <= i + off + right, off = sk - sq).
__device__ __forceinline__ void query_range(const FwdParams& p, int n0, int n_last, int sq,
                                            int off, int& m_lo, int& m_hi) {
  m_lo = 0;
  m_hi = sq;
  if (p.window_right >= 0) m_lo = max(0, n0 - off - p.window_right);
  if (p.window_left >= 0) m_hi = min(sq, n_last - off + p.window_left + 1);
}

// One query tile of the main kernel's loop (query head h, rows m0 .. m0 + BM - 1) into shared
// memory: Q, dO [BM][D + 8], base-2 LSE and dsum [BM] (DSUM false: no dsum, the dV pass). With
// C::kPrefetch, load() fills registers that store() writes out after the next barrier;
// without, store() copies synchronously (load() does nothing).
template <class C, bool DSUM>
struct QueryTile {
  static constexpr int BM = C::kBlockM, T = C::kThreads, D = C::kHeadDim, ST = C::kStride;
  struct Regs {
    RowsInRegs<BM, T, D> q, dout;
    float lse2, dsum;
  };
  struct None {};
  using Held = typename std::conditional<C::kPrefetch, Regs, None>::type;
  Held held;
  int h, m0;  // the tile in flight (prefetch) or to copy

  // The step after the current one in the flat (query head of the group, query tile) loop:
  // the next tile of this head, or tile t_lo of the next head (no division by the tile
  // count: it cost ~30 instructions per step).
  __device__ __forceinline__ void load_next(const BwdParams& p, const BwdSequence& rows, int t_lo,
                                            int t_hi, int tid) {
    const bool next_head = m0 + BM >= t_hi * BM;
    load(p, rows, next_head ? h + 1 : h, next_head ? t_lo * BM : m0 + BM, tid);
  }

  __device__ __forceinline__ void load(const BwdParams& p, const BwdSequence& rows, int h_, int m0_,
                                       int tid) {
    h = h_;
    m0 = m0_;
    if constexpr (C::kPrefetch) {
      held.q.load(static_cast<const __half*>(p.q) +
                      q_like(rows, h, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                  p.q_row_stride, m0, rows.sq, p.head_dim, tid);
      held.dout.load(static_cast<const __half*>(p.dout) +
                         q_like(rows, h, p.do_batch_stride, p.do_row_stride, p.do_head_stride),
                     p.do_row_stride, m0, rows.sq, p.head_dim, tid);
      const int r = m0 + tid;
      held.lse2 = INFINITY;
      held.dsum = 0.f;
      if (tid < BM && r < rows.sq) {
        held.lse2 = ld_global_early(p.lse + q_like(rows, h, p.lse_batch_stride, 1, p.lse_head_stride) + r);
        if (DSUM) held.dsum = ld_global_early(p.dsum + q_like(rows, h, p.dsum_batch_stride, 1, p.dsum_head_stride) + r);
      }
    }
  }

  __device__ __forceinline__ void store(const BwdParams& p, const BwdSequence& rows, __half* sQ,
                                        __half* sdO, float* sL, float* sD, int tid) const {
    if constexpr (C::kPrefetch) {
      held.q.template store<ST>(sQ, tid);
      held.dout.template store<ST>(sdO, tid);
      if (tid < BM) {
        sL[tid] = lse_log2(held.lse2);
        if constexpr (DSUM) sD[tid] = held.dsum;
      }
    } else {
      copy_tile<BM, T, D, ST, C::kCopyBatch>(sQ, static_cast<const __half*>(p.q) +
                                      q_like(rows, h, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                              p.q_row_stride, m0, rows.sq, p.head_dim, tid);
      copy_tile<BM, T, D, ST, C::kCopyBatch>(sdO, static_cast<const __half*>(p.dout) +
                                       q_like(rows, h, p.do_batch_stride, p.do_row_stride, p.do_head_stride),
                              p.do_row_stride, m0, rows.sq, p.head_dim, tid);
      if (tid < BM) {
        const int r = m0 + tid;
        sL[tid] = r < rows.sq ? lse_log2(p.lse[q_like(rows, h, p.lse_batch_stride, 1, p.lse_head_stride) + r])
                              : INFINITY;
        if constexpr (DSUM)
          sD[tid] = r < rows.sq ? p.dsum[q_like(rows, h, p.dsum_batch_stride, 1, p.dsum_head_stride) + r]
                                : 0.f;
      }
    }
  }
};

// The dV pass of a split backward may run more keys per CTA than the dK/dQ pass (its tiles
// are smaller: no V, no dS^T): its config must be the main one with another block_n.
template <class C, class CDv>
constexpr bool same_but_block_n() {
  return C::kHeadDim == CDv::kHeadDim && C::kBlockM == CDv::kBlockM && C::kSplit == CDv::kSplit &&
         C::kPrefetch == CDv::kPrefetch && C::kVInRegs == CDv::kVInRegs &&
         C::kMinBlocks == CDv::kMinBlocks && C::kDqBlockM == CDv::kDqBlockM &&
         C::kDqBlockN == CDv::kDqBlockN && C::kDqPass == CDv::kDqPass;
}

// Grid (key blocks, kv heads, batch) of the main kernel in mode MODE (BwdMode): seqlen_k is
// max_seqlen_k for varlen.
template <class C, int MODE, class Kernel>
int launch_bwd(Kernel kernel, const BwdParams& p, cudaStream_t stream) {
  const int nblocks = (p.seqlen_k + C::kBlockN - 1) / C::kBlockN;
  if (nblocks == 0 || p.batch == 0 || p.kv_heads == 0) return 0;
  return launch_on(kernel, dim3(nblocks, p.kv_heads, p.batch), C::kThreads,
                   C::smem_bytes(MODE), p, stream);
}

// Grid (query blocks, heads, batch) of the deterministic dQ kernel.
template <class C, class Kernel>
int launch_bwd_dq(Kernel kernel, const BwdParams& p, cudaStream_t stream) {
  const int mblocks = (p.seqlen_q + C::kDqBlockM - 1) / C::kDqBlockM;
  if (mblocks == 0 || p.batch == 0 || p.heads == 0) return 0;
  return launch_on(kernel, dim3(mblocks * (C::kHeadDim / C::kDqCols), p.heads, p.batch),
                   C::kDqThreads, C::kDqSmemBytes, p, stream);
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
