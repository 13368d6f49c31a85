// FlashAttention-2 backward for Turing (sm_75): the math of the two passes whose bodies
// common/bwd_kernel.cuh holds (BwdMainOps, BwdDqOps), in mma.m16n8k8 + ldmatrix as the
// forward (fwd_kernel.cuh). Algorithm: common/bwd_common.cuh. The sm75-only features stay
// here: the dim split, K/V as A fragments in registers (v_in_regs), dQ in chunks.
//
// bwd_kernel: one CTA per (BN keys, kv head, batch), warp w owning keys 16w .. 16w + 15
// (with a dim split of KS, warps KS w .. KS w + KS - 1 own them, each 1 / KS of the head
// dim: the partial S^T / dP^T are summed through shared memory, common/dim_split.cuh), so
// everything is computed transposed (keys are the MMA rows):
//   S^T = K Q^T, dP^T = V dO^T   A = the warp's K / V rows (ldmatrix), B = Q / dO as stored
//   P^T, dS^T                    elementwise in the accumulators (LSE, dsum per column)
//   dV += P^T dO, dK += dS^T Q   P^T / dS^T packed to fp16 are the A fragments (as P in
//                                the forward), B = dO / Q through ldmatrix.trans
//   dQ += dS K                   dS^T staged in shared memory (fp16), read back as A with
//                                ldmatrix.trans; fp32 atomics into dq_accum
// bwd_dq_kernel (deterministic): one CTA per (DQ_BM queries, head, batch, dQ column part),
// warp = 16 query rows, as the forward: S = Q K^T, dP = dO V^T, dS, dQ += dS K in
// registers, key tiles in ascending order; writes dq itself (fp16, times the scale). At
// d512 (kDqVInRegs) V's B fragments come from global memory, not a V tile.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/bwd_common.cuh"
#include "common/bwd_kernel.cuh"
#include "common/dim_split.cuh"
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/softmax.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace sm75 {

template <int D, int BN, int BM, int DQ_BM, int DQ_BN, bool SPLIT, bool PREFETCH = false,
          int MIN_BLOCKS = 1, bool V_IN_REGS = false, int KS = 1, bool DQ_PASS = false>
struct BwdConfig : BwdShape<D, BN, BM, DQ_BM, DQ_BN, SPLIT, PREFETCH, MIN_BLOCKS, V_IN_REGS, KS, DQ_PASS> {
  using S = BwdShape<D, BN, BM, DQ_BM, DQ_BN, SPLIT, PREFETCH, MIN_BLOCKS, V_IN_REGS, KS, DQ_PASS>;
  // K, V [BN][D + 8], Q, dO [BM][D + 8], dS^T [BN][BM + 8] fp16; LSE, dsum [BM] fp32. The dV
  // pass of a split backward (mode kBwdDv) has no V, dS^T or dsum, and with V_IN_REGS no K
  // (S::k_rows, S::v_rows, S::ds_rows): less shared memory and no K tile to copy.
  __host__ __device__ static constexpr int tile_bytes(int mode) {
    return (S::k_rows(mode) + S::v_rows(mode) + 2 * BM) * S::kStride * 2 + S::ds_rows(mode) * S::kDsStride * 2 +
           (mode == detail::kBwdDv ? 1 : 2) * BM * 4;
  }
  // dim split: then, from exchange_offset (16-byte aligned), one exchange slot per warp: its
  // partial S^T (and dP^T but in the dV pass), a float4 per lane and n8 tile
  __host__ __device__ static constexpr int exchange_floats4(int mode) {
    return KS > 1 ? (mode == detail::kBwdDv ? 1 : 2) * (BM / 8) * 32 : 0;
  }
  __host__ __device__ static constexpr int exchange_offset(int mode) {
    return (tile_bytes(mode) + 15) / 16 * 16;
  }
  __host__ __device__ static constexpr int smem_bytes(int mode) {
    return KS > 1 ? exchange_offset(mode) + S::kWarps * exchange_floats4(mode) * 16 : tile_bytes(mode);
  }
  static constexpr int kSmemBytes = smem_bytes(detail::kBwdAll);
  // Q, dO [DQ_BM][D + 8] (none with kDqQInRegs), K, V [DQ_BN][D + 8] (no V tile with kDqVInRegs)
  static constexpr int kDqSmemBytes =
      ((S::kDqQInRegs ? 0 : 2 * DQ_BM) + (S::kDqVInRegs ? 1 : 2) * DQ_BN) * S::kStride * 2;
  // dQ of a query tile: BM / 16 slices x D / 8 n8 tiles spread over the warps
  static constexpr int kSlices = BM / 16;
  static constexpr int kWarpsPerSlice = S::kWarps >= kSlices ? S::kWarps / kSlices : 1;
  static constexpr int kSlicesPerWarp = S::kWarps >= kSlices ? 1 : kSlices / S::kWarps;
  static constexpr int kDqTiles = D / 8 / kWarpsPerSlice;  // n8 tiles per warp and slice
  // n8 tiles accumulated at a time (pairs: one ldmatrix.x4.trans of K feeds two)
  // (odd counts: the last tile through ldmatrix.x2.trans)
  static constexpr int kDqChunk =
      kDqTiles % 8 == 0 ? 8 : kDqTiles % 4 == 0 ? 4 : kDqTiles % 2 == 0 ? 2 : kDqTiles;
  static_assert(S::kWarps % kSlices == 0 || kSlices % S::kWarps == 0,
                "warps and query slices of a tile must divide one another");
  static_assert(D / 8 % kWarpsPerSlice == 0, "dQ: the warps of a slice split its n8 tiles evenly");
};

// The A fragment of k16 step kt from x (P^T, dS^T or dS in fp32 accumulators, n8 tiles)
// packed to fp16: the accumulator layout of two n8 tiles is the A layout (as P in the forward).
template <int N>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&x)[N][4], int kt) {
  a[0] = detail::pack_half2(x[2 * kt][0], x[2 * kt][1]);
  a[1] = detail::pack_half2(x[2 * kt][2], x[2 * kt][3]);
  a[2] = detail::pack_half2(x[2 * kt + 1][0], x[2 * kt + 1][1]);
  a[3] = detail::pack_half2(x[2 * kt + 1][2], x[2 * kt + 1][3]);
}

