// CPU kernel templates of the sm7x core ops, included by cpu_kernels.cpp (float, and
// fp16/bf16 through torch's header-only types) and by cpu_kernels_f16c.cpp (fp16 through
// F16C instructions, compiled with -mf16c and picked at run time on CPUs that have them).
// The including file declares load(const S*) -> float and store(S*, float) for its
// storage types first. Everything is in an anonymous namespace: each file gets its own
// copy, so the two builds never merge (no ODR clash between -mf16c and generic code).
#pragma once

#include <math.h>
#include <algorithm>
#include <cstring>

#include "fp8.h"
#include "kernels.h"

namespace sm7x {
namespace core {
namespace {

// Calls fn(begin, end) over [0, n) through the runner, with a lambda as context.
template <typename F>
void parallel(ParallelRunner run, int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  run(
      n, grain,
      [](int64_t b, int64_t e, void* ctx) { (*static_cast<const F*>(ctx))(b, e); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

// Rows of this many elements or more are worth one task each.
int64_t row_grain(int64_t row_elems) {
  const int64_t target = 1 << 15;
  return row_elems >= target ? 1 : target / (row_elems > 0 ? row_elems : 1);
}

// Sum of squares with several partial sums so the compiler can keep lanes busy.
template <typename S>
float sum_squares(const S* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const float v = load(x + i + k);
      acc[k] += v * v;
    }
  for (; i < n; ++i) {
    const float v = load(x + i);
    acc[0] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename S>
void rms_norm_impl(const RmsNormArgs& a, ParallelRunner run) {
  const S* w = static_cast<const S*>(a.weight);
  parallel(run, a.rows, row_grain(a.hidden), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const S* x = static_cast<const S*>(a.x) + r * a.x_stride;
      S* out = static_cast<S*>(a.out) + r * a.out_stride;
      const float inv = 1.0f / sqrtf(sum_squares(x, a.hidden) / a.hidden + a.eps);
      for (int64_t i = 0; i < a.hidden; ++i) store(out + i, load(x + i) * inv * load(w + i));
    }
  });
}

// R: the residual's type, S or float (the residual stream kept in fp32).
template <typename S, typename R = S>
void fused_add_rms_norm_impl(const FusedAddRmsNormArgs& a, ParallelRunner run) {
  const S* w = static_cast<const S*>(a.weight);
  parallel(run, a.rows, row_grain(a.hidden), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      S* x = static_cast<S*>(a.x) + r * a.x_stride;
      R* res = static_cast<R*>(a.residual) + r * a.r_stride;
      // residual += x, rounded to the residual's type (vLLM semantics), then the norm of
      // the rounded sum.
      for (int64_t i = 0; i < a.hidden; ++i) store(res + i, load(x + i) + load(res + i));
      const float inv = 1.0f / sqrtf(sum_squares(res, a.hidden) / a.hidden + a.eps);
      for (int64_t i = 0; i < a.hidden; ++i) store(x + i, load(res + i) * inv * load(w + i));
    }
  });
}

template <typename S>
void silu_and_mul_impl(const SiluAndMulArgs& a, ParallelRunner run) {
  parallel(run, a.rows, row_grain(2 * a.d), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const S* gate = static_cast<const S*>(a.x) + r * a.x_stride;
      const S* up = gate + a.d;
      S* out = static_cast<S*>(a.out) + r * a.out_stride;
      for (int64_t i = 0; i < a.d; ++i) {
        const float g = load(gate + i);
        store(out + i, g / (1.0f + expf(-g)) * load(up + i));
      }
    }
  });
}

template <typename S>
void rotate_head(S* x, const float* cos, const float* sin, int64_t rot_dim, bool neox) {
  const int64_t half = rot_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    S* p1 = neox ? x + i : x + 2 * i;
    S* p2 = neox ? x + i + half : x + 2 * i + 1;
    const float x1 = load(p1), x2 = load(p2);
    store(p1, x1 * cos[i] - x2 * sin[i]);
    store(p2, x2 * cos[i] + x1 * sin[i]);
  }
}

