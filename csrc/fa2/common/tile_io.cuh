// Tile copies global -> registers -> shared memory with 128-bit accesses (no cp.async
// before sm_80: the registers let a load stay in flight across the GEMMs of the previous
// tile, see KvPrefetch). C is a FwdShape (common/config.cuh).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sm7x {
namespace fa2 {
namespace detail {

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

// Whether the i-th uint4 of thread tid lies inside a tile of ROWS rows: always, unless the
// tile's 16-byte chunks do not split evenly over the threads (e.g. 32 rows of d = 112,
// 448 chunks over 128 threads); then the copy runs ceil(chunks / threads) rounds and the
// last one is partial. i is a compile-time constant in every unrolled caller, so even
// tiles get no test at all.
template <class C, int ROWS>
__device__ __forceinline__ bool in_tile(int i, int tid) {
  constexpr int kTotal = ROWS * C::kChunks;
  if constexpr (kTotal % C::kThreads == 0)
    return true;
  else
    return i < kTotal / C::kThreads || tid + i * C::kThreads < kTotal;
}

// Rows n0 .. of a strided tile: row j is j * stride elements on.
struct StridedRows {
  int64_t stride;
  __device__ __forceinline__ int64_t operator()(int j) const { return (int64_t)j * stride; }
};

// rows [n0, n0 + ROWS) x all chunks of a [ROWS][D] fp16 tile into registers; rows >= n
// and chunks past the real head dim read as zeros. row_offset(j) is the element offset of
// row j from g (StridedRows; the serving kernels: packed GQA rows of q).
template <class C, int ROWS, int LOADS, class RowOffset>
__device__ __forceinline__ void load_tile_rows(uint4 (&r)[LOADS], const __half* g,
                                               const RowOffset& row_offset, int n0, int n,
                                               int head_dim, int tid) {
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    int row, c;
    tile_coord<C>(i, tid, row, c);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (in_tile<C, ROWS>(i, tid) && n0 + row < n && c * 8 < head_dim)
      v = __ldg(reinterpret_cast<const uint4*>(g + row_offset(n0 + row) + c * 8));
    r[i] = v;
  }
}

// Strided rows: when the threads cover whole rows, a thread's loads lie kRowStep rows
// apart in one column, so one address per tile is stepped by a 64-bit increment (instead
// of a 64-bit row product and bounds test per load, which cost ~13 instructions per load
// in the forward's loop).
template <class C, int ROWS, int LOADS>
__device__ __forceinline__ void load_tile(uint4 (&r)[LOADS], const __half* g,
                                          int64_t row_stride, int n0, int n, int head_dim,
                                          int tid) {
  if constexpr (C::kThreads % C::kChunks == 0) {
    constexpr int kRowStep = C::kThreads / C::kChunks;
    int row, c;
    tile_coord<C>(0, tid, row, c);
    const int rows_left = n - n0 - row;  // rows of the sequence from this thread's first
    const bool col_ok = c * 8 < head_dim;
    const __half* src = g + (int64_t)(n0 + row) * row_stride + c * 8;
    const int64_t step = (int64_t)kRowStep * row_stride;
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (in_tile<C, ROWS>(i, tid) && i * kRowStep < rows_left && col_ok)
        v = __ldg(reinterpret_cast<const uint4*>(src));
      r[i] = v;
      src += step;
    }
  } else {
    load_tile_rows<C, ROWS>(r, g, StridedRows{row_stride}, n0, n, head_dim, tid);
  }
}

template <class C, int ROWS, int LOADS>
__device__ __forceinline__ void store_tile(__half* s, const uint4 (&r)[LOADS], int tid) {
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    int row, c;
    tile_coord<C>(i, tid, row, c);
    if (in_tile<C, ROWS>(i, tid)) *reinterpret_cast<uint4*>(s + row * C::kStride + c * 8) = r[i];
  }
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