// acc (M n8 tiles of columns) += A x B, B's 16 rows at addr read with ldmatrix.trans (stored
// [k][n]), 16 columns per step.
template <int M>
__device__ __forceinline__ void mma_trans(float (&acc)[M][4], const uint32_t (&a)[4], uint32_t addr) {
#pragma unroll
  for (int dn = 0; dn < M / 2; ++dn) {
    uint32_t b[4];
    detail::ldmatrix_x4_trans(b, addr + dn * 32);
    detail::mma_k16(acc[2 * dn], acc[2 * dn + 1], a, b);
  }
}

// The main pass's math (common/bwd_kernel.cuh bwd_main_body), everything transposed (keys
// are the MMA rows): this warp's 16 keys (kw), with a dim split its half of the columns (c0).
template <class C, int MODE>
struct BwdMainOps {
  using Config = C;
  static constexpr int kMode = MODE;
  static constexpr int kScratchBytes = 0;  // LSE, dsum right after dS^T
  static constexpr int D = C::kHeadDim, BN = C::kBlockN, BM = C::kBlockM, ST = C::kStride;
  static constexpr int KS = C::kDimSplit, DW = D / KS;  // DW: the columns of dK / dV a warp holds
  static constexpr int SD = C::kDsStride, NQ = BM / 8, DT = DW / 8;
  // kk loops unrolled by 2: the next slice's ldmatrix overlaps this one's mma (measured 1-4%
  // faster at d80-d128); full unrolling only adds registers, and d256 has none to spare
  static constexpr int KKU = D >= 256 ? 1 : 2;
  static constexpr bool kDv = MODE != detail::kBwdDkDq, kDk = MODE != detail::kBwdDv;
  static constexpr bool kVRegs = C::kVInRegs && kDk;  // V as A fragments in registers, no sV
  // the dV pass of such a config holds K the same way (S^T = K Q^T is its only use of K)
  static constexpr bool kKRegs = C::kVInRegs && MODE == detail::kBwdDv;
  static constexpr bool kARegs = kVRegs || kKRegs;

