// The serving call's two small kernels that do not depend on the head dim, compiled once
// per library: the split-KV combine and the input check the op runs before the launch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>

#include "common/serving.cuh"
#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace {

using detail::accum_row;
using detail::clamp_int;
using detail::packed_row_offset;
using detail::ServingWork;

// One CTA of kCombineWarps warps per (packed row, kv head, sequence): warp w sums the
// partitions w, w + kCombineWarps, .. and shared memory adds the warps' sums. A step of
// batch 1 at 128k keys has ~200 partitions per row and only 32 rows: one warp walking a
// row's partitions one after another waited on a load per partition (33 us beside the
// 121 us decode kernel of an E4M3 step on an H100); split over warps, with several loads
// in flight per warp, it took 7 (csrc/fa2/MEASUREMENTS.md, "The split-KV combine").
constexpr int kCombineWarps = 8;

// The sum (kMax false) or max (true) of v over the CTA; every thread gets it.
template <bool kMax>
__device__ __forceinline__ float cta_reduce(float v, float (&slots)[kCombineWarps]) {
  for (int m = 16; m > 0; m >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, m);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = v;
  __syncthreads();
  v = slots[0];
#pragma unroll
  for (int i = 1; i < kCombineWarps; ++i) v = kMax ? fmaxf(v, slots[i]) : v + slots[i];
  __syncthreads();  // slots are free again
  return v;
}

// Per (packed row r, kv head hk) of a sequence b with several partitions: the partials'
// LSEs give the weights exp(lse_s - lse) of their (already normalized) outputs; lse =
// log sum_s exp(lse_s) (and exp(s_h) of a sink). A row that saw no key in any partition:
// 0 and lse = +inf (s_h with a sink).
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const FwdParams p) {
  __shared__ float slots[kCombineWarps];
  __shared__ float4 sums[kCombineWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int z0 = clamp_int(p.split_offsets[b], 0, p.num_partitions);
  const int ns = clamp_int(p.split_offsets[b + 1] - z0, 0, p.num_partitions - z0);
  if (ns <= 1) return;  // uniform over the CTA, as the row test below
  const ServingWork w = detail::serving_work(p, z0, hk);
  if (r >= w.rows) return;
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < ns; s += blockDim.x)
    mx = fmaxf(mx, p.lse_accum[accum_row(p, z0 + s, hk, r)]);
  mx = cta_reduce<true>(mx, slots);
  float sum = 0.f;
  if (mx != -INFINITY)
    for (int s = threadIdx.x; s < ns; s += blockDim.x)
      sum += __expf(p.lse_accum[accum_row(p, z0 + s, hk, r)] - mx);
  sum = cta_reduce<false>(sum, slots);
  float lse = sum > 0.f ? mx + __logf(sum) : INFINITY;
  if (p.sinks != nullptr) {  // the sink joins the merged denominator (fa2.h FwdParams::sinks)
    const float s = p.sinks[hk * p.group + r % p.group];
    lse = sum > 0.f ? fmaxf(lse, s) + __logf(1.f + __expf(-fabsf(lse - s))) : s;
  }
  int64_t o_off, lse_off;
  detail::serving_out_offsets(p, w, 0, hk * p.group, o_off, lse_off);
  __half* o = static_cast<__half*>(p.o) +
              o_off + packed_row_offset(r, p.group, p.o_row_stride, p.o_head_stride);
  for (int c0 = 0; c0 < p.head_dim; c0 += 128) {  // 4 columns a lane
    const int c = c0 + lane * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (sum > 0.f && c < p.head_dim) {
#pragma unroll 4
      for (int s = warp; s < ns; s += kCombineWarps) {
        const int64_t a = accum_row(p, z0 + s, hk, r);
        const float wgt = __expf(p.lse_accum[a] - lse);  // exp(-inf) = 0: empty partitions
        const float4 v = *reinterpret_cast<const float4*>(p.o_accum + a * p.head_dim + c);
        acc.x = fmaf(wgt, v.x, acc.x);
        acc.y = fmaf(wgt, v.y, acc.y);
        acc.z = fmaf(wgt, v.z, acc.z);
        acc.w = fmaf(wgt, v.w, acc.w);
      }
    }
    sums[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && c < p.head_dim) {
#pragma unroll
      for (int i = 1; i < kCombineWarps; ++i) {
        const float4 v = sums[i][lane];
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      const __half2 lo = __floats2half2_rn(acc.x, acc.y), hi = __floats2half2_rn(acc.z, acc.w);
      uint2 pk;
      pk.x = *reinterpret_cast<const uint32_t*>(&lo);
      pk.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(o + c) = pk;
    }
    __syncthreads();  // sums is written again by the next columns
  }
  if (threadIdx.x == 0) p.lse[lse_off + packed_row_offset(r, p.group, 1, p.lse_head_stride)] = lse;
}

// bad = {kind, seq, index, value} of the first violation found (kind 0: none).
__device__ void report(int* bad, int kind, int seq, int index, int value) {
  if (atomicCAS(bad, 0, kind) == 0) {
    bad[1] = seq;
    bad[2] = index;
    bad[3] = value;
  }
}

// Threads of a check CTA, and the block-table entries each thread reads in one go (loads in
// flight: a 128k-key sequence has 8,192 pages, which one CTA walking them a load at a time
// took 46-57 us to check on an H100, beside a 100-180 us decode kernel; now 3 us).
constexpr int kValidateThreads = 256, kValidateLoads = 4;

// Grid (sequence, slice of its block table): the values the serving kernel reads from the
// device, unclamped. Slice 0 also checks the sequence's lengths and partitions.
__global__ void __launch_bounds__(kValidateThreads) validate_kernel(const FwdParams p, int* bad) {
  const int b = blockIdx.x;
  int kend = p.seqused_k != nullptr ? p.seqused_k[b] + p.seqused_add
             : p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]
                                         : p.seqlen_k;
  if (blockIdx.y == 0) {
    const int z0 = p.split_offsets[b], z1 = p.split_offsets[b + 1];
    const bool offsets_ok = !(z0 < 0 || z1 < z0 || z1 > p.num_partitions ||
                              (b == p.batch - 1 && z1 != p.num_partitions));
    if (threadIdx.x == 0) {
      if (p.cu_seqlens_q != nullptr) {
        const int qs = p.cu_seqlens_q[b], qe = p.cu_seqlens_q[b + 1];
        if (b == 0 && qs != 0) report(bad, 3, b, 0, qs);
        if (qe < qs || qe - qs > p.seqlen_q) report(bad, 3, b, b + 1, qe);
        if (b == p.batch - 1 && qe != p.total_q) report(bad, 3, b, b + 1, qe);
      }
      if (!offsets_ok) report(bad, 6, b, b + 1, z1);
      if (p.cache_batch_idx != nullptr) {
        const int row = p.cache_batch_idx[b];
        if (row < 0 || row >= p.num_pages) report(bad, 5, b, b, row);
      }
      if (kend < 0 || kend > p.kv_capacity) report(bad, 2, b, b, kend);
      const int k0 = p.k_start != nullptr ? p.k_start[b] : 0;
      if (k0 < 0 || k0 > max(kend, 0)) report(bad, 4, b, b, k0);
      // the plan must cover every key
      if (z1 > 0 && z1 <= p.num_partitions && kend - k0 > p.partitions[3 * (z1 - 1) + 2])
        report(bad, 7, b, p.partitions[3 * (z1 - 1) + 2], kend - k0);
    }
    if (offsets_ok)
      for (int z = z0 + threadIdx.x; z < z1; z += blockDim.x)
        if (p.partitions[3 * z] != b || p.partitions[3 * z + 1] < 0 ||
            p.partitions[3 * z + 2] < p.partitions[3 * z + 1])
          report(bad, 6, b, z, p.partitions[3 * z]);
  }
  if (p.block_table != nullptr) {
    kend = clamp_int(kend, 0, p.kv_capacity);
    const int used = (kend + (1 << p.page_shift) - 1) >> p.page_shift;
    const int32_t* const row = p.block_table + (int64_t)b * p.bt_stride;
    const int step = gridDim.y * blockDim.x;
    for (int j0 = blockIdx.y * blockDim.x + threadIdx.x; j0 < used; j0 += kValidateLoads * step) {
      int page[kValidateLoads];
#pragma unroll
      for (int u = 0; u < kValidateLoads; ++u)
        page[u] = j0 + u * step < used ? row[j0 + u * step] : 0;
#pragma unroll
      for (int u = 0; u < kValidateLoads; ++u)
        if (page[u] < 0 || page[u] >= p.num_pages) report(bad, 1, b, j0 + u * step, page[u]);
    }
  }
}

