// What the serving instantiation of both kernels adds to the prefill one (fa2.h, "Serving"):
// which sequence, kv head and key range a CTA works on (split-KV partitions), the packed
// GQA rows (query token r / group of head hk * group + r % group), keys read from a paged
// or contiguous cache, and where outputs go (final, or fp32 partials for common/combine.cuh).
//
// Every index that comes from device memory (cu_seqlens_q, seqused_k, block_table,
// cache_batch_idx, k_start, partitions) is clamped to the tensors' extents before it
// addresses anything: inside a CUDA graph the op cannot check them on the host, and a bad
// value must give a wrong answer at worst, never a read or write out of bounds.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/bounds.cuh"
#include "common/epilogue.cuh"
#include "common/softmax.cuh"
#include "common/tile_io.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace detail {

__device__ __forceinline__ int clamp_int(int x, int lo, int hi) { return min(max(x, lo), hi); }

// The work of CTA (partition z, kv head hk).
struct ServingWork {
  int b;             // sequence
  int sq, rows;      // query tokens, packed rows (sq * group)
  int sk;            // keys of the sequence (masks are aligned to it)
  int kv_lo, kv_hi;  // this partition's keys, within [0, sk]
  bool split;        // the sequence has several partitions: write partials
  int64_t q_tok0;    // global index of the sequence's first query token (rows of q)
  int64_t q_off;     // element offset of (first token, head hk * group) in p.q
  int64_t k_off, v_off;     // contiguous cache: the sequence's first key; paged: kv head
  const int32_t* pages;     // paged: the sequence's block_table row; else null
  int cache_row, k0;        // contiguous cache: the sequence's row and first key
};

__device__ __forceinline__ ServingWork serving_work(const FwdParams& p, int z, int hk) {
  ServingWork w;
  const int32_t* part = p.partitions + 3 * (int64_t)z;
  w.b = clamp_int(part[0], 0, p.batch - 1);
  w.split = p.split_offsets[w.b + 1] - p.split_offsets[w.b] > 1 && p.o_accum != nullptr;
  if (p.cu_seqlens_q != nullptr) {  // packed q [total_q, H, D]; seqlen_q: max_seqlen_q
    const int qs = clamp_int(p.cu_seqlens_q[w.b], 0, p.total_q);
    const int qe = clamp_int(p.cu_seqlens_q[w.b + 1], qs, p.total_q);
    w.sq = min(qe - qs, p.seqlen_q);
    w.q_tok0 = qs;
    w.q_off = (int64_t)qs * p.q_row_stride;
  } else {  // q [B, seqlen_q, H, D]
    w.sq = p.seqlen_q;
    w.q_tok0 = (int64_t)w.b * p.seqlen_q;
    w.q_off = (int64_t)w.b * p.q_batch_stride;
  }
  w.q_off += (int64_t)hk * p.group * p.q_head_stride;
  w.rows = w.sq * p.group;
  int k0 = p.k_start != nullptr ? p.k_start[w.b] : 0;
  int kend;
  if (p.seqused_k != nullptr) {
    kend = p.seqused_k[w.b] + p.seqused_add;
  } else if (p.cu_seqlens_k != nullptr) {
    kend = p.cu_seqlens_k[w.b + 1] - p.cu_seqlens_k[w.b];
  } else {
    kend = p.seqlen_k;
  }
  kend = clamp_int(kend, 0, p.kv_capacity);
  k0 = clamp_int(k0, 0, kend);
  w.sk = kend - k0;
  w.kv_lo = clamp_int(part[1], 0, w.sk);
  w.kv_hi = clamp_int(part[2], w.kv_lo, w.sk);
  w.k_off = (int64_t)hk * p.k_head_stride;
  w.v_off = (int64_t)hk * p.v_head_stride;
  if (p.block_table != nullptr) {
    w.pages = p.block_table + (int64_t)w.b * p.bt_stride;
  } else {
    w.pages = nullptr;
    const int row = p.cache_batch_idx != nullptr
                        ? clamp_int(p.cache_batch_idx[w.b], 0, p.num_pages - 1)
                        : w.b;
    w.cache_row = row;
    w.k0 = k0;
    w.k_off += (int64_t)row * p.k_batch_stride + (int64_t)k0 * p.k_row_stride;
    w.v_off += (int64_t)row * p.v_batch_stride + (int64_t)k0 * p.v_row_stride;
  }
  return w;
}