  // S^T (then P^T) and dP^T (then dS^T) of one query tile, in the accumulators
  struct Scores {
    float st[NQ][4], dpt[kDk ? NQ : 1][4];
  };

  const int warp, lane;
  const int kw, c0;  // kw: this warp's 16 keys; c0: its first column (dim split)
  const int g, tig;
  float dk[kDk ? DT : 1][4], dv[kDv ? DT : 1][4];
  int a_frag, b_frag, bt_frag, ds_frag, key0;
  uint32_t tQ, tdO;  // this tile's Q and dO as B stored [k][n] (ldmatrix .trans)
  detail::PairSlots xs;
  const float4* xfirst;  // KS = 4: the group's first exchange slot (sum_partials)
  uint32_t afrag[kARegs ? DW / 16 : 1][4];

  __device__ __forceinline__ BwdMainOps(unsigned char*, int warp_, int lane_)
      : warp(warp_), lane(lane_), kw(warp_ / KS), c0(KS > 1 ? (warp_ % KS) * DW : 0),
        g(lane_ >> 2), tig(lane_ & 3) {}

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < (kDk ? DT : 1); ++i) dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
#pragma unroll
    for (int i = 0; i < (kDv ? DT : 1); ++i) dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
  }

  __device__ __forceinline__ void begin(const BwdParams& p, const detail::BwdSequence& rows, int hk,
                                        int n0, int sk, int head_dim, unsigned char* smem_raw) {
    using namespace detail;
    // ldmatrix lane addresses (see fwd_kernel.cuh): A rows of this warp; B stored [n][k];
    // B stored [k][n] (.trans); dS A stored [k][m] (.trans)
    a_frag = (kw * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8 + c0;
    b_frag = ((lane & 7) + (lane >> 4) * 8) * ST + ((lane >> 3) & 1) * 8 + c0;
    bt_frag = ((lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;
    ds_frag = ((lane & 7) + (lane >> 4) * 8) * SD + ((lane >> 3) & 1) * 8;
    key0 = n0 + kw * 16 + g;  // this thread's keys: key0, key0 + 8
    // dim split: the exchange slots (common/dim_split.cuh), S^T then dP^T; the KS warps of
    // 16 keys meet at named barrier 1 + kw
    if constexpr (KS > 1) {
      xs = pair_slots(smem_raw + C::exchange_offset(MODE), warp, C::exchange_floats4(MODE), lane);
      xfirst = xs.mine - (warp % KS) * C::exchange_floats4(MODE);  // as the forward's
    }
    // kARegs: the A fragments of V's (kVRegs) or K's (kKRegs) 16 x D block of this warp
    // straight from global memory, as ldmatrix_x4 at aV / aK + kk * 32 would give them (r:
    // rows +0/+8, columns +0/+8 of slice kk); 32-bit loads, once per CTA. Keys past sk and
    // columns past head_dim are zeros.
    if constexpr (kARegs) {
      const __half* const ag =
          kKRegs ? static_cast<const __half*>(p.k) +
                       k_like(rows, hk, p.k_batch_stride, p.k_row_stride, p.k_head_stride)
                 : static_cast<const __half*>(p.v) +
                       k_like(rows, hk, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
      const int64_t a_stride = kKRegs ? p.k_row_stride : p.v_row_stride;
#pragma unroll
      for (int kk = 0; kk < DW / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int key = key0 + (r & 1) * 8, col = c0 + kk * 16 + (r >> 1) * 8 + tig * 2;
          afrag[kk][r] = key < sk && col < head_dim
                             ? __ldg(reinterpret_cast<const unsigned int*>(
                                   ag + (int64_t)key * a_stride + col))
                             : 0u;
        }
    }
  }

  // The 16 x 16 A fragment of head-dim slice kk of this warp's K or V rows: held in
  // registers (REGS: afrag) or loaded with ldmatrix from base
  template <bool REGS>
  __device__ __forceinline__ void load_a(uint32_t (&a)[4], int kk, uint32_t base) const {
    if constexpr (REGS) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = afrag[kk][r];
    } else {
      detail::ldmatrix_x4(a, base + kk * 32);
    }
  }
  // acc (the tile's BM queries, n8 tiles) += A x B over slice kk, B the BM rows at b as
  // stored ([query][d]): each B fragment feeds one MMA pair
  __device__ __forceinline__ static void mma_rows(float (&acc)[NQ][4], const uint32_t (&a)[4],
                                                  uint32_t b, int kk) {
#pragma unroll
    for (int nn = 0; nn < BM / 16; ++nn) {
      uint32_t bb[4];
      detail::ldmatrix_x4(bb, b + (nn * 16 * ST + kk * 16) * 2);
      detail::mma_k16(acc[2 * nn], acc[2 * nn + 1], a, bb);
    }
  }
  // ---- S^T = K Q^T, dP^T = V dO^T (each B fragment feeds one MMA pair)
  __device__ __forceinline__ void scores(Scores& t, const __half* sK, const __half* sV,
                                         const __half* sQ, const __half* sdO) {
    using namespace detail;
    auto& st = t.st;
    auto& dpt = t.dpt;
    const uint32_t aK = smem_addr(sK + a_frag), aV = smem_addr(sV + a_frag);
    const uint32_t bQ = smem_addr(sQ + b_frag), bdO = smem_addr(sdO + b_frag);
    tQ = smem_addr(sQ + bt_frag + c0);
    tdO = smem_addr(sdO + bt_frag + c0);
#pragma unroll
    for (int i = 0; i < NQ; ++i) st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.f;
#pragma unroll
    for (int i = 0; i < (kDk ? NQ : 1); ++i) dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.f;
    // fully unrolled with kARegs: afrag[kk] must be a register, not re-loaded per tile
#pragma unroll(kARegs ? DW / 16 : KKU)
    for (int kk = 0; kk < DW / 16; ++kk) {
      uint32_t ak[4];
      load_a<kKRegs>(ak, kk, aK);
      mma_rows(st, ak, bQ, kk);
      if constexpr (kDk) {
        uint32_t av[4];
        load_a<kVRegs>(av, kk, aV);
        mma_rows(dpt, av, bdO, kk);
      }
    }
    if constexpr (KS > 1) {
      // S^T, dP^T = this warp's partials + the others' of its group (KS = 2: the partner's
      // added; KS = 4: all four slots summed in warp order, so that the four hold the same
      // sum). A slot is rewritten next tile only after the loop's first barrier, which the
      // others reach after their reads.
      if constexpr (kDk) put_partial(xs.mine, st, dpt); else put_partial(xs.mine, st);
      named_barrier(1 + kw, 32 * KS);
      if constexpr (KS == 2) {
        if constexpr (kDk) add_partial(st, dpt, xs.peer); else add_partial(st, xs.peer);
      } else {
        constexpr int slot = C::exchange_floats4(MODE);
        sum_partials<KS>(st, xfirst, slot);
        if constexpr (kDk) sum_partials<KS>(dpt, xfirst + NQ * 32, slot);
      }
    }
  }

  // ---- P^T = exp2(S^T sl2 - LSE2), dS^T = P^T (dP^T - dsum) (1 - tanh^2); element e of
  // n8 tile i: key key0 + (e >> 1) * 8, query m0 + 8i + 2 tig + (e & 1)
  // What the elementwise step needs of this thread (the step runs inside with_score_flags'
  // lambda, which then captures this small struct instead of the whole Ops)
  struct Pos {
    int key0, tig;
  };
  __device__ __forceinline__ Pos pos() const { return {key0, tig}; }

  template <class Flags>
  __device__ __forceinline__ static void probs(const Pos& pos, Scores& t, const Flags& flags,
                                               const BwdParams& p,
                                        const detail::SoftmaxScale& sc, const float* sL,
                                        const float* sD, __half*, int, int m0, int sk, int off,
                                        int left, int right) {
    using namespace detail;
    auto& st = t.st;
    auto& dpt = t.dpt;
    const int key0 = pos.key0, tig = pos.tig;
#pragma unroll
    for (int i = 0; i < NQ; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = i * 8 + tig * 2 + (e & 1);
        float deriv;
        const float pr = score_prob(flags, st[i][e], sc, p.softcap, sL[qi], [&] {
          return key_visible(key0 + (e >> 1) * 8, m0 + qi, sk, off, left, right);
        }, deriv);
        st[i][e] = pr;
        if constexpr (kDk) dpt[i][e] = pr * (dpt[i][e] - sD[qi]) * deriv;
      }
  }

  // ---- dV += P^T dO, dK += dS^T Q (k = queries, 16 at a time): P^T / dS^T packed to fp16
  // are the A fragments
  __device__ __forceinline__ void accumulate(const Scores& t, const __half*, const __half*,
                                             __half* sdS, bool dq_atomic) {
    using namespace detail;
    auto& st = t.st;
    auto& dpt = t.dpt;
#pragma unroll
    for (int kt = 0; kt < BM / 16; ++kt) {
      if constexpr (kDv) {
        uint32_t a[4];
        pack_a(a, st, kt);
        mma_trans(dv, a, tdO + kt * 16 * ST * 2);
      }
      if constexpr (kDk) {
        uint32_t a[4];
        pack_a(a, dpt, kt);
        mma_trans(dk, a, tQ + kt * 16 * ST * 2);
        // dS^T -> shared memory, this warp's 16 key rows (dim split: the pair holds the
        // same dS^T, the first warp writes it)
        if (dq_atomic && c0 == 0) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int i = 2 * kt + j;
            *reinterpret_cast<uint32_t*>(sdS + (kw * 16 + g) * SD + i * 8 + tig * 2) =
                pack_half2(dpt[i][0], dpt[i][1]);
            *reinterpret_cast<uint32_t*>(sdS + (kw * 16 + g + 8) * SD + i * 8 + tig * 2) =
                pack_half2(dpt[i][2], dpt[i][3]);
          }
        }
      }
    }
  }

  // ---- dQ += dS K: the tile's BM / 16 query slices x D / 8 n8 tiles over the warps
  // (kSlicesPerWarp, kDqTiles), kDqChunk n8 tiles accumulated at a time
  __device__ __forceinline__ void dq_atomic(const BwdParams& p, const detail::BwdSequence& rows,
                                            int h, int m0, int sq, const __half* sK,
                                            const __half* sdS) {
    using namespace detail;
    const int head_dim = p.head_dim;
    const uint32_t tK = smem_addr(sK + bt_frag), aS = smem_addr(sdS + ds_frag);
    float* const acc = p.dq_accum + q_like(rows, h, p.acc_batch_stride, p.acc_row_stride, head_dim);
#pragma unroll
    for (int si = 0; si < C::kSlicesPerWarp; ++si) {
      const int slice = C::kWarps >= C::kSlices ? warp / C::kWarpsPerSlice
                                                : warp * C::kSlicesPerWarp + si;
      const int tile0 = C::kWarps >= C::kSlices ? (warp % C::kWarpsPerSlice) * C::kDqTiles : 0;
      const int row = m0 + slice * 16 + g;
#pragma unroll 1
      for (int c0 = 0; c0 < C::kDqTiles; c0 += C::kDqChunk) {
        float a[C::kDqChunk][4];
#pragma unroll
        for (int j = 0; j < C::kDqChunk; ++j) a[j][0] = a[j][1] = a[j][2] = a[j][3] = 0.f;
#pragma unroll
        for (int kt = 0; kt < BN / 16; ++kt) {
          uint32_t as[4];
          ldmatrix_x4_trans(as, aS + (kt * 16 * SD + slice * 16) * 2);
#pragma unroll
          for (int j = 0; j < C::kDqChunk / 2; ++j) {
            uint32_t bk[4];
            ldmatrix_x4_trans(bk, tK + (kt * 16 * ST + (tile0 + c0 + 2 * j) * 8) * 2);
            mma_k16(a[2 * j], a[2 * j + 1], as, bk);
          }
          if constexpr (C::kDqChunk % 2 == 1) {  // the odd last n8 tile
            uint32_t bk[2];
            ldmatrix_x2_trans(bk, tK + (kt * 16 * ST + (tile0 + c0 + C::kDqChunk - 1) * 8) * 2);
            mma_m16n8k8(a[C::kDqChunk - 1], as[0], as[1], bk[0]);
            mma_m16n8k8(a[C::kDqChunk - 1], as[2], as[3], bk[1]);
          }
        }
        // this thread's dQ elements: rows row, row + 8, columns col0 + 8j, + 1. A chunk
        // wholly inside dq takes its atomics unconditionally at constant offsets from two
        // row pointers; tested one by one, each became a branch that rebuilt its address.
        const int col0 = (tile0 + c0) * 8 + tig * 2;
        float* const r0 = acc + (int64_t)row * p.acc_row_stride + col0;
        float* const r8 = r0 + 8 * p.acc_row_stride;
        if (row + 8 < sq && (tile0 + c0 + C::kDqChunk) * 8 <= head_dim) {
#pragma unroll
          for (int j = 0; j < C::kDqChunk; ++j) {
            atomicAdd(r0 + j * 8, a[j][0]);
            atomicAdd(r0 + j * 8 + 1, a[j][1]);
            atomicAdd(r8 + j * 8, a[j][2]);
            atomicAdd(r8 + j * 8 + 1, a[j][3]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < C::kDqChunk; ++j) {
            if (col0 + j * 8 < head_dim) {
              if (row < sq) {
                atomicAdd(r0 + j * 8, a[j][0]);
                atomicAdd(r0 + j * 8 + 1, a[j][1]);
              }
              if (row + 8 < sq) {
                atomicAdd(r8 + j * 8, a[j][2]);
                atomicAdd(r8 + j * 8 + 1, a[j][3]);
              }
            }
          }
        }
      }
    }
  }

  // ---- dK (times the scale), dV: fp16 straight from the accumulators; keys without a
  // query that sees them write zeros
  // The column test reads p.head_dim, not the body's head_dim: with that value nvcc merged it
  // with the A-fragment loads' tests (kARegs) and kept their predicates live across the query
  // loop (d128 dK pass: 255 registers instead of 244).
  __device__ __forceinline__ void store(const BwdParams& p, const detail::BwdSequence& rows, int hk,
                                        int, int sk, int) {
    using namespace detail;
    const float scale = p.scale;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int key = key0 + hr * 8;
      if (key >= sk) continue;
      __half* const dkr = static_cast<__half*>(p.dk) +
                          k_like(rows, hk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) +
                          (int64_t)key * p.dk_row_stride;
      __half* const dvr = static_cast<__half*>(p.dv) +
                          k_like(rows, hk, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride) +
                          (int64_t)key * p.dv_row_stride;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        const int col = c0 + i * 8 + tig * 2;
        if (col >= p.head_dim) continue;
        if constexpr (kDk)
          *reinterpret_cast<uint32_t*>(dkr + col) =
              pack_half2(dk[i][2 * hr] * scale, dk[i][2 * hr + 1] * scale);
        if constexpr (kDv)
          *reinterpret_cast<uint32_t*>(dvr + col) = pack_half2(dv[i][2 * hr], dv[i][2 * hr + 1]);
      }
    }
  }
};

