// FlashAttention-2 forward kernel for Volta (sm_70). Included only by the generated
// per-head-dim instantiation files (csrc/fa2/fwd_instance.cu.in); no torch header.
//
// Volta has no ldmatrix, no cp.async and no m16n8k8; its tensor-core instruction is
// mma.m8n8k4 (quad-pair layout) and WMMA m16n16k16 on top of it. This kernel uses WMMA
// (nvcuda::wmma, fp16 in, fp32 accumulate): the accumulator layout is opaque, so the
// score tile S goes through shared memory anyway (the online softmax needs whole rows),
// and WMMA's fragment loads from padded shared memory are the simplest correct route.
//
// One CTA computes BR query rows of one (batch, head): BR / 16 warps, each owning 16
// rows. Per key tile of BC keys, per warp:
//   S = Q K^T       WMMA m16n16k16, A = Q (row major, smem), B = K (col major: K rows as
//                   stored), BC / 16 fp32 accumulators -> the warp's fp32 scratch [16][BC]
//   online softmax  fp32 (common/softmax.cuh), 2 lanes per row (lane >> 1 = row, lane & 1
//                   = which 4-column half of every 8 columns). P written as fp16 to the
//                   warp's sP.
//   O += P V        WMMA, A = P (smem), B = V (row major), one D/16 slice at a time into
//                   the scratch; each lane then does o = o * alpha + PV for its row. O
//                   lives in registers (D / 2 floats per lane) in the softmax's layout,
//                   so the per-row rescale needs no shuffles.
// Global loads are 128-bit and register-staged (common/tile_io.cuh): with
// KvPrefetch::kBoth the next K/V tiles are fetched into registers at the top of an
// iteration and stored to shared memory after its GEMMs; kNone fetches them after.
// Shared memory: Q [BR][D+8], K [BC][D+8], V [BC][D+8] fp16; per warp an fp32 scratch
// [16][max(BC, D) + 8] and an fp16 P tile [16][BC+8].
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

#include "common/bounds.cuh"
#include "common/config.cuh"
#include "common/epilogue.cuh"
#include "common/launch.cuh"
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/serving.cuh"
#include "common/softmax.cuh"
#include "common/tile_io.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace sm70 {

template <int D, int BR, int BC, KvPrefetch PREFETCH, bool Q_IN_REGS, int WR = 16>
struct FwdConfig : TileShape<D, BR, BC, WR> {
  using Shape = TileShape<D, BR, BC, WR>;
  static constexpr bool kPrefetch = PREFETCH == KvPrefetch::kBoth;
  static constexpr int kSStride = BC + 8;  // fp32 S scratch row stride (floats)
  static constexpr int kOStride = D + 8;   // fp32 PV scratch row stride (floats)
  static constexpr int kScratchFloats = 16 * (kSStride > kOStride ? kSStride : kOStride);
  static constexpr int kPStride = BC + 8;  // fp16 P row stride (halves)
  static constexpr int kTileBytes = (BR + 2 * BC) * Shape::kStride * 2;
  static constexpr int kSmemBytes =
      kTileBytes + Shape::kWarps * kScratchFloats * 4 + Shape::kWarps * 16 * kPStride * 2;
  static_assert(PREFETCH == KvPrefetch::kBoth || PREFETCH == KvPrefetch::kNone,
                "sm70 kernel: prefetch kBoth or kNone");
  static_assert(!Q_IN_REGS, "sm70 kernel: WMMA reads Q from shared memory (no q_in_regs)");
  static_assert(WR == 16, "sm70 kernel: 16 rows per warp (no warp_rows)");
  static_assert(kTileBytes % 32 == 0 && (kScratchFloats * 4) % 32 == 0 &&
                    (16 * kPStride * 2) % 32 == 0,
                "WMMA pointers must stay 32-byte aligned");
};

