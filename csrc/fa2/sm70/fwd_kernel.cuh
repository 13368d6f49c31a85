// FlashAttention-2 forward kernel for Volta (sm_70). Included only by the generated
// per-head-dim instantiation files (csrc/fa2/fwd_instance.cu.in); no torch header.
//
// Volta has no ldmatrix, no cp.async and no m16n8k8; its tensor-core instruction is
// mma.m8n8k4 (quad-pair layout) and WMMA m16n16k16 on top of it. This kernel uses WMMA
// (nvcuda::wmma, fp16 in, fp32 accumulate). The online softmax needs whole rows, so the
// score tile S goes through shared memory; the output O does not:
//
// One CTA computes BR query rows of one (batch, head): BR / WR warps, each owning WR rows
// (WR / 16 m16 slices sharing every K/V fragment it loads). Per key tile of BC keys, per
// warp:
//   S = Q K^T       WMMA, A = Q (fragments kept in registers with q_in_regs, else read
//                   from shared memory), B = K (col major: K rows as stored) -> the warp's
//                   fp32 S scratch [WR][BC + 8]
//   online softmax  fp32 (common/softmax.cuh), 2 lanes per row (lane >> 1 = row, lane & 1
//                   = which 4-column half of every 8 columns); P written as fp16 over
//                   the front of its S row and read back into A fragments once per tile.
//   O += P V        O stays in WMMA accumulator fragments across tiles (D / 16 per slice).
//                   Their layout is opaque, but fixed: at the start each warp loads a
//                   fragment from a tile whose every element holds its row number, which
//                   tells it the row of each of its accumulator slots; the per-row rescale
//                   then costs one shuffle per slot per tile (fetch the row's alpha from
//                   the softmax lanes) instead of an fp32 round trip of P V through shared
//                   memory per D/16 slice, and P is loaded once instead of D/16 times.
// Global loads are 128-bit and register-staged (common/tile_io.cuh): with
// KvPrefetch::kBoth the next K/V tiles are fetched into registers at the top of an
// iteration and stored to shared memory after its GEMMs; kNone fetches them after.
// Shared memory: K [BC][D+8], V [BC][D+8], then Q [BR][D+8] and the warps' S / P
// scratch [WR][BC+8] fp32, which overlap with q_in_regs (Q is only read before the first tile): that is
// what lets two CTAs share a V100 SM at d <= 128.
//
// Dim split (KS = 4, d512: whole rows would need 256 accumulator registers per lane): KS
// warps share WR rows, each owning D / KS columns of Q and O. Each stores its partial S to
// its own scratch; the group meets at named barrier 1 + rw; each reads the KS partials of
// its rows and sums them in warp order (one order: all KS warps get the same S and run
// the same softmax), and meets the group again before P overwrites its scratch.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

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

template <int D, int BR, int BC, KvPrefetch PREFETCH, bool Q_IN_REGS, int WR = 16, int KS = 1>
struct FwdConfig : FwdShape<D, BR, BC, WR, KS> {
  using Shape = FwdShape<D, BR, BC, WR, KS>;
  static constexpr bool kPrefetch = PREFETCH == KvPrefetch::kBoth;
  static constexpr bool kQInRegs = Q_IN_REGS;
  static constexpr int kSStride = BC + 8;  // fp32 S scratch row stride (floats)
  // P (fp16) overwrites the front half of each S row: row stride 2 kSStride halves.
  static constexpr int kPStride = 2 * kSStride;
  static constexpr int kKVBytes = 2 * BC * Shape::kStride * 2;
  static constexpr int kQBytes = BR * Shape::kStride * 2;
  static constexpr int kWarpScratchBytes = WR * kSStride * 4;
  static constexpr int kScratchBytes = Shape::kWarps * kWarpScratchBytes;
  // q_in_regs: Q's tile is dead once its fragments are loaded, so the scratch reuses it.
  static constexpr int kSmemBytes =
      kKVBytes + (Q_IN_REGS ? (kQBytes > kScratchBytes ? kQBytes : kScratchBytes)
                            : kQBytes + kScratchBytes);
  static_assert(PREFETCH == KvPrefetch::kBoth || PREFETCH == KvPrefetch::kNone,
                "sm70 kernel: prefetch kBoth or kNone");
  static_assert(kKVBytes % 32 == 0 && kQBytes % 32 == 0 && kWarpScratchBytes % 32 == 0,
                "WMMA pointers must stay 32-byte aligned");
  // The row map at the start and the epilogue's fp32 staging use one 16x16 fp32 tile per
  // warp inside the K/V tiles (free then).
  static_assert(Shape::kWarps * 16 * 16 * 4 <= kKVBytes, "sm70 kernel: K/V tiles too small "
                "for the warps' 16x16 staging tiles (more keys per tile or fewer warps)");
};

