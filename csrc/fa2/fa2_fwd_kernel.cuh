// FlashAttention-2 forward kernel for Turing (sm_75). Included only by the per-head-dim
// instantiation files (fa2_fwd_hdim*.cu); no torch header.
//
// One CTA computes BR query rows of one (batch, head): BR / 16 warps, each owning 16
// rows (one m16 slice). Per key tile of BC keys:
//   S = Q K^T       mma.sync m16n8k8 (fp16 in, fp32 accumulate), A from Q and B from K
//                   via ldmatrix (K rows are the B "col" layout as stored)
//   online softmax  fp32, running max / sum per row, exp2 with log2(e) folded into the
//                   scale; masking for seqlen tails, causal (bottom-right aligned),
//                   sliding window; optional tanh softcap
//   O += P V        P stays in registers: the accumulator of an n8 tile of S is, packed
//                   to fp16, exactly the A fragment of an m16n8k8 with k = those 8 keys
//                   (two chained k8 MMAs = the m16n8k16 A layout); V through
//                   ldmatrix.trans.
// Turing has no cp.async: the next tiles are fetched with 128-bit global loads into
// registers, issued before the GEMMs of the current tile, and stored to shared memory
// after them (see KvPrefetch for the schedules).
// Shared memory: Q [BR][D+8], K [BC][D+8], V [BC][D+8] fp16 (row padding of 16 bytes
// makes the 8 row addresses of every ldmatrix hit distinct banks), <= 64 KB (Turing).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fa2.h"