template <typename S, typename C, typename P>
void rotary_impl(const RotaryArgs& a, ParallelRunner run) {
  const P* pos = static_cast<const P*>(a.positions);
  const int64_t half = a.rot_dim / 2;
  const int64_t work = (a.num_heads + a.num_kv_heads) * a.head_size;
  parallel(run, a.tokens, row_grain(work), [&](int64_t b, int64_t e) {
    // cos/sin of one position in fp32 (the cache may be fp32 or the query dtype).
    // Plain new[]: no std template gets instantiated here, so the -mf16c copy of this
    // file shares no (COMDAT) code with the generic one.
    float* cs = new float[2 * half];
    for (int64_t t = b; t < e; ++t) {
      const C* row = static_cast<const C*>(a.cos_sin) + static_cast<int64_t>(pos[t]) * a.cs_stride;
      for (int64_t i = 0; i < 2 * half; ++i) cs[i] = load(row + i);
      S* q = static_cast<S*>(a.query) + t * a.q_token_stride;
      for (int64_t h = 0; h < a.num_heads; ++h)
        rotate_head(q + h * a.q_head_stride, cs, cs + half, a.rot_dim, a.is_neox);
      if (a.key != nullptr) {
        S* k = static_cast<S*>(a.key) + t * a.k_token_stride;
        for (int64_t h = 0; h < a.num_kv_heads; ++h)
          rotate_head(k + h * a.k_head_stride, cs, cs + half, a.rot_dim, a.is_neox);
      }
    }
    delete[] cs;
  });
}

// One cache row per (token, kv head) of every token with a slot (a negative slot is a
// padding token): store(dst, src, n, scale, row_scale) writes n values of a key or value
// row into the cache row, whose elements are C (S itself, or the codes of an 8-bit
// cache); row_scale: where an int8 cache keeps that row's scale (else null).
template <typename C, typename S, typename P, typename Store>
void scatter_rows(const ReshapeAndCacheArgs& a, ParallelRunner run, float ks, float vs, Store store) {
  const P* slots = static_cast<const P*>(a.slot_mapping);
  const int64_t work = a.kv_heads * (a.head_size + a.v_head_size);
  parallel(run, a.tokens, row_grain(work), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t slot = static_cast<int64_t>(slots[t]);
      if (slot < 0) continue;  // padding token
      const int64_t blk = slot / a.block_size, off = slot % a.block_size;
      for (int64_t h = 0; h < a.kv_heads; ++h) {
        float* krs = a.k_scale_cache ? a.k_scale_cache + blk * a.ks_b + off * a.ks_o + h * a.ks_h
                                     : nullptr;
        float* vrs = a.v_scale_cache ? a.v_scale_cache + blk * a.vs_b + off * a.vs_o + h * a.vs_h
                                     : nullptr;
        store(static_cast<C*>(a.key_cache) + blk * a.kc_b + off * a.kc_o + h * a.kc_h,
              static_cast<const S*>(a.key) + t * a.k_t + h * a.k_h, a.head_size, ks, krs);
        store(static_cast<C*>(a.value_cache) + blk * a.vc_b + off * a.vc_o + h * a.vc_h,
              static_cast<const S*>(a.value) + t * a.v_t + h * a.v_h, a.v_head_size, vs, vrs);
      }
    }
  });
}

template <fp8::Format F, typename S, typename P>
void reshape_and_cache_fp8_impl(const ReshapeAndCacheArgs& a, ParallelRunner run) {
  // each value as the fp8 code of value / scale
  scatter_rows<uint8_t, S, P>(a, run, *a.k_scale, *a.v_scale,
                              [](uint8_t* dst, const S* src, int64_t n, float scale, float*) {
    for (int64_t i = 0; i < n; ++i) dst[i] = fp8::encode<F>(load(src + i) / scale);
  });
}

template <typename S, typename P>
void reshape_and_cache_int8_impl(const ReshapeAndCacheArgs& a, ParallelRunner run) {
  // each row as int8 codes of its own scale (fp8.h int8row), the scale beside it
  scatter_rows<int8_t, S, P>(a, run, 1.f, 1.f,
                             [](int8_t* dst, const S* src, int64_t n, float, float* row_scale) {
    float m = 0.f;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, int8row::finite_abs(load(src + i)));
    const float scale = int8row::scale_of(m), inv = 1.f / scale;
    for (int64_t i = 0; i < n; ++i) dst[i] = int8row::encode(load(src + i), inv);
    *row_scale = scale;
  });
}

template <typename S, typename P>
void reshape_and_cache_impl(const ReshapeAndCacheArgs& a, ParallelRunner run) {
  if (a.cache == KvCache::Fp8E4M3) return reshape_and_cache_fp8_impl<fp8::Format::E4M3, S, P>(a, run);
  if (a.cache == KvCache::Fp8E5M2) return reshape_and_cache_fp8_impl<fp8::Format::E5M2, S, P>(a, run);
  if (a.cache == KvCache::Int8) return reshape_and_cache_int8_impl<S, P>(a, run);
  scatter_rows<S, S, P>(a, run, 1.f, 1.f, [](S* dst, const S* src, int64_t n, float, float*) {
    std::memcpy(dst, src, sizeof(S) * n);
  });
}

}  // namespace
}  // namespace core
}  // namespace sm7x
