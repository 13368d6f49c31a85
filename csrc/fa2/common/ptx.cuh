// Inline-PTX wrappers of the FA2 kernels.
//
// fast_exp2, pack_half2 and smem_addr are valid on every arch. ldmatrix and
// mma.m16n8k8 exist from sm_75 on (Volta has neither): they are declared only for the
// host pass and device passes of sm_75 and newer, so calling them from sm_70 code fails
// at compile time instead of in ptxas.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace sm7x {
namespace fa2 {
namespace detail {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh for the softcap. sm_75 has tanh.approx.f32 (what flash-attn's softcap uses on
// sm80); Volta has no such instruction, so there 1 - 2 / (2^(2x log2 e) + 1) with ex2 and
// a fast divide: a few instructions instead of tanhf's long polynomial, and exact limits
// (+-1) at large |x|.
__device__ __forceinline__ float fast_tanh(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.f - __fdividef(2.f, fast_exp2(x * 2.8853900817779268f) + 1.f);
#endif
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Barrier `id` (1..15; 0 is __syncthreads') for `threads` threads, whole warps: a few
// warps of a CTA meet without stopping the others. "memory": shared-memory writes before
// it are visible to the other warps after it, and no access moves across it.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 750
// ---- sm_75 and newer only

// ldmatrix from a 32-bit shared-memory address (smem_addr), or from a pointer into shared
// memory. The address forms let a kernel keep one base per tile and add constants that
// ptxas folds into the instruction.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  ldmatrix_x4(r, smem_addr(p));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  ldmatrix_x4_trans(r, smem_addr(p));
}

// d (16x8 fp32) += a (16x8 fp16, row) * b (8x8 fp16, col)
__device__ __forceinline__ void mma_m16n8k8(float (&d)[4], uint32_t a0, uint32_t a1,
                                             uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// Two n8 tiles (d0: columns 0-7, d1: 8-15) += A (16 x 16: a as ldmatrix_x4 loads it, or a P
// tile packed so) x B (16 x 16: b as ldmatrix_x4 of B stored [n][k], or ldmatrix_x4_trans
// of B stored [k][n]): the four m16n8k8 MMAs of one k16 step, in the order every kernel
// issues them.
__device__ __forceinline__ void mma_k16(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[4]) {
  mma_m16n8k8(d0, a[0], a[1], b[0]);
  mma_m16n8k8(d0, a[2], a[3], b[1]);
  mma_m16n8k8(d1, a[0], a[1], b[2]);
  mma_m16n8k8(d1, a[2], a[3], b[3]);
}

// The 8x8 b16 matrix whose row lane / 4 holds, at columns 2 (lane % 4) and + 1, the two
// halves of x (an mma accumulator's layout, packed), transposed into the same layout: the
// decode kernel's P^T from its S^T accumulators.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
#endif  // sm_75 and newer only

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
