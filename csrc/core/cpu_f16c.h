// fp16 CPU kernels built with F16C conversions (cpu_kernels_f16c.cpp, compiled with
// -mf16c), used at run time when the CPU has F16C/AVX; the generic fp16 path converts
// in software and is several times slower. Only where the build defines SM7X_CPU_F16C.
#pragma once

#include "kernels.h"

namespace sm7x {
namespace core {
namespace f16c {

#ifdef SM7X_CPU_F16C
bool available();
void rms_norm(const RmsNormArgs& a, ParallelRunner run);
void fused_add_rms_norm(const FusedAddRmsNormArgs& a, ParallelRunner run);
void silu_and_mul(const SiluAndMulArgs& a, ParallelRunner run);
void rotary_embedding(DType cache_t, IType pos_t, const RotaryArgs& a, ParallelRunner run);
#else
inline bool available() { return false; }
inline void rms_norm(const RmsNormArgs&, ParallelRunner) {}
inline void fused_add_rms_norm(const FusedAddRmsNormArgs&, ParallelRunner) {}
inline void silu_and_mul(const SiluAndMulArgs&, ParallelRunner) {}
inline void rotary_embedding(DType, IType, const RotaryArgs&, ParallelRunner) {}
#endif

}  // namespace f16c
}  // namespace core
}  // namespace sm7x