// SERVING: the serving instantiation, as in sm75/fwd_kernel.cuh (packed GQA rows, keys
// from a (paged) cache, split partials; warps without rows skip the GEMMs).
template <class C, bool SERVING>
__global__ void __launch_bounds__(C::kThreads) fwd_kernel(const FwdParams p) {
  using namespace nvcuda;
  using namespace detail;
  constexpr int D = C::kHeadDim, BR = C::kBlockM, BC = C::kBlockN, ST = C::kStride;
  constexpr int SS = C::kSStride, OS = C::kOStride, PS = C::kPStride;
  constexpr int NJ = BC / 8;  // 8-column groups of S per row
  constexpr int DJ = D / 8;   // 8-column groups of O per row
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __half* sQ = reinterpret_cast<__half*>(smem_raw);
  __half* sK = sQ + BR * ST;
  __half* sV = sK + BC * ST;
  float* scratch_all = reinterpret_cast<float*>(smem_raw + C::kTileBytes);
  __half* sP_all = reinterpret_cast<__half*>(scratch_all + C::kWarps * C::kScratchFloats);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int lr = lane >> 1, half = lane & 1;  // softmax / O layout: row lr, 4-col half
  // Prefill: (m-block, head, batch); serving: (m-block, kv head, partition).
  const int h = blockIdx.y, b = blockIdx.z;
  // Last m-block first: with causal masking it has the most key tiles (less tail).
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BR;
  float* scratch = scratch_all + warp * C::kScratchFloats;
  __half* sP = sP_all + warp * 16 * PS;

  CtaWork cw;
  if (!cta_work<BR, BC, SERVING>(p, b, h, m0, cw)) return;
  const int sq = cw.sq, sk = cw.sk, off = cw.off, t_lo = cw.t_lo, t_hi = cw.t_hi;
  const int first_row = cw.first_row, last_row = cw.last_row;
  [[maybe_unused]] const ServingWork& w = cw.w;
  const SoftmaxScale sc = softmax_scale(p);
  const bool warp_on = !SERVING || m0 + warp * 16 < sq;
  // K / V tile n0 -> registers; serving: the pages of the next tile's rows are fetched
  // into pg one tile ahead (fetch(n0) right after the loads of the tile before).
  [[maybe_unused]] int pg[SERVING ? C::kTileLoads : 1];
  auto fetch = [&](int n0) {
    if constexpr (SERVING) fetch_pages<C>(pg, p, w.pages, n0, sk, tid);
  };
  auto load_k = [&](uint4(&r)[C::kTileLoads], int n0) {
    load_kv<C, SERVING>(r, cw.kg, pg, p, cw, p.k_batch_stride, p.k_row_stride, n0, tid);
  };
  auto load_v = [&](uint4(&r)[C::kTileLoads], int n0) {
    load_kv<C, SERVING>(r, cw.vg, pg, p, cw, p.v_batch_stride, p.v_row_stride, n0, tid);
  };

  {
    uint4 qr[C::kQLoads];
    load_q<C, SERVING>(qr, p, cw, m0, tid);
    store_tile<C>(sQ, qr, tid);
  }

  float o[DJ][4];
#pragma unroll
  for (int j = 0; j < DJ; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float row_max = -INFINITY, row_sum = 0.f;
  const int row = m0 + warp * 16 + lr;  // this lane's query row
  const int mrow = SERVING ? row / p.group : row;  // its query position for the masks

  uint4 stage_k[C::kTileLoads];
  uint4 stage_v[C::kTileLoads];
  if (t_lo < t_hi) {
    fetch(t_lo * BC);
    load_k(stage_k, t_lo * BC);
    load_v(stage_v, t_lo * BC);
    fetch((t_lo + 1) * BC);
    store_tile<C>(sK, stage_k, tid);
    store_tile<C>(sV, stage_v, tid);
  }
  __syncthreads();

  const __half* sQw = sQ + warp * 16 * ST;
  for (int t = t_lo; t < t_hi; ++t) {
    const int n0 = t * BC;
    if constexpr (C::kPrefetch) {
      if (t + 1 < t_hi) {  // K_{t+1}, V_{t+1} in flight during this whole iteration
        load_k(stage_k, n0 + BC);
        load_v(stage_v, n0 + BC);
        fetch(n0 + 2 * BC);
      }
    }
    if (warp_on) {
    // ---- S = Q K^T -> scratch
    {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BC / 16];
#pragma unroll
      for (int nn = 0; nn < BC / 16; ++nn) wmma::fill_fragment(acc[nn], 0.f);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::load_matrix_sync(a, sQw + kk * 16, ST);
#pragma unroll
        for (int nn = 0; nn < BC / 16; ++nn) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> bk;
          wmma::load_matrix_sync(bk, sK + nn * 16 * ST + kk * 16, ST);
          wmma::mma_sync(acc[nn], a, bk, acc[nn]);
        }
      }
#pragma unroll
      for (int nn = 0; nn < BC / 16; ++nn)
        wmma::store_matrix_sync(scratch + nn * 16, acc[nn], SS, wmma::mem_row_major);
    }
    __syncwarp();
    // ---- softcap, masking, online softmax (fp32); P -> sP as fp16
    float s[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float4 v4 = *reinterpret_cast<const float4*>(scratch + lr * SS + j * 8 + half * 4);
      s[j][0] = v4.x;
      s[j][1] = v4.y;
      s[j][2] = v4.z;
      s[j][3] = v4.w;
    }
    softcap_scores(s, p, sc.cap_in);
    // s[j][e]: key n0 + 8 j + 4 half + e of this lane's row
    if (SM7X_FA2_TILE_NEEDS_MASK(p, BC, n0, first_row, last_row, sk, off) ||
        (SERVING && n0 < w.kv_lo)) {
      const int left = p.window_left, right = p.window_right;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + j * 8 + half * 4 + e;
          if (!key_visible(col, mrow, sk, off, left, right) || (SERVING && col < w.kv_lo))
            s[j][e] = -INFINITY;
        }
    }
    float mx = row_max;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      mx = fmaxf(mx, fmaxf(fmaxf(s[j][0], s[j][1]), fmaxf(s[j][2], s[j][3])));
    mx = row_allreduce_max<2>(mx);
    float bias;
    const float alpha = online_rescale(row_max, mx, sc.sl2, bias);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2_scaled(s[j][e], sc.sl2, bias);
        sum += s[j][e];
      }
      uint2 pk;
      pk.x = pack_half2(s[j][0], s[j][1]);
      pk.y = pack_half2(s[j][2], s[j][3]);
      *reinterpret_cast<uint2*>(sP + lr * PS + j * 8 + half * 4) = pk;
    }
    row_sum = row_sum * alpha + sum;  // per-lane partial, reduced at the end
    __syncwarp();
    // ---- PV = P V, one 16-column slice of D at a time -> scratch (S is consumed)
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kt = 0; kt < BC / 16; ++kt) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> bv;
        wmma::load_matrix_sync(a, sP + kt * 16, PS);
        wmma::load_matrix_sync(bv, sV + kt * 16 * ST + dn * 16, ST);
        wmma::mma_sync(acc, a, bv, acc);
      }
      wmma::store_matrix_sync(scratch + dn * 16, acc, OS, wmma::mem_row_major);
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      const float4 v4 = *reinterpret_cast<const float4*>(scratch + lr * OS + j * 8 + half * 4);
      o[j][0] = fmaf(o[j][0], alpha, v4.x);
      o[j][1] = fmaf(o[j][1], alpha, v4.y);
      o[j][2] = fmaf(o[j][2], alpha, v4.z);
      o[j][3] = fmaf(o[j][3], alpha, v4.w);
    }
    __syncwarp();  // scratch is rewritten by the next tile's S
    }  // warp_on
    if (t + 1 < t_hi) {
      __syncthreads();  // every warp is done with sK and sV
      if constexpr (!C::kPrefetch) {
        load_k(stage_k, n0 + BC);
        load_v(stage_v, n0 + BC);
        fetch(n0 + 2 * BC);
      }
      store_tile<C>(sK, stage_k, tid);
      store_tile<C>(sV, stage_v, tid);
      __syncthreads();
    }
  }

  // ---- epilogue: O / l, LSE; O staged through this warp's own rows of sQ
  const float l = row_allreduce_sum<2>(row_sum);
  const float inv = inv_row_sum(l);
  [[maybe_unused]] int64_t o_off, lse_off;
  if constexpr (SERVING) {
    if (w.split) {  // fp32 partials straight from the registers, for run_combine
      if (row < sq) {
        const int64_t a = accum_row(p, b, h, row);
        if (half == 0) p.lse_accum[a] = partial_lse(p, l, row_max);
#pragma unroll
        for (int j = 0; j < DJ; ++j) {
          const int col = j * 8 + half * 4;
          if (col < p.head_dim)
            *reinterpret_cast<float4*>(p.o_accum + a * p.head_dim + col) =
                make_float4(o[j][0] * inv, o[j][1] * inv, o[j][2] * inv, o[j][3] * inv);
        }
      }
      return;
    }
    serving_out_offsets(p, w, 0, h * p.group, o_off, lse_off);
    if (half == 0 && row < sq)
      p.lse[lse_off + packed_row_offset(row, p.group, 1, p.lse_head_stride)] =
          row_lse(p, l, row_max);
  } else {
    out_offsets(p, b, h, o_off, lse_off);
    if (half == 0 && row < sq) p.lse[lse_off + row] = row_lse(p, l, row_max);
  }
  __syncwarp();
  __half* sO = sQ + warp * 16 * ST;  // only this warp ever read these Q rows
#pragma unroll
  for (int j = 0; j < DJ; ++j) {
    uint2 pk;
    pk.x = pack_half2(o[j][0] * inv, o[j][1] * inv);
    pk.y = pack_half2(o[j][2] * inv, o[j][3] * inv);
    *reinterpret_cast<uint2*>(sO + lr * ST + j * 8 + half * 4) = pk;
  }
  __syncwarp();
  if constexpr (SERVING)
    store_o_rows_at<C>(p, OutRows{o_off, p.group, p.o_row_stride, p.o_head_stride}, sO, m0, warp,
                       sq, lane);
  else
    store_o_rows<C>(p, o_off, sO, m0, warp, sq, lane);
}

}  // namespace sm70
}  // namespace fa2
}  // namespace sm7x
