// sm7x FlashAttention-2 forward for Volta (sm_70) and Turing (sm_75): the interface
// between the op layer (ops.cpp, torch stable ABI) and the kernels (sm70/ or sm75/
// fwd_kernel.cuh, instantiated once per compiled head dim by the generated
// fwd_hdim*.cu files, which see no torch header). Each library compiles this with its own
// compiled_head_dims.h, generated from python/sm7x/targets.json.
//
// Plain C++17: raw pointers, strides in elements, a cudaStream_t. The op layer has
// validated shapes, dtypes, devices and alignment (every pointer 16-byte aligned, every
// stride but the last a multiple of 8 elements, the last dim contiguous).
#pragma once

#include <cstdint>

#include "compiled_head_dims.h"  // kCompiledHeadDims, kMaxHeadDim, kHeadDimMultiple

typedef struct CUstream_st* cudaStream_t;

namespace sm7x {
namespace fa2 {

struct FwdParams {
  // fp16 tensors. Batched: [B, S, H, D]; varlen: [total, H, D] (batch stride unused).
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // batched: [B, H, Sq]; varlen: [H, total_q]
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;  // lse rows are contiguous
  // Varlen: [B + 1] int32 prefix sums (device); null for batched inputs.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int batch, heads, kv_heads;
  int seqlen_q, seqlen_k;  // varlen: max_seqlen_q / max_seqlen_k (grid size only)
  int head_dim;            // actual head dim (multiple of 8, <= the compiled one)
  float scale;             // softmax scale
  float softcap;           // 0: off; else s = softcap * tanh(s * scale / softcap)
  int window_left, window_right;  // -1: unbounded; causal is window_right = 0
};

// Launches on `stream` (current device); returns a cudaError_t as int (0 = success).
// One specialization per entry of kCompiledHeadDims (generated fwd_hdim*.cu).
template <int kHeadDim>
int run_fwd(const FwdParams& p, cudaStream_t stream);

// run_fwd of the smallest compiled head dim >= p.head_dim (dispatch.cu);
// cudaErrorInvalidValue when p.head_dim is larger than all of them.
int fwd(const FwdParams& p, cudaStream_t stream);
const char* cuda_error_string(int err);

}  // namespace fa2
}  // namespace sm7x