std::mutex g_bad_mutex;
int* g_bad[64] = {};  // per device: 4 ints, allocated on first use

}  // namespace

int run_combine(const FwdParams& p, cudaStream_t stream) {
  const int rows = p.seqlen_q * p.group;
  if (rows == 0 || p.batch == 0 || p.kv_heads == 0) return 0;
  dim3 grid(rows, p.kv_heads, p.batch);
  combine_kernel<<<grid, 32 * kCombineWarps, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int validate_serving(const FwdParams& p, cudaStream_t stream, bool* checked, int bad[4]) {
  *checked = false;
  bad[0] = bad[1] = bad[2] = bad[3] = 0;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (capture != cudaStreamCaptureStatusNone || p.batch == 0) return 0;
  int dev = 0;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess) return static_cast<int>(e);
  if (dev < 0 || dev >= 64) return static_cast<int>(cudaErrorInvalidDevice);
  std::lock_guard<std::mutex> lock(g_bad_mutex);  // one check at a time uses the buffer
  if (g_bad[dev] == nullptr &&
      (e = cudaMalloc(reinterpret_cast<void**>(&g_bad[dev]), 4 * sizeof(int))) != cudaSuccess)
    return static_cast<int>(e);
  int* const buf = g_bad[dev];
  if ((e = cudaMemsetAsync(buf, 0, 4 * sizeof(int), stream)) != cudaSuccess)
    return static_cast<int>(e);
  // slices of the block table: as many as give each thread kValidateLoads pages
  int slices = 1;
  if (p.block_table != nullptr) {
    const int64_t pages = ((int64_t)p.kv_capacity + (1 << p.page_shift) - 1) >> p.page_shift;
    slices = static_cast<int>(std::min<int64_t>(
        65535, std::max<int64_t>(1, pages / (kValidateThreads * kValidateLoads))));
  }
  validate_kernel<<<dim3(p.batch, slices), kValidateThreads, 0, stream>>>(p, buf);
  if ((e = cudaGetLastError()) != cudaSuccess) return static_cast<int>(e);
  if ((e = cudaMemcpyAsync(bad, buf, 4 * sizeof(int), cudaMemcpyDeviceToHost, stream)) !=
      cudaSuccess)
    return static_cast<int>(e);
  if ((e = cudaStreamSynchronize(stream)) != cudaSuccess) return static_cast<int>(e);
  *checked = true;
  return 0;
}

}  // namespace fa2
}  // namespace sm7x
