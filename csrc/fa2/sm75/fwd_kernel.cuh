// FlashAttention-2 forward kernel for Turing (sm_75). Included only by the generated
// per-head-dim instantiation files (csrc/fa2/fwd_instance.cu.in); no torch header.
//
// One CTA computes BR query rows of one (batch, head): BR / WR warps, each owning WR = 16
// or 32 rows (one or two m16 slices; with two, each K and V fragment loaded from shared
// memory feeds both slices' MMAs). Per key tile of BC keys:
//   S = Q K^T       mma.sync m16n8k8 (fp16 in, fp32 accumulate), A from Q and B from K
//                   via ldmatrix (K rows are the B "col" layout as stored)
//   online softmax  fp32 (common/softmax.cuh); a quad of lanes holds a pair of rows
//   O += P V        P stays in registers: the accumulator of an n8 tile of S is, packed
//                   to fp16, exactly the A fragment of an m16n8k8 with k = those 8 keys
//                   (two chained k8 MMAs = the m16n8k16 A layout); V through
//                   ldmatrix.trans.
// Turing has no cp.async: the next tiles are fetched with 128-bit global loads into
// registers, issued before the GEMMs of the current tile, and stored to shared memory
// after them (KvPrefetch::kBoth, kStaged or kDouble, common/config.cuh).
// Shared memory: Q [BR][D+8], then K [BC][D+8], V [BC][D+8] fp16, twice with kDouble
// (with Q_IN_REGS, K and V reuse the Q tile's space); with a dim split, then one fp32
// S exchange slot per warp.
//
// Dim split (KS = 2, d256): a pair of warps shares 16 rows, each holding half of the
// head dim of Q and O (64 O accumulators instead of 128, Q in registers); they sum their
// partial S through shared memory (common/dim_split.cuh), run the same softmax, and each
// multiplies P by its half of V. Every warp reads half of each K and V tile, so a d256
// tile costs a warp as much shared memory as a d128 one. KS = 4 (d512): four warps share
// 16 rows, each with a quarter of the head dim (64 O accumulators), and each sums the four
// partial S tiles in warp order. The serving instantiation takes a dim split too (d512 has
// no other way to hold O): each warp writes its columns of the partials and of the output;
// the first warp of the group writes the LSE.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/bounds.cuh"
#include "common/config.cuh"
#include "common/dim_split.cuh"
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

// Q_IN_REGS: each warp keeps its Q fragments (WR / 16 x D / 16 x 4 registers) for the
// whole key loop instead of re-reading them from shared memory per tile; the Q tile is
// then only staged in shared memory, which the K/V tiles reuse (smem = max(Q, K/V tiles)).
template <int D, int BR, int BC, KvPrefetch PREFETCH, bool Q_IN_REGS, int WR = 16, int KS = 1>
struct FwdConfig : FwdShape<D, BR, BC, WR, KS> {
  using Shape = FwdShape<D, BR, BC, WR, KS>;
  static constexpr KvPrefetch kPrefetch = PREFETCH;
  static constexpr bool kQInRegs = Q_IN_REGS;
  // K/V of the next tile held in registers across the whole iteration
  static constexpr bool kPrefetchBoth = PREFETCH == KvPrefetch::kBoth || PREFETCH == KvPrefetch::kDouble;
  static constexpr bool kDouble = PREFETCH == KvPrefetch::kDouble;
  static constexpr int kKvRows = (kDouble ? 4 : 2) * BC;  // K and V tiles, x2 with kDouble
  static constexpr int kTileBytes =
      (Q_IN_REGS ? (BR > kKvRows ? BR : kKvRows) : BR + kKvRows) * Shape::kStride * 2;
  // dim split: one slot per warp of its partial S (a float4 per lane per slice and n8 tile)
  static constexpr int kExchangeBytes = KS > 1 ? Shape::kWarps * (WR / 16) * (BC / 8) * 32 * 16 : 0;
  static constexpr int kSmemBytes = kTileBytes + kExchangeBytes;
  static_assert(PREFETCH != KvPrefetch::kNone, "sm75 kernel: prefetch kBoth, kStaged or kDouble");
};