// Element offset of packed row r (token r / group, head r % group of the kv head's group)
// from ServingWork::q_off (and the same for the output, with o strides).
__device__ __forceinline__ int64_t packed_row_offset(int r, int group, int64_t row_stride,
                                                     int64_t head_stride) {
  const int t = r / group;
  return (int64_t)t * row_stride + (int64_t)(r - t * group) * head_stride;
}

// Keys come in two steps, so that the page-table read is off the critical path: the page
// of each of a thread's tile rows is fetched one tile ahead (fetch_pages, an L2 hit in
// flight during a whole iteration), and the rows of the next tile are then loaded
// straight from the cache (load_cache_tile). C is a FwdShape; LOADS its kTileLoads.
template <class C, int LOADS>
__device__ __forceinline__ void fetch_pages(int (&pg)[LOADS], const FwdParams& p,
                                            const int32_t* pages, int n0, int n, int tid) {
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    int row, c;
    tile_coord<C>(i, tid, row, c);
    const int j = n0 + row;
    pg[i] = pages != nullptr && j < n && in_tile<C, C::kBlockN>(i, tid)
                ? clamp_int(__ldg(pages + (j >> p.page_shift)), 0, p.num_pages - 1)
                : 0;
  }
}

// 8-bit caches (fa2.h KvFormat). Volta and Turing have no fp8 conversion instructions
// (cvt from e4m3x2 / e5m2x2 needs sm_89), so two codes become two fp16 in integer ops:
// one byte permute puts each code in the high byte of its fp16 half; an E5M2 code then IS
// that fp16 (same sign, exponent width and bias: Inf and NaN included), and an E4M3 code
// with its magnitude shifted one bit right is its value x 2^-8 in fp16, subnormals included
// (kv_scales folds the 2^8 back). E4M3's NaN (magnitude 0x7F, never written: writes
// saturate) would read as 480: it is made an fp16 NaN, so that a NaN in the cache still
// reaches the output as it would in fp16. That costs as much again as the conversion, so
// the common path converts without it and the loader tests each 16 codes for a NaN first
// (fp8x16_has_nan), taking the exact path (e4m3x2_to_half2_nan) only where one is.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t codes, int sel) {
  const uint32_t w = __byte_perm(codes, 0u, sel);  // [0, c_lo, 0, c_hi]
  return (w & 0x80008000u) | ((w & 0x7F007F00u) >> 1);
}

__device__ __forceinline__ uint32_t e4m3x2_to_half2_nan(uint32_t codes, int sel) {
  const uint32_t w = __byte_perm(codes, 0u, sel);
  const uint32_t mag = w & 0x7F007F00u;
  const uint32_t nan = (mag + 0x01000100u) & 0x80008000u;  // magnitude 0x7F
  return (w & 0x80008000u) | (mag >> 1) | (nan - (nan >> 5));
}

// Whether any of 16 E4M3 codes is a NaN (magnitude 0x7F: + 1 carries into the byte's top
// bit, never into the next byte).
__device__ __forceinline__ bool fp8x16_has_nan(const uint4& c) {
  constexpr uint32_t kMag = 0x7F7F7F7Fu, kOne = 0x01010101u, kTop = 0x80808080u;
  return ((((c.x & kMag) + kOne) | ((c.y & kMag) + kOne) | ((c.z & kMag) + kOne) |
           ((c.w & kMag) + kOne)) & kTop) != 0u;
}

