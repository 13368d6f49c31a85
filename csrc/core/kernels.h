// sm7x core kernels: the interface between the op layer (ops.cpp, which sees torch's
// stable ABI) and the kernels (cpu_kernels.cpp, cuda_kernels.cu, which see no torch).
//
// Everything here is plain C++17: raw pointers, element counts, strides in elements
// and, for CUDA, a cudaStream_t; no torch types. Callers have validated shapes, dtypes
// and devices; the kernels only pick a vectorized or a scalar path from the pointers
// and strides. (cpu_kernels.cpp borrows torch's header-only Half/BFloat16 conversions;
// cuda_kernels.cu includes no torch header at all.)
#pragma once

#include <cstdint>

// cudaStream_t without pulling CUDA headers into the op layer (the same typedef as
// CUDA's driver_types.h; a repeated identical typedef is legal C++).
typedef struct CUstream_st* cudaStream_t;

namespace sm7x {
namespace core {

// Element types the kernels are instantiated for. fp16 and bf16 are stored as 16-bit
// values and converted to fp32 for all arithmetic (accumulation is always fp32).
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };
// Index types of positions / slot_mapping.
enum class IType : int { I64 = 0, I32 = 1 };
// What a KV cache stores: the key/value dtype itself, or 8-bit codes (fp8.h) of
// value / scale with one float32 scale per cache (vLLM's kv_cache_dtype "fp8_e4m3",
// "fp8_e5m2"; "fp8" is E4M3).
enum class KvCache : int { Same = 0, Fp8E4M3 = 1, Fp8E5M2 = 2, Int8 = 3 };

const char* dtype_name(DType t);

// ---------------------------------------------------------------------------------------
// Arguments. Row strides are in elements; the last dimension is always contiguous.

struct RmsNormArgs {
  void* out;              // [rows, hidden] (row stride out_stride)
  const void* x;          // [rows, hidden] (row stride x_stride)
  const void* weight;     // [hidden], contiguous
  int64_t rows, hidden;
  int64_t out_stride, x_stride;
  float eps;
};

struct FusedAddRmsNormArgs {
  void* x;                // in: input, out: normalized (row stride x_stride)
  void* residual;         // in: residual, out: residual + input (row stride r_stride); x's
                          // dtype or float32 (the sum then kept in fp32)
  const void* weight;     // [hidden], contiguous
  int64_t rows, hidden;
  int64_t x_stride, r_stride;
  float eps;
};

struct SiluAndMulArgs {
  void* out;              // [rows, d]
  const void* x;          // [rows, 2*d] = [gate | up]
  int64_t rows, d;
  int64_t out_stride, x_stride;
};

struct RotaryArgs {
  const void* positions;  // [tokens], contiguous, IType
  void* query;            // token t, head h, dim i at query[t*q_token_stride + h*q_head_stride + i]
  void* key;              // may be null (no key)
  const void* cos_sin;    // [max_pos, rot_dim] = [cos | sin], contiguous rows of cs_stride
  int64_t tokens, num_heads, num_kv_heads, head_size, rot_dim, max_pos;
  int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride, cs_stride;
  bool is_neox;
};

struct ReshapeAndCacheArgs {
  const void* key;        // [tokens, kv_heads, head_size] with strides (k_t, k_h, 1)
  const void* value;      // [tokens, kv_heads, v_head_size] with strides (v_t, v_h, 1)
  void* key_cache;        // [num_blocks, block_size, kv_heads, head_size], strides kc_*
  void* value_cache;      // [num_blocks, block_size, kv_heads, v_head_size], strides vc_*
  const void* slot_mapping;  // [tokens], contiguous, IType; slot < 0: skip the token
  int64_t tokens, kv_heads, head_size, v_head_size, num_blocks, block_size;
  int64_t k_t, k_h, v_t, v_h;
  int64_t kc_b, kc_o, kc_h, vc_b, vc_o, vc_h;  // block, offset-in-block, head strides
  KvCache cache;          // Same: caches of the key's dtype; else 1-byte codes
  const float* k_scale;   // fp8 caches: one float32 each (on the caches' device), the
  const float* v_scale;   // code is round(value / scale); null for Same
  // Int8: float32 scale caches [num_blocks, block_size, kv_heads] (strides ks_* / vs_*),
  // one scale written per cached row (fp8.h int8row); null otherwise
  float* k_scale_cache;
  float* v_scale_cache;
  int64_t ks_b, ks_o, ks_h, vs_b, vs_o, vs_h;
};

// ---------------------------------------------------------------------------------------
// CPU kernels (cpu_kernels.cpp). Parallelised by the caller-supplied runner so the
// kernels stay free of torch: run(n, grain, fn) calls fn(begin, end) over [0, n).

using ParallelFn = void (*)(int64_t begin, int64_t end, void* ctx);
using ParallelRunner = void (*)(int64_t n, int64_t grain, ParallelFn fn, void* ctx);

void rms_norm_cpu(DType t, const RmsNormArgs& a, ParallelRunner run);
void fused_add_rms_norm_cpu(DType t, DType residual_t, const FusedAddRmsNormArgs& a,
                            ParallelRunner run);
void silu_and_mul_cpu(DType t, const SiluAndMulArgs& a, ParallelRunner run);
// cache_t: dtype of cos_sin (the query dtype or F32). Positions were range-checked.
void rotary_embedding_cpu(DType t, DType cache_t, IType pos_t, const RotaryArgs& a,
                          ParallelRunner run);
// Slots were range-checked (negative = skip).
void reshape_and_cache_cpu(DType t, IType slot_t, const ReshapeAndCacheArgs& a,
                           ParallelRunner run);

// ---------------------------------------------------------------------------------------
// CUDA launchers (cuda_kernels.cu). They launch on `stream` on the current device and
// return a cudaError_t as int (0 = success); cuda_error_string() names it.
// Out-of-range positions / slots cannot be checked on the host without a sync: the
// kernels skip such tokens (no out-of-bounds access) instead.

int rms_norm_cuda(DType t, const RmsNormArgs& a, cudaStream_t stream);
int fused_add_rms_norm_cuda(DType t, DType residual_t, const FusedAddRmsNormArgs& a,
                            cudaStream_t stream);
int silu_and_mul_cuda(DType t, const SiluAndMulArgs& a, cudaStream_t stream);
int rotary_embedding_cuda(DType t, DType cache_t, IType pos_t, const RotaryArgs& a,
                          cudaStream_t stream);
int reshape_and_cache_cuda(DType t, IType slot_t, const ReshapeAndCacheArgs& a,
                           cudaStream_t stream);
const char* cuda_error_string(int err);

}  // namespace core
}  // namespace sm7x
