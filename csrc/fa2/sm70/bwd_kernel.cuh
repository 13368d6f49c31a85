// FlashAttention-2 backward for Volta (sm_70): the math of the two passes whose bodies
// common/bwd_kernel.cuh holds (BwdMainOps, BwdDqOps), in WMMA m16n16k16 (fp16 in, fp32
// accumulate) as the sm70 forward (fwd_kernel.cuh). Algorithm: common/bwd_common.cuh.
//
// bwd_kernel: one CTA per (BN keys, kv head, batch), warp w owning keys 16w .. 16w + 15.
// dK and dV stay in WMMA accumulator fragments for the whole CTA. Per query tile:
//   S^T = K Q^T, dP^T = V dO^T   A = the warp's K / V rows (row major), B = Q / dO as
//                                stored ([query][d] is B col major)
//   P^T, dS^T                    the accumulators go through the warp's fp32 scratch
//                                (their layout is opaque); 2 lanes per key row compute
//                                P and dS in fp32 and write them as fp16: P^T to the
//                                warp's sP, dS^T to the CTA's sdS [BN][BM + 8]
//   dV += P^T dO, dK += dS^T Q   A from sP / sdS (row major), B = dO / Q (row major)
//   dQ += dS K                   A = dS from sdS (col major: stored transposed), B = K;
//                                each warp takes 16 x 16 tiles of dQ, stages each in its
//                                scratch and adds it to dq_accum with fp32 atomics
// bwd_dq_kernel (deterministic): one CTA per (DQ_BM queries, head, batch), warp = 16 query
// rows: S = Q K^T, dP = dO V^T -> scratch -> dS (fp16, sP) -> dQ += dS K in accumulator
// fragments, key tiles in ascending order; writes dq itself.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

