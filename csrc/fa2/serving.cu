// The serving call's two small kernels that do not depend on the head dim, compiled once
// per library: the split-KV combine and the input check the op runs before the launch.
#include <cuda_runtime.h>

#include <cmath>
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

constexpr int kCombineRows = 4;  // one warp per packed row

// Per (packed row r, kv head hk) of a sequence b with several partitions: the partials'
// LSEs give the weights exp(lse_s - lse) of their (already normalized) outputs; lse =
// log sum_s exp(lse_s) (and exp(s_h) of a sink). A row that saw no key in any partition:
// 0 and lse = +inf (s_h with a sink).
__global__ void __launch_bounds__(32 * kCombineRows) combine_kernel(const FwdParams p) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kCombineRows + (threadIdx.x >> 5), hk = blockIdx.y, b = blockIdx.z;
  const int z0 = clamp_int(p.split_offsets[b], 0, p.num_partitions);
  const int ns = clamp_int(p.split_offsets[b + 1] - z0, 0, p.num_partitions - z0);
  if (ns <= 1) return;
  const ServingWork w = detail::serving_work(p, z0, hk);
  if (r >= w.rows) return;
  float mx = -INFINITY;
  for (int s = lane; s < ns; s += 32) mx = fmaxf(mx, p.lse_accum[accum_row(p, z0 + s, hk, r)]);
  for (int m = 16; m > 0; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
  float sum = 0.f;
  if (mx != -INFINITY)
    for (int s = lane; s < ns; s += 32) sum += __expf(p.lse_accum[accum_row(p, z0 + s, hk, r)] - mx);
  for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  float lse = sum > 0.f ? mx + __logf(sum) : INFINITY;
  if (p.sinks != nullptr) {  // the sink joins the merged denominator (fa2.h FwdParams::sinks)
    const float s = p.sinks[hk * p.group + r % p.group];
    lse = sum > 0.f ? fmaxf(lse, s) + __logf(1.f + __expf(-fabsf(lse - s))) : s;
  }
  int64_t o_off, lse_off;
  detail::serving_out_offsets(p, w, 0, hk * p.group, o_off, lse_off);
  __half* o = static_cast<__half*>(p.o) +
              o_off + packed_row_offset(r, p.group, p.o_row_stride, p.o_head_stride);
  for (int c = lane * 4; c < p.head_dim; c += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (sum > 0.f) {
      for (int s = 0; s < ns; ++s) {
        const int64_t a = accum_row(p, z0 + s, hk, r);
        const float wgt = __expf(p.lse_accum[a] - lse);  // exp(-inf) = 0: empty partitions
        const float4 v = *reinterpret_cast<const float4*>(p.o_accum + a * p.head_dim + c);
        acc.x = fmaf(wgt, v.x, acc.x);
        acc.y = fmaf(wgt, v.y, acc.y);
        acc.z = fmaf(wgt, v.z, acc.z);
        acc.w = fmaf(wgt, v.w, acc.w);
      }
    }
    const __half2 lo = __floats2half2_rn(acc.x, acc.y), hi = __floats2half2_rn(acc.z, acc.w);
    uint2 pk;
    pk.x = *reinterpret_cast<const uint32_t*>(&lo);
    pk.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(o + c) = pk;
  }
  if (lane == 0) p.lse[lse_off + packed_row_offset(r, p.group, 1, p.lse_head_stride)] = lse;
}

// bad = {kind, seq, index, value} of the first violation found (kind 0: none).
__device__ void report(int* bad, int kind, int seq, int index, int value) {
  if (atomicCAS(bad, 0, kind) == 0) {
    bad[1] = seq;
    bad[2] = index;
    bad[3] = value;
  }
}

// One CTA per sequence: the values the serving kernel reads from the device, unclamped.
__global__ void validate_kernel(const FwdParams p, int* bad) {
  const int b = blockIdx.x;
  if (threadIdx.x == 0) {
    if (p.cu_seqlens_q != nullptr) {
      const int qs = p.cu_seqlens_q[b], qe = p.cu_seqlens_q[b + 1];
      if (b == 0 && qs != 0) report(bad, 3, b, 0, qs);
      if (qe < qs || qe - qs > p.seqlen_q) report(bad, 3, b, b + 1, qe);
      if (b == p.batch - 1 && qe != p.total_q) report(bad, 3, b, b + 1, qe);
    }
    const int z0 = p.split_offsets[b], z1 = p.split_offsets[b + 1];
    if (z0 < 0 || z1 < z0 || z1 > p.num_partitions || (b == p.batch - 1 && z1 != p.num_partitions))
      report(bad, 6, b, b + 1, z1);
    else
      for (int z = z0; z < z1; ++z)
        if (p.partitions[3 * z] != b || p.partitions[3 * z + 1] < 0 ||
            p.partitions[3 * z + 2] < p.partitions[3 * z + 1])
          report(bad, 6, b, z, p.partitions[3 * z]);
    if (p.cache_batch_idx != nullptr) {
      const int row = p.cache_batch_idx[b];
      if (row < 0 || row >= p.num_pages) report(bad, 5, b, b, row);
    }
  }
  int kend = p.seqused_k != nullptr ? p.seqused_k[b] + p.seqused_add
             : p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]
                                         : p.seqlen_k;
  if (threadIdx.x == 0) {
    if (kend < 0 || kend > p.kv_capacity) report(bad, 2, b, b, kend);
    const int k0 = p.k_start != nullptr ? p.k_start[b] : 0;
    if (k0 < 0 || k0 > max(kend, 0)) report(bad, 4, b, b, k0);
    const int z1 = p.split_offsets[b + 1];  // the plan must cover every key
    if (z1 > 0 && z1 <= p.num_partitions && kend - k0 > p.partitions[3 * (z1 - 1) + 2])
      report(bad, 7, b, p.partitions[3 * (z1 - 1) + 2], kend - k0);
  }
  if (p.block_table != nullptr) {
    kend = clamp_int(kend, 0, p.kv_capacity);
    const int used = (kend + (1 << p.page_shift) - 1) >> p.page_shift;
    for (int j = threadIdx.x; j < used; j += blockDim.x) {
      const int page = p.block_table[(int64_t)b * p.bt_stride + j];
      if (page < 0 || page >= p.num_pages) report(bad, 1, b, j, page);
    }
  }
}

std::mutex g_bad_mutex;
int* g_bad[64] = {};  // per device: 4 ints, allocated on first use

}  // namespace

int run_combine(const FwdParams& p, cudaStream_t stream) {
  const int rows = p.seqlen_q * p.group;
  if (rows == 0 || p.batch == 0 || p.kv_heads == 0) return 0;
  dim3 grid((rows + kCombineRows - 1) / kCombineRows, p.kv_heads, p.batch);
  combine_kernel<<<grid, 32 * kCombineRows, 0, stream>>>(p);
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
  validate_kernel<<<p.batch, 128, 0, stream>>>(p, buf);
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
