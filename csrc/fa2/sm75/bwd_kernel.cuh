// FlashAttention-2 backward kernels for Turing (sm_75): mma.m16n8k8 + ldmatrix, as the
// forward (fwd_kernel.cuh). Algorithm and work split: common/bwd_common.cuh.
//
// bwd_kernel: one CTA per (BN keys, kv head, batch), warp w owning keys 16w .. 16w + 15
// (with a dim split, warps 2w and 2w + 1 own them, each half of the head dim: the
// partial S^T / dP^T are summed through shared memory, common/dim_split.cuh), so
// everything is computed transposed (keys are the MMA rows):
//   S^T = K Q^T, dP^T = V dO^T   A = the warp's K / V rows (ldmatrix), B = Q / dO as stored
//   P^T, dS^T                    elementwise in the accumulators (LSE, dsum per column)
//   dV += P^T dO, dK += dS^T Q   P^T / dS^T packed to fp16 are the A fragments (as P in
//                                the forward), B = dO / Q through ldmatrix.trans
//   dQ += dS K                   dS^T staged in shared memory (fp16), read back as A with
//                                ldmatrix.trans; fp32 atomics into dq_accum
// bwd_dq_kernel (deterministic): one CTA per (DQ_BM queries, head, batch), warp = 16 query
// rows, as the forward: S = Q K^T, dP = dO V^T, dS, dQ += dS K in registers, key tiles in
// ascending order; writes dq itself (fp16, times the scale).
// Query tiles come through QueryTile (common/bwd_common.cuh): prefetched into registers
// where the config has registers to spare for it (targets.json "prefetch"), else copied
// synchronously; K/V and the dQ kernel's tiles are copied synchronously.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/bwd_common.cuh"
#include "common/dim_split.cuh"
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/softmax.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace sm75 {

template <int D, int BN, int BM, int DQ_BM, int DQ_BN, bool SPLIT, bool PREFETCH = false,
          int MIN_BLOCKS = 1, bool V_IN_REGS = false, int KS = 1>
struct BwdConfig : BwdShape<D, BN, BM, DQ_BM, DQ_BN, SPLIT, PREFETCH, MIN_BLOCKS, V_IN_REGS, KS> {
  using S = BwdShape<D, BN, BM, DQ_BM, DQ_BN, SPLIT, PREFETCH, MIN_BLOCKS, V_IN_REGS, KS>;
  // K, V [BN][D + 8], Q, dO [BM][D + 8], dS^T [BN][BM + 8] fp16; LSE, dsum [BM] fp32. The dV
  // pass of a split backward (mode kBwdDv) has no V, dS^T or dsum (S::v_rows, S::ds_rows):
  // less shared memory, so that more of its CTAs fit on a Turing SM (d = 256: 2 instead of 1).
  __host__ __device__ static constexpr int tile_bytes(int mode) {
    return (BN + S::v_rows(mode) + 2 * BM) * S::kStride * 2 + S::ds_rows(mode) * S::kDsStride * 2 +
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
  // Q, dO [DQ_BM][D + 8], K, V [DQ_BN][D + 8]
  static constexpr int kDqSmemBytes = (2 * DQ_BM + 2 * DQ_BN) * S::kStride * 2;
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

// ldmatrix from a 32-bit shared address: every fragment address is a base per tile plus
// a constant that ptxas folds into the instruction.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

template <class C, int MODE>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) bwd_kernel(const BwdParams p) {
  using namespace detail;
  constexpr int D = C::kHeadDim, BN = C::kBlockN, BM = C::kBlockM, ST = C::kStride;
  constexpr int KS = C::kDimSplit, DW = D / KS;  // DW: the columns of dK / dV a warp holds
  constexpr int SD = C::kDsStride, NQ = BM / 8, DT = DW / 8, T = C::kThreads;
  // kk loops unrolled by 2: the next slice's ldmatrix overlaps this one's mma (measured 1-4%
  // faster at d80-d128); full unrolling only adds registers, and d256 has none to spare
  constexpr int KKU = D >= 256 ? 1 : 2;
  constexpr bool kDv = MODE != kBwdDkDq, kDk = MODE != kBwdDv;
  constexpr bool kVRegs = C::kVInRegs && kDk;  // V as A fragments in registers, no sV
  // the dV pass of such a config holds K the same way (S^T = K Q^T is its only use of K)
  constexpr bool kKRegs = C::kVInRegs && MODE == kBwdDv;
  constexpr bool kARegs = kVRegs || kKRegs;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // the layout of BwdConfig::smem_bytes(MODE) (the dV pass has no sD either)
  __half* const sK = reinterpret_cast<__half*>(smem_raw);
  __half* const sV = sK + BN * ST;
  __half* const sQ = sV + C::v_rows(MODE) * ST;
  __half* const sdO = sQ + BM * ST;
  __half* const sdS = sdO + BM * ST;
  float* const sL = reinterpret_cast<float*>(sdS + C::ds_rows(MODE) * SD);
  float* const sD = sL + BM;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // kw: this warp's 16 keys; c0: its first column (dim split)
  const int kw = warp / KS, c0 = KS > 1 ? (warp % KS) * DW : 0;
  const int g = lane >> 2, tig = lane & 3;
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

  float dk[kDk ? DT : 1][4], dv[kDv ? DT : 1][4];
#pragma unroll
  for (int i = 0; i < (kDk ? DT : 1); ++i) dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
#pragma unroll
  for (int i = 0; i < (kDv ? DT : 1); ++i) dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;

  // ldmatrix lane addresses (see fwd_kernel.cuh): A rows of this warp; B stored [n][k];
  // B stored [k][n] (.trans); dS A stored [k][m] (.trans)
  const int a_frag = (kw * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8 + c0;
  const int b_frag = ((lane & 7) + (lane >> 4) * 8) * ST + ((lane >> 3) & 1) * 8 + c0;
  const int bt_frag = ((lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;
  const int ds_frag = ((lane & 7) + (lane >> 4) * 8) * SD + ((lane >> 3) & 1) * 8;
  const int key0 = n0 + kw * 16 + g;  // this thread's keys: key0, key0 + 8
  // dim split (KS = 2): the exchange slots (common/dim_split.cuh), S^T then dP^T; the pair
  // meets at named barrier 1 + kw
  [[maybe_unused]] const PairSlots xs =
      pair_slots(smem_raw + C::exchange_offset(MODE), warp, C::exchange_floats4(MODE), lane);
  // kARegs: the A fragments of V's (kVRegs) or K's (kKRegs) 16 x D block of this warp
  // straight from global memory, as ldsm_x4 at aV / aK + kk * 32 would give them (r: rows
  // +0/+8, columns +0/+8 of slice kk); 32-bit loads, once per CTA. Keys past sk and columns
  // past head_dim are zeros.
  [[maybe_unused]] uint32_t afrag[kARegs ? DW / 16 : 1][4];
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

  // One flat loop over (query head of the group, query tile): offsets are recomputed from
  // the parameters each step instead of held across it (registers: dK/dV need them).
  const int ntiles = t_hi - t_lo, nsteps = group * ntiles;
  QueryTile<C, kDk> tile;
  if (nsteps > 0) tile.load(p, rows, hk * group, t_lo * BM, tid);
  for (int it = 0; it < nsteps; ++it) {
    const int h = tile.h;
    {
      const int m0 = tile.m0;
      __syncthreads();  // every warp is done with the previous tile's Q, dO, dS
      tile.store(p, rows, sQ, sdO, sL, sD, tid);
      __syncthreads();
      // the next tile: in flight while this one computes (kPrefetch)
      if (it + 1 < nsteps) tile.load_next(p, rows, t_lo, t_hi, tid);
      // fragment bases (bytes)
      const uint32_t aK = smem_addr(sK + a_frag), aV = smem_addr(sV + a_frag);
      const uint32_t bQ = smem_addr(sQ + b_frag), bdO = smem_addr(sdO + b_frag);
      const uint32_t tQ = smem_addr(sQ + bt_frag + c0), tdO = smem_addr(sdO + bt_frag + c0);

      // ---- S^T = K Q^T, dP^T = V dO^T (each B fragment feeds one MMA pair)
      float st[NQ][4], dpt[kDk ? NQ : 1][4];
#pragma unroll
      for (int i = 0; i < NQ; ++i) st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.f;
#pragma unroll
      for (int i = 0; i < (kDk ? NQ : 1); ++i) dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.f;
      // fully unrolled with kARegs: afrag[kk] must be a register, not re-loaded per tile
#pragma unroll(kARegs ? DW / 16 : KKU)
      for (int kk = 0; kk < DW / 16; ++kk) {
        uint32_t ak[4];
        if constexpr (kKRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) ak[r] = afrag[kk][r];
        } else {
          ldsm_x4(ak, aK + kk * 32);
        }
#pragma unroll
        for (int nn = 0; nn < BM / 16; ++nn) {
          uint32_t bq[4];
          ldsm_x4(bq, bQ + (nn * 16 * ST + kk * 16) * 2);
          mma_m16n8k8(st[2 * nn], ak[0], ak[1], bq[0]);
          mma_m16n8k8(st[2 * nn], ak[2], ak[3], bq[1]);
          mma_m16n8k8(st[2 * nn + 1], ak[0], ak[1], bq[2]);
          mma_m16n8k8(st[2 * nn + 1], ak[2], ak[3], bq[3]);
        }
        if constexpr (kDk) {
          uint32_t av[4];
          if constexpr (kVRegs) {
#pragma unroll
            for (int r = 0; r < 4; ++r) av[r] = afrag[kk][r];
          } else {
            ldsm_x4(av, aV + kk * 32);
          }
#pragma unroll
          for (int nn = 0; nn < BM / 16; ++nn) {
            uint32_t bd[4];
            ldsm_x4(bd, bdO + (nn * 16 * ST + kk * 16) * 2);
            mma_m16n8k8(dpt[2 * nn], av[0], av[1], bd[0]);
            mma_m16n8k8(dpt[2 * nn], av[2], av[3], bd[1]);
            mma_m16n8k8(dpt[2 * nn + 1], av[0], av[1], bd[2]);
            mma_m16n8k8(dpt[2 * nn + 1], av[2], av[3], bd[3]);
          }
        }
      }
      if constexpr (KS > 1) {
        // S^T, dP^T = this half's partials + the partner's. A slot is rewritten next tile
        // only after the loop's first barrier, which the partner reaches after its read.
        if constexpr (kDk) put_partial(xs.mine, st, dpt); else put_partial(xs.mine, st);
        named_barrier(1 + kw, 32 * KS);
        if constexpr (kDk) add_partial(st, dpt, xs.peer); else add_partial(st, xs.peer);
      }

      // ---- P^T = exp2(S^T sl2 - LSE2), dS^T = P^T (dP^T - dsum) (1 - tanh^2); element e of
      // n8 tile i: key key0 + (e >> 1) * 8, query m0 + 8i + 2 tig + (e & 1)
      const int last_row = min(m0 + BM, sq) - 1;
      const bool masked = SM7X_FA2_TILE_NEEDS_MASK(p, BN, n0, m0, last_row, sk, off);
      with_score_flags(p.softcap > 0.f, masked, [&](auto flags) {
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
      });

      // ---- dV += P^T dO, dK += dS^T Q (k = queries, 16 at a time)
#pragma unroll
      for (int kt = 0; kt < BM / 16; ++kt) {
        if constexpr (kDv) {
          const uint32_t a0 = pack_half2(st[2 * kt][0], st[2 * kt][1]);
          const uint32_t a1 = pack_half2(st[2 * kt][2], st[2 * kt][3]);
          const uint32_t a2 = pack_half2(st[2 * kt + 1][0], st[2 * kt + 1][1]);
          const uint32_t a3 = pack_half2(st[2 * kt + 1][2], st[2 * kt + 1][3]);
          uint32_t addr = tdO + kt * 16 * ST * 2;
#pragma unroll
          for (int dn = 0; dn < DW / 16; ++dn) {
            uint32_t bv[4];
            ldsm_x4_t(bv, addr + dn * 32);
            mma_m16n8k8(dv[2 * dn], a0, a1, bv[0]);
            mma_m16n8k8(dv[2 * dn], a2, a3, bv[1]);
            mma_m16n8k8(dv[2 * dn + 1], a0, a1, bv[2]);
            mma_m16n8k8(dv[2 * dn + 1], a2, a3, bv[3]);
          }
        }
        if constexpr (kDk) {
          const uint32_t a0 = pack_half2(dpt[2 * kt][0], dpt[2 * kt][1]);
          const uint32_t a1 = pack_half2(dpt[2 * kt][2], dpt[2 * kt][3]);
          const uint32_t a2 = pack_half2(dpt[2 * kt + 1][0], dpt[2 * kt + 1][1]);
          const uint32_t a3 = pack_half2(dpt[2 * kt + 1][2], dpt[2 * kt + 1][3]);
          uint32_t addr = tQ + kt * 16 * ST * 2;
#pragma unroll
          for (int dn = 0; dn < DW / 16; ++dn) {
            uint32_t bq[4];
            ldsm_x4_t(bq, addr + dn * 32);
            mma_m16n8k8(dk[2 * dn], a0, a1, bq[0]);
            mma_m16n8k8(dk[2 * dn], a2, a3, bq[1]);
            mma_m16n8k8(dk[2 * dn + 1], a0, a1, bq[2]);
            mma_m16n8k8(dk[2 * dn + 1], a2, a3, bq[3]);
          }
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

      // ---- dQ += dS K over this CTA's BN keys, fp32 atomics (one writer order per run
      // is not fixed: p.deterministic runs bwd_dq_kernel instead)
      if constexpr (kDk) {
        if (dq_atomic) {
          __syncthreads();  // dS^T of every warp stored
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
                ldsm_x4_t(as, aS + (kt * 16 * SD + slice * 16) * 2);
#pragma unroll
                for (int j = 0; j < C::kDqChunk / 2; ++j) {
                  uint32_t bk[4];
                  ldsm_x4_t(bk, tK + (kt * 16 * ST + (tile0 + c0 + 2 * j) * 8) * 2);
                  mma_m16n8k8(a[2 * j], as[0], as[1], bk[0]);
                  mma_m16n8k8(a[2 * j], as[2], as[3], bk[1]);
                  mma_m16n8k8(a[2 * j + 1], as[0], as[1], bk[2]);
                  mma_m16n8k8(a[2 * j + 1], as[2], as[3], bk[3]);
                }
                if constexpr (C::kDqChunk % 2 == 1) {  // the odd last n8 tile
                  uint32_t bk[2];
                  ldsm_x2_t(bk, tK + (kt * 16 * ST + (tile0 + c0 + C::kDqChunk - 1) * 8) * 2);
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
      }
    }
  }

  // ---- dK (times the scale), dV: fp16 straight from the accumulators; keys without a
  // query that sees them write zeros
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
      if (col >= head_dim) continue;
      if constexpr (kDk)
        *reinterpret_cast<uint32_t*>(dkr + col) =
            pack_half2(dk[i][2 * hr] * scale, dk[i][2 * hr + 1] * scale);
      if constexpr (kDv)
        *reinterpret_cast<uint32_t*>(dvr + col) = pack_half2(dv[i][2 * hr], dv[i][2 * hr + 1]);
    }
  }
}

// Deterministic dQ: rows [m0, m0 + DQ_BM) of query head h, key tiles in ascending order.
template <class C>
__global__ void __launch_bounds__(C::kDqThreads) bwd_dq_kernel(const BwdParams p) {
  using namespace detail;
  constexpr int D = C::kHeadDim, BM = C::kDqBlockM, BN = C::kDqBlockN, ST = C::kStride;
  constexpr int NT = BN / 8, DC = C::kDqCols, DT = DC / 8, T = C::kDqThreads;
  constexpr int KKU = 1;  // kk loops: full unrolling only adds registers
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* const sQ = reinterpret_cast<__half*>(smem_raw);
  __half* const sdO = sQ + BM * ST;
  __half* const sK = sdO + BM * ST;
  __half* const sV = sK + BN * ST;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int h = blockIdx.y, b = blockIdx.z;
  // (query block, column part): longest (causal) blocks first
  constexpr int NPART = D / DC;
  const int part = blockIdx.x % NPART;
  const int m0 = (gridDim.x / NPART - 1 - blockIdx.x / NPART) * BM;
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

  // this thread's rows r0, r0 + 8: LSE (base 2) and dsum
  const int r0 = m0 + warp * 16 + g;
  float l2[2], ds[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r0 + hr * 8;
    l2[hr] = r < sq ? lse_log2(p.lse[rows.qb * p.lse_batch_stride + h * p.lse_head_stride +
                                     rows.qs + r])
                    : INFINITY;
    ds[hr] = r < sq ? p.dsum[rows.qb * p.dsum_batch_stride + h * p.dsum_head_stride +
                             rows.qs + r]
                    : 0.f;
  }

  const int off = sk - sq, last_row = min(m0 + BM, sq) - 1;
  int n_lo = 0, n_hi = sk;
  if (left >= 0) n_lo = max(0, m0 + off - left);
  if (right >= 0) n_hi = min(sk, last_row + off + right + 1);
  const int t_lo = n_lo / BN, t_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : t_lo;

  const int a_frag = (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;
  const int b_frag = ((lane & 7) + (lane >> 4) * 8) * ST + ((lane >> 3) & 1) * 8;
  const int bt_frag = ((lane & 7) + ((lane >> 3) & 1) * 8) * ST + (lane >> 4) * 8;

  float dq[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

  for (int t = t_lo; t < t_hi; ++t) {
    const int n0 = t * BN;
    __syncthreads();  // every warp is done with the previous K, V
    copy_rows<BN, T, D, ST, C::kDqCopyBatch>(sK, kg, p.k_row_stride, n0, sk, head_dim, tid);
    copy_rows<BN, T, D, ST, C::kDqCopyBatch>(sV, vg, p.v_row_stride, n0, sk, head_dim, tid);
    __syncthreads();
    const uint32_t aQ = smem_addr(sQ + a_frag), adO = smem_addr(sdO + a_frag);
    const uint32_t bK = smem_addr(sK + b_frag), bV = smem_addr(sV + b_frag);
    const uint32_t tK = smem_addr(sK + bt_frag);
    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
    }
#pragma unroll KKU
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[4], ad[4];
      ldsm_x4(aq, aQ + kk * 32);
      ldsm_x4(ad, adO + kk * 32);
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        uint32_t bk[4], bv[4];
        ldsm_x4(bk, bK + (nn * 16 * ST + kk * 16) * 2);
        ldsm_x4(bv, bV + (nn * 16 * ST + kk * 16) * 2);
        mma_m16n8k8(s[2 * nn], aq[0], aq[1], bk[0]);
        mma_m16n8k8(s[2 * nn], aq[2], aq[3], bk[1]);
        mma_m16n8k8(s[2 * nn + 1], aq[0], aq[1], bk[2]);
        mma_m16n8k8(s[2 * nn + 1], aq[2], aq[3], bk[3]);
        mma_m16n8k8(dp[2 * nn], ad[0], ad[1], bv[0]);
        mma_m16n8k8(dp[2 * nn], ad[2], ad[3], bv[1]);
        mma_m16n8k8(dp[2 * nn + 1], ad[0], ad[1], bv[2]);
        mma_m16n8k8(dp[2 * nn + 1], ad[2], ad[3], bv[3]);
      }
    }
    const bool masked = SM7X_FA2_TILE_NEEDS_MASK(p, BN, n0, m0, last_row, sk, off);
    with_score_flags(p.softcap > 0.f, masked, [&](auto flags) {
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hr = e >> 1;
          float deriv;
          const float pr = score_prob(flags, s[i][e], sc, p.softcap, l2[hr], [&] {
            return key_visible(n0 + i * 8 + tig * 2 + (e & 1), r0 + hr * 8, sk, off, left, right);
          }, deriv);
          dp[i][e] = pr * (dp[i][e] - ds[hr]) * deriv;
        }
    });
    // ---- dQ += dS K: dS packed to fp16 is the A fragment (as P in the forward)
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
      const uint32_t a0 = pack_half2(dp[2 * kt][0], dp[2 * kt][1]);
      const uint32_t a1 = pack_half2(dp[2 * kt][2], dp[2 * kt][3]);
      const uint32_t a2 = pack_half2(dp[2 * kt + 1][0], dp[2 * kt + 1][1]);
      const uint32_t a3 = pack_half2(dp[2 * kt + 1][2], dp[2 * kt + 1][3]);
      uint32_t addr = tK + (kt * 16 * ST + part * DC) * 2;
#pragma unroll
      for (int dn = 0; dn < DC / 16; ++dn) {
        uint32_t bk[4];
        ldsm_x4_t(bk, addr + dn * 32);
        mma_m16n8k8(dq[2 * dn], a0, a1, bk[0]);
        mma_m16n8k8(dq[2 * dn], a2, a3, bk[1]);
        mma_m16n8k8(dq[2 * dn + 1], a0, a1, bk[2]);
        mma_m16n8k8(dq[2 * dn + 1], a2, a3, bk[3]);
      }
    }
  }

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
      if (col < head_dim)
        *reinterpret_cast<uint32_t*>(dqr + col) =
            pack_half2(dq[i][2 * hr] * scale, dq[i][2 * hr + 1] * scale);
    }
  }
}

// The main backward of one head dim: dK/dV (+ dQ atomics), or with C::kSplit dV and
// then dK (+ dQ) in two passes, the dV pass with CDv (C with its own block_n: targets.json
// dv_block_n).
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

}  // namespace sm75
}  // namespace fa2
}  // namespace sm7x