#include "common/bwd_common.cuh"
#include "common/bwd_kernel.cuh"
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/softmax.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace sm70 {

template <int D, int BN, int BM, int DQ_BM, int DQ_BN, bool SPLIT, bool PREFETCH = false,
          int MIN_BLOCKS = 1, bool V_IN_REGS = false, int KS = 1, bool DQ_PASS = false>
struct BwdConfig : BwdShape<D, BN, BM, DQ_BM, DQ_BN, SPLIT, PREFETCH, MIN_BLOCKS, V_IN_REGS, 1, DQ_PASS> {
  using S = BwdShape<D, BN, BM, DQ_BM, DQ_BN, SPLIT, PREFETCH, MIN_BLOCKS, V_IN_REGS, 1, DQ_PASS>;
  static_assert(KS == 1, "sm70 backward: no dim split (each warp owns whole rows of dK / dV)");
  static_assert(!V_IN_REGS, "sm70 backward: v_in_regs is not implemented (WMMA fragments)");
  static_assert(!S::kDqVInRegs, "sm70 backward: head dims up to 256 (its dQ kernel stages V)");
  static_assert(!DQ_PASS, "sm70 backward: dq_pass is not implemented (dK reads dS^T from the "
                          "shared tile that dq_pass leaves out)");
  static constexpr int kSS = BM + 8;  // fp32 scratch row stride (S^T, dP^T; dQ/dK/dV tiles)
  static constexpr int kWarpScratchFloats = 2 * 16 * kSS;
  static constexpr int kTileBytes = (2 * BN + 2 * BM) * S::kStride * 2;
  // K, V [BN][D + 8], Q, dO [BM][D + 8], dS^T [BN][BM + 8] fp16; per warp a fp32 scratch
  // [2][16][BM + 8] and P^T [16][BM + 8] fp16; LSE, dsum [BM] fp32. The dV pass of a split
  // backward (mode kBwdDv) has no V and no dS^T (S::v_rows, S::ds_rows; d = 256: 2 CTAs per
  // V100 SM instead of 1).
  static constexpr int smem_bytes(int mode) {
    return (S::k_rows(mode) + S::v_rows(mode) + 2 * BM) * S::kStride * 2 + S::ds_rows(mode) * S::kDsStride * 2 +
           S::kWarps * (kWarpScratchFloats * 4 + 16 * S::kDsStride * 2) + 2 * BM * 4;
  }
  static constexpr int kSmemBytes = smem_bytes(detail::kBwdAll);
  // dQ kernel: Q, dO [DQ_BM][D + 8], K, V [DQ_BN][D + 8]; per warp a fp32 scratch
  // [2][16][DQ_BN + 8] and dS [16][DQ_BN + 8] fp16
  static constexpr int kDqSS = DQ_BN + 8;
  static constexpr int kDqTileBytes = (2 * DQ_BM + 2 * DQ_BN) * S::kStride * 2;
  static constexpr int kDqSmemBytes =
      kDqTileBytes + S::kDqWarps * (2 * 16 * kDqSS * 4 + 16 * kDqSS * 2);
  static_assert(kTileBytes % 32 == 0 && (BN * S::kDsStride * 2) % 32 == 0 &&
                    (kWarpScratchFloats * 4) % 32 == 0 && (16 * S::kDsStride * 2) % 32 == 0 &&
                    kDqTileBytes % 32 == 0 && (2 * 16 * kDqSS * 4) % 32 == 0 &&
                    (16 * kDqSS * 2) % 32 == 0,
                "WMMA pointers must stay 32-byte aligned");
};

using AccFrag = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;
using ARow = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major>;
using ACol = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::col_major>;
using BRow = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::row_major>;
using BCol = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::col_major>;

// A 16 x 16 fp32 accumulator through the warp's scratch (row stride ss) to 16 fp16 rows of
// global memory: row r at g + r * row_stride, columns col0 .. col0 + 15 (< head_dim), rows
// < nrows, times mul. Each lane writes 8 consecutive halves (one 16-byte store).
__device__ __forceinline__ void store_tile_f16(const AccFrag& f, float* scratch, int ss,
                                               __half* g, int64_t row_stride, int nrows,
                                               int col0, int head_dim, float mul, int lane) {
  nvcuda::wmma::store_matrix_sync(scratch, f, ss, nvcuda::wmma::mem_row_major);
  __syncwarp();
  const int r = lane >> 1, c = (lane & 1) * 8;
  if (r < nrows && col0 + c < head_dim) {
    uint4 v;
    uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = detail::pack_half2(scratch[r * ss + c + 2 * j] * mul, scratch[r * ss + c + 2 * j + 1] * mul);
    *reinterpret_cast<uint4*>(g + (int64_t)r * row_stride + col0 + c) = v;
  }
  __syncwarp();
}

// One warp's 16 x (NN x 16) product over the head dim into its fp32 scratch: out [16][ss] =
// A B^T, A the 16 rows at a and B the NN x 16 rows at b, both [row][D] fp16 tiles of row
// stride ST (B's rows are its columns: WMMA col major). Every S / dP of both passes.
template <int NN, int D, int ST>
__device__ __forceinline__ void gemm_abt_to_scratch(float* out, int ss, const __half* a,
                                                    const __half* b) {
  using namespace nvcuda;
  AccFrag s[NN];
#pragma unroll
  for (int nn = 0; nn < NN; ++nn) wmma::fill_fragment(s[nn], 0.f);
#pragma unroll 1
  for (int kk = 0; kk < D / 16; ++kk) {
    ARow fa;
    wmma::load_matrix_sync(fa, a + kk * 16, ST);
#pragma unroll
    for (int nn = 0; nn < NN; ++nn) {
      BCol fb;
      wmma::load_matrix_sync(fb, b + nn * 16 * ST + kk * 16, ST);
      wmma::mma_sync(s[nn], fa, fb, s[nn]);
    }
  }
#pragma unroll
  for (int nn = 0; nn < NN; ++nn) wmma::store_matrix_sync(out + nn * 16, s[nn], ss, wmma::mem_row_major);
}

// The main pass's math (common/bwd_kernel.cuh bwd_main_body): warp w owns keys 16w ..
// 16w + 15; S^T and dP^T go through the warp's fp32 scratch, P^T to its fp16 sP and dS^T to
// the CTA's sdS, where the next GEMMs read them as WMMA A fragments.
template <class C, int MODE>
struct BwdMainOps {
  using Config = C;
  static constexpr int kMode = MODE;
  static constexpr int D = C::kHeadDim, BN = C::kBlockN, BM = C::kBlockM, ST = C::kStride;
  static constexpr int SD = C::kDsStride, SS = C::kSS, W = C::kWarps;
  static constexpr bool kDv = MODE != detail::kBwdDkDq, kDk = MODE != detail::kBwdDv;
  // per warp: a fp32 scratch [2][16][BM + 8] (S^T, dP^T) and P^T [16][BM + 8] fp16
  static constexpr int kScratchBytes = W * (C::kWarpScratchFloats * 4 + 16 * SD * 2);
  struct Scores {};  // S^T, dP^T live in the scratch, P^T and dS^T in sP / sdS

  const int warp, lane;
  float* const sS;   // S^T [16][SS]
  float* const sdP;  // dP^T [16][SS]
  __half* const sP;  // P^T [16][SD]
  AccFrag dk[kDk ? D / 16 : 1], dv[kDv ? D / 16 : 1];
  // elementwise: lane -> key row er, query columns ec0 .. ec0 + BM / 2 - 1
  int er, ec0, key;

  __device__ __forceinline__ BwdMainOps(unsigned char* scratch, int warp_, int lane_)
      : warp(warp_), lane(lane_),
        sS(reinterpret_cast<float*>(scratch) + warp_ * C::kWarpScratchFloats),
        sdP(sS + 16 * SS),
        sP(reinterpret_cast<__half*>(reinterpret_cast<float*>(scratch) + W * C::kWarpScratchFloats) +
           warp_ * 16 * SD) {}

  __device__ __forceinline__ void zero() {
    using namespace nvcuda;
#pragma unroll
    for (int i = 0; i < (kDk ? D / 16 : 1); ++i) wmma::fill_fragment(dk[i], 0.f);
#pragma unroll
    for (int i = 0; i < (kDv ? D / 16 : 1); ++i) wmma::fill_fragment(dv[i], 0.f);
  }

  __device__ __forceinline__ void begin(const BwdParams&, const detail::BwdSequence&, int, int n0,
                                        int, int, unsigned char*) {
    er = lane >> 1;
    ec0 = (lane & 1) * (BM / 2);
    key = n0 + warp * 16 + er;
  }

  // ---- S^T = K Q^T, dP^T = V dO^T -> scratch
  __device__ __forceinline__ void scores(Scores&, const __half* sK, const __half* sV,
                                         const __half* sQ, const __half* sdO) {
    gemm_abt_to_scratch<BM / 16, D, ST>(sS, SS, sK + warp * 16 * ST, sQ);
    if constexpr (kDk) gemm_abt_to_scratch<BM / 16, D, ST>(sdP, SS, sV + warp * 16 * ST, sdO);
    __syncwarp();
  }

  // ---- P^T, dS^T (fp32) -> fp16 sP, sdS: 2 lanes per key row
  struct Pos {
    int er, ec0, key, warp;
    const float *sS, *sdP;
    __half* sP;
  };
  __device__ __forceinline__ Pos pos() const { return {er, ec0, key, warp, sS, sdP, sP}; }

  template <class Flags>
  __device__ __forceinline__ static void probs(const Pos& pos, Scores&, const Flags& flags,
                                               const BwdParams& p, const detail::SoftmaxScale& sc,
                                               const float* sL, const float* sD, __half* sdS,
                                               int, int m0, int sk, int off, int left,
                                               int right) {
    using namespace detail;
    const int er = pos.er, ec0 = pos.ec0, key = pos.key;
#pragma unroll 4
    for (int j = 0; j < BM / 2; ++j) {
      const int c = ec0 + j;
      float deriv;
      const float pr = score_prob(flags, pos.sS[er * SS + c], sc, p.softcap, sL[c], [&] {
        return key_visible(key, m0 + c, sk, off, left, right);
      }, deriv);
      pos.sP[er * SD + c] = __float2half_rn(pr);
      if constexpr (kDk)
        sdS[(pos.warp * 16 + er) * SD + c] = __float2half_rn(pr * (pos.sdP[er * SS + c] - sD[c]) * deriv);
    }
  }

  // ---- dV += P^T dO, dK += dS^T Q
  __device__ __forceinline__ void accumulate(const Scores&, const __half* sQ, const __half* sdO,
                                             const __half* sdS, bool) {
    using namespace nvcuda;
    __syncwarp();
#pragma unroll
    for (int kt = 0; kt < BM / 16; ++kt) {
      if constexpr (kDv) {
        ARow a;
        wmma::load_matrix_sync(a, sP + kt * 16, SD);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          BRow bd;
          wmma::load_matrix_sync(bd, sdO + kt * 16 * ST + dn * 16, ST);
          wmma::mma_sync(dv[dn], a, bd, dv[dn]);
        }
      }
      if constexpr (kDk) {
        ARow a;
        wmma::load_matrix_sync(a, sdS + warp * 16 * SD + kt * 16, SD);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          BRow bq;
          wmma::load_matrix_sync(bq, sQ + kt * 16 * ST + dn * 16, ST);
          wmma::mma_sync(dk[dn], a, bq, dk[dn]);
        }
      }
    }
  }

  // ---- dQ += dS K: 16 x 16 tiles of the BM x D block over the warps, fp32 atomics
  __device__ __forceinline__ void dq_atomic(const BwdParams& p, const detail::BwdSequence& rows,
                                            int h, int m0, int sq, const __half* sK,
                                            const __half* sdS) {
    using namespace nvcuda;
    using namespace detail;
    const int head_dim = p.head_dim;
    float* const acc = p.dq_accum + q_like(rows, h, p.acc_batch_stride, p.acc_row_stride, head_dim);
#pragma unroll 1
    for (int ti = warp; ti < BM / 16 * (D / 16); ti += W) {
      const int ms = ti / (D / 16), dn = ti % (D / 16);
      AccFrag f;
      wmma::fill_fragment(f, 0.f);
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) {
        ACol a;  // A[query][key] = sdS[key][query]
        wmma::load_matrix_sync(a, sdS + kt * 16 * SD + ms * 16, SD);
        BRow bk;
        wmma::load_matrix_sync(bk, sK + kt * 16 * ST + dn * 16, ST);
        wmma::mma_sync(f, a, bk, f);
      }
      wmma::store_matrix_sync(sS, f, SS, wmma::mem_row_major);
      __syncwarp();
      const int r = lane >> 1, c0 = (lane & 1) * 8;
      const int row = m0 + ms * 16 + r;
      // 8 columns of one row: unconditional atomics at constant offsets where they are
      // all inside dq (tested one by one, each became a branch rebuilding its address)
      float* const acc_row = acc + (int64_t)row * p.acc_row_stride + dn * 16 + c0;
      if (row < sq && dn * 16 + c0 + 8 <= head_dim) {
#pragma unroll
        for (int j = 0; j < 8; ++j) atomicAdd(acc_row + j, sS[r * SS + c0 + j]);
      } else if (row < sq) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (dn * 16 + c0 + j < head_dim) atomicAdd(acc_row + j, sS[r * SS + c0 + j]);
      }
      __syncwarp();
    }
  }

  // ---- dK (times the scale), dV through the warp's scratch; keys without a query that
  // sees them write zeros
  __device__ __forceinline__ void store(const BwdParams& p, const detail::BwdSequence& rows, int hk,
                                        int n0, int sk, int head_dim) {
    using namespace detail;
    __syncwarp();
    const int krows = min(16, sk - (n0 + warp * 16));
    if (krows > 0) {
      const int64_t krow0 = n0 + warp * 16;
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        if constexpr (kDk)
          store_tile_f16(dk[dn], sS, SS,
                         static_cast<__half*>(p.dk) +
                             k_like(rows, hk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) +
                             krow0 * p.dk_row_stride,
                         p.dk_row_stride, krows, dn * 16, head_dim, p.scale, lane);
        if constexpr (kDv)
          store_tile_f16(dv[dn], sS, SS,
                         static_cast<__half*>(p.dv) +
                             k_like(rows, hk, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride) +
                             krow0 * p.dv_row_stride,
                         p.dv_row_stride, krows, dn * 16, head_dim, 1.f, lane);
      }
    }
  }
};

