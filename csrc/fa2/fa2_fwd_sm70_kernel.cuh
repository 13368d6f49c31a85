// FlashAttention-2 forward kernel for Volta (sm_70). Included only by the per-head-dim
// instantiation files (fa2_fwd_sm70_hdim*.cu); no torch header.
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
//   online softmax  fp32, 2 lanes per row (lane >> 1 = row, lane & 1 = which 4-column
//                   half of every 8 columns), exp2 with log2(e) folded into the scale;
//                   masking for seqlen tails, causal (bottom-right aligned), sliding
//                   window; optional tanh softcap. P written as fp16 to the warp's sP.
//   O += P V        WMMA, A = P (smem), B = V (row major), one D/16 slice at a time into
//                   the scratch; each lane then does o = o * alpha + PV for its row. O
//                   lives in registers (D / 2 floats per lane) in the softmax's layout,
//                   so the per-row rescale needs no shuffles.
// Global loads are 128-bit and register-staged (the helpers of fa2_fwd_kernel.cuh): with
// kPrefetch the next K/V tiles are fetched into registers at the top of an iteration and
// stored to shared memory after its GEMMs.
// Shared memory (<= 96 KB, V100): Q [BR][D+8], K [BC][D+8], V [BC][D+8] fp16; per warp an
// fp32 scratch [16][max(BC, D) + 8] and an fp16 P tile [16][BC+8].
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

#include "fa2.h"
#include "fa2_fwd_kernel.cuh"  // arch-neutral helpers: tile I/O, fast_exp2, pack_half2, launch

namespace sm7x {
namespace fa2 {
namespace sm70 {

constexpr int kVoltaSmemBytes = 96 * 1024;  // max shared memory per block on V100

template <int D, int BR, int BC, bool PREFETCH>
struct Sm70Config {
  static constexpr bool kPrefetch = PREFETCH;
  static constexpr int kHeadDim = D;
  static constexpr int kBlockM = BR;
  static constexpr int kBlockN = BC;
  static constexpr int kWarps = BR / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = D + 8;  // fp16 tile row stride (halves)
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kSStride = BC + 8;  // fp32 S scratch row stride (floats)
  static constexpr int kOStride = D + 8;   // fp32 PV scratch row stride (floats)
  static constexpr int kScratchFloats = 16 * (kSStride > kOStride ? kSStride : kOStride);
  static constexpr int kPStride = BC + 8;  // fp16 P row stride (halves)
  static constexpr int kTileBytes = (BR + 2 * BC) * kStride * 2;
  static constexpr int kSmemBytes =
      kTileBytes + kWarps * kScratchFloats * 4 + kWarps * 16 * kPStride * 2;
  static constexpr int kQLoads = BR * kChunks / kThreads;
  static constexpr int kTileLoads = BC * kChunks / kThreads;
  static_assert(D % 16 == 0 && D <= 256, "head dim: a multiple of 16, at most 256");
  static_assert(BR % 16 == 0 && BC % 16 == 0, "tiles: multiples of 16");
  static_assert(kSmemBytes <= kVoltaSmemBytes, "shared memory over Volta's 96 KB");
  static_assert(kTileBytes % 32 == 0 && (kScratchFloats * 4) % 32 == 0 &&
                    (16 * kPStride * 2) % 32 == 0,
                "WMMA pointers must stay 32-byte aligned");
  static_assert(BR * kChunks % kThreads == 0 && BC * kChunks % kThreads == 0,
                "tile loads must split evenly over the threads");
};

template <class C>
__global__ void __launch_bounds__(C::kThreads) fwd_kernel_sm70(const FwdParams p) {
  using namespace nvcuda;
  using detail::fast_exp2;
  using detail::load_tile;
  using detail::pack_half2;
  using detail::store_tile;
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
  const int h = blockIdx.y, b = blockIdx.z;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BR;
  float* scratch = scratch_all + warp * C::kScratchFloats;
  __half* sP = sP_all + warp * 16 * PS;

  int sq, sk;
  int64_t q_off, k_off, v_off;
  if (p.cu_seqlens_q != nullptr) {
    const int qs = p.cu_seqlens_q[b], ks = p.cu_seqlens_k[b];
    sq = p.cu_seqlens_q[b + 1] - qs;
    sk = p.cu_seqlens_k[b + 1] - ks;
    q_off = (int64_t)qs * p.q_row_stride;
    k_off = (int64_t)ks * p.k_row_stride;
    v_off = (int64_t)ks * p.v_row_stride;
  } else {
    sq = p.seqlen_q;
    sk = p.seqlen_k;
    q_off = (int64_t)b * p.q_batch_stride;
    k_off = (int64_t)b * p.k_batch_stride;
    v_off = (int64_t)b * p.v_batch_stride;
  }
  if (m0 >= sq) return;
  const int hk = h / (p.heads / p.kv_heads);
  const __half* qg = static_cast<const __half*>(p.q) + q_off + (int64_t)h * p.q_head_stride;
  const __half* kg = static_cast<const __half*>(p.k) + k_off + (int64_t)hk * p.k_head_stride;
  const __half* vg = static_cast<const __half*>(p.v) + v_off + (int64_t)hk * p.v_head_stride;

  // Keys row i may see (bottom-right aligned): [i + off - left, i + off + right].
  const int off = sk - sq;
  const int last_row = min(m0 + BR, sq) - 1;
  int n_lo = 0, n_hi = sk;
  if (p.window_left >= 0) n_lo = max(0, m0 + off - p.window_left);
  if (p.window_right >= 0) n_hi = min(sk, last_row + off + p.window_right + 1);
  const int t_lo = n_lo / BC;
  const int t_hi = n_hi > n_lo ? (n_hi + BC - 1) / BC : t_lo;

  const float sl2 = p.softcap > 0.f ? 1.4426950408889634f : p.scale * 1.4426950408889634f;
  const float cap_in = p.softcap > 0.f ? p.scale / p.softcap : 0.f;

  {
    uint4 qr[C::kQLoads];
    load_tile<C>(qr, qg, p.q_row_stride, m0, sq, p.head_dim, tid);
    store_tile<C>(sQ, qr, tid);
  }

  float o[DJ][4];
#pragma unroll
  for (int j = 0; j < DJ; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float row_max = -INFINITY, row_sum = 0.f;
  const int row = m0 + warp * 16 + lr;  // this lane's query row

  uint4 stage_k[C::kTileLoads];
  uint4 stage_v[C::kTileLoads];
  if (t_lo < t_hi) {
    load_tile<C>(stage_k, kg, p.k_row_stride, t_lo * BC, sk, p.head_dim, tid);
    load_tile<C>(stage_v, vg, p.v_row_stride, t_lo * BC, sk, p.head_dim, tid);
    store_tile<C>(sK, stage_k, tid);
    store_tile<C>(sV, stage_v, tid);
  }
  __syncthreads();

  const __half* sQw = sQ + warp * 16 * ST;
  for (int t = t_lo; t < t_hi; ++t) {
    const int n0 = t * BC;
    if constexpr (C::kPrefetch) {
      if (t + 1 < t_hi) {  // K_{t+1}, V_{t+1} in flight during this whole iteration
        load_tile<C>(stage_k, kg, p.k_row_stride, n0 + BC, sk, p.head_dim, tid);
        load_tile<C>(stage_v, vg, p.v_row_stride, n0 + BC, sk, p.head_dim, tid);
      }
    }
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
    if (p.softcap > 0.f) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = p.softcap * tanhf(s[j][e] * cap_in);
    }
    const bool need_mask =
        n0 + BC > sk ||
        (p.window_right >= 0 && n0 + BC - 1 > m0 + off + p.window_right) ||
        (p.window_left >= 0 && n0 < last_row + off - p.window_left);
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + j * 8 + half * 4 + e;
          const bool ok = col < sk &&
                          (p.window_right < 0 || col <= row + off + p.window_right) &&
                          (p.window_left < 0 || col >= row + off - p.window_left);
          if (!ok) s[j][e] = -INFINITY;
        }
    }
    float mx = row_max;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      mx = fmaxf(mx, fmaxf(fmaxf(s[j][0], s[j][1]), fmaxf(s[j][2], s[j][3])));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_use = mx == -INFINITY ? 0.f : mx;  // a row with nothing seen yet
    const float alpha = fast_exp2((row_max - m_use) * sl2);
    row_max = mx;
    const float bias = -m_use * sl2;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = fast_exp2(fmaf(s[j][e], sl2, bias));
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
    if (t + 1 < t_hi) {
      __syncthreads();  // every warp is done with sK and sV
      if constexpr (!C::kPrefetch) {
        load_tile<C>(stage_k, kg, p.k_row_stride, n0 + BC, sk, p.head_dim, tid);
        load_tile<C>(stage_v, vg, p.v_row_stride, n0 + BC, sk, p.head_dim, tid);
      }
      store_tile<C>(sK, stage_k, tid);
      store_tile<C>(sV, stage_v, tid);
      __syncthreads();
    }
  }

