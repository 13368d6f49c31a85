// CUDA kernels of the sm7x core ops. No torch header here: the op layer (ops.cpp) hands
// over raw pointers, sizes, strides in elements and the stream to launch on.
//
// All ops are memory-bound. Each kernel has a 128-bit path (uint4 loads/stores, used when
// every pointer, row stride and the row length are 16-byte aligned) and a scalar path
// with the same structure. Arithmetic is fp32; fp16/bf16 are converted on load/store.
// bf16 uses only the __nv_bfloat16 <-> float conversions of cuda_bf16.h, which exist
// for every architecture since CUDA 11 (software conversions below sm_80), so the same
// code builds for sm_70 and sm_75.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fp8.h"
#include "kernels.h"

namespace sm7x {
namespace core {
namespace {

// ---------------------------------------------------------------------------------------
// Element conversions and packs.

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N elements of T as floats: one 128-bit load when N*sizeof(T) == 16 (the caller
// guarantees 16-byte alignment then), else element by element.
template <typename T, int N>
__device__ __forceinline__ void load_pack(float (&f)[N], const T* p) {
  if constexpr (sizeof(T) * N == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    T tmp[N];
    memcpy(tmp, &raw, 16);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_f(tmp[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_f(p[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const float (&f)[N]) {
  if constexpr (sizeof(T) * N == 16) {
    T tmp[N];
#pragma unroll
    for (int i = 0; i < N; ++i) tmp[i] = from_f<T>(f[i]);
    uint4 raw;
    memcpy(&raw, tmp, 16);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = from_f<T>(f[i]);
  }
}

// N elements of T as they are stored (one 128-bit access when N*sizeof(T) == 16):
// kept in registers, 16-bit types take half the registers of floats.
template <typename T, int N>
__device__ __forceinline__ void load_raw(T (&r)[N], const T* p) {
  if constexpr (sizeof(T) * N == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    memcpy(r, &raw, 16);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = p[i];
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_raw(T* p, const T (&r)[N]) {
  if constexpr (sizeof(T) * N == 16) {
    uint4 raw;
    memcpy(&raw, r, 16);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = r[i];
  }
}

// Elements per 128-bit pack.
template <typename T>
constexpr int kPack = 16 / sizeof(T);

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
inline bool aligned16(int64_t elems, int64_t elem_size) { return (elems * elem_size) % 16 == 0; }

inline int round_up(int64_t v, int64_t m) { return static_cast<int>((v + m - 1) / m * m); }
inline int clamp_threads(int64_t want, int lo, int hi) {
  int t = round_up(want < 1 ? 1 : want, 32);
  return t < lo ? lo : (t > hi ? hi : t);
}
inline unsigned grid_for(int64_t rows) {
  const int64_t cap = 0x7fffffff;
  return static_cast<unsigned>(rows < cap ? rows : cap);
}

// Sum over the block; every thread gets the total. Two barriers inside, one before so
// a grid-stride loop can call it again without racing on the shared slots.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    float s = lane < nwarps ? partial[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// ---------------------------------------------------------------------------------------
// RMS norm, plain and fused with the residual add. One block per row (grid-stride);
// each thread keeps up to VPT packs of its row in registers between the reduction and
// the write, so a row is read once from memory; longer rows are re-read (L1/L2). R: the
// residual's type, T or float (the residual stream kept in fp32; the row values then
// stay fp32 too).

constexpr int kVPT = 4;
constexpr int kNormMaxThreads = 1024;

template <typename T, int N, bool FUSED, typename R = T>
__global__ void __launch_bounds__(kNormMaxThreads)
rms_norm_kernel(T* out_or_x, int64_t out_stride, const T* x_in, int64_t x_stride,
                R* residual, int64_t r_stride, const T* __restrict__ weight, int64_t rows,
                int hidden, float eps) {
  static_assert(FUSED || std::is_same_v<R, T>, "a residual type only with the residual add");
  const int nvec = hidden / N;
  const bool cached = nvec <= kVPT * static_cast<int>(blockDim.x);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = x_in + row * x_stride;
    T* out = out_or_x + row * out_stride;
    R* res = FUSED ? residual + row * r_stride : nullptr;
    float ss = 0.0f;
    R cache[kVPT][N];
    // Loads pack i of the row into v and adds its squares to ss. FUSED: v = x + residual
    // rounded to R (what the residual stores), written back to the residual.
    auto load_row = [&](R (&v)[N], int i) {
      if constexpr (FUSED) {
        T xv[N];
        R r[N];
        load_raw<T, N>(xv, x + static_cast<int64_t>(i) * N);
        load_raw<R, N>(r, res + static_cast<int64_t>(i) * N);
#pragma unroll
        for (int e = 0; e < N; ++e) v[e] = from_f<R>(to_f(xv[e]) + to_f(r[e]));
        store_raw<R, N>(res + static_cast<int64_t>(i) * N, v);
      } else {
        load_raw<T, N>(v, x + static_cast<int64_t>(i) * N);
      }
#pragma unroll
      for (int e = 0; e < N; ++e) ss += to_f(v[e]) * to_f(v[e]);
    };
    if (cached) {
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nvec) load_row(cache[k], i);
      }
    } else {
      for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        R v[N];
        load_row(v, i);
      }
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / hidden + eps);
    // Writes pack i of the output from the row values v.
    auto write_row = [&](const R (&v)[N], int i) {
      float w[N], y[N];
      load_pack<T, N>(w, weight + static_cast<int64_t>(i) * N);
#pragma unroll
      for (int e = 0; e < N; ++e) y[e] = to_f(v[e]) * inv * w[e];
      store_pack<T, N>(out + static_cast<int64_t>(i) * N, y);
    };
    if (cached) {
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nvec) write_row(cache[k], i);
      }
    } else {
      // Re-read what this thread itself read (and, FUSED, wrote) in the first pass.
      const R* src;
      if constexpr (FUSED)
        src = res;
      else
        src = x;
      for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        R v[N];
        load_raw<R, N>(v, src + static_cast<int64_t>(i) * N);
        write_row(v, i);
      }
    }
  }
}

template <typename T, bool FUSED, typename R = T>
int launch_rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                    void* residual, int64_t r_stride, const void* weight, int64_t rows,
                    int64_t hidden, float eps, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return 0;
  constexpr int N = kPack<T>;
  const int64_t es = sizeof(T);
  bool vec = hidden % N == 0 && aligned16(out) && aligned16(x) && aligned16(weight) &&
             aligned16(out_stride, es) && aligned16(x_stride, es);
  if (FUSED) vec = vec && aligned16(residual) && aligned16(r_stride, sizeof(R));
  const int64_t nvec = vec ? hidden / N : hidden;
  const int threads = clamp_threads((nvec + kVPT - 1) / kVPT, 32, kNormMaxThreads);
  const unsigned grid = grid_for(rows);
  T* o = static_cast<T*>(out);
  const T* xi = static_cast<const T*>(x);
  R* r = static_cast<R*>(residual);
  const T* w = static_cast<const T*>(weight);
  const int h = static_cast<int>(hidden);
  if (vec)
    rms_norm_kernel<T, N, FUSED, R><<<grid, threads, 0, stream>>>(o, out_stride, xi, x_stride,
                                                                   r, r_stride, w, rows, h, eps);
  else
    rms_norm_kernel<T, 1, FUSED, R><<<grid, threads, 0, stream>>>(o, out_stride, xi, x_stride,
                                                                   r, r_stride, w, rows, h, eps);
  return static_cast<int>(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------
// silu_and_mul: one block per row (grid-stride), each thread two packs per step with
// all loads issued before the stores.

constexpr int kUnroll = 2;
constexpr int kSiluMaxThreads = 512;

template <typename T, int N>
__global__ void __launch_bounds__(kSiluMaxThreads) silu_and_mul_kernel(T* out_base, int64_t out_stride, const T* x_base,
                                    int64_t x_stride, int64_t rows, int d) {
  const int nvec = d / N;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* __restrict__ gate = x_base + row * x_stride;
    const T* __restrict__ up = gate + d;
    T* __restrict__ out = out_base + row * out_stride;
    for (int base = threadIdx.x; base < nvec; base += kUnroll * blockDim.x) {
      float g[kUnroll][N], u[kUnroll][N];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int i = base + k * blockDim.x;
        if (i < nvec) {
          load_pack<T, N>(g[k], gate + static_cast<int64_t>(i) * N);
          load_pack<T, N>(u[k], up + static_cast<int64_t>(i) * N);
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int i = base + k * blockDim.x;
        if (i < nvec) {
          float y[N];
#pragma unroll
          for (int e = 0; e < N; ++e) y[e] = g[k][e] / (1.0f + __expf(-g[k][e])) * u[k][e];
          store_pack<T, N>(out + static_cast<int64_t>(i) * N, y);
        }
      }
    }
  }
}

template <typename T>
int launch_silu_and_mul(const SiluAndMulArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.d == 0) return 0;
  constexpr int N = kPack<T>;
  const int64_t es = sizeof(T);
  const bool vec = a.d % N == 0 && aligned16(a.out) && aligned16(a.x) &&
                   aligned16(a.out_stride, es) && aligned16(a.x_stride, es);
  const int64_t nvec = vec ? a.d / N : a.d;
  const int threads = clamp_threads((nvec + kUnroll - 1) / kUnroll, 32, kSiluMaxThreads);
  T* o = static_cast<T*>(a.out);
  const T* x = static_cast<const T*>(a.x);
  const int d = static_cast<int>(a.d);
  if (vec)
    silu_and_mul_kernel<T, N><<<grid_for(a.rows), threads, 0, stream>>>(o, a.out_stride, x,
                                                                         a.x_stride, a.rows, d);
  else
    silu_and_mul_kernel<T, 1><<<grid_for(a.rows), threads, 0, stream>>>(o, a.out_stride, x,
                                                                         a.x_stride, a.rows, d);
  return static_cast<int>(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------
// Rotary embedding: one block per token (grid-stride). The token's cos/sin row goes to
// shared memory as fp32 once; then the block walks (head, pack) items of the query
// heads followed by the key heads. NeoX: a pack is N consecutive i of both halves
// (x[i], x[i + rot_dim/2]); GPT-J: a pack is N consecutive elements = N/2 pairs.

constexpr int kTokenMaxThreads = 256;  // rotary and reshape_and_cache: a block per token

template <typename T, typename C, typename P, int N, bool NEOX>
__global__ void __launch_bounds__(kTokenMaxThreads) rotary_kernel(RotaryArgs a) {
  extern __shared__ float cs[];  // [cos(rot_dim/2) | sin(rot_dim/2)]
  const int rot = static_cast<int>(a.rot_dim), half = rot / 2;
  const int packs = NEOX ? half / N : rot / N;
  const int nq = static_cast<int>(a.num_heads);
  const int nheads = nq + (a.key != nullptr ? static_cast<int>(a.num_kv_heads) : 0);
  const int items = nheads * packs;
  const P* positions = static_cast<const P*>(a.positions);
  const C* cache = static_cast<const C*>(a.cos_sin);
  T* query = static_cast<T*>(a.query);
  T* key = static_cast<T*>(a.key);
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    const int64_t pos = static_cast<int64_t>(positions[t]);
    if (pos < 0 || pos >= a.max_pos) continue;  // uniform per block; see kernels.h
    __syncthreads();                           // the previous token is done with cs
    const C* row = cache + pos * a.cs_stride;
    for (int i = threadIdx.x; i < rot; i += blockDim.x) cs[i] = to_f(row[i]);
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      const int h = it / packs, j = it - h * packs;
      T* x = h < nq ? query + t * a.q_token_stride + h * a.q_head_stride
                    : key + t * a.k_token_stride + (h - nq) * a.k_head_stride;
      if constexpr (NEOX) {
        const int i0 = j * N;
        float x1[N], x2[N];
        load_pack<T, N>(x1, x + i0);
        load_pack<T, N>(x2, x + half + i0);
        float y1[N], y2[N];
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const float c = cs[i0 + e], s = cs[half + i0 + e];
          y1[e] = x1[e] * c - x2[e] * s;
          y2[e] = x2[e] * c + x1[e] * s;
        }
        store_pack<T, N>(x + i0, y1);
        store_pack<T, N>(x + half + i0, y2);
      } else {
        const int e0 = j * N;
        float v[N];
        load_pack<T, N>(v, x + e0);
#pragma unroll
        for (int p = 0; p < N / 2; ++p) {
          const int i = e0 / 2 + p;
          const float c = cs[i], s = cs[half + i];
          const float x1 = v[2 * p], x2 = v[2 * p + 1];
          v[2 * p] = x1 * c - x2 * s;
          v[2 * p + 1] = x2 * c + x1 * s;
        }
        store_pack<T, N>(x + e0, v);
      }
    }
  }
}

template <typename T, typename C, typename P>
int launch_rotary(const RotaryArgs& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.rot_dim == 0) return 0;
  constexpr int N = kPack<T>;
  const int64_t es = sizeof(T);
  const int64_t half = a.rot_dim / 2;
  bool vec = (a.is_neox ? half % N == 0 : a.rot_dim % N == 0) && aligned16(a.query) &&
             aligned16(a.q_token_stride, es) && aligned16(a.q_head_stride, es);
  if (a.key != nullptr)
    vec = vec && aligned16(a.key) && aligned16(a.k_token_stride, es) &&
          aligned16(a.k_head_stride, es);
  const int64_t nheads = a.num_heads + (a.key != nullptr ? a.num_kv_heads : 0);
  const int n = vec ? N : (a.is_neox ? 1 : 2);
  const int64_t items = nheads * (a.is_neox ? half / n : a.rot_dim / n);
  const int threads = clamp_threads(items, 32, kTokenMaxThreads);
  const size_t smem = sizeof(float) * a.rot_dim;
  const unsigned grid = grid_for(a.tokens);
  if (vec) {
    if (a.is_neox)
      rotary_kernel<T, C, P, N, true><<<grid, threads, smem, stream>>>(a);
    else
      rotary_kernel<T, C, P, N, false><<<grid, threads, smem, stream>>>(a);
  } else {
    if (a.is_neox)
      rotary_kernel<T, C, P, 1, true><<<grid, threads, smem, stream>>>(a);
    else
      rotary_kernel<T, C, P, 2, false><<<grid, threads, smem, stream>>>(a);
  }
  return static_cast<int>(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------
// reshape_and_cache: a pure copy, so it is instantiated per element size, not dtype.
// One block per token (grid-stride); items are (head, pack) of the key then the value.

template <typename E, typename P>
__global__ void __launch_bounds__(kTokenMaxThreads) reshape_and_cache_kernel(ReshapeAndCacheArgs a) {
  // E is the unit copied: uint4 (vector path) or the element's own size (scalar path);
  // strides and sizes below are in units of E.
  const P* slots = static_cast<const P*>(a.slot_mapping);
  const int kp = static_cast<int>(a.head_size), vp = static_cast<int>(a.v_head_size);
  const int heads = static_cast<int>(a.kv_heads);
  const int items = heads * (kp + vp);
  const int64_t nslots = a.num_blocks * a.block_size;
  const E* key = static_cast<const E*>(a.key);
  const E* value = static_cast<const E*>(a.value);
  E* kc = static_cast<E*>(a.key_cache);
  E* vc = static_cast<E*>(a.value_cache);
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0 || slot >= nslots) continue;  // padding (or out of range: see kernels.h)
    const int64_t blk = slot / a.block_size, off = slot - blk * a.block_size;
    const E* ks = key + t * a.k_t;
    const E* vs = value + t * a.v_t;
    E* kd = kc + blk * a.kc_b + off * a.kc_o;
    E* vd = vc + blk * a.vc_b + off * a.vc_o;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      if (it < heads * kp) {
        const int h = it / kp, j = it - h * kp;
        kd[h * a.kc_h + j] = ks[h * a.k_h + j];
      } else {
        const int r = it - heads * kp;
        const int h = r / vp, j = r - h * vp;
        vd[h * a.vc_h + j] = vs[h * a.v_h + j];
      }
    }
  }
}