// The dQ pass's math (common/bwd_kernel.cuh bwd_dq_body), as the forward: warp = 16 query
// rows, S = Q K^T, dP = dO V^T, dS, dQ += dS K in registers (dS packed to fp16 is the A
// fragment, as P in the forward).
template <class C>
struct BwdDqOps {
  using Config = C;
  static constexpr int D = C::kHeadDim, BM = C::kDqBlockM, BN = C::kDqBlockN, ST = C::kStride;
  static constexpr int NT = BN / 8, DC = C::kDqCols, DT = DC / 8;
  static constexpr int KKU = 1;  // kk loops: full unrolling only adds registers

  const int warp, lane, g, tig;
  int r0;  // this thread's rows r0, r0 + 8: LSE (base 2) and dsum
  float l2[2], dsum[2];
  int a_frag, b_frag, bt_frag;
  float dq[DT][4];
  // kDqQInRegs: this warp's 16 rows of Q and dO as A fragments (q_fragments)
  uint32_t qfrag[C::kDqQInRegs ? D / 16 : 1][4], dofrag[C::kDqQInRegs ? D / 16 : 1][4];
  // kDqVInRegs: this thread's two V rows of the key tile in global memory (keys +g, +g + 8,
  // from column 2 tig; null past the keys) and the head dim (v_tile)
  const unsigned int* vrow[2] = {nullptr, nullptr};
  int vcols = 0;
  // S (then unused) and dP (then dS) of one key tile, in the accumulators
  struct Scores {
    float s[NT][4], dp[NT][4];
  };

