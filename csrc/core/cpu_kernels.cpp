// CPU implementations of the sm7x core ops (templates in cpu_kernels_impl.h): fp32
// arithmetic, parallel over rows/tokens through the runner the op layer passes in
// (torch's intra-op thread pool). fp16/bf16 convert through torch's header-only
// Half/BFloat16 types (rounding exactly like torch); fp16 goes to the F16C build of the
// same templates (cpu_kernels_f16c.cpp) when the CPU has F16C.
#include "kernels.h"

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>


namespace sm7x {
namespace core {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
  }
  return "?";
}

namespace {

using Half = c10::Half;
using BFloat16 = c10::BFloat16;

inline float load(const float* p) { return *p; }
inline float load(const Half* p) { return static_cast<float>(*p); }
inline float load(const BFloat16* p) { return static_cast<float>(*p); }
inline void store(float* p, float v) { *p = v; }
inline void store(Half* p, float v) { *p = Half(v); }
inline void store(BFloat16* p, float v) { *p = BFloat16(v); }

}  // namespace
}  // namespace core
}  // namespace sm7x

#include "cpu_f16c.h"
#include "cpu_kernels_impl.h"

namespace sm7x {
namespace core {
namespace {

// dtype dispatch: calls f(S{}) with a value of the storage type.
template <typename F>
void dispatch(DType t, const F& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::F16: f(Half{}); return;
    case DType::BF16: f(BFloat16{}); return;
  }
}

}  // namespace

void rms_norm_cpu(DType t, const RmsNormArgs& a, ParallelRunner run) {
  if (t == DType::F16 && f16c::available()) return f16c::rms_norm(a, run);
  dispatch(t, [&](auto s) { rms_norm_impl<decltype(s)>(a, run); });
}

void fused_add_rms_norm_cpu(DType t, DType residual_t, const FusedAddRmsNormArgs& a,
                            ParallelRunner run) {
  if (residual_t != t)  // a float32 residual
    return dispatch(t, [&](auto s) { fused_add_rms_norm_impl<decltype(s), float>(a, run); });
  if (t == DType::F16 && f16c::available()) return f16c::fused_add_rms_norm(a, run);
  dispatch(t, [&](auto s) { fused_add_rms_norm_impl<decltype(s)>(a, run); });
}

void silu_and_mul_cpu(DType t, const SiluAndMulArgs& a, ParallelRunner run) {
  if (t == DType::F16 && f16c::available()) return f16c::silu_and_mul(a, run);
  dispatch(t, [&](auto s) { silu_and_mul_impl<decltype(s)>(a, run); });
}

void rotary_embedding_cpu(DType t, DType cache_t, IType pos_t, const RotaryArgs& a,
                          ParallelRunner run) {
  if (t == DType::F16 && f16c::available()) return f16c::rotary_embedding(cache_t, pos_t, a, run);
  dispatch(t, [&](auto s) {
    using S = decltype(s);
    auto with_pos = [&](auto c) {
      using C = decltype(c);
      if (pos_t == IType::I64)
        rotary_impl<S, C, int64_t>(a, run);
      else
        rotary_impl<S, C, int32_t>(a, run);
    };
    if (cache_t == DType::F32)
      with_pos(float{});
    else
      with_pos(S{});
  });
}

void reshape_and_cache_cpu(DType t, IType slot_t, const ReshapeAndCacheArgs& a,
                           ParallelRunner run) {
  dispatch(t, [&](auto s) {
    using S = decltype(s);
    if (slot_t == IType::I64)
      reshape_and_cache_impl<S, int64_t>(a, run);
    else
      reshape_and_cache_impl<S, int32_t>(a, run);
  });
}

}  // namespace core
}  // namespace sm7x