// The dQ pass's math (common/bwd_kernel.cuh bwd_dq_body): warp = 16 query rows; S, dP through
// the warp's scratch, dS (fp16) to its sdS, dQ += dS K in accumulator fragments.
template <class C>
struct BwdDqOps {
  using Config = C;
  static constexpr int D = C::kHeadDim, BM = C::kDqBlockM, BN = C::kDqBlockN, ST = C::kStride;
  static constexpr int SS = C::kDqSS, DC = C::kDqCols, W = C::kDqWarps;

  const int warp, lane;
  float* const sS;    // S [16][SS]
  float* const sdP;   // dP [16][SS]
  __half* const sdS;  // dS [16][SS] fp16
  // elementwise: lane -> query row er of the warp, key columns ec0 .. ec0 + BN / 2 - 1
  int er, ec0, row;
  float l2, dsum;
  AccFrag dq[DC / 16];
  struct Scores {};  // S, dP live in the scratch, dS in sdS

  __device__ __forceinline__ BwdDqOps(unsigned char* scratch, int warp_, int lane_)
      : warp(warp_), lane(lane_),
        sS(reinterpret_cast<float*>(scratch) + warp_ * 2 * 16 * SS),
        sdP(sS + 16 * SS),
        sdS(reinterpret_cast<__half*>(reinterpret_cast<float*>(scratch) + W * 2 * 16 * SS) +
            warp_ * 16 * SS) {}