  __device__ __forceinline__ BwdDqOps(unsigned char*, int warp_, int lane_)
      : warp(warp_), lane(lane_), g(lane_ >> 2), tig(lane_ & 3) {}

  __device__ __forceinline__ void row_stats(const BwdParams& p, const detail::BwdSequence& rows,
                                            int h, int m0, int sq) {
    using namespace detail;
    r0 = m0 + warp * 16 + g;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = r0 + hr * 8;
      l2[hr] = r < sq ? lse_log2(p.lse[rows.qb * p.lse_batch_stride + h * p.lse_head_stride +
                                       rows.qs + r])
                      : INFINITY;
      dsum[hr] = r < sq ? p.dsum[rows.qb * p.dsum_batch_stride + h * p.dsum_head_stride +
                               rows.qs + r]
                      : 0.f;
    }
  }

  __device__ __forceinline__ void begin() {
    a_frag = (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;
    b_frag = ((lane & 7) + (lane >> 4) * 8) * ST + ((lane >> 3) & 1) * 8;
    bt_frag = ((lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;
#pragma unroll
    for (int i = 0; i < DT; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
  }

  // kDqQInRegs: the A fragments of this warp's 16 rows of Q and dO straight from global
  // memory, as ldmatrix_x4 at aQ / adO + kk * 32 would give them (r: rows +0/+8, columns
  // +0/+8 of slice kk); rows past sq and columns past head_dim are zeros. Once per CTA.
  __device__ __forceinline__ void q_fragments(const __half* q, int64_t q_stride, const __half* dout,
                                              int64_t do_stride, int sq, int head_dim) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = r0 + (r & 1) * 8, col = kk * 16 + (r >> 1) * 8 + tig * 2;
        const bool in = row < sq && col < head_dim;
        qfrag[kk][r] = in ? __ldg(reinterpret_cast<const unsigned int*>(q + (int64_t)row * q_stride + col)) : 0u;
        dofrag[kk][r] =
            in ? __ldg(reinterpret_cast<const unsigned int*>(dout + (int64_t)row * do_stride + col)) : 0u;
      }
  }

  // kDqVInRegs: the key tile's V is read from global memory in scores (no V tile)
  __device__ __forceinline__ void v_tile(const __half* v, int64_t stride, int n0, int sk,
                                         int head_dim) {
    static_assert(BN == 16, "kDqVInRegs: one 16-key slice per tile");
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int key = n0 + hr * 8 + g;
      vrow[hr] = key < sk ? reinterpret_cast<const unsigned int*>(v + (int64_t)key * stride + tig * 2)
                          : nullptr;
    }
    vcols = head_dim - tig * 2;
  }
  // The B fragment of the tile's 16 keys and head-dim slice kk of V as ldmatrix_x4 at
  // bV + kk * 16 * 2 would give it (r: keys +0 / +8, columns +0 / +8), from global memory;
  // keys past sk and columns past head_dim are zeros.
  __device__ __forceinline__ void v_fragment(uint32_t (&b)[4], int kk) const {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const unsigned int* const row = vrow[r >> 1];
      const int col = kk * 16 + (r & 1) * 8;  // from this thread's column 2 tig
      b[r] = row != nullptr && col < vcols ? __ldg(row + col / 2) : 0u;
    }
  }

  __device__ __forceinline__ void scores(Scores& t, const __half* sQ, const __half* sdO,
                                         const __half* sK, const __half* sV) {
    using namespace detail;
    auto& s = t.s;
    auto& dp = t.dp;
    const uint32_t aQ = smem_addr(sQ + a_frag), adO = smem_addr(sdO + a_frag);
    const uint32_t bK = smem_addr(sK + b_frag), bV = smem_addr(sV + b_frag);
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
    }
    // fully unrolled with kDqQInRegs: qfrag[kk] must be a register, not re-loaded per tile