namespace sm7x {
namespace fa2 {

constexpr int kTuringSmemBytes = 64 * 1024;  // max shared memory per block on sm_75

// How the next K/V tiles travel global -> registers -> shared memory:
//   kBoth:   K_{t+1} and V_{t+1} are both fetched into registers at the top of iteration t
//            and stored after O += P V_t (2 barriers per tile, two tiles of staging
//            registers).
//   kSplit:  V_t is fetched during S = Q K_t^T and K_{t+1} during P V_t (4 barriers per
//            tile, one tile of staging registers).
//   kStaged: K_{t+1} is fetched during S = Q K_t^T and the softmax and stored once every
//            warp is done with K_t; V_{t+1} is then fetched during P V_t and stored once
//            every warp is done with V_t (2 barriers per tile, one tile of staging
//            registers; for head dims whose accumulators leave no registers to spare).
enum class KvPrefetch { kBoth, kSplit, kStaged };

// Q_IN_REGS: each warp keeps its Q fragments (D / 16 x 4 registers) for the whole key
// loop instead of re-reading them from shared memory per tile; the Q tile is then only
// staged in shared memory, which the K/V tiles reuse (smem = max(Q, K + V) tiles).
template <int D, int BR, int BC, KvPrefetch PREFETCH = KvPrefetch::kBoth, bool Q_IN_REGS = false>
struct FwdConfig {
  static constexpr KvPrefetch kPrefetch = PREFETCH;
  static constexpr bool kQInRegs = Q_IN_REGS;
  static constexpr bool kPrefetchBoth = PREFETCH == KvPrefetch::kBoth;
  static constexpr int kHeadDim = D;
  static constexpr int kBlockM = BR;
  static constexpr int kBlockN = BC;
  static constexpr int kWarps = BR / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = D + 8;  // smem row stride in halves
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kSmemBytes =
      (Q_IN_REGS ? (BR > 2 * BC ? BR : 2 * BC) : BR + 2 * BC) * kStride * 2;
  static constexpr int kQLoads = BR * kChunks / kThreads;
  static constexpr int kTileLoads = BC * kChunks / kThreads;  // uint4 per thread per K/V tile
  static_assert(D % 16 == 0 && D <= 256, "head dim: a multiple of 16, at most 256");
  static_assert(BR % 16 == 0 && BC % 16 == 0, "tiles: multiples of 16");
  static_assert(kSmemBytes <= kTuringSmemBytes, "shared memory over Turing's 64 KB");
  static_assert(BR * kChunks % kThreads == 0 && BC * kChunks % kThreads == 0,
                "tile loads must split evenly over the threads");
};

namespace detail {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// d (16x8 fp32) += a (16x8 fp16, row) * b (8x8 fp16, col)
__device__ __forceinline__ void mma_16816_k8(float (&d)[4], uint32_t a0, uint32_t a1,
                                             uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Row and 16-byte chunk of the i-th uint4 of thread tid in a tile copy: idx / kChunks and
// idx % kChunks of idx = tid + i * kThreads. When the threads cover whole rows the chunk
// does not depend on i, which written out lets the compiler keep one address per thread
// and tile (constant row offsets) instead of one per i.
template <class C>
__device__ __forceinline__ void tile_coord(int i, int tid, int& row, int& c) {
  if constexpr (C::kThreads % C::kChunks == 0) {
    const unsigned t = static_cast<unsigned>(tid);  // tid >= 0: same values as below
    row = static_cast<int>(t / C::kChunks) + i * (C::kThreads / C::kChunks);
    c = static_cast<int>(t % C::kChunks);
  } else {
    const int idx = tid + i * C::kThreads;
    row = idx / C::kChunks;
    c = idx % C::kChunks;
  }
}

// rows [n0, n0 + ROWS) x all chunks of a [rows][D] fp16 tile into registers; rows >= n
// and chunks past the real head dim read as zeros.
template <class C, int LOADS>
__device__ __forceinline__ void load_tile(uint4 (&r)[LOADS], const __half* g,
                                          int64_t row_stride, int n0, int n, int head_dim,
                                          int tid) {
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    int row, c;
    tile_coord<C>(i, tid, row, c);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (n0 + row < n && c * 8 < head_dim)
      v = __ldg(reinterpret_cast<const uint4*>(g + (int64_t)(n0 + row) * row_stride + c * 8));
    r[i] = v;
  }
}

template <class C, int LOADS>
__device__ __forceinline__ void store_tile(__half* s, const uint4 (&r)[LOADS], int tid) {
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    int row, c;
    tile_coord<C>(i, tid, row, c);
    *reinterpret_cast<uint4*>(s + row * C::kStride + c * 8) = r[i];
  }
}

// One CTA per (m-block, head, batch), with the config's dynamic shared memory.
template <class C, class Kernel>
int launch(Kernel kernel, const FwdParams& p, cudaStream_t stream) {
  const int mblocks = (p.seqlen_q + C::kBlockM - 1) / C::kBlockM;
  if (mblocks == 0 || p.batch == 0 || p.heads == 0) return 0;
  if (C::kSmemBytes > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         C::kSmemBytes);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  dim3 grid(mblocks, p.heads, p.batch);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace detail

template <class C>
__global__ void __launch_bounds__(C::kThreads) fwd_kernel(const FwdParams p) {
  using namespace detail;
  constexpr int D = C::kHeadDim, BR = C::kBlockM, BC = C::kBlockN, ST = C::kStride;
  constexpr int NT = BC / 8;  // n8 tiles of S per warp
  constexpr int DT = D / 8;   // n8 tiles of O per warp
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* sQ = reinterpret_cast<__half*>(smem_raw);
  __half* sK = C::kQInRegs ? sQ : sQ + BR * ST;  // kQInRegs: K/V reuse the Q staging
  __half* sV = sK + BC * ST;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int h = blockIdx.y, b = blockIdx.z;
  // Last m-block first: with causal masking it has the most key tiles (less tail).
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BR;

  // Only what the main loop needs is computed here; the output and LSE addresses are
  // derived again in the epilogue (fewer registers live across the loop).
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

  // Q tile -> smem (once).
  {
    uint4 qr[C::kQLoads];
    load_tile<C>(qr, qg, p.q_row_stride, m0, sq, p.head_dim, tid);
    store_tile<C>(sQ, qr, tid);
  }
  const __half* q_frag_base =
      sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;
  uint32_t qa[C::kQInRegs ? D / 16 : 1][4];
  if constexpr (C::kQInRegs) {
    __syncthreads();  // Q tile stored
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qa[kk], q_frag_base + kk * 16);
    __syncthreads();  // every warp holds its Q fragments: sQ is free for K and V
  }

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const int r0 = m0 + warp * 16 + g;  // rows of this thread: r0 and r0 + 8

  uint4 stage[C::kTileLoads];
  uint4 stage_v[C::kPrefetchBoth ? C::kTileLoads : 1];
  if (t_lo < t_hi) {
    load_tile<C>(stage, kg, p.k_row_stride, t_lo * BC, sk, p.head_dim, tid);
    store_tile<C>(sK, stage, tid);
    load_tile<C>(stage, vg, p.v_row_stride, t_lo * BC, sk, p.head_dim, tid);
    if constexpr (C::kPrefetch != KvPrefetch::kSplit) store_tile<C>(sV, stage, tid);
    // kSplit: V_{t_lo} stays in flight, stored in the first iteration
  }
  __syncthreads();

  const __half* k_frag_base = sK + ((lane & 7) + (lane >> 4) * 8) * ST + ((lane >> 3) & 1) * 8;
  const __half* v_frag_base = sV + ((lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;

  for (int t = t_lo; t < t_hi; ++t) {
    const int n0 = t * BC;
    if constexpr (C::kPrefetchBoth) {
      if (t + 1 < t_hi) {  // K_{t+1}, V_{t+1} in flight during this whole iteration
        load_tile<C>(stage, kg, p.k_row_stride, n0 + BC, sk, p.head_dim, tid);
        load_tile<C>(stage_v, vg, p.v_row_stride, n0 + BC, sk, p.head_dim, tid);
      }
    } else if constexpr (C::kPrefetch == KvPrefetch::kStaged) {
      if (t + 1 < t_hi)  // K_{t+1} in flight during S = Q K_t^T and the softmax
        load_tile<C>(stage, kg, p.k_row_stride, n0 + BC, sk, p.head_dim, tid);
    }
    // ---- S = Q K^T
    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      if constexpr (C::kQInRegs) {
        a[0] = qa[kk][0];
        a[1] = qa[kk][1];
        a[2] = qa[kk][2];
        a[3] = qa[kk][3];
      } else {
        ldmatrix_x4(a, q_frag_base + kk * 16);
      }
#pragma unroll
      for (int nn = 0; nn < BC / 16; ++nn) {
        uint32_t bk[4];
        ldmatrix_x4(bk, k_frag_base + nn * 16 * ST + kk * 16);
        mma_16816_k8(s[2 * nn], a[0], a[1], bk[0]);
        mma_16816_k8(s[2 * nn], a[2], a[3], bk[1]);
        mma_16816_k8(s[2 * nn + 1], a[0], a[1], bk[2]);
        mma_16816_k8(s[2 * nn + 1], a[2], a[3], bk[3]);
      }
    }
    // ---- softcap, masking, online softmax (fp32)
    if (p.softcap > 0.f) {
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] = p.softcap * tanhf(s[i][e] * cap_in);
    }
    const bool need_mask =
        n0 + BC > sk ||
        (p.window_right >= 0 && n0 + BC - 1 > m0 + off + p.window_right) ||
        (p.window_left >= 0 && n0 < last_row + off - p.window_left);
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + i * 8 + tig * 2 + (e & 1);
          const int row = r0 + (e >> 1) * 8;
          const bool ok = col < sk &&
                          (p.window_right < 0 || col <= row + off + p.window_right) &&
                          (p.window_left < 0 || col >= row + off - p.window_left);
          if (!ok) s[i][e] = -INFINITY;
        }
    }
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = row_max[hr];
#pragma unroll
      for (int i = 0; i < NT; ++i) mx = fmaxf(mx, fmaxf(s[i][2 * hr], s[i][2 * hr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_use = mx == -INFINITY ? 0.f : mx;  // a row with nothing seen yet
      alpha[hr] = fast_exp2((row_max[hr] - m_use) * sl2);
      row_max[hr] = mx;
      const float bias = -m_use * sl2;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        s[i][2 * hr] = fast_exp2(fmaf(s[i][2 * hr], sl2, bias));
        s[i][2 * hr + 1] = fast_exp2(fmaf(s[i][2 * hr + 1], sl2, bias));
        sum += s[i][2 * hr] + s[i][2 * hr + 1];
      }
      row_sum[hr] = row_sum[hr] * alpha[hr] + sum;  // per-thread partial, reduced at the end
    }
    // O *= alpha only when some row of the warp saw a new max (alpha != 1): once the
    // maxima settle most tiles skip the D / 2 multiplies (same result: x * 1 == x).
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[0];
        o[i][2] *= alpha[1];
        o[i][3] *= alpha[1];
      }
    }
    // P as fp16 A fragments: tile i covers keys n0 + 8i .. 8i + 7.
    uint32_t pa[NT][2];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      pa[i][0] = pack_half2(s[i][0], s[i][1]);
      pa[i][1] = pack_half2(s[i][2], s[i][3]);
    }
    if constexpr (C::kPrefetch == KvPrefetch::kStaged) {
      __syncthreads();  // every warp is done with sK (K_t)
      if (t + 1 < t_hi) {
        store_tile<C>(sK, stage, tid);  // K_{t+1}: read after the barrier below
        load_tile<C>(stage, vg, p.v_row_stride, n0 + BC, sk, p.head_dim, tid);
      }
    } else if constexpr (C::kPrefetch == KvPrefetch::kSplit) {
      __syncthreads();  // every warp is done with sK; sV is free since the last P V
      store_tile<C>(sV, stage, tid);
      if (t + 1 < t_hi) load_tile<C>(stage, kg, p.k_row_stride, n0 + BC, sk, p.head_dim, tid);
      __syncthreads();
    }
    // ---- O += P V (K_{t+1} or V_{t+1} loads in flight)