// 16 codes (one 16-byte load) -> 16 fp16 (two 16-byte chunks of the shared tile) by
// pair(word, selector), which converts the two codes a byte permute selector picks.
template <class Pair>
__device__ __forceinline__ void widen_x16(const uint4& c, uint4& lo, uint4& hi, Pair pair) {
  lo = make_uint4(pair(c.x, 0x1404), pair(c.x, 0x3424), pair(c.y, 0x1404), pair(c.y, 0x3424));
  hi = make_uint4(pair(c.z, 0x1404), pair(c.z, 0x3424), pair(c.w, 0x1404), pair(c.w, 0x3424));
}

// int8 codes (kKvInt8): each pair becomes two fp16 by the magic-number trick (the byte
// under exponent 0x64 is 1024 + code + 128 as an fp16, exact; minus 1152 leaves the code,
// exact too). The row's scale is not applied here but to the scores (K) and the
// probabilities (V) in fp32, as vLLM's Triton kernel does (kv_row_scale below), so the
// tile holds exact integers and no product is rounded to fp16.
__device__ __forceinline__ uint32_t int8x2_to_half2(uint32_t biased, int sel) {
  const uint32_t w = __byte_perm(biased, 0x64646464u, sel);  // [c_lo + 128, 0x64, c_hi + 128, 0x64]
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&w), __float2half2_rn(1152.f));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// 16 int8 codes of one row -> 16 fp16 (two 16-byte chunks of the shared tile).
__device__ __forceinline__ void widen_int8x16(const uint4& c, uint4& lo, uint4& hi) {
  const uint32_t b[4] = {c.x ^ 0x80808080u, c.y ^ 0x80808080u, c.z ^ 0x80808080u,
                         c.w ^ 0x80808080u};
  lo = make_uint4(int8x2_to_half2(b[0], 0x5140), int8x2_to_half2(b[0], 0x5342),
                  int8x2_to_half2(b[1], 0x5140), int8x2_to_half2(b[1], 0x5342));
  hi = make_uint4(int8x2_to_half2(b[2], 0x5140), int8x2_to_half2(b[2], 0x5342),
                  int8x2_to_half2(b[3], 0x5140), int8x2_to_half2(b[3], 0x5342));
}

// An int8 tile's row scales live in shared memory beside the codes, in each row's padding
// (the 8 halves past the head dim: ldmatrix never reads them), written with the row.
template <class C>
__device__ __forceinline__ float* kv_row_scale_slot(__half* tile, int row) {
  static_assert(C::kStride >= C::kHeadDim + 2, "int8 caches keep a float in each row's padding");
  return reinterpret_cast<float*>(tile + row * C::kStride + C::kHeadDim);
}

template <class C>
__device__ __forceinline__ float kv_row_scale(const __half* tile, int row) {
  return *reinterpret_cast<const float*>(tile + row * C::kStride + C::kHeadDim);
}

// A K or V tile in flight from global memory to shared memory: the loads (fp16 chunks or
// 16 codes each) and, over an int8 cache, the scale of each load's row.
template <int LOADS, int KV>
struct KvStage {
  uint4 r[LOADS];
  float scale[KV == kReadRowScaled ? LOADS : 1];
};

// The factors the scores and the output still need for an 8-bit cache as stored: the
// descales (per tensor, kv head or (sequence, kv head)), and 2^8 for E4M3 codes (read as
// value x 2^-8). 1 for fp16 caches (KV8 false) and in prefill.
struct KvScales {
  float k, v;
};

template <bool KV8>
__device__ __forceinline__ KvScales kv_scales(const FwdParams& p, const ServingWork& w, int hk) {
  if constexpr (KV8) {
    const float code = p.kv_format == kKvE4M3 ? 256.f : 1.f;
    auto descale = [&](const float* d, const int64_t(&stride)[2]) {
      return d == nullptr ? 1.f : __ldg(d + w.b * stride[0] + hk * stride[1]);
    };
    return {code * descale(p.k_descale, p.k_descale_stride),
            code * descale(p.v_descale, p.v_descale_stride)};
  } else {
    return {1.f, 1.f};
  }
}