// SERVING: the serving instantiation (fa2.h "Serving", common/serving.cuh): grid (m-block,
// kv head, partition), the rows are a GQA group's packed query rows, keys come from a
// (paged) cache and a split sequence writes fp32 partials. Warps whose rows are all past
// the sequence's rows skip the GEMMs (decode: one token x group rows) but still load tiles.
// KV (fa2.h KvRead) other than fp16, an 8-bit cache: at least 1 CTA per SM, so that
// ptxas keeps the registers it needs (left free it chose 168 for the sm70 d112 narrow
// kernel and spilled 16 bytes);
// 0 (no minimum) leaves the fp16 kernels' SASS as it was.
template <class C, bool SERVING, int KV = kReadF16>
__global__ void __launch_bounds__(C::kThreads, KV != kReadF16 ? 1 : 0) fwd_kernel(const FwdParams p) {
  using namespace detail;
  constexpr bool KV8 = KV != kReadF16;  // fa2.h KvRead: a cache of one-byte codes
  constexpr int D = C::kHeadDim, BR = C::kBlockM, BC = C::kBlockN, ST = C::kStride;
  constexpr int MS = C::kSlices, WR = C::kWarpRows, KS = C::kDimSplit;
  static_assert(KS == 1 || BR / WR <= 15, "dim split: one named barrier per row group (ids 1..15)");
  constexpr int DW = D / KS;  // head-dim columns of Q and O this warp holds
  constexpr int NT = BC / 8;  // n8 tiles of S per slice
  constexpr int DT = DW / 8;  // n8 tiles of O per slice
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* sQ = reinterpret_cast<__half*>(smem_raw);
  __half* const sK0 = C::kQInRegs ? sQ : sQ + BR * ST;  // kQInRegs: K/V reuse the Q staging

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // rw: the row group (WR rows) of this warp; its columns start at c0 (dim split)
  const int rw = warp / KS, c0 = KS > 1 ? (warp % KS) * DW : 0;
  const int g = lane >> 2, tig = lane & 3;
  // Prefill: (m-block, head, batch); serving: (m-block, kv head, partition).
  const int h = blockIdx.y, b = blockIdx.z;
  // Last m-block first: with causal masking it has the most key tiles (less tail).
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BR;

  CtaWork cw;
  if (!cta_work<BR, BC, SERVING, KV>(p, b, h, m0, cw)) return;
  const int sq = cw.sq, sk = cw.sk, off = cw.off, t_lo = cw.t_lo, t_hi = cw.t_hi;
  const int first_row = cw.first_row, last_row = cw.last_row;
  [[maybe_unused]] const ServingWork& w = cw.w;
  // 8-bit cache: the descales (and E4M3's 2^8) fold into the softmax scale and 1 / l
  const KvScales kvs = kv_scales<KV8>(p, w, h);
  const SoftmaxScale sc = softmax_scale(p, kvs.k);
  const bool warp_on = !SERVING || m0 + rw * WR < sq;
  // An 8-bit cache (KV8) is loaded 16 codes per load (CodeTile): fewer loads, its own
  // row map (the pages fetched follow it)
  using Tile = std::conditional_t<KV8, CodeTile<C>, C>;
  constexpr int KL = kv_tile_loads<C, KV8>();
  // K / V tile n0 -> registers; serving: the pages of the next tile's rows are fetched
  // into pg one tile ahead (fetch(n0) right after the loads of the tile before).
  [[maybe_unused]] int pg[SERVING ? KL : 1];
  auto fetch = [&](int n0) {
    if constexpr (SERVING) fetch_pages<Tile>(pg, p, w.pages, n0, sk, tid);
  };
  auto load_k = [&](KvStage<KL, KV>& r, int n0) {
    load_kv<C, SERVING, false, KV>(r, pg, p, cw, n0, tid);
  };
  auto load_v = [&](KvStage<KL, KV>& r, int n0) {
    load_kv<C, SERVING, true, KV>(r, pg, p, cw, n0, tid);
  };

  // Q tile -> smem (once).
  {
    uint4 qr[C::kQLoads];
    load_q<C, SERVING>(qr, p, cw, m0, tid);
    store_tile<C, BR>(sQ, qr, tid);
  }
  // Slice ms of this warp: rows rw * WR + ms * 16 .. + 15 of the tile (columns c0 ..).
  const __half* q_frag_base =
      sQ + (rw * WR + (lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8 + c0;
  uint32_t qa[C::kQInRegs ? MS : 1][C::kQInRegs ? DW / 16 : 1][4];
  if constexpr (C::kQInRegs) {
    __syncthreads();  // Q tile stored
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int kk = 0; kk < DW / 16; ++kk) ldmatrix_x4(qa[ms][kk], q_frag_base + ms * 16 * ST + kk * 16);
    __syncthreads();  // every warp holds its Q fragments: sQ is free for K and V
  }

  float o[MS][DT][4];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int i = 0; i < DT; ++i) o[ms][i][0] = o[ms][i][1] = o[ms][i][2] = o[ms][i][3] = 0.f;
  float row_max[MS][2], row_sum[MS][2];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms) {
    row_max[ms][0] = row_max[ms][1] = -INFINITY;
    row_sum[ms][0] = row_sum[ms][1] = 0.f;
  }
  // rows of this thread in slice ms: r0 + 16 ms and r0 + 16 ms + 8
  const int r0 = m0 + rw * WR + g;
  // The query position of row r for the masks (serving: its token).
  auto mask_row = [&](int r) { return SERVING ? r / p.group : r; };

  KvStage<KL, KV> stage;
  KvStage<C::kPrefetchBoth ? KL : 1, KV> stage_v;
  if (t_lo < t_hi) {
    fetch(t_lo * BC);
    load_k(stage, t_lo * BC);
    store_kv<C, KV>(sK0, stage, p, tid);
    load_v(stage, t_lo * BC);
    fetch((t_lo + 1) * BC);
    store_kv<C, KV>(sK0 + BC * ST, stage, p, tid);
  }
  __syncthreads();

  const int k_frag = ((lane & 7) + (lane >> 4) * 8) * ST + ((lane >> 3) & 1) * 8 + c0;
  const int v_frag = ((lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8 + c0;
  // dim split: the exchange slots (common/dim_split.cuh) after the tiles, MS x NT float4
  // per lane; the KS warps of a row group meet at named barrier 1 + rw
  [[maybe_unused]] const PairSlots xs = pair_slots(smem_raw + C::kTileBytes, warp, MS * NT * 32, lane);
  [[maybe_unused]] const float4* const group_first = xs.mine - (warp % KS) * MS * NT * 32;

  for (int t = t_lo; t < t_hi; ++t) {
    const int n0 = t * BC;
    // kDouble: tile t lives in buffer (t - t_lo) & 1
    __half* const sK = C::kDouble && ((t - t_lo) & 1) ? sK0 + 2 * BC * ST : sK0;
    __half* const sV = sK + BC * ST;
    if constexpr (C::kPrefetchBoth) {
      if (t + 1 < t_hi) {  // K_{t+1}, V_{t+1} in flight during this whole iteration
        load_k(stage, n0 + BC);
        load_v(stage_v, n0 + BC);
        fetch(n0 + 2 * BC);
      }
    } else {  // kStaged
      if (t + 1 < t_hi)  // K_{t+1} in flight during S = Q K_t^T and the softmax
        load_k(stage, n0 + BC);
    }
    uint32_t pa[MS][NT][2];  // P as fp16 A fragments: tile i covers keys n0 + 8i .. 8i + 7.
    if (warp_on) {
    // ---- S = Q K^T: each K fragment feeds the MS slices
    float s[MS][NT][4];
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int i = 0; i < NT; ++i) s[ms][i][0] = s[ms][i][1] = s[ms][i][2] = s[ms][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DW / 16; ++kk) {
      uint32_t a[MS][4];
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        if constexpr (C::kQInRegs) {
#pragma unroll
          for (int j = 0; j < 4; ++j) a[ms][j] = qa[ms][kk][j];
        } else {
          ldmatrix_x4(a[ms], q_frag_base + ms * 16 * ST + kk * 16);
        }
      }
#pragma unroll
      for (int nn = 0; nn < BC / 16; ++nn) {
        uint32_t bk[4];
        ldmatrix_x4(bk, sK + k_frag + nn * 16 * ST + kk * 16);
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          mma_k16(s[ms][2 * nn], s[ms][2 * nn + 1], a[ms], bk);
        }
      }
    }
    if constexpr (KS > 1) {
      // S = the sum of the group's partials. A slot is rewritten next tile only after a
      // CTA barrier of this one, which the other warps reach after their reads.
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) put_partial(xs.mine + ms * NT * 32, s[ms]);
      named_barrier(1 + rw, 32 * KS);
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        if constexpr (KS == 2)  // this half's partial + the partner's (a + b == b + a)
          add_partial(s[ms], xs.peer + ms * NT * 32);
        else
          sum_partials<KS>(s[ms], group_first + ms * NT * 32, MS * NT * 32);
      }
    }
    if constexpr (KV == kReadRowScaled) {  // int8 cache: each key's scale on its score column
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const float k0 = kv_row_scale<C>(sK, i * 8 + tig * 2);
        const float k1 = kv_row_scale<C>(sK, i * 8 + tig * 2 + 1);
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          s[ms][i][0] *= k0;
          s[ms][i][1] *= k1;
          s[ms][i][2] *= k0;
          s[ms][i][3] *= k1;
        }
      }
    }
    // ---- softcap, masking, online softmax (fp32)
    bool rescale = false;