  __device__ __forceinline__ void row_stats(const BwdParams& p, const detail::BwdSequence& rows,
                                            int h, int m0, int sq) {
    using namespace detail;
    er = lane >> 1;
    ec0 = (lane & 1) * (BN / 2);
    row = m0 + warp * 16 + er;
    l2 = row < sq ? lse_log2(p.lse[q_like(rows, h, p.lse_batch_stride, 1, p.lse_head_stride) + row])
                  : INFINITY;
    dsum = row < sq ? p.dsum[q_like(rows, h, p.dsum_batch_stride, 1, p.dsum_head_stride) + row]
                    : 0.f;
  }

  __device__ __forceinline__ void begin() {
#pragma unroll
    for (int i = 0; i < DC / 16; ++i) nvcuda::wmma::fill_fragment(dq[i], 0.f);
  }

  // ---- S = Q K^T, dP = dO V^T -> scratch
  __device__ __forceinline__ void scores(Scores&, const __half* sQ, const __half* sdO,
                                         const __half* sK, const __half* sV) {
    gemm_abt_to_scratch<BN / 16, D, ST>(sS, SS, sQ + warp * 16 * ST, sK);
    gemm_abt_to_scratch<BN / 16, D, ST>(sdP, SS, sdO + warp * 16 * ST, sV);
    __syncwarp();
  }

