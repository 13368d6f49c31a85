// The fp16 CPU kernels again, compiled with -mf16c: conversions by the F16C instructions
// (vcvtph2ps / vcvtps2ph, round to nearest even: the same results as the software
// conversion) instead of bit manipulation. Called only after f16c::available().
// No torch header and no std template here (see cpu_kernels_impl.h): nothing compiled
// with -mf16c can be merged into the generic code.
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>

#include "cpu_f16c.h"

namespace sm7x {
namespace core {
namespace {

struct Half16 {  // IEEE fp16 bits, the layout of torch.float16
  uint16_t bits;
};

inline float load(const float* p) { return *p; }
inline float load(const Half16* p) { return _cvtsh_ss(p->bits); }
inline void store(float* p, float v) { *p = v; }
inline void store(Half16* p, float v) {
  p->bits = static_cast<uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace
}  // namespace core
}  // namespace sm7x

#include "cpu_kernels_impl.h"

namespace sm7x {
namespace core {
namespace f16c {

bool available() {
  // SM7X_CPU_NO_F16C=1 forces the software conversions (tests compare both paths).
  static const bool ok = [] {
    const char* off = getenv("SM7X_CPU_NO_F16C");
    if (off != nullptr && off[0] != '\0' && off[0] != '0') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

void rms_norm(const RmsNormArgs& a, ParallelRunner run) { rms_norm_impl<Half16>(a, run); }

void fused_add_rms_norm(const FusedAddRmsNormArgs& a, ParallelRunner run) {
  fused_add_rms_norm_impl<Half16>(a, run);
}

void silu_and_mul(const SiluAndMulArgs& a, ParallelRunner run) {
  silu_and_mul_impl<Half16>(a, run);
}

void rotary_embedding(DType cache_t, IType pos_t, const RotaryArgs& a, ParallelRunner run) {
  if (cache_t == DType::F32)
    pos_t == IType::I64 ? rotary_impl<Half16, float, int64_t>(a, run)
                        : rotary_impl<Half16, float, int32_t>(a, run);
  else
    pos_t == IType::I64 ? rotary_impl<Half16, Half16, int64_t>(a, run)
                        : rotary_impl<Half16, Half16, int32_t>(a, run);
}

}  // namespace f16c
}  // namespace core
}  // namespace sm7x