// SERVING: the serving instantiation, as in sm75/fwd_kernel.cuh (packed GQA rows, keys
// from a (paged) cache, split partials; warps without rows skip the GEMMs).
// KV (fa2.h KvRead) other than fp16, an 8-bit cache: at least 1 CTA per SM, so that
// ptxas keeps the registers it needs (left free it chose 168 for the sm70 d112 narrow
// kernel and spilled 16 bytes);
// 0 (no minimum) leaves the fp16 kernels' SASS as it was.
template <class C, bool SERVING, int KV = kReadF16>
__global__ void __launch_bounds__(C::kThreads, KV != kReadF16 ? 1 : 0) fwd_kernel(const FwdParams p) {
  using namespace nvcuda;
  using namespace detail;
  constexpr bool KV8 = KV != kReadF16;  // fa2.h KvRead: a cache of one-byte codes
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major>;
  constexpr int D = C::kHeadDim, BR = C::kBlockM, BC = C::kBlockN, ST = C::kStride;
  constexpr int SS = C::kSStride, PS = C::kPStride;
  constexpr int MS = C::kSlices, WR = C::kWarpRows, KS = C::kDimSplit;
  constexpr int DW = D / KS;  // head-dim columns of Q and O this warp holds
  static_assert(KS == 1 || BR / WR <= 15, "dim split: one named barrier per row group (ids 1..15)");
  constexpr int NJ = BC / 8;  // 8-column groups of S per row
  constexpr int NS = Acc::num_elements;  // accumulator slots per lane
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __half* sK = reinterpret_cast<__half*>(smem_raw);
  __half* sV = sK + BC * ST;
  __half* sQ = sV + BC * ST;
  unsigned char* scratch_base = smem_raw + C::kKVBytes + (C::kQInRegs ? 0 : C::kQBytes);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int lr = lane >> 1, half = lane & 1;  // softmax layout: row lr, 4-col half
  // rw: the row group (WR rows) of this warp; its columns start at c0 (dim split)
  const int rw = warp / KS, c0 = KS > 1 ? (warp % KS) * DW : 0;
  // Prefill: (m-block, head, batch); serving: (m-block, kv head, partition).
  const int h = blockIdx.y, b = blockIdx.z;
  // Last m-block first: with causal masking it has the most key tiles (less tail).
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BR;
  float* scratch = reinterpret_cast<float*>(scratch_base + warp * C::kWarpScratchBytes);
  __half* sP = reinterpret_cast<__half*>(scratch);  // row r: the front of S's row r
  float* stage = reinterpret_cast<float*>(smem_raw) + warp * 256;  // 16x16 fp32, in sK/sV

  CtaWork cw;
  if (!cta_work<BR, BC, SERVING, KV>(p, b, h, m0, cw)) return;
  const int sq = cw.sq, sk = cw.sk, off = cw.off, t_lo = cw.t_lo, t_hi = cw.t_hi;
  const int first_row = cw.first_row, last_row = cw.last_row;
  [[maybe_unused]] const ServingWork& w = cw.w;
  // 8-bit cache: the descales (and E4M3's 2^8) fold into the softmax scale and 1 / l
  const KvScales kvs = kv_scales<KV8>(p, w, h);
  const SoftmaxScale sc = softmax_scale(p, kvs.k);
  const bool warp_on = !SERVING || m0 + rw * WR < sq;

  // The row (0..15 of an m16 slice) of each accumulator slot of this lane, 4 bits per slot
  // (one register): the same for every accumulator fragment, so the softmax lane 2 * row
  // holds that slot's alpha.
  static_assert(NS <= 8, "sm70 kernel: row map packs 8 slots of 4 bits");
  uint32_t slot_rows = 0;
  {
    for (int i = lane; i < 256; i += 32) stage[i] = static_cast<float>(i >> 4);
    __syncwarp();
    Acc rows;
    wmma::load_matrix_sync(rows, stage, 16, wmma::mem_row_major);
#pragma unroll
    for (int i = 0; i < NS; ++i) slot_rows |= static_cast<uint32_t>(rows.x[i]) << (4 * i);
  }
  __syncthreads();  // the staging tiles lie in sK / sV, stored next
  auto row_value = [&](float x, int i) {
    return __shfl_sync(0xffffffffu, x, static_cast<int>((slot_rows >> (4 * i)) & 15u) * 2);
  };

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

  {
    uint4 qr[C::kQLoads];
    load_q<C, SERVING>(qr, p, cw, m0, tid);
    store_tile<C, BR>(sQ, qr, tid);
  }

  Acc o[MS][DW / 16];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int j = 0; j < DW / 16; ++j) wmma::fill_fragment(o[ms][j], 0.f);
  float row_max[MS], row_sum[MS];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms) row_max[ms] = -INFINITY, row_sum[ms] = 0.f;
  const int row0 = m0 + rw * WR + lr;  // this lane's query row of slice 0

  KvStage<KL, KV> stage_k, stage_v;
  if (t_lo < t_hi) {
    fetch(t_lo * BC);
    load_k(stage_k, t_lo * BC);
    load_v(stage_v, t_lo * BC);
    fetch((t_lo + 1) * BC);
    store_kv<C, KV>(sK, stage_k, p, tid);
    store_kv<C, KV>(sV, stage_v, p, tid);
  }
  __syncthreads();

  const __half* sQw = sQ + rw * WR * ST + c0;
  [[maybe_unused]] FragA qf[C::kQInRegs ? MS : 1][C::kQInRegs ? DW / 16 : 1];
  if constexpr (C::kQInRegs) {
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int kk = 0; kk < DW / 16; ++kk)
        wmma::load_matrix_sync(qf[ms][kk], sQw + ms * 16 * ST + kk * 16, ST);
    __syncthreads();  // the scratch overlaps every warp's Q rows
  }

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
    // ---- S = Q K^T -> scratch (every K fragment feeds the warp's MS slices)
    {
      Acc acc[MS][BC / 16];
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nn = 0; nn < BC / 16; ++nn) wmma::fill_fragment(acc[ms][nn], 0.f);
#pragma unroll
      for (int kk = 0; kk < DW / 16; ++kk) {
        FragA a[MS];
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          if constexpr (C::kQInRegs)
            a[ms] = qf[ms][kk];
          else
            wmma::load_matrix_sync(a[ms], sQw + ms * 16 * ST + kk * 16, ST);
        }