// reshape_and_cache into fp8 caches: each element is converted (fp8.h: integer and plain
// float operations, as these GPUs have no fp8 conversion instruction), so T is the
// key/value type; the same one block per token, items (head, element).
template <typename T, typename P, fp8::Format F>
__global__ void __launch_bounds__(kTokenMaxThreads) reshape_and_cache_fp8_kernel(ReshapeAndCacheArgs a) {
  const P* slots = static_cast<const P*>(a.slot_mapping);
  const int kp = static_cast<int>(a.head_size), vp = static_cast<int>(a.v_head_size);
  const int heads = static_cast<int>(a.kv_heads);
  const int items = heads * (kp + vp);
  const int64_t nslots = a.num_blocks * a.block_size;
  const float ks = *a.k_scale, vs = *a.v_scale;  // read on the device: no host sync
  const T* key = static_cast<const T*>(a.key);
  const T* value = static_cast<const T*>(a.value);
  uint8_t* kc = static_cast<uint8_t*>(a.key_cache);
  uint8_t* vc = static_cast<uint8_t*>(a.value_cache);
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0 || slot >= nslots) continue;  // padding (or out of range: see kernels.h)
    const int64_t blk = slot / a.block_size, off = slot - blk * a.block_size;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      if (it < heads * kp) {
        const int h = it / kp, j = it - h * kp;
        kc[blk * a.kc_b + off * a.kc_o + h * a.kc_h + j] =
            fp8::encode<F>(to_f(key[t * a.k_t + h * a.k_h + j]) / ks);
      } else {
        const int r = it - heads * kp;
        const int h = r / vp, j = r - h * vp;
        vc[blk * a.vc_b + off * a.vc_o + h * a.vc_h + j] =
            fp8::encode<F>(to_f(value[t * a.v_t + h * a.v_h + j]) / vs);
      }
    }
  }
}