#pragma unroll
    for (int kt = 0; kt < BC / 16; ++kt) {
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_frag_base + kt * 16 * ST + dn * 16);
        mma_16816_k8(o[2 * dn], pa[2 * kt][0], pa[2 * kt][1], bv[0]);
        mma_16816_k8(o[2 * dn], pa[2 * kt + 1][0], pa[2 * kt + 1][1], bv[1]);
        mma_16816_k8(o[2 * dn + 1], pa[2 * kt][0], pa[2 * kt][1], bv[2]);
        mma_16816_k8(o[2 * dn + 1], pa[2 * kt + 1][0], pa[2 * kt + 1][1], bv[3]);
      }
    }
    if (t + 1 < t_hi) {
      if constexpr (C::kPrefetch == KvPrefetch::kStaged) {
        __syncthreads();  // every warp is done with sV (V_t)
        store_tile<C>(sV, stage, tid);  // V_{t+1}: read after the next iteration's first barrier
      } else {
        __syncthreads();  // every warp is done with sK and sV
        store_tile<C>(sK, stage, tid);
        if constexpr (C::kPrefetchBoth)
          store_tile<C>(sV, stage_v, tid);
        else
          load_tile<C>(stage, vg, p.v_row_stride, n0 + BC, sk, p.head_dim, tid);
        __syncthreads();
      }
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
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float l = row_sum[hr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      o[i][2 * hr] *= inv;
      o[i][2 * hr + 1] *= inv;
    }
    const int row = r0 + hr * 8;
    if (tig == 0 && row < sq) {
      const float scale_nat = p.softcap > 0.f ? 1.f : p.scale;
      lg[row] = l > 0.f ? row_max[hr] * scale_nat + __logf(l) : INFINITY;
    }
  }
  if constexpr (C::kQInRegs)
    __syncthreads();  // sO overlaps sK / sV, which other warps may still read
  else
    __syncwarp();
  __half* sO = sQ + warp * 16 * ST;
#pragma unroll
  for (int i = 0; i < DT; ++i) {
    *reinterpret_cast<uint32_t*>(sO + g * ST + i * 8 + tig * 2) = pack_half2(o[i][0], o[i][1]);
    *reinterpret_cast<uint32_t*>(sO + (g + 8) * ST + i * 8 + tig * 2) =
        pack_half2(o[i][2], o[i][3]);
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 * C::kChunks / 32; ++i) {
    const int idx = lane + i * 32;
    const int row = idx / C::kChunks, c = idx % C::kChunks;
    const int grow = m0 + warp * 16 + row;
    if (grow < sq && c * 8 < p.head_dim)
      *reinterpret_cast<uint4*>(og + (int64_t)grow * p.o_row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(sO + row * ST + c * 8);
  }
}

template <class C>
int launch_fwd(const FwdParams& p, cudaStream_t stream) {
  return detail::launch<C>(fwd_kernel<C>, p, stream);
}

}  // namespace fa2
}  // namespace sm7x