#pragma unroll
        for (int nn = 0; nn < BC / 16; ++nn) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> bk;
          wmma::load_matrix_sync(bk, sK + nn * 16 * ST + kk * 16 + c0, ST);
#pragma unroll
          for (int ms = 0; ms < MS; ++ms) wmma::mma_sync(acc[ms][nn], a[ms], bk, acc[ms][nn]);
        }
      }
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nn = 0; nn < BC / 16; ++nn)
          wmma::store_matrix_sync(scratch + ms * 16 * SS + nn * 16, acc[ms][nn], SS,
                                  wmma::mem_row_major);
    }
    if constexpr (KS > 1)
      named_barrier(1 + rw, 32 * KS);  // the group's partial S stored
    else
      __syncwarp();
    // ---- softcap, masking, online softmax (fp32); P -> sP as fp16
    float alpha[MS];
#pragma unroll
    for (int ms = 0; ms < MS; ++ms) {
      const float* srow = scratch + (ms * 16 + lr) * SS;
      float s[NJ][4];
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        if constexpr (KS == 1) {
          const float4 v4 = *reinterpret_cast<const float4*>(srow + j * 8 + half * 4);
          s[j][0] = v4.x;
          s[j][1] = v4.y;
          s[j][2] = v4.z;
          s[j][3] = v4.w;
        } else {  // the group's partials, summed in warp order
          s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
          for (int x = 0; x < KS; ++x) {
            const float* xrow = reinterpret_cast<const float*>(
                scratch_base + (rw * KS + x) * C::kWarpScratchBytes) + (ms * 16 + lr) * SS;
            const float4 v4 = *reinterpret_cast<const float4*>(xrow + j * 8 + half * 4);
            s[j][0] += v4.x;
            s[j][1] += v4.y;
            s[j][2] += v4.z;
            s[j][3] += v4.w;
          }
        }
      }
      if constexpr (KV == kReadRowScaled) {  // int8 cache: each key's scale on its score
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] *= kv_row_scale<C>(sK, j * 8 + half * 4 + e);
      }
      softcap_scores(s, p, sc.cap_in);
      // s[j][e]: key n0 + 8 j + 4 half + e of this lane's row
      const int row = row0 + ms * 16;
      const int mrow = SERVING ? row / p.group : row;  // its query position for the masks
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
      float mx = row_max[ms];
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        mx = fmaxf(mx, fmaxf(fmaxf(s[j][0], s[j][1]), fmaxf(s[j][2], s[j][3])));
      mx = row_allreduce_max<2>(mx);
      float bias;
      alpha[ms] = online_rescale(row_max[ms], mx, sc.sl2, bias);
      float sum = 0.f;
      if constexpr (KS > 1)
        named_barrier(1 + rw, 32 * KS);  // the group has read these rows before P overwrites them
      else
        __syncwarp();  // both lanes of the row have read it before P overwrites its front
      __half* prow = sP + (ms * 16 + lr) * PS;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = exp2_scaled(s[j][e], sc.sl2, bias);
          sum += s[j][e];
        }
        uint2 pk;
        if constexpr (KV == kReadRowScaled) {  // P times each key's V scale (l unscaled)
          float v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) v[e] = s[j][e] * kv_row_scale<C>(sV, j * 8 + half * 4 + e);
          pk.x = pack_half2(v[0], v[1]);
          pk.y = pack_half2(v[2], v[3]);
        } else {
          pk.x = pack_half2(s[j][0], s[j][1]);
          pk.y = pack_half2(s[j][2], s[j][3]);
        }
        *reinterpret_cast<uint2*>(prow + j * 8 + half * 4) = pk;
      }
      row_sum[ms] = row_sum[ms] * alpha[ms] + sum;  // per-lane partial, reduced at the end
    }
    __syncwarp();
    // ---- O = O * alpha + P V: P read once; each V fragment feeds the MS slices
    {
      FragA pa[MS][BC / 16];
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
#pragma unroll
        for (int kt = 0; kt < BC / 16; ++kt)
          wmma::load_matrix_sync(pa[ms][kt], sP + ms * 16 * PS + kt * 16, PS);
        float a_slot[NS];
#pragma unroll
        for (int i = 0; i < NS; ++i) a_slot[i] = row_value(alpha[ms], i);
#pragma unroll
        for (int dn = 0; dn < DW / 16; ++dn)
#pragma unroll
          for (int i = 0; i < NS; ++i) o[ms][dn].x[i] *= a_slot[i];
      }