// reshape_and_cache into int8 caches with row scales (fp8.h int8row): one warp per
// (token, kv head) row of the key then the value, its absmax by shuffles, then the codes
// and, from lane 0, the row's scale into the scale cache.
template <typename T, typename P>
__global__ void __launch_bounds__(kTokenMaxThreads) reshape_and_cache_int8_kernel(ReshapeAndCacheArgs a) {
  const P* slots = static_cast<const P*>(a.slot_mapping);
  const int heads = static_cast<int>(a.kv_heads);
  const int64_t nslots = a.num_blocks * a.block_size;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0 || slot >= nslots) continue;  // padding (or out of range: see kernels.h)
    const int64_t blk = slot / a.block_size, off = slot - blk * a.block_size;
    for (int row = threadIdx.x >> 5; row < 2 * heads; row += warps) {
      const bool v = row >= heads;
      const int h = v ? row - heads : row;
      const T* src = static_cast<const T*>(v ? a.value : a.key) + t * (v ? a.v_t : a.k_t) +
                     h * (v ? a.v_h : a.k_h);
      int8_t* dst = static_cast<int8_t*>(v ? a.value_cache : a.key_cache) +
                    blk * (v ? a.vc_b : a.kc_b) + off * (v ? a.vc_o : a.kc_o) +
                    h * (v ? a.vc_h : a.kc_h);
      const int n = static_cast<int>(v ? a.v_head_size : a.head_size);
      float m = 0.f;
      for (int j = lane; j < n; j += 32) m = fmaxf(m, int8row::finite_abs(to_f(src[j])));
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float scale = int8row::scale_of(m), inv = 1.f / scale;
      for (int j = lane; j < n; j += 32) dst[j] = int8row::encode(to_f(src[j]), inv);
      if (lane == 0)
        (v ? a.v_scale_cache : a.k_scale_cache)[blk * (v ? a.vs_b : a.ks_b) +
                                                 off * (v ? a.vs_o : a.ks_o) +
                                                 h * (v ? a.vs_h : a.ks_h)] = scale;
    }
  }
}

