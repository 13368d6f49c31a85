// 8-bit KV cache codes: OCP FP8 E4M3 ("fn": no infinities, 0x7F is NaN, largest 448) and
// E5M2 (IEEE-like, largest finite 57344), encoded and decoded with integer and plain float
// operations. Volta and Turing have no fp8 conversion instructions (cvt to or from
// e4m3x2 / e5m2x2 needs sm_89), and the same code serves the CPU kernels, so one
// definition of the rounding is shared by every writer and reader of a cache.
//
// Encoding follows vLLM's cache writes (float(x) / scale, then __NV_SATFINITE):
// round to nearest even; finite values past the largest code and +-inf saturate to it;
// NaN stays NaN (0x7F with the sign).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SM7X_FP8_FN __host__ __device__ __forceinline__
#else
#define SM7X_FP8_FN inline
#endif

namespace sm7x {
namespace fp8 {

enum class Format : int { E4M3 = 0, E5M2 = 1 };

SM7X_FP8_FN uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

SM7X_FP8_FN float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// Format parameters: mantissa bits, exponent bias, largest finite code.
template <Format F>
struct Traits;
template <>
struct Traits<Format::E4M3> {
  static constexpr int kMant = 3, kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7E;  // 448 (0x7F is NaN)
};
template <>
struct Traits<Format::E5M2> {
  static constexpr int kMant = 2, kBias = 15;
  static constexpr uint32_t kMaxCode = 0x7B;  // 57344 (0x7C is inf)
};

template <Format F>
SM7X_FP8_FN uint8_t encode(float x) {
  constexpr int kMant = Traits<F>::kMant, kBias = Traits<F>::kBias;
  uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7Fu);  // NaN
  uint32_t code;
  if (u < (static_cast<uint32_t>(127 + 1 - kBias) << 23)) {
    // Below the smallest normal: a multiple of 2^(1 - bias - mant). Scaling by a power of
    // two is exact, and adding 2^23 makes the float adder round to an integer, nearest
    // even; 2^mant (the smallest normal's code) comes out of a round-up naturally.
    const float scaled = bits_float(u) * static_cast<float>(1u << (kBias - 1 + kMant));
    code = float_bits(scaled + 8388608.0f) - 0x4b000000u;
  } else {
    // Normal: drop the low mantissa bits, nearest even; a carry moves into the exponent.
    constexpr int kDrop = 23 - kMant;
    const uint32_t rounded = u + ((1u << (kDrop - 1)) - 1u) + ((u >> kDrop) & 1u);
    code = (rounded >> kDrop) - (static_cast<uint32_t>(127 - kBias) << kMant);
  }
  if (code > Traits<F>::kMaxCode) code = Traits<F>::kMaxCode;  // saturate (+-inf too)
  return static_cast<uint8_t>(sign | code);
}

// The value of a code as a float (exact). An E4M3 0x7F/0xFF (never written: writes
// saturate) reads as NaN here.
template <Format F>
SM7X_FP8_FN float decode(uint8_t b) {
  constexpr int kMant = Traits<F>::kMant, kBias = Traits<F>::kBias;
  constexpr uint32_t kExpMask = (0x7Fu >> kMant);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> kMant) & kExpMask, m = b & ((1u << kMant) - 1u);
  if (e == 0)  // subnormal: m * 2^(1 - bias - mant), exact in float
    return bits_float(sign | float_bits(static_cast<float>(m) /
                                        static_cast<float>(1u << (kBias - 1 + kMant))));
  if (F == Format::E4M3 ? (e == kExpMask && m == ((1u << kMant) - 1u)) : e == kExpMask)
    return bits_float(sign | 0x7f800000u | (m << (23 - kMant)));  // NaN (E5M2: inf if m == 0)
  return bits_float(sign | ((e - kBias + 127) << 23) | (m << (23 - kMant)));
}

}  // namespace fp8

// int8 codes with one float32 scale per cached row (a token's kv head), vLLM's
// int8_per_token_head, written as vLLM's Triton writer does: scale = max(absmax / 127,
// 1e-6), code = x * (1 / scale) rounded half away from zero, clamped to [-128, 127]. int8
// has no inf or NaN: the absmax is taken over the finite values, +inf saturates to 127,
// -inf to -128 (the clamp) and NaN is stored as 0 (vLLM leaves them to its float-to-int
// conversion).
namespace int8row {

SM7X_FP8_FN float scale_of(float absmax) {
  const float s = absmax / 127.f;
  return s > 1e-6f ? s : 1e-6f;
}

// |x| if finite, else 0: the absmax's terms.
SM7X_FP8_FN float finite_abs(float x) {
  const float a = x < 0.f ? -x : x;
  return a <= 3.4028234663852886e38f ? a : 0.f;  // false for inf and NaN
}

SM7X_FP8_FN int8_t encode(float x, float inv_scale) {
  if (x != x) return 0;
#if defined(__CUDA_ARCH__)
  float q = __fmul_rn(x, inv_scale);  // not fused with the + 0.5 below: the host's rounding
#else
  float q = x * inv_scale;
#endif
  q = q >= 0.f ? q + 0.5f : q - 0.5f;
  q = q > 127.f ? 127.f : q < -128.f ? -128.f : q;
  return static_cast<int8_t>(q);  // truncates toward zero
}

}  // namespace int8row
}  // namespace sm7x