#pragma unroll
      for (int dn = 0; dn < DW / 16; ++dn)
#pragma unroll
        for (int kt = 0; kt < BC / 16; ++kt) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> bv;
          wmma::load_matrix_sync(bv, sV + kt * 16 * ST + dn * 16 + c0, ST);
#pragma unroll
          for (int ms = 0; ms < MS; ++ms) wmma::mma_sync(o[ms][dn], pa[ms][kt], bv, o[ms][dn]);
        }
    }
    }  // warp_on
    if (t + 1 < t_hi) {
      __syncthreads();  // every warp is done with sK and sV
      if constexpr (!C::kPrefetch) {
        load_k(stage_k, n0 + BC);
        load_v(stage_v, n0 + BC);
        fetch(n0 + 2 * BC);
      }
      store_kv<C, KV>(sK, stage_k, p, tid);
      store_kv<C, KV>(sV, stage_v, p, tid);
      __syncthreads();
    }
  }
  // Every warp is past its GEMMs: the staging tiles (sK / sV) and sO (Q's tile, which the
  // scratch may overlap) are free.
  __syncthreads();

  // ---- epilogue: O / l and LSE per row; O leaves the accumulators slice by slice through
  // the warp's 16x16 staging tile, to fp16 rows in sO (or fp32 partials)
  [[maybe_unused]] int64_t o_off, lse_off;
  float l[MS], lse_end[MS];
  // prefill: query head h; serving: the packed row's (split rows: run_combine adds sinks)
  const float* sinks = p.sinks;
  if constexpr (SERVING) sinks = w.split ? nullptr : p.sinks;