template <typename T, typename P>
int launch_reshape_and_cache_fp8(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  if (a.tokens == 0) return 0;
  const int threads = clamp_threads(a.kv_heads * (a.head_size + a.v_head_size), 32,
                                    kTokenMaxThreads);
  const unsigned grid = grid_for(a.tokens);
  if (a.cache == KvCache::Int8)
    reshape_and_cache_int8_kernel<T, P><<<grid, clamp_threads(64 * a.kv_heads, 32, kTokenMaxThreads),
                                         0, stream>>>(a);
  else if (a.cache == KvCache::Fp8E4M3)
    reshape_and_cache_fp8_kernel<T, P, fp8::Format::E4M3><<<grid, threads, 0, stream>>>(a);
  else
    reshape_and_cache_fp8_kernel<T, P, fp8::Format::E5M2><<<grid, threads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

// Rescales every size and stride of `a` from elements of `es` bytes to units of `us`.
ReshapeAndCacheArgs in_units(ReshapeAndCacheArgs a, int64_t es, int64_t us) {
  auto f = [&](int64_t& v) { v = v * es / us; };
  f(a.head_size); f(a.v_head_size);
  f(a.k_t); f(a.k_h); f(a.v_t); f(a.v_h);
  f(a.kc_b); f(a.kc_o); f(a.kc_h); f(a.vc_b); f(a.vc_o); f(a.vc_h);
  return a;
}

template <typename P>
int launch_reshape_and_cache(int64_t es, const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  if (a.tokens == 0) return 0;
  const int64_t all[] = {a.head_size, a.v_head_size, a.k_t, a.k_h, a.v_t, a.v_h,
                         a.kc_b, a.kc_o, a.kc_h, a.vc_b, a.vc_o, a.vc_h};
  bool vec = aligned16(a.key) && aligned16(a.value) && aligned16(a.key_cache) &&
             aligned16(a.value_cache);
  for (int64_t v : all) vec = vec && aligned16(v, es);
  const int64_t unit = vec ? 16 : es;
  const ReshapeAndCacheArgs u = in_units(a, es, unit);
  const int threads = clamp_threads(u.kv_heads * (u.head_size + u.v_head_size), 32,
                                    kTokenMaxThreads);
  const unsigned grid = grid_for(a.tokens);
  if (vec)
    reshape_and_cache_kernel<uint4, P><<<grid, threads, 0, stream>>>(u);
  else if (es == 4)
    reshape_and_cache_kernel<uint32_t, P><<<grid, threads, 0, stream>>>(u);
  else
    reshape_and_cache_kernel<uint16_t, P><<<grid, threads, 0, stream>>>(u);
  return static_cast<int>(cudaGetLastError());
}

// dtype dispatch to the CUDA element type.
template <typename F>
int dispatch(DType t, const F& f) {
  switch (t) {
    case DType::F32: return f(float{});
    case DType::F16: return f(__half{});
    case DType::BF16: return f(__nv_bfloat16{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int rms_norm_cuda(DType t, const RmsNormArgs& a, cudaStream_t stream) {
  return dispatch(t, [&](auto s) {
    return launch_rms_norm<decltype(s), false>(a.out, a.out_stride, a.x, a.x_stride, nullptr,
                                               0, a.weight, a.rows, a.hidden, a.eps, stream);
  });
}

int fused_add_rms_norm_cuda(DType t, DType residual_t, const FusedAddRmsNormArgs& a,
                            cudaStream_t stream) {
  return dispatch(t, [&](auto s) {
    using T = decltype(s);
    auto run = [&](auto r) {
      return launch_rms_norm<T, true, decltype(r)>(a.x, a.x_stride, a.x, a.x_stride,
                                                   a.residual, a.r_stride, a.weight, a.rows,
                                                   a.hidden, a.eps, stream);
    };
    return residual_t == t ? run(T{}) : run(float{});  // else a float32 residual
  });
}

int silu_and_mul_cuda(DType t, const SiluAndMulArgs& a, cudaStream_t stream) {
  return dispatch(t, [&](auto s) { return launch_silu_and_mul<decltype(s)>(a, stream); });
}

int rotary_embedding_cuda(DType t, DType cache_t, IType pos_t, const RotaryArgs& a,
                          cudaStream_t stream) {
  return dispatch(t, [&](auto s) {
    using T = decltype(s);
    auto with_pos = [&](auto c) {
      using C = decltype(c);
      return pos_t == IType::I64 ? launch_rotary<T, C, int64_t>(a, stream)
                                 : launch_rotary<T, C, int32_t>(a, stream);
    };
    return cache_t == DType::F32 ? with_pos(float{}) : with_pos(T{});
  });
}

int reshape_and_cache_cuda(DType t, IType slot_t, const ReshapeAndCacheArgs& a,
                           cudaStream_t stream) {
  if (a.cache != KvCache::Same)
    return dispatch(t, [&](auto s) {
      using T = decltype(s);
      return slot_t == IType::I64 ? launch_reshape_and_cache_fp8<T, int64_t>(a, stream)
                                  : launch_reshape_and_cache_fp8<T, int32_t>(a, stream);
    });
  const int64_t es = t == DType::F32 ? 4 : 2;
  return slot_t == IType::I64 ? launch_reshape_and_cache<int64_t>(es, a, stream)
                              : launch_reshape_and_cache<int32_t>(es, a, stream);
}

const char* cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // namespace core
}  // namespace sm7x