#pragma unroll
    for (int ms = 0; ms < MS; ++ms) {
      softcap_scores(s[ms], p, sc.cap_in);
      if (SM7X_FA2_TILE_NEEDS_MASK(p, BC, n0, first_row, last_row, sk, off) ||
          (SERVING && n0 < w.kv_lo)) {
        const int left = p.window_left, right = p.window_right;
        const int mr0 = mask_row(r0 + ms * 16), mr1 = mask_row(r0 + ms * 16 + 8);
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {  // element e of n8 tile i: row + (e >> 1) * 8, key + (e & 1)
            const int col = n0 + i * 8 + tig * 2 + (e & 1);
            if (!key_visible(col, (e >> 1) ? mr1 : mr0, sk, off, left, right) ||
                (SERVING && col < w.kv_lo))
              s[ms][i][e] = -INFINITY;
          }
      }
    }
    float alpha[MS][2];
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {  // rows r0 (hr = 0) and r0 + 8 (hr = 1) of the slice
      float mx = row_max[ms][hr];
#pragma unroll
      for (int i = 0; i < NT; ++i) mx = fmaxf(mx, fmaxf(s[ms][i][2 * hr], s[ms][i][2 * hr + 1]));
      mx = row_allreduce_max<4>(mx);
      float bias;
      alpha[ms][hr] = online_rescale(row_max[ms][hr], mx, sc.sl2, bias);
      rescale |= alpha[ms][hr] != 1.f;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        s[ms][i][2 * hr] = exp2_scaled(s[ms][i][2 * hr], sc.sl2, bias);
        s[ms][i][2 * hr + 1] = exp2_scaled(s[ms][i][2 * hr + 1], sc.sl2, bias);
        sum += s[ms][i][2 * hr] + s[ms][i][2 * hr + 1];
      }
      row_sum[ms][hr] = row_sum[ms][hr] * alpha[ms][hr] + sum;  // per-thread partial, reduced at the end
    }
    // O *= alpha only when some row of the warp saw a new max (alpha != 1): once the
    // maxima settle most tiles skip the D / 2 multiplies (same result: x * 1 == x).
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        o[ms][i][0] *= alpha[ms][0];
        o[ms][i][1] *= alpha[ms][0];
        o[ms][i][2] *= alpha[ms][1];
        o[ms][i][3] *= alpha[ms][1];
      }
    }
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      if constexpr (KV == kReadRowScaled) {  // P times each key's V scale (l stays unscaled)
        const float v0 = kv_row_scale<C>(sV, i * 8 + tig * 2);
        const float v1 = kv_row_scale<C>(sV, i * 8 + tig * 2 + 1);
        pa[ms][i][0] = pack_half2(s[ms][i][0] * v0, s[ms][i][1] * v1);
        pa[ms][i][1] = pack_half2(s[ms][i][2] * v0, s[ms][i][3] * v1);
      } else {
        pa[ms][i][0] = pack_half2(s[ms][i][0], s[ms][i][1]);
        pa[ms][i][1] = pack_half2(s[ms][i][2], s[ms][i][3]);
      }
    }
    }  // warp_on
    if constexpr (C::kPrefetch == KvPrefetch::kStaged) {
      __syncthreads();  // every warp is done with sK (K_t)
      if (t + 1 < t_hi) {
        store_kv<C, KV>(sK, stage, p, tid);  // K_{t+1}: read after the barrier below
        load_v(stage, n0 + BC);
        fetch(n0 + 2 * BC);
      }
    }
    // ---- O += P V (K_{t+1} or V_{t+1} loads in flight): each V fragment feeds the MS slices
    if (warp_on) {
#pragma unroll
    for (int kt = 0; kt < BC / 16; ++kt) {
#pragma unroll
      for (int dn = 0; dn < DW / 16; ++dn) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, sV + v_frag + kt * 16 * ST + dn * 16);
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          // P's two n8 tiles of these 16 keys: the A fragment of a k16 step
          const uint32_t a[4] = {pa[ms][2 * kt][0], pa[ms][2 * kt][1], pa[ms][2 * kt + 1][0],
                                 pa[ms][2 * kt + 1][1]};
          mma_k16(o[ms][2 * dn], o[ms][2 * dn + 1], a, bv);
        }
      }
    }
    }  // warp_on
    if (t + 1 < t_hi) {
      if constexpr (C::kPrefetch == KvPrefetch::kStaged) {
        __syncthreads();  // every warp is done with sV (V_t)
        store_kv<C, KV>(sV, stage, p, tid);  // V_{t+1}: read after the next iteration's first barrier
      } else if constexpr (C::kDouble) {
        // the other buffer: every warp left it (tile t - 1) before the last barrier
        __half* const nK = sK == sK0 ? sK0 + 2 * BC * ST : sK0;
        store_kv<C, KV>(nK, stage, p, tid);
        store_kv<C, KV>(nK + BC * ST, stage_v, p, tid);
        __syncthreads();  // K_{t+1}, V_{t+1} stored
      } else {
        __syncthreads();  // every warp is done with sK and sV
        store_kv<C, KV>(sK, stage, p, tid);
        store_kv<C, KV>(sV, stage_v, p, tid);
        __syncthreads();
      }
    }
  }

  // ---- epilogue: O / l, LSE; O staged through this warp's own rows of sQ
  [[maybe_unused]] int64_t o_off, lse_off;
  if constexpr (SERVING) {
    float l[MS][2], lse_end[MS][2];
    const float* const sinks = w.split ? nullptr : p.sinks;  // split rows: run_combine's
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      l[ms][hr] = row_allreduce_sum<4>(row_sum[ms][hr]);
      const int row = r0 + ms * 16 + hr * 8;  // packed: query head h * group + row % group
      const RowEnd e = row_end(sc, l[ms][hr], row_max[ms][hr], sinks, h * p.group + row % p.group);
      lse_end[ms][hr] = e.lse;
      const float inv = e.inv * kvs.v;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        o[ms][i][2 * hr] *= inv;
        o[ms][i][2 * hr + 1] *= inv;
      }
    }
    if (w.split) {  // fp32 partials straight from the registers, for run_combine
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = r0 + ms * 16 + hr * 8;
        if (row >= sq) continue;
        const int64_t a = accum_row(p, b, h, row);
        if (tig == 0 && c0 == 0) p.lse_accum[a] = partial_lse(sc, l[ms][hr], row_max[ms][hr]);
#pragma unroll
        for (int i = 0; i < DT; ++i) {
          const int col = c0 + i * 8 + tig * 2;
          if (col < p.head_dim)
            *reinterpret_cast<float2*>(p.o_accum + a * p.head_dim + col) =
                make_float2(o[ms][i][2 * hr], o[ms][i][2 * hr + 1]);
        }
      }
      return;
    }
    serving_out_offsets(p, w, 0, h * p.group, o_off, lse_off);
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = r0 + ms * 16 + hr * 8;
      if (tig == 0 && c0 == 0 && row < sq)
        p.lse[lse_off + packed_row_offset(row, p.group, 1, p.lse_head_stride)] = lse_end[ms][hr];
    }
  } else {
    out_offsets(p, b, h, o_off, lse_off);
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float l = row_allreduce_sum<4>(row_sum[ms][hr]);
      const RowEnd e = row_end(sc, l, row_max[ms][hr], p.sinks, h);
      const float inv = e.inv * kvs.v;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        o[ms][i][2 * hr] *= inv;
        o[ms][i][2 * hr + 1] *= inv;
      }
      const int row = r0 + ms * 16 + hr * 8;
      if (tig == 0 && c0 == 0 && row < sq) p.lse[lse_off + row] = e.lse;
    }
  }
  if constexpr (C::kQInRegs)
    __syncthreads();  // sO overlaps sK / sV, which other warps may still read
  else
    __syncwarp();
#pragma unroll
  for (int ms = 0; ms < MS; ++ms) {
    const int slice = rw * MS + ms;
    __half* sO = sQ + slice * 16 * ST;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      *reinterpret_cast<uint32_t*>(sO + g * ST + c0 + i * 8 + tig * 2) = pack_half2(o[ms][i][0], o[ms][i][1]);
      *reinterpret_cast<uint32_t*>(sO + (g + 8) * ST + c0 + i * 8 + tig * 2) =
          pack_half2(o[ms][i][2], o[ms][i][3]);
    }
    if constexpr (KS > 1)
      named_barrier(1 + rw, 32 * KS);  // every part of the slice staged
    else
      __syncwarp();
    store_o_slice<C, SERVING>(p, o_off, sO, m0, slice, sq, lane, warp % KS);
  }
}

}  // namespace sm75
}  // namespace fa2
}  // namespace sm7x