#pragma unroll
  for (int ms = 0; ms < MS; ++ms) {
    l[ms] = row_allreduce_sum<2>(row_sum[ms]);
    const int row = row0 + ms * 16;
    const RowEnd e = row_end(sc, l[ms], row_max[ms], sinks, SERVING ? h * p.group + row % p.group : h);
    lse_end[ms] = e.lse;
    const float inv = e.inv * kvs.v;
    float inv_slot[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) inv_slot[i] = row_value(inv, i);
#pragma unroll
    for (int dn = 0; dn < DW / 16; ++dn)
#pragma unroll
      for (int i = 0; i < NS; ++i) o[ms][dn].x[i] *= inv_slot[i];
  }
  // The lane's 8 columns (half * 8 ..) of row lr of slice ms, 16-column group dn.
  auto stage_row = [&](int ms, int dn, float (&v)[8]) {
    wmma::store_matrix_sync(stage, o[ms][dn], 16, wmma::mem_row_major);
    __syncwarp();
    const float4 x = *reinterpret_cast<const float4*>(stage + lr * 16 + half * 8);
    const float4 y = *reinterpret_cast<const float4*>(stage + lr * 16 + half * 8 + 4);
    __syncwarp();
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z,
    v[7] = y.w;
  };
  if constexpr (SERVING) {
    if (w.split) {  // fp32 partials, for run_combine
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        const int row = row0 + ms * 16;
        if (!warp_on) continue;
        const int64_t a = row < sq ? accum_row(p, b, h, row) : 0;
        if (half == 0 && c0 == 0 && row < sq) p.lse_accum[a] = partial_lse(sc, l[ms], row_max[ms]);
#pragma unroll
        for (int dn = 0; dn < DW / 16; ++dn) {
          float v[8];
          stage_row(ms, dn, v);
          const int col = c0 + dn * 16 + half * 8;
          if (row < sq && col < p.head_dim) {
            float4* dst = reinterpret_cast<float4*>(p.o_accum + a * p.head_dim + col);
            dst[0] = make_float4(v[0], v[1], v[2], v[3]);
            dst[1] = make_float4(v[4], v[5], v[6], v[7]);
          }
        }
      }
      return;
    }
    serving_out_offsets(p, w, 0, h * p.group, o_off, lse_off);
#pragma unroll
    for (int ms = 0; ms < MS; ++ms) {
      const int row = row0 + ms * 16;
      if (half == 0 && c0 == 0 && row < sq)
        p.lse[lse_off + packed_row_offset(row, p.group, 1, p.lse_head_stride)] = lse_end[ms];
    }
  } else {
    out_offsets(p, b, h, o_off, lse_off);
#pragma unroll
    for (int ms = 0; ms < MS; ++ms) {
      const int row = row0 + ms * 16;
      if (half == 0 && c0 == 0 && row < sq) p.lse[lse_off + row] = lse_end[ms];
    }
  }
#pragma unroll
  for (int ms = 0; ms < MS; ++ms) {
    const int slice = rw * MS + ms;
    __half* sO = sQ + slice * 16 * ST;
#pragma unroll
    for (int dn = 0; dn < DW / 16; ++dn) {
      float v[8];
      stage_row(ms, dn, v);
      uint4 pk;
      pk.x = pack_half2(v[0], v[1]);
      pk.y = pack_half2(v[2], v[3]);
      pk.z = pack_half2(v[4], v[5]);
      pk.w = pack_half2(v[6], v[7]);
      *reinterpret_cast<uint4*>(sO + lr * ST + c0 + dn * 16 + half * 8) = pk;
    }
    if constexpr (KS > 1)
      named_barrier(1 + rw, 32 * KS);  // every part of the slice staged
    else
      __syncwarp();
    store_o_slice<C, SERVING>(p, o_off, sO, m0, slice, sq, lane, warp % KS);
  }
}

}  // namespace sm70
}  // namespace fa2
}  // namespace sm7x