#pragma unroll(C::kDqQInRegs ? D / 16 : KKU)
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[4], ad[4];
      if constexpr (C::kDqQInRegs) {
#pragma unroll
        for (int r = 0; r < 4; ++r) aq[r] = qfrag[kk][r], ad[r] = dofrag[kk][r];
      } else {
        ldmatrix_x4(aq, aQ + kk * 32);
        ldmatrix_x4(ad, adO + kk * 32);
      }
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        uint32_t bk[4], bv[4];
        ldmatrix_x4(bk, bK + (nn * 16 * ST + kk * 16) * 2);
        if constexpr (C::kDqVInRegs)
          v_fragment(bv, kk);
        else
          ldmatrix_x4(bv, bV + (nn * 16 * ST + kk * 16) * 2);
        mma_k16(s[2 * nn], s[2 * nn + 1], aq, bk);
        mma_k16(dp[2 * nn], dp[2 * nn + 1], ad, bv);
      }
    }
  }

  struct Pos {
    int r0, tig;
    float l2[2], dsum[2];
  };
  __device__ __forceinline__ Pos pos() const { return {r0, tig, {l2[0], l2[1]}, {dsum[0], dsum[1]}}; }

  // Whether none of this warp's 16 rows sees any key of the tile [n0, n0 + BN) (rows past
  // sq see nothing; each row's visible keys are one interval, shifted by one per row)
  __device__ __forceinline__ bool sees_none(int n0, int sq, int sk, int off, int left,
                                            int right) const {
    const int first = r0 - g, last = min(first + 15, sq - 1);
    return first >= sq || n0 >= sk || (right >= 0 && n0 > last + off + right) ||
           (left >= 0 && n0 + BN - 1 < first + off - left);
  }

  template <class Flags>
  __device__ __forceinline__ static void ds(const Pos& pos, Scores& t, const Flags& flags,
                                            const BwdParams& p, const detail::SoftmaxScale& sc,
                                            int n0, int sk, int off, int left, int right) {
    using namespace detail;
    auto& s = t.s;
    auto& dp = t.dp;
    const int r0 = pos.r0, tig = pos.tig;
    const float(&l2)[2] = pos.l2;
    const float(&dsum)[2] = pos.dsum;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = e >> 1;
        float deriv;
        const float pr = score_prob(flags, s[i][e], sc, p.softcap, l2[hr], [&] {
          return key_visible(n0 + i * 8 + tig * 2 + (e & 1), r0 + hr * 8, sk, off, left, right);
        }, deriv);
        dp[i][e] = pr * (dp[i][e] - dsum[hr]) * deriv;
      }
  }

  // ---- dQ += dS K: dS packed to fp16 is the A fragment (as P in the forward)
  __device__ __forceinline__ void accumulate(const Scores& t, const __half* sK, int part) {
    using namespace detail;
    auto& dp = t.dp;
    const uint32_t tK = smem_addr(sK + bt_frag);
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
      uint32_t a[4];
      pack_a(a, dp, kt);
      mma_trans(dq, a, tK + (kt * 16 * ST + part * DC) * 2);
    }
  }

  __device__ __forceinline__ void store(const BwdParams& p, const detail::BwdSequence& rows, int h,
                                        int, int sq, int part) {
    using namespace detail;
    const float scale = p.scale;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = r0 + hr * 8;
      if (r >= sq) continue;
      __half* const dqr = static_cast<__half*>(p.dq) +
                          q_like(rows, h, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride) +
                          (int64_t)r * p.dq_row_stride;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        const int col = part * DC + i * 8 + tig * 2;
        if (col < p.head_dim)
          *reinterpret_cast<uint32_t*>(dqr + col) =
              pack_half2(dq[i][2 * hr] * scale, dq[i][2 * hr + 1] * scale);
      }
    }
  }
};

SM7X_FA2_BWD_KERNELS(16)

}  // namespace sm75
}  // namespace fa2
}  // namespace sm7x