  // ---- epilogue: O / l, LSE; O staged through this warp's own rows of sQ for 128-bit stores
  int64_t o_off, lse_off;
  if (p.cu_seqlens_q != nullptr) {
    const int qs = p.cu_seqlens_q[b];
    o_off = (int64_t)qs * p.o_row_stride;
    lse_off = qs;
  } else {
    o_off = (int64_t)b * p.o_batch_stride;
    lse_off = (int64_t)b * p.lse_batch_stride;
  }
  __half* og = static_cast<__half*>(p.o) + o_off + (int64_t)h * p.o_head_stride;
  float* lg = p.lse + lse_off + (int64_t)h * p.lse_head_stride;
  float l = row_sum + __shfl_xor_sync(0xffffffffu, row_sum, 1);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  if (half == 0 && row < sq) {
    const float scale_nat = p.softcap > 0.f ? 1.f : p.scale;
    lg[row] = l > 0.f ? row_max * scale_nat + __logf(l) : INFINITY;
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
#pragma unroll
  for (int i = 0; i < 16 * C::kChunks / 32; ++i) {
    const int idx = lane + i * 32;
    const int r = idx / C::kChunks, c = idx % C::kChunks;
    const int grow = m0 + warp * 16 + r;
    if (grow < sq && c * 8 < p.head_dim)
      *reinterpret_cast<uint4*>(og + (int64_t)grow * p.o_row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(sO + r * ST + c * 8);
  }
}

template <class C>
int launch_fwd_sm70(const FwdParams& p, cudaStream_t stream) {
  return detail::launch<C>(fwd_kernel_sm70<C>, p, stream);
}

}  // namespace sm70
}  // namespace fa2
}  // namespace sm7x