// Rows [n0, n0 + BC) of a cache tile (K or V: page_stride / row_stride are its strides)
// into registers; rows >= n and chunks past the real head dim read as zeros. Paged: row j
// is row j % page_size of page pg[i] (fetched for this tile); contiguous: j rows on.
template <class C, int LOADS>
__device__ __forceinline__ void load_cache_tile(uint4 (&r)[LOADS], const __half* g,
                                                const int (&pg)[LOADS], bool paged,
                                                int page_shift, int64_t page_stride,
                                                int64_t row_stride, int n0, int n,
                                                int head_dim, int tid) {
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    int row, c;
    tile_coord<C>(i, tid, row, c);
    const int j = n0 + row;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (in_tile<C, C::kBlockN>(i, tid) && j < n && c * 8 < head_dim) {
      const int64_t off = paged ? (int64_t)pg[i] * page_stride +
                                      (int64_t)(j & ((1 << page_shift) - 1)) * row_stride
                                : (int64_t)j * row_stride;
      v = __ldg(reinterpret_cast<const uint4*>(g + off + c * 8));
    }
    r[i] = v;
  }
}

// The tile as an 8-bit cache is loaded: 16 codes (16 bytes) per load, so a thread issues
// half the loads of the fp16 tile for half the bytes (decode is bound by the loads in
// flight, not only by bytes: 8 codes per load measured no faster than fp16). A FwdShape
// for tile_coord / in_tile whose "chunks" are pairs of the tile's 8-element chunks.
template <class C>
struct CodeTile {
  static_assert(C::kChunks % 2 == 0, "8-bit cache tiles: compiled head dims are multiples of 16");
  static constexpr int kThreads = C::kThreads, kChunks = C::kChunks / 2, kBlockN = C::kBlockN;
  static constexpr int kLoads = (C::kBlockN * kChunks + kThreads - 1) / kThreads;
};

// Loads per thread of a K/V tile: fp16 (C::kTileLoads) or 8-bit codes (CodeTile).
template <class C, bool KV8>
__host__ __device__ constexpr int kv_tile_loads() {
  if constexpr (KV8)
    return CodeTile<C>::kLoads;
  else
    return C::kTileLoads;
}

