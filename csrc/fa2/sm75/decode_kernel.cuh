// The Turing decode kernel: the serving instantiation for at most 8 packed query rows per
// kv head (a decode step of up to 8 query heads per kv head, or a few tokens of a smaller
// group), with the GEMMs swapped ("swap AB") so that keys, not query rows, fill the MMA's
// 16-row M dimension:
//   S^T = K Q^T     m16n8k8: A = 16 keys x 8 head-dim columns (ldmatrix of the K tile as
//                   stored), B = Q^T (the 8 query rows: N), held in registers
//   online softmax  per query row = per accumulator column: the 8 lanes of a column
//                   (tig, tig + 4, ..) reduce with shuffles
//   O^T += V^T P^T  m16n8k8: A = 16 head-dim rows x 8 keys (ldmatrix.trans of V), B = P^T:
//                   an S^T accumulator packed to fp16 and transposed by movmatrix
// The serving kernel (fwd_kernel<C, true>) puts the query rows on M, where a decode step
// fills 1-8 of the 16 rows: this one issues half its MMAs, keeps half the O accumulators
// (D / 16 x 4 floats) and half the Q fragments (D / 8 registers), and so runs more warps
// per SM. That is what an 8-bit cache needs (fp16 decode is bound by bytes, 8-bit decode
// was bound by the instructions of each key tile: csrc/fa2/MEASUREMENTS.md).
//
// One warp per CTA, grid (m-blocks of 8 rows, kv heads, partitions) as launch_serving; the
// work, masks, cache loads (fp16, 8-bit codes, int8 with row scales), descales and the
// split partials are the serving kernel's (common/serving.cuh). Shared memory: the K and V
// tiles [BC][D + 8] fp16, which also stage the Q tile at the start and O at the end.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/bounds.cuh"
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
namespace sm75 {

// What the tile copies (common/tile_io.cuh, serving.cuh) read of a config, for one warp,
// 8 query rows and BC keys per tile.
template <int D, int BC>
struct DecodeConfig {
  static constexpr int kHeadDim = D, kBlockM = kDecodeRows, kBlockN = BC;
  static constexpr int kWarps = 1, kThreads = 32;
  static constexpr int kStride = D + 8;  // fp16 tile row stride (halves), as FwdShape's
  static constexpr int kChunks = D / 8;
  static constexpr int kQLoads = (kBlockM * kChunks + kThreads - 1) / kThreads;
  static constexpr int kTileLoads = (BC * kChunks + kThreads - 1) / kThreads;
  static constexpr int kSmemBytes = 2 * BC * kStride * 2;
  static_assert(D % 16 == 0 && D <= 256, "head dim: a multiple of 16, at most 256");
  static_assert(BC % 16 == 0 && 2 * BC >= kBlockM, "key tiles: multiples of 16");
};

// Registers per thread ptxas may use (__maxnreg__, kept in the PTX that newer GPUs
// JIT-compile): 168 over an 8-bit cache, 12 warps per SM, where an 8-bit decode is bound by
// the instructions of its warps (csrc/fa2/MEASUREMENTS.md: int8 at 200 registers ran 8 warps
// and took 1.3x the time; its sm_75 SASS keeps 12-24 bytes on the stack at d112 / d128,
// targets.json int8_stack_bytes). The fp16 kernel is left free: its decode is bound by bytes.
template <int KV>
constexpr int decode_max_regs() {
  return KV == kReadF16 ? 255 : 168;
}

template <class C, int KV>
__global__ void __maxnreg__(decode_max_regs<KV>()) decode_kernel(const FwdParams p) {
  using namespace detail;
  constexpr bool KV8 = KV != kReadF16;
  constexpr int D = C::kHeadDim, BR = C::kBlockM, BC = C::kBlockN, ST = C::kStride;
  constexpr int MT = BC / 16;  // m16 key slices of a tile
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* const sK = reinterpret_cast<__half*>(smem_raw);
  __half* const sV = sK + BC * ST;

  const int lane = threadIdx.x, g = lane >> 2, tig = lane & 3;
  const int h = blockIdx.y, b = blockIdx.z;
  const int m0 = blockIdx.x * BR;
  CtaWork cw;
  if (!cta_work<BR, BC, true, KV>(p, b, h, m0, cw)) return;
  const int sq = cw.sq, sk = cw.sk, off = cw.off, t_lo = cw.t_lo, t_hi = cw.t_hi;
  const int first_row = cw.first_row, last_row = cw.last_row;
  const ServingWork& w = cw.w;
  const KvScales kvs = kv_scales<KV8>(p, w, h);
  const SoftmaxScale sc = softmax_scale(p, kvs.k);

  using Tile = std::conditional_t<KV8, CodeTile<C>, C>;
  constexpr int KL = kv_tile_loads<C, KV8>();
  int pg[KL];
  auto fetch = [&](int n0) { fetch_pages<Tile>(pg, p, w.pages, n0, sk, lane); };
  KvStage<KL, KV> stage_k, stage_v;
  auto load = [&](int n0) {
    load_kv<C, true, false, KV>(stage_k, pg, p, cw, n0, lane);
    load_kv<C, true, true, KV>(stage_v, pg, p, cw, n0, lane);
  };
  auto store = [&]() {
    store_kv<C, KV>(sK, stage_k, p, lane);
    store_kv<C, KV>(sV, stage_v, p, lane);
  };
  if (t_lo < t_hi) {
    fetch(t_lo * BC);
    load(t_lo * BC);
    fetch((t_lo + 1) * BC);
  }

  // Q^T as B fragments (column n = query row g, k = head-dim columns 2 tig, 2 tig + 1 of
  // each 8): staged through the K tile's space once.
  uint32_t qb[D / 8];
  {
    uint4 qr[C::kQLoads];
    load_q<C, true>(qr, p, cw, m0, lane);
    store_tile<C, BR>(sK, qr, lane);
    __syncwarp();
#pragma unroll
    for (int kk = 0; kk < D / 8; ++kk)
      qb[kk] = *reinterpret_cast<const uint32_t*>(sK + g * ST + kk * 8 + tig * 2);
    __syncwarp();
  }
  if (t_lo < t_hi) store();
  __syncwarp();

  // O^T: head-dim rows dm * 16 + g (+ 8) of query rows 2 tig, 2 tig + 1
  float o[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // the two query rows of this lane (columns 2 tig + j of every accumulator)
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const int r0 = m0 + tig * 2;
  const int mr[2] = {r0 / p.group, (r0 + 1) / p.group};  // their query tokens (masks)
  // ldmatrix lanes: K as A (keys on rows), V^T as A (ldmatrix.trans of V's rows)
  const int a_frag = ((lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;
  const int v_frag = ((lane & 7) + (lane >> 4) * 8) * ST + ((lane >> 3) & 1) * 8;

  for (int t = t_lo; t < t_hi; ++t) {
    const int n0 = t * BC;
    if (t + 1 < t_hi) {  // K_{t+1}, V_{t+1} in flight during this whole iteration
      load(n0 + BC);
      fetch(n0 + 2 * BC);
    }
    // ---- S^T = K Q^T: two accumulators per key slice (even / odd k16 steps), so that
    // the MMA chain of one slice is half as long
    float s[MT][4], s2[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][e] = s2[mt][e] = 0.f;
#pragma unroll
    for (int kp = 0; kp < D / 16; ++kp)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t a[4];
        ldmatrix_x4(a, sK + a_frag + mt * 16 * ST + kp * 16);
        float(&acc)[4] = kp & 1 ? s2[mt] : s[mt];
        mma_m16n8k8(acc, a[0], a[1], qb[2 * kp]);
        mma_m16n8k8(acc, a[2], a[3], qb[2 * kp + 1]);
      }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][e] += s2[mt][e];
    // element e of slice mt: key n0 + 16 mt + g + (e >> 1) * 8, row r0 + (e & 1)
    if constexpr (KV == kReadRowScaled) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float k0 = kv_row_scale<C>(sK, mt * 16 + g), k1 = kv_row_scale<C>(sK, mt * 16 + g + 8);
        s[mt][0] *= k0;
        s[mt][1] *= k0;
        s[mt][2] *= k1;
        s[mt][3] *= k1;
      }
    }
    softcap_scores(s, p, sc.cap_in);
    if (SM7X_FA2_TILE_NEEDS_MASK(p, BC, n0, first_row, last_row, sk, off) || n0 < w.kv_lo) {
      const int left = p.window_left, right = p.window_right;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + mt * 16 + g + (e >> 1) * 8;
          if (!key_visible(col, mr[e & 1], sk, off, left, right) || col < w.kv_lo)
            s[mt][e] = -INFINITY;
        }
    }
    // ---- online softmax of the lane's two rows (fp32)
    float alpha[2];
    bool rescale = false;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mx = row_max[j];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mx = fmaxf(mx, fmaxf(s[mt][j], s[mt][j + 2]));
      mx = row_allreduce_max<8, 4>(mx);
      float bias;
      alpha[j] = online_rescale(row_max[j], mx, sc.sl2, bias);
      rescale |= alpha[j] != 1.f;
      float sum = 0.f;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        s[mt][j] = exp2_scaled(s[mt][j], sc.sl2, bias);
        s[mt][j + 2] = exp2_scaled(s[mt][j + 2], sc.sl2, bias);
        sum += s[mt][j] + s[mt][j + 2];
      }
      row_sum[j] = row_sum[j] * alpha[j] + sum;  // per-lane partial, reduced at the end
    }
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[1];
        o[i][2] *= alpha[0];
        o[i][3] *= alpha[1];
      }
    }
    // ---- P^T as B fragments: keys 8 i .. 8 i + 7 of the tile (i = 2 mt: e 0, 1; 2 mt + 1:
    // e 2, 3), an int8 cache's V row scales applied to P (l stays unscaled)
    uint32_t pb[BC / 8];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float v0 = 1.f, v1 = 1.f;
      if constexpr (KV == kReadRowScaled) {
        v0 = kv_row_scale<C>(sV, mt * 16 + g);
        v1 = kv_row_scale<C>(sV, mt * 16 + g + 8);
      }
      pb[2 * mt] = movmatrix_trans(pack_half2(s[mt][0] * v0, s[mt][1] * v0));
      pb[2 * mt + 1] = movmatrix_trans(pack_half2(s[mt][2] * v1, s[mt][3] * v1));
    }
    // ---- O^T += V^T P^T
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int dm = 0; dm < D / 16; ++dm) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, sV + v_frag + mt * 16 * ST + dm * 16);
        mma_m16n8k8(o[dm], a[0], a[1], pb[2 * mt]);
        mma_m16n8k8(o[dm], a[2], a[3], pb[2 * mt + 1]);
      }
    if (t + 1 < t_hi) {
      __syncwarp();  // the warp is done with sK and sV
      store();
      __syncwarp();
    }
  }

  // ---- epilogue: O / l and the LSE per row; fp32 partials, or O staged through sK
  float l[2], lse_end[2];
  const float* const sinks = w.split ? nullptr : p.sinks;  // split rows: run_combine's
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l[j] = row_allreduce_sum<8, 4>(row_sum[j]);
    const int row = r0 + j;  // packed: query head h * group + row % group
    const RowEnd e = row_end(sc, l[j], row_max[j], sinks, h * p.group + row % p.group);
    lse_end[j] = e.lse;
    const float inv = e.inv * kvs.v;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      o[i][j] *= inv;
      o[i][j + 2] *= inv;
    }
  }
  if (w.split) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = r0 + j;
      if (row >= sq) continue;
      const int64_t a = accum_row(p, b, h, row);
      if (g == 0) p.lse_accum[a] = partial_lse(sc, l[j], row_max[j]);
      float* const oa = p.o_accum + a * p.head_dim;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        const int col = i * 16 + g;
        if (col < p.head_dim) oa[col] = o[i][j];
        if (col + 8 < p.head_dim) oa[col + 8] = o[i][j + 2];
      }
    }
    return;
  }
  int64_t o_off, lse_off;
  serving_out_offsets(p, w, 0, h * p.group, o_off, lse_off);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int row = r0 + j;
    if (g == 0 && row < sq)
      p.lse[lse_off + packed_row_offset(row, p.group, 1, p.lse_head_stride)] = lse_end[j];
  }
  __syncwarp();  // the last tile's reads of sK are done
  __half* const sO = sK;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      sO[(tig * 2 + j) * ST + i * 16 + g] = __float2half_rn(o[i][j]);
      sO[(tig * 2 + j) * ST + i * 16 + g + 8] = __float2half_rn(o[i][j + 2]);
    }
  __syncwarp();
  const OutRows rows{o_off, p.group, p.o_row_stride, p.o_head_stride};
  __half* const out = static_cast<__half*>(p.o);
#pragma unroll
  for (int i = 0; i < (BR * C::kChunks + 31) / 32; ++i) {
    const int idx = lane + i * 32;
    const int r = idx / C::kChunks, c = idx % C::kChunks;
    if (r < BR && m0 + r < sq && c * 8 < p.head_dim)
      *reinterpret_cast<uint4*>(out + rows(m0 + r) + c * 8) =
          *reinterpret_cast<const uint4*>(sO + r * ST + c * 8);
  }
}

}  // namespace sm75
}  // namespace fa2
}  // namespace sm7x
