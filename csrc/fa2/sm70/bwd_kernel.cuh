// FlashAttention-2 backward kernels for Volta (sm_70): WMMA m16n16k16 (fp16 in, fp32
// accumulate) as the sm70 forward (fwd_kernel.cuh). Algorithm and work split:
// common/bwd_common.cuh; the same two kernels as sm75/bwd_kernel.cuh.
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
// Tiles come in as on sm75 (QueryTile prefetches query tiles where the config says so).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

#include "common/bwd_common.cuh"
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/softmax.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace sm70 {

template <int D, int BN, int BM, int DQ_BM, int DQ_BN, bool SPLIT, bool PREFETCH = false,
          int MIN_BLOCKS = 1, bool V_IN_REGS = false, int KS = 1>
struct BwdConfig : BwdShape<D, BN, BM, DQ_BM, DQ_BN, SPLIT, PREFETCH, MIN_BLOCKS, V_IN_REGS> {
  using S = BwdShape<D, BN, BM, DQ_BM, DQ_BN, SPLIT, PREFETCH, MIN_BLOCKS, V_IN_REGS>;
  static_assert(KS == 1, "sm70 backward: no dim split (each warp owns whole rows of dK / dV)");
  static_assert(!V_IN_REGS, "sm70 backward: v_in_regs is not implemented (WMMA fragments)");
  static constexpr int kSS = BM + 8;  // fp32 scratch row stride (S^T, dP^T; dQ/dK/dV tiles)
  static constexpr int kWarpScratchFloats = 2 * 16 * kSS;
  static constexpr int kTileBytes = (2 * BN + 2 * BM) * S::kStride * 2;
  // K, V [BN][D + 8], Q, dO [BM][D + 8], dS^T [BN][BM + 8] fp16; per warp a fp32 scratch
  // [2][16][BM + 8] and P^T [16][BM + 8] fp16; LSE, dsum [BM] fp32. The dV pass of a split
  // backward (mode kBwdDv) has no V and no dS^T (S::v_rows, S::ds_rows; d = 256: 2 CTAs per
  // V100 SM instead of 1).
  static constexpr int smem_bytes(int mode) {
    return (BN + S::v_rows(mode) + 2 * BM) * S::kStride * 2 + S::ds_rows(mode) * S::kDsStride * 2 +
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

template <class C, int MODE>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) bwd_kernel(const BwdParams p) {
  using namespace nvcuda;
  using namespace detail;
  constexpr int D = C::kHeadDim, BN = C::kBlockN, BM = C::kBlockM, ST = C::kStride;
  constexpr int SD = C::kDsStride, SS = C::kSS, T = C::kThreads, W = C::kWarps;
  constexpr bool kDv = MODE != kBwdDkDq, kDk = MODE != kBwdDv;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // the layout of BwdConfig::smem_bytes(MODE)
  __half* const sK = reinterpret_cast<__half*>(smem_raw);
  __half* const sV = sK + BN * ST;
  __half* const sQ = sV + C::v_rows(MODE) * ST;
  __half* const sdO = sQ + BM * ST;
  __half* const sdS = sdO + BM * ST;
  float* const scratch0 = reinterpret_cast<float*>(sdS + C::ds_rows(MODE) * SD);
  __half* const sP0 = reinterpret_cast<__half*>(scratch0 + W * C::kWarpScratchFloats);
  float* const sL = reinterpret_cast<float*>(sP0 + W * 16 * SD);
  float* const sD = sL + BM;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* const sS = scratch0 + warp * C::kWarpScratchFloats;  // S^T [16][SS]
  float* const sdP = sS + 16 * SS;                              // dP^T [16][SS]
  __half* const sP = sP0 + warp * 16 * SD;                      // P^T [16][SD]
  const int hk = blockIdx.y, b = blockIdx.z, n0 = blockIdx.x * BN;
  const BwdRows rows = bwd_rows(p, b);
  const int sq = rows.sq, sk = rows.sk;
  if (n0 >= sk) return;
  const int head_dim = p.head_dim;
  const int group = p.heads / p.kv_heads;
  const int off = sk - sq, n_last = min(n0 + BN, sk) - 1;
  const int left = p.window_left, right = p.window_right;
  const SoftmaxScale sc = softmax_scale(p);
  const bool dq_atomic = kDk && !p.deterministic;

  copy_rows<BN, T, D, ST, C::kCopyBatch>(sK, static_cast<const __half*>(p.k) +
                                  k_like(rows, hk, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                          p.k_row_stride, n0, sk, head_dim, tid);
  if constexpr (C::v_rows(MODE) > 0)
    copy_rows<BN, T, D, ST, C::kCopyBatch>(sV, static_cast<const __half*>(p.v) +
                                    k_like(rows, hk, p.v_batch_stride, p.v_row_stride, p.v_head_stride),
                            p.v_row_stride, n0, sk, head_dim, tid);

  int m_lo, m_hi;
  query_range(p, n0, n_last, sq, off, m_lo, m_hi);
  const int t_lo = m_lo / BM, t_hi = m_hi > m_lo ? (m_hi + BM - 1) / BM : t_lo;

  AccFrag dk[kDk ? D / 16 : 1], dv[kDv ? D / 16 : 1];
#pragma unroll
  for (int i = 0; i < (kDk ? D / 16 : 1); ++i) wmma::fill_fragment(dk[i], 0.f);
#pragma unroll
  for (int i = 0; i < (kDv ? D / 16 : 1); ++i) wmma::fill_fragment(dv[i], 0.f);

  // elementwise: lane -> key row er, query columns ec0 .. ec0 + BM / 2 - 1
  const int er = lane >> 1, ec0 = (lane & 1) * (BM / 2);
  const int key = n0 + warp * 16 + er;

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

    // ---- S^T = K Q^T, dP^T = V dO^T -> scratch
    {
      AccFrag s[BM / 16];
#pragma unroll
      for (int nn = 0; nn < BM / 16; ++nn) wmma::fill_fragment(s[nn], 0.f);
#pragma unroll 1
      for (int kk = 0; kk < D / 16; ++kk) {
        ARow a;
        wmma::load_matrix_sync(a, sK + warp * 16 * ST + kk * 16, ST);
#pragma unroll
        for (int nn = 0; nn < BM / 16; ++nn) {
          BCol bq;
          wmma::load_matrix_sync(bq, sQ + nn * 16 * ST + kk * 16, ST);
          wmma::mma_sync(s[nn], a, bq, s[nn]);
        }
      }
#pragma unroll
      for (int nn = 0; nn < BM / 16; ++nn)
        wmma::store_matrix_sync(sS + nn * 16, s[nn], SS, wmma::mem_row_major);
    }
    if constexpr (kDk) {
      AccFrag s[BM / 16];
#pragma unroll
      for (int nn = 0; nn < BM / 16; ++nn) wmma::fill_fragment(s[nn], 0.f);
#pragma unroll 1
      for (int kk = 0; kk < D / 16; ++kk) {
        ARow a;
        wmma::load_matrix_sync(a, sV + warp * 16 * ST + kk * 16, ST);
#pragma unroll
        for (int nn = 0; nn < BM / 16; ++nn) {
          BCol bd;
          wmma::load_matrix_sync(bd, sdO + nn * 16 * ST + kk * 16, ST);
          wmma::mma_sync(s[nn], a, bd, s[nn]);
        }
      }
#pragma unroll
      for (int nn = 0; nn < BM / 16; ++nn)
        wmma::store_matrix_sync(sdP + nn * 16, s[nn], SS, wmma::mem_row_major);
    }
    __syncwarp();

    // ---- P^T, dS^T (fp32) -> fp16 sP, sdS
    {
      const int last_row = min(m0 + BM, sq) - 1;
      const bool masked = SM7X_FA2_TILE_NEEDS_MASK(p, BN, n0, m0, last_row, sk, off);
      with_score_flags(p.softcap > 0.f, masked, [&](auto flags) {
#pragma unroll 4
        for (int j = 0; j < BM / 2; ++j) {
          const int c = ec0 + j;
          float deriv;
          const float pr = score_prob(flags, sS[er * SS + c], sc, p.softcap, sL[c], [&] {
            return key_visible(key, m0 + c, sk, off, left, right);
          }, deriv);
          sP[er * SD + c] = __float2half_rn(pr);
          if constexpr (kDk)
            sdS[(warp * 16 + er) * SD + c] = __float2half_rn(pr * (sdP[er * SS + c] - sD[c]) * deriv);
        }
      });
    }
    __syncwarp();

    // ---- dV += P^T dO, dK += dS^T Q
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

    // ---- dQ += dS K: 16 x 16 tiles of the BM x D block over the warps, fp32 atomics
    if constexpr (kDk) {
      if (dq_atomic) {
        __syncthreads();  // dS^T of every warp stored
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
    }
  }

  // ---- dK (times the scale), dV through the warp's scratch; keys without a query that
  // sees them write zeros
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

// Deterministic dQ: rows [m0, m0 + DQ_BM) of query head h, key tiles in ascending order;
// columns [part * kDqCols, + kDqCols) of dQ (d = 256: two CTAs per query block).
template <class C>
__global__ void __launch_bounds__(C::kDqThreads) bwd_dq_kernel(const BwdParams p) {
  using namespace nvcuda;
  using namespace detail;
  constexpr int D = C::kHeadDim, BM = C::kDqBlockM, BN = C::kDqBlockN, ST = C::kStride;
  constexpr int SS = C::kDqSS, DC = C::kDqCols, T = C::kDqThreads, W = C::kDqWarps;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __half* const sQ = reinterpret_cast<__half*>(smem_raw);
  __half* const sdO = sQ + BM * ST;
  __half* const sK = sdO + BM * ST;
  __half* const sV = sK + BN * ST;
  float* const scratch0 = reinterpret_cast<float*>(sV + BN * ST);
  __half* const sdS0 = reinterpret_cast<__half*>(scratch0 + W * 2 * 16 * SS);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* const sS = scratch0 + warp * 2 * 16 * SS;  // S [16][SS]
  float* const sdP = sS + 16 * SS;                  // dP [16][SS]
  __half* const sdS = sdS0 + warp * 16 * SS;        // dS [16][SS] fp16
  const int h = blockIdx.y, b = blockIdx.z;
  constexpr int NPART = D / DC;
  const int part = blockIdx.x % NPART;
  const int m0 = (gridDim.x / NPART - 1 - blockIdx.x / NPART) * BM;  // longest blocks first
  const BwdRows rows = bwd_rows(p, b);
  const int sq = rows.sq, sk = rows.sk;
  if (m0 >= sq) return;
  const int head_dim = p.head_dim;
  const int hk = h / (p.heads / p.kv_heads);
  const int left = p.window_left, right = p.window_right;
  const SoftmaxScale sc = softmax_scale(p);

  copy_rows<BM, T, D, ST, C::kDqCopyBatch>(sQ, static_cast<const __half*>(p.q) +
                                  q_like(rows, h, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                          p.q_row_stride, m0, sq, head_dim, tid);
  copy_rows<BM, T, D, ST, C::kDqCopyBatch>(sdO, static_cast<const __half*>(p.dout) +
                                   q_like(rows, h, p.do_batch_stride, p.do_row_stride, p.do_head_stride),
                          p.do_row_stride, m0, sq, head_dim, tid);
  const __half* const kg = static_cast<const __half*>(p.k) +
                           k_like(rows, hk, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  const __half* const vg = static_cast<const __half*>(p.v) +
                           k_like(rows, hk, p.v_batch_stride, p.v_row_stride, p.v_head_stride);

  // elementwise: lane -> query row er of the warp, key columns ec0 .. ec0 + BN / 2 - 1
  const int er = lane >> 1, ec0 = (lane & 1) * (BN / 2);
  const int row = m0 + warp * 16 + er;
  const float l2 = row < sq ? lse_log2(p.lse[q_like(rows, h, p.lse_batch_stride, 1, p.lse_head_stride) + row])
                            : INFINITY;
  const float dsum = row < sq ? p.dsum[q_like(rows, h, p.dsum_batch_stride, 1, p.dsum_head_stride) + row]
                              : 0.f;

  const int off = sk - sq, last_row = min(m0 + BM, sq) - 1;
  int n_lo = 0, n_hi = sk;
  if (left >= 0) n_lo = max(0, m0 + off - left);
  if (right >= 0) n_hi = min(sk, last_row + off + right + 1);
  const int t_lo = n_lo / BN, t_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : t_lo;

  AccFrag dq[DC / 16];
#pragma unroll
  for (int i = 0; i < DC / 16; ++i) wmma::fill_fragment(dq[i], 0.f);

  for (int t = t_lo; t < t_hi; ++t) {
    const int n0 = t * BN;
    __syncthreads();  // every warp is done with the previous K, V
    copy_rows<BN, T, D, ST, C::kDqCopyBatch>(sK, kg, p.k_row_stride, n0, sk, head_dim, tid);
    copy_rows<BN, T, D, ST, C::kDqCopyBatch>(sV, vg, p.v_row_stride, n0, sk, head_dim, tid);
    __syncthreads();
    {
      AccFrag s[BN / 16];
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) wmma::fill_fragment(s[nn], 0.f);
#pragma unroll 1
      for (int kk = 0; kk < D / 16; ++kk) {
        ARow a;
        wmma::load_matrix_sync(a, sQ + warp * 16 * ST + kk * 16, ST);
#pragma unroll
        for (int nn = 0; nn < BN / 16; ++nn) {
          BCol bk;
          wmma::load_matrix_sync(bk, sK + nn * 16 * ST + kk * 16, ST);
          wmma::mma_sync(s[nn], a, bk, s[nn]);
        }
      }
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn)
        wmma::store_matrix_sync(sS + nn * 16, s[nn], SS, wmma::mem_row_major);
    }
    {
      AccFrag s[BN / 16];
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) wmma::fill_fragment(s[nn], 0.f);
#pragma unroll 1
      for (int kk = 0; kk < D / 16; ++kk) {
        ARow a;
        wmma::load_matrix_sync(a, sdO + warp * 16 * ST + kk * 16, ST);
#pragma unroll
        for (int nn = 0; nn < BN / 16; ++nn) {
          BCol bv;
          wmma::load_matrix_sync(bv, sV + nn * 16 * ST + kk * 16, ST);
          wmma::mma_sync(s[nn], a, bv, s[nn]);
        }
      }
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn)
        wmma::store_matrix_sync(sdP + nn * 16, s[nn], SS, wmma::mem_row_major);
    }
    __syncwarp();
    {
      const bool masked = SM7X_FA2_TILE_NEEDS_MASK(p, BN, n0, m0, last_row, sk, off);
      with_score_flags(p.softcap > 0.f, masked, [&](auto flags) {
#pragma unroll 4
        for (int j = 0; j < BN / 2; ++j) {
          const int c = ec0 + j;
          float deriv;
          const float pr = score_prob(flags, sS[er * SS + c], sc, p.softcap, l2, [&] {
            return key_visible(n0 + c, row, sk, off, left, right);
          }, deriv);
          sdS[er * SS + c] = __float2half_rn(pr * (sdP[er * SS + c] - dsum) * deriv);
        }
      });
    }
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

  __syncwarp();
  const int nrows = min(16, sq - (m0 + warp * 16));
  if (nrows > 0) {
    __half* const dqg = static_cast<__half*>(p.dq) +
                        q_like(rows, h, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride) +
                        (int64_t)(m0 + warp * 16) * p.dq_row_stride;
#pragma unroll
    for (int dn = 0; dn < DC / 16; ++dn)
      store_tile_f16(dq[dn], sS, SS, dqg, p.dq_row_stride, nrows, part * DC + dn * 16, head_dim,
                     p.scale, lane);
  }
}

template <class C, class CDv = C>
int run_bwd_main(const BwdParams& p, cudaStream_t stream) {
  if constexpr (C::kSplit) {
    static_assert(detail::same_but_block_n<C, CDv>(), "the dV pass's config differs only in block_n");
    if (const int e = detail::launch_bwd<CDv, detail::kBwdDv>(bwd_kernel<CDv, detail::kBwdDv>, p, stream)) return e;
    return detail::launch_bwd<C, detail::kBwdDkDq>(bwd_kernel<C, detail::kBwdDkDq>, p, stream);
  } else {
    return detail::launch_bwd<C, detail::kBwdAll>(bwd_kernel<C, detail::kBwdAll>, p, stream);
  }
}

template <class C>
int run_bwd_dq(const BwdParams& p, cudaStream_t stream) {
  return detail::launch_bwd_dq<C>(bwd_dq_kernel<C>, p, stream);
}

}  // namespace sm70
}  // namespace fa2
}  // namespace sm7x