  struct Pos {
    int er, ec0, row;
    float l2, dsum;
    const float *sS, *sdP;
    __half* sdS;
  };
  __device__ __forceinline__ Pos pos() const { return {er, ec0, row, l2, dsum, sS, sdP, sdS}; }

  template <class Flags>
  __device__ __forceinline__ static void ds(const Pos& pos, Scores&, const Flags& flags,
                                            const BwdParams& p,
                                            const detail::SoftmaxScale& sc, int n0, int sk,
                                            int off, int left, int right) {
    using namespace detail;
    const int er = pos.er, ec0 = pos.ec0, row = pos.row;
#pragma unroll 4
    for (int j = 0; j < BN / 2; ++j) {
      const int c = ec0 + j;
      float deriv;
      const float pr = score_prob(flags, pos.sS[er * SS + c], sc, p.softcap, pos.l2, [&] {
        return key_visible(n0 + c, row, sk, off, left, right);
      }, deriv);
      pos.sdS[er * SS + c] = __float2half_rn(pr * (pos.sdP[er * SS + c] - pos.dsum) * deriv);
    }
  }

  __device__ __forceinline__ void accumulate(const Scores&, const __half* sK, int part) {
    using namespace nvcuda;
    __syncwarp();
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
      ARow a;
      wmma::load_matrix_sync(a, sdS + kt * 16, SS);
#pragma unroll
      for (int dn = 0; dn < DC / 16; ++dn) {
        BRow bk;
        wmma::load_matrix_sync(bk, sK + kt * 16 * ST + part * DC + dn * 16, ST);
        wmma::mma_sync(dq[dn], a, bk, dq[dn]);
      }
    }
  }

  __device__ __forceinline__ void store(const BwdParams& p, const detail::BwdSequence& rows, int h,
                                        int m0, int sq, int part) {
    using namespace detail;
    __syncwarp();
    const int nrows = min(16, sq - (m0 + warp * 16));
    if (nrows > 0) {
      __half* const dqg = static_cast<__half*>(p.dq) +
                          q_like(rows, h, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride) +
                          (int64_t)(m0 + warp * 16) * p.dq_row_stride;
#pragma unroll
      for (int dn = 0; dn < DC / 16; ++dn)
        store_tile_f16(dq[dn], sS, SS, dqg, p.dq_row_stride, nrows, part * DC + dn * 16, p.head_dim,
                       p.scale, lane);
    }
  }
};

SM7X_FA2_BWD_KERNELS(128)

}  // namespace sm70
}  // namespace fa2
}  // namespace sm7x