// 16 codes of a row at a (chunk c) as two 8-byte loads, the second only where the head dim
// reaches it (an odd multiple of 8 ends in half a pair).
__device__ __forceinline__ uint4 load_code_pairs(const unsigned char* a, int c, int head_dim) {
  const uint2 lo = __ldg(reinterpret_cast<const uint2*>(a));
  const uint2 hi = c * 16 + 8 < head_dim ? __ldg(reinterpret_cast<const uint2*>(a + 8))
                                         : make_uint2(0, 0);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// Rows [n0, n0 + BC) of an 8-bit cache tile into registers, 16 codes per uint4 (g: the
// kv head's first byte; strides in bytes). One 16-byte load where the chunk is whole and
// the cache's rows are 16-byte aligned (p.kv_align, set by the op), else 8-byte loads
// (a head dim that is an odd multiple of 8 ends in half a pair), or 4-byte ones (vLLM's
// int8 rows, each followed by its 4-byte scale). KV == kReadRowScaled: each row's scale
// too (rs: the kv head's scale cache; paged by block and slot, contiguous by row).
template <class C, int KV, int LOADS>
__device__ __forceinline__ void load_code_tile(KvStage<LOADS, KV>& st, const unsigned char* g,
                                               const float* rs, const int64_t (&rs_stride)[3],
                                               const int (&pg)[LOADS], const FwdParams& p,
                                               bool paged, int64_t page_stride,
                                               int64_t row_stride, int n0, int n, int tid) {
  using T = CodeTile<C>;
  // The common case in one address per tile, stepped (as load_tile): the threads cover
  // whole rows, so a thread's loads lie kRowStep rows apart in one column; the tile lies in
  // one page (pages of at least kBlockN keys); every chunk is one 16-byte load. The general
  // loop below costs ~35 instructions per load (a 64-bit page and row product, and the
  // alignment and head-dim branches), which 8-bit decode, bound by the instructions of each
  // key tile, paid 8 times a tile (csrc/fa2/MEASUREMENTS.md, "Stepped 8-bit tile loads").
  if constexpr (T::kThreads % T::kChunks == 0) {
    if (p.kv_align == 16 && p.head_dim % 16 == 0 &&
        (!paged || (1 << p.page_shift) >= C::kBlockN)) {
      constexpr int kRowStep = T::kThreads / T::kChunks;
      int row, c;
      tile_coord<T>(0, tid, row, c);
      const int j = n0 + row, rows_left = n - j;
      const bool col_ok = c * 16 < p.head_dim;
      const int slot = paged ? j & ((1 << p.page_shift) - 1) : j;
      const unsigned char* a =
          g + (paged ? (int64_t)pg[0] * page_stride : 0) + (int64_t)slot * row_stride + c * 16;
      const int64_t step = (int64_t)kRowStep * row_stride;
      [[maybe_unused]] const float* sp = nullptr;
      [[maybe_unused]] int64_t sstep = 0;
      if constexpr (KV == kReadRowScaled) {
        sp = rs + (paged ? (int64_t)pg[0] * rs_stride[0] : 0) + (int64_t)slot * rs_stride[1];
        sstep = (int64_t)kRowStep * rs_stride[1];
      }
#pragma unroll
      for (int i = 0; i < T::kLoads; ++i) {
        const bool live = in_tile<T, C::kBlockN>(i, tid) && i * kRowStep < rows_left;
        st.r[i] = live && col_ok ? __ldg(reinterpret_cast<const uint4*>(a)) : make_uint4(0, 0, 0, 0);
        if constexpr (KV == kReadRowScaled) {
          st.scale[i] = live ? __ldg(sp) : 0.f;
          sp += sstep;
        }
        a += step;
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < T::kLoads; ++i) {
    int row, c;
    tile_coord<T>(i, tid, row, c);
    const int j = n0 + row;
    uint4 v = make_uint4(0, 0, 0, 0);
    if constexpr (KV == kReadRowScaled) {
      const bool live = in_tile<T, C::kBlockN>(i, tid) && j < n;
      const int slot = paged ? j & ((1 << p.page_shift) - 1) : j;
      if (live && c * 16 < p.head_dim) {
        const int64_t off = paged ? (int64_t)pg[i] * page_stride + (int64_t)slot * row_stride
                                  : (int64_t)j * row_stride;
        const unsigned char* a = g + off + c * 16;
        if (p.kv_align == 16 && c * 16 + 16 <= p.head_dim) {
          v = __ldg(reinterpret_cast<const uint4*>(a));
        } else if (p.kv_align >= 8) {
          v = load_code_pairs(a, c, p.head_dim);
        } else {
          const uint32_t* w = reinterpret_cast<const uint32_t*>(a);
          v.x = __ldg(w);
          v.y = __ldg(w + 1);
          if (c * 16 + 8 < p.head_dim) {
            v.z = __ldg(w + 2);
            v.w = __ldg(w + 3);
          }
        }
      }
      st.r[i] = v;
      st.scale[i] = live ? __ldg(rs + (paged ? (int64_t)pg[i] * rs_stride[0] : 0) +
                                 (int64_t)slot * rs_stride[1])
                         : 0.f;
    } else {  // fp8: rows are 8-byte aligned (the op checks), no scales
      if (in_tile<T, C::kBlockN>(i, tid) && j < n && c * 16 < p.head_dim) {
        const int64_t off = paged ? (int64_t)pg[i] * page_stride +
                                        (int64_t)(j & ((1 << p.page_shift) - 1)) * row_stride
                                  : (int64_t)j * row_stride;
        const unsigned char* a = g + off + c * 16;
        if (p.kv_align == 16 && c * 16 + 16 <= p.head_dim)
          v = __ldg(reinterpret_cast<const uint4*>(a));
        else
          v = load_code_pairs(a, c, p.head_dim);
      }
      st.r[i] = v;
    }
  }
}

// An 8-bit cache tile from registers (load_code_tile) to shared memory as fp16, each 16
// codes widened by widen(codes, lo, hi) (and an int8 row's scale stored with the row).
template <class C, int KV, int LOADS, class Widen>
__device__ __forceinline__ void store_codes(__half* s, const KvStage<LOADS, KV>& st, int tid,
                                            Widen widen) {
  using T = CodeTile<C>;
#pragma unroll
  for (int i = 0; i < T::kLoads; ++i) {
    int row, c;
    tile_coord<T>(i, tid, row, c);
    if (in_tile<T, C::kBlockN>(i, tid)) {
      uint4 lo, hi;
      widen(st.r[i], lo, hi);
      if constexpr (KV == kReadRowScaled) {
        if (c == 0) *kv_row_scale_slot<C>(s, row) = st.scale[i];
      }
      uint4* dst = reinterpret_cast<uint4*>(s + row * C::kStride + c * 16);
      dst[0] = lo;
      dst[1] = hi;
    }
  }
}

// The widening of the tile's format, chosen once per tile (the format is uniform over the
// CTA: one fp8 kernel serves both formats): int8, E5M2 (a byte permute per pair), E4M3
// without NaN handling unless one of this thread's codes is a NaN (rare: writes saturate).
template <class C, int KV, int LOADS>
__device__ __forceinline__ void store_code_tile(__half* s, const KvStage<LOADS, KV>& st,
                                                const FwdParams& p, int tid) {
  if constexpr (KV == kReadRowScaled) {
    store_codes<C>(s, st, tid, widen_int8x16);
  } else if (p.kv_format == kKvE5M2) {
    store_codes<C>(s, st, tid, [](const uint4& c, uint4& lo, uint4& hi) {
      widen_x16(c, lo, hi, [](uint32_t w, int sel) { return __byte_perm(w, 0u, sel); });
    });
  } else {
    bool nan = false;
#pragma unroll
    for (int i = 0; i < LOADS; ++i) nan |= fp8x16_has_nan(st.r[i]);
    if (!nan)
      store_codes<C>(s, st, tid, [](const uint4& c, uint4& lo, uint4& hi) {
        widen_x16(c, lo, hi, e4m3x2_to_half2);
      });
    else
      store_codes<C>(s, st, tid, [](const uint4& c, uint4& lo, uint4& hi) {
        widen_x16(c, lo, hi, e4m3x2_to_half2_nan);
      });
  }
}

// A K or V tile from registers to shared memory (fp16 as loaded, or 8-bit codes widened).
template <class C, int KV, int LOADS>
__device__ __forceinline__ void store_kv(__half* s, const KvStage<LOADS, KV>& st,
                                         const FwdParams& p, int tid) {
  if constexpr (KV != kReadF16)
    store_code_tile<C>(s, st, p, tid);
  else
    store_tile<C, C::kBlockN>(s, st.r, tid);
}

// Row-offset functors for load_tile_rows (Q) / store_o_rows_at (O).
struct PackedRows {
  int group;
  int64_t row_stride, head_stride;
  __device__ __forceinline__ int64_t operator()(int r) const {
    return packed_row_offset(r, group, row_stride, head_stride);
  }
};

struct OutRows {
  int64_t base;  // serving_out_offsets of (token 0, head hk * group)
  int group;
  int64_t row_stride, head_stride;
  __device__ __forceinline__ int64_t operator()(int r) const {
    return base + packed_row_offset(r, group, row_stride, head_stride);
  }
};

// The 16 staged O rows of m16 slice `slice` (sO) to the output: packed GQA rows through
// OutRows in the serving instantiation, plain rows at o_off in prefill. With a dim split
// the C::kDimSplit warps that staged the slice each store part `part` of it.
template <class C, bool SERVING>
__device__ __forceinline__ void store_o_slice(const FwdParams& p, int64_t o_off, const __half* sO,
                                              int m0, int slice, int sq, int lane, int part = 0) {
  constexpr int KS = C::kDimSplit;
  if constexpr (SERVING)
    store_o_rows_at<C, OutRows, KS>(p, OutRows{o_off, p.group, p.o_row_stride, p.o_head_stride},
                                    sO, m0, slice, sq, lane, part);
  else
    store_o_rows_at<C, OffsetRows, KS>(p, OffsetRows{o_off, p.o_row_stride}, sO, m0, slice, sq,
                                       lane, part);
}

// Key tiles of rows with tokens [first_tok, last_tok] inside the partition [kv_lo, kv_hi),
// with the window applied (bottom-right aligned: off = sk - sq).
template <int BC>
__device__ __forceinline__ void serving_tiles(const FwdParams& p, const ServingWork& w,
                                              int first_tok, int last_tok, int& t_lo,
                                              int& t_hi) {
  const int off = w.sk - w.sq;
  int n_lo = w.kv_lo, n_hi = w.kv_hi;
  if (p.window_left >= 0) n_lo = max(n_lo, first_tok + off - p.window_left);
  if (p.window_right >= 0) n_hi = min(n_hi, last_tok + off + p.window_right + 1);
  t_lo = n_lo / BC;
  t_hi = n_hi > n_lo ? (n_hi + BC - 1) / BC : t_lo;
}

// Element offsets in p.o and p.lse of query token t, head h of sequence w.b.
__device__ __forceinline__ void serving_out_offsets(const FwdParams& p, const ServingWork& w,
                                                    int t, int h, int64_t& o_off,
                                                    int64_t& lse_off) {
  if (p.cu_seqlens_q != nullptr) {
    o_off = (w.q_tok0 + t) * p.o_row_stride;
    lse_off = w.q_tok0 + t;
  } else {
    o_off = (int64_t)w.b * p.o_batch_stride + (int64_t)t * p.o_row_stride;
    lse_off = (int64_t)w.b * p.lse_batch_stride + t;
  }
  o_off += (int64_t)h * p.o_head_stride;
  lse_off += (int64_t)h * p.lse_head_stride;
}

// Index of packed row r of (partition z, kv head hk) in lse_accum (times head_dim: o_accum).
__device__ __forceinline__ int64_t accum_row(const FwdParams& p, int z, int hk, int r) {
  return ((int64_t)z * p.kv_heads + hk) * p.accum_rows + r;
}

// A split's LSE: -inf for a row that saw no key in this partition, so that the combine
// gives it weight 0.
__device__ __forceinline__ float partial_lse(const SoftmaxScale& sc, float l, float row_max) {
  return l > 0.f ? row_max * sc.nat + __logf(l) : -INFINITY;
}


// What the key loop of either instantiation needs: Q/K/V bases, the rows of the sequence
// (serving: packed rows), the key bound of loads and masks, the mask alignment, the key
// tiles, and the first/last query position the masks see (serving: tokens). False when the
// CTA's m-block starts past the rows (nothing to do).
struct CtaWork {
  const __half *qg, *kg, *vg;    // K, V: the sequence's (prefill) or the cache's kv head
  const unsigned char *kc, *vc;  // an 8-bit cache's kv head (KV8)
  const float *ks, *vs;          // an int8 cache's row scales of this kv head (and row)
  int sq, sk, off, t_lo, t_hi, first_row, last_row;
  ServingWork w;  // serving only
};

template <int BR, int BC, bool SERVING, int KV = kReadF16>
__device__ __forceinline__ bool cta_work(const FwdParams& p, int b, int h, int m0, CtaWork& c) {
  if constexpr (SERVING) {
    c.w = serving_work(p, b, h);
    c.sq = c.w.rows;
    if (m0 >= c.sq) return false;
    c.qg = static_cast<const __half*>(p.q) + c.w.q_off;
    if constexpr (KV != kReadF16) {  // one-byte elements: the offsets are bytes
      c.kc = static_cast<const unsigned char*>(p.k) + c.w.k_off;
      c.vc = static_cast<const unsigned char*>(p.v) + c.w.v_off;
    } else {
      c.kg = static_cast<const __half*>(p.k) + c.w.k_off;
      c.vg = static_cast<const __half*>(p.v) + c.w.v_off;
    }
    if constexpr (KV == kReadRowScaled) {
      c.ks = p.k_row_scale + (int64_t)h * p.k_row_scale_stride[2];
      c.vs = p.v_row_scale + (int64_t)h * p.v_row_scale_stride[2];
      if (c.w.pages == nullptr) {  // contiguous: the sequence's cache row, from its first key
        c.ks += (int64_t)c.w.cache_row * p.k_row_scale_stride[0] +
                (int64_t)c.w.k0 * p.k_row_scale_stride[1];
        c.vs += (int64_t)c.w.cache_row * p.v_row_scale_stride[0] +
                (int64_t)c.w.k0 * p.v_row_scale_stride[1];
      }
    }
    c.sk = c.w.kv_hi;
    c.off = c.w.sk - c.w.sq;
    c.first_row = m0 / p.group;
    c.last_row = (min(m0 + BR, c.sq) - 1) / p.group;
    serving_tiles<BC>(p, c.w, c.first_row, c.last_row, c.t_lo, c.t_hi);
  } else {
    const Sequence seq = sequence(p, b);
    c.sq = seq.sq;
    c.sk = seq.sk;
    if (m0 >= c.sq) return false;
    int64_t q_off, k_off, v_off;
    head_offsets(p, seq, h, q_off, k_off, v_off);
    c.qg = static_cast<const __half*>(p.q) + q_off;
    c.kg = static_cast<const __half*>(p.k) + k_off;
    c.vg = static_cast<const __half*>(p.v) + v_off;
    const KeyTiles tiles = key_tiles<BR, BC>(p, m0, c.sq, c.sk);
    c.off = tiles.off;
    c.first_row = m0;
    c.last_row = tiles.last_row;
    c.t_lo = tiles.t_lo;
    c.t_hi = tiles.t_hi;
  }
  return true;
}

// The Q tile (rows [m0, m0 + BR) of the sequence; serving: packed rows) -> registers.
template <class C, bool SERVING>
__device__ __forceinline__ void load_q(uint4 (&r)[C::kQLoads], const FwdParams& p,
                                       const CtaWork& c, int m0, int tid) {
  if constexpr (SERVING)
    load_tile_rows<C, C::kBlockM>(r, c.qg, PackedRows{p.group, p.q_row_stride, p.q_head_stride}, m0, c.sq,
                      p.head_dim, tid);
  else
    load_tile<C, C::kBlockM>(r, c.qg, p.q_row_stride, m0, c.sq, p.head_dim, tid);
}

// The K (V = false) or V tile of keys n0 .. -> registers. Serving: from the cache, pg
// holding the pages of this tile's rows (fetch_pages, one tile ahead), fp16 or (KV8) the
// 8-bit codes; prefill: rows of the sequence.
template <class C, bool SERVING, bool V, int KV, int LOADS, int PAGES>
__device__ __forceinline__ void load_kv(KvStage<LOADS, KV>& st, const int (&pg)[PAGES],
                                        const FwdParams& p, const CtaWork& c, int n0, int tid) {
  const int64_t row_stride = V ? p.v_row_stride : p.k_row_stride;
  const int64_t batch_stride = V ? p.v_batch_stride : p.k_batch_stride;
  if constexpr (KV != kReadF16)
    load_code_tile<C>(st, V ? c.vc : c.kc, V ? c.vs : c.ks,
                      V ? p.v_row_scale_stride : p.k_row_scale_stride, pg, p,
                      c.w.pages != nullptr, batch_stride, row_stride, n0, c.sk, tid);
  else if constexpr (SERVING)
    load_cache_tile<C>(st.r, V ? c.vg : c.kg, pg, c.w.pages != nullptr, p.page_shift,
                       batch_stride, row_stride, n0, c.sk, p.head_dim, tid);
  else
    load_tile<C, C::kBlockN>(st.r, V ? c.vg : c.kg, row_stride, n0, c.sk, p.head_dim, tid);
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
