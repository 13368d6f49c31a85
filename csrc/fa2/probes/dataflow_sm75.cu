// Data-flow ceilings of the sm75 d128 tiles (a maintainer's probe; not part of any package).
//
// Each case runs one tile's instruction stream of the shipped forward or backward kernel
// with nothing else: no masks, no sequence bounds, no epilogue, operands of constant
// value, K/V (or Q/dO) tiles copied from an L2-resident buffer. One CTA per SM, as a T4's
// 64 KB of shared memory allows for these tiles (the rest is padding). TFLOP/s count the
// MMAs only and are printed against the register-only mma.m16n8k8 loop of the same run
// (the baseline peak.cu measures for `python -m sm7x.bench fa2`). What a case reaches is
// an upper bound for a real kernel with that data flow on the GPU it ran on.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_75,code=compute_75 -o dataflow dataflow_sm75.cu
//   ./dataflow [--json]     (compute_75 PTX: JIT-compiled on a newer GPU, as the library's;
//                            on a T4 build code=sm_75 as well)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));         \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

namespace {

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b));
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p, bool trans) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// the four MMAs one ldmatrix.x4 of B feeds: two n8 tiles (c0, c1) x two k8 halves of A
// (a: {a0, a1} of the first k8 half, {a2, a3} of the second); b0..b3 in that order
__device__ __forceinline__ void mma4(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                     uint32_t b00, uint32_t b01, uint32_t b10, uint32_t b11) {
  mma(c0, a[0], a[1], b00);
  mma(c0, a[2], a[3], b01);
  mma(c1, a[0], a[1], b10);
  mma(c1, a[2], a[3], b11);
}
__device__ __forceinline__ uint32_t pack(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr int D = 128, ST = D + 8, THREADS = 256;  // 8 warps, as the shipped d128 tiles
constexpr int SOURCE_TILES = 64, SOURCE_CHUNKS = 4096;  // the L2-resident copy source (4 MB)

// Per tile: the next tile's LOADS 16-byte chunks per thread into registers at the top, then
// (after the GEMMs) stored to shared memory between two barriers (kBoth), or after one
// (kDouble: the store goes to the other buffer), or between barriers of GROUP warps.
enum Sync { kNoLoads, kBoth, kDouble, kGroups };

__device__ __forceinline__ void sync_group(Sync sync, int group) {
  if (sync == kGroups)
    asm volatile("bar.sync %0, %1;" ::"r"(1 + (int)(threadIdx.x >> 5) / group), "r"(group * 32));
  else
    __syncthreads();
}

template <int LOADS>
__device__ __forceinline__ void fetch(uint4 (&stage)[LOADS], const uint4* src, int it) {
#pragma unroll
  for (int i = 0; i < LOADS; ++i)
    stage[i] = src[((blockIdx.x * 7 + it) % SOURCE_TILES) * SOURCE_CHUNKS + i * THREADS + threadIdx.x];
}
template <int LOADS>
__device__ __forceinline__ void store(__half* tile, const uint4 (&stage)[LOADS]) {
  uint4* t = reinterpret_cast<uint4*>(tile);
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    const int c = i * THREADS + threadIdx.x;
    t[(c / (D / 8)) * (ST / 8) + c % (D / 8)] = stage[i];
  }
}

__device__ void fill(__half* s, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = __float2half(1e-3f * (i % 7));
  __syncthreads();
}

// Forward: MT m16 slices per warp (16 or 32 rows), BN keys per tile, Q in registers,
// S = Q K^T (K by ldmatrix), optionally the online softmax (row max over the quad,
// ex2.approx, O and l rescaled), P V (V by ldmatrix.trans).
template <int MT, int BN, bool SOFTMAX, Sync SYNC, int GROUP = 8>
__global__ void __launch_bounds__(THREADS, 1) fwd_flow(float* out, int iters, const uint4* src, float*) {
  extern __shared__ __align__(16) __half smem[];
  __half* const sK = smem;
  __half* const sV = smem + BN * ST;
  fill(smem, 2 * BN * ST);
  const int lane = threadIdx.x & 31;
  uint32_t q[MT][D / 8][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int k = 0; k < D / 8; ++k) {
      q[m][k][0] = pack(1e-3f * lane, 1e-3f * k);
      q[m][k][1] = pack(2e-3f, 1e-3f * m);
    }
  float o[MT][D / 8][4] = {}, mx[MT][2] = {}, l[MT][2] = {};
  const int r_nt = lane % 8 + 8 * (lane / 16), c_nt = 8 * ((lane / 8) % 2);  // B of [n][k]
  const int r_t = lane % 8 + 8 * ((lane / 8) % 2), c_t = 8 * (lane / 16);   // B of [k][n]
  constexpr int LOADS = 2 * BN * D / 8 / THREADS;
  uint4 stage[LOADS];
  for (int it = 0; it < iters; ++it) {
    if (SYNC != kNoLoads) fetch(stage, src, it);
    float s[MT][BN / 8][4] = {};
#pragma unroll
    for (int k = 0; k < D / 16; ++k)
#pragma unroll
      for (int n = 0; n < BN / 16; ++n) {
        uint32_t b[4];
        ldsm4(b, sK + (n * 16 + r_nt) * ST + k * 16 + c_nt, false);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const uint32_t a[4] = {q[m][2 * k][0], q[m][2 * k][1], q[m][2 * k + 1][0], q[m][2 * k + 1][1]};
          mma4(s[m][2 * n], s[m][2 * n + 1], a, b[0], b[2], b[1], b[3]);
        }
      }
    uint32_t p[MT][BN / 8][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (SOFTMAX) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float x = mx[m][h];
#pragma unroll
          for (int n = 0; n < BN / 8; ++n) x = fmaxf(x, fmaxf(s[m][n][2 * h], s[m][n][2 * h + 1]));
          x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
          x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
          const float corr = ex2(mx[m][h] - x);
          mx[m][h] = x;
          l[m][h] *= corr;
#pragma unroll
          for (int j = 0; j < D / 8; ++j) {
            o[m][j][2 * h] *= corr;
            o[m][j][2 * h + 1] *= corr;
          }
#pragma unroll
          for (int n = 0; n < BN / 8; ++n) {
            s[m][n][2 * h] = ex2(s[m][n][2 * h] - x);
            s[m][n][2 * h + 1] = ex2(s[m][n][2 * h + 1] - x);
            l[m][h] += s[m][n][2 * h] + s[m][n][2 * h + 1];
          }
        }
      }
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        p[m][n][0] = pack(s[m][n][0], s[m][n][1]);
        p[m][n][1] = pack(s[m][n][2], s[m][n][3]);
      }
    }
#pragma unroll
    for (int k = 0; k < BN / 16; ++k)
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        uint32_t b[4];
        ldsm4(b, sV + (k * 16 + r_t) * ST + n * 16 + c_t, true);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const uint32_t a[4] = {p[m][2 * k][0], p[m][2 * k][1], p[m][2 * k + 1][0], p[m][2 * k + 1][1]};
          mma4(o[m][2 * n], o[m][2 * n + 1], a, b[0], b[1], b[2], b[3]);
        }
      }
    if (SYNC != kNoLoads) {
      // the contents do not matter here: the store overwrites the tile being read
      if (SYNC != kDouble) sync_group(SYNC, GROUP);
      store(smem, stage);
      sync_group(SYNC, GROUP);
    }
  }
  float t = 0.f;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    t += l[m][0] + l[m][1];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) t += o[m][j][0] + o[m][j][1] + o[m][j][2] + o[m][j][3];
  }
  out[blockIdx.x * THREADS + threadIdx.x] = t;  // keeps the work from being removed
}

// Backward, d128's split tile: 8 warps x 16 keys (128 keys per CTA), query tiles of BM = 32
// rows, Q and dO copied each tile (kBoth). The dV pass (DK false): S^T = K Q^T with K in
// registers, P^T = exp2(S^T - lse), dV += P^T dO. The dK/dQ pass: S^T = K Q^T (K by
// ldmatrix), dP^T = V dO^T (V in registers), dS^T = P^T (dP^T - dsum), dK += dS^T Q, dS^T
// to shared memory, a barrier, dQ[32 x 16 columns of this warp] += dS K, then fp32 atomics
// (DQ 0), plain stores (DQ 1) or no dQ step at all (DQ 2).
constexpr int BM = 32, BNB = 128, SD = BM + 8;
constexpr int BWD_SMEM = (BNB + 2 * BM) * ST * 2 + BNB * SD * 2 + 2 * BM * 4;

// FEWER: one barrier fewer per tile. dK/dQ pass: the next Q / dO tile is stored right after
// the dS^T barrier (every warp is done with this tile's Q and dO there) and the dQ step runs
// before the barrier that publishes it (2 barriers instead of 3). dV pass: Q / dO double
// buffered, the next tile stored into the other buffer before one barrier (1 instead of 2).
template <bool DK, int DQ = 0, bool FEWER = false>
__global__ void __launch_bounds__(THREADS, 1) bwd_flow(float* out, int iters, const uint4* src, float* dq) {
  extern __shared__ __align__(16) unsigned char raw[];
  __half* const sK = reinterpret_cast<__half*>(raw);
  __half* sQ = sK + BNB * ST;
  __half* sO = sQ + BM * ST;
  __half* const sS = sO + BM * ST;
  float* const sL = reinterpret_cast<float*>(sS + BNB * SD);
  fill(sK, (BNB + 2 * BM) * ST + BNB * SD);
  if (threadIdx.x < 2 * BM) sL[threadIdx.x] = 0.f;
  __syncthreads();
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
  uint32_t a[D / 8][2];  // the warp's 16 keys of K (dV pass) or V (dK/dQ pass), A fragments
#pragma unroll
  for (int k = 0; k < D / 8; ++k) {
    a[k][0] = pack(1e-3f * lane, 1e-3f * k);
    a[k][1] = pack(2e-3f, 1e-3f);
  }
  float acc[D / 8][4] = {};  // dV or dK of the warp's 16 keys
  const int r_nt = lane % 8 + 8 * (lane / 16), c_nt = 8 * ((lane / 8) % 2);
  const int r_t = lane % 8 + 8 * ((lane / 8) % 2), c_t = 8 * (lane / 16);
  constexpr int LOADS = 2 * BM * D / 8 / THREADS;
  uint4 stage[LOADS];
  for (int it = 0; it < iters; ++it) {
    fetch(stage, src, it);
    float s[BM / 8][4] = {}, dp[BM / 8][4] = {};
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      uint32_t kf[4];
      if (DK) {
        ldsm4(kf, sK + (w * 16 + lane % 16) * ST + k * 16 + 8 * (lane / 16), false);
      } else {
        kf[0] = a[2 * k][0]; kf[1] = a[2 * k][1]; kf[2] = a[2 * k + 1][0]; kf[3] = a[2 * k + 1][1];
      }
#pragma unroll
      for (int n = 0; n < BM / 16; ++n) {
        uint32_t b[4];
        ldsm4(b, sQ + (n * 16 + r_nt) * ST + k * 16 + c_nt, false);
        mma4(s[2 * n], s[2 * n + 1], kf, b[0], b[2], b[1], b[3]);
        if (DK) {
          uint32_t c[4];
          ldsm4(c, sO + (n * 16 + r_nt) * ST + k * 16 + c_nt, false);
          const uint32_t av[4] = {a[2 * k][0], a[2 * k][1], a[2 * k + 1][0], a[2 * k + 1][1]};
          mma4(dp[2 * n], dp[2 * n + 1], av, c[0], c[2], c[1], c[3]);
        }
      }
    }
    uint32_t p[BM / 8][2];
#pragma unroll
    for (int n = 0; n < BM / 8; ++n) {
      const float l0 = sL[n * 8 + 2 * tq], l1 = sL[n * 8 + 2 * tq + 1];
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = ex2(s[n][e] - (e & 1 ? l1 : l0));
      if (DK) {
        const float d0 = sL[BM + n * 8 + 2 * tq], d1 = sL[BM + n * 8 + 2 * tq + 1];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] *= dp[n][e] - (e & 1 ? d1 : d0);
      }
      p[n][0] = pack(v[0], v[1]);
      p[n][1] = pack(v[2], v[3]);
      if (DK && DQ < 2) {
        *reinterpret_cast<uint32_t*>(sS + (w * 16 + gq) * SD + n * 8 + 2 * tq) = p[n][0];
        *reinterpret_cast<uint32_t*>(sS + (w * 16 + gq + 8) * SD + n * 8 + 2 * tq) = p[n][1];
      }
    }
    const __half* const rhs = DK ? sQ : sO;  // dK += dS^T Q, dV += P^T dO
#pragma unroll
    for (int k = 0; k < BM / 16; ++k)
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        uint32_t b[4];
        ldsm4(b, rhs + (k * 16 + r_t) * ST + n * 16 + c_t, true);
        const uint32_t ap[4] = {p[2 * k][0], p[2 * k][1], p[2 * k + 1][0], p[2 * k + 1][1]};
        mma4(acc[2 * n], acc[2 * n + 1], ap, b[0], b[1], b[2], b[3]);
      }
    if (DK && DQ < 2) {
      __syncthreads();  // dS^T of every warp is in shared memory
      if (FEWER) store(sQ, stage);
      float g[2][2][4] = {};
#pragma unroll
      for (int k = 0; k < BNB / 16; ++k) {
        uint32_t kb[4];
        ldsm4(kb, sK + (k * 16 + r_t) * ST + w * 16 + c_t, true);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          uint32_t r[4];
          ldsm4(r, sS + (k * 16 + lane % 8 + 8 * (lane / 16)) * SD + m * 16 + 8 * ((lane / 8) % 2), true);
          mma4(g[m][0], g[m][1], r, kb[0], kb[1], kb[2], kb[3]);
        }
      }
      float* const d = dq + static_cast<size_t>((blockIdx.x * 7 + it) % SOURCE_TILES) * BM * D;
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float* const x = d + (m * 16 + gq + 8 * (e / 2)) * D + w * 16 + n * 8 + 2 * tq + (e & 1);
            if (DQ == 0) atomicAdd(x, g[m][n][e]);
            else *x = g[m][n][e];
          }
    }
    if (!FEWER) {
      __syncthreads();
      store(sQ, stage);  // Q and dO rows are contiguous
    } else if (!DK) {  // the other buffer: past the tiles above (the launch pads shared memory)
      __half* const next = it % 2 ? sK + BNB * ST : reinterpret_cast<__half*>(raw + BWD_SMEM);
      store(next, stage);
      sQ = next;
      sO = next + BM * ST;
    }
    __syncthreads();
  }
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) t += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  out[blockIdx.x * THREADS + threadIdx.x] = t;
}

__global__ void mma_loop(float* out, int iters, const uint4*, float*) {
  float acc[8][4] = {};
  const uint32_t x = pack(1e-3f, 2e-3f), y = pack(3e-3f, 1e-3f);
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int c = 0; c < 8; ++c) mma(acc[c], x, x, y);
  float t = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) t += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = t;
}

using Kernel = void (*)(float*, int, const uint4*, float*);
struct Buffers {
  float* out;
  const uint4* src;
  float* dq;
};

// best of 5 launches after a warm-up, in ms
float time_ms(Kernel k, int blocks, int threads, int smem, int iters, const Buffers& b) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  k<<<blocks, threads, smem>>>(b.out, iters, b.src, b.dq);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(e0));
    k<<<blocks, threads, smem>>>(b.out, iters, b.src, b.dq);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (ms < best) best = ms;
  }
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  return best;
}

struct Case {
  const char* name;
  Kernel kernel;
  int warps_per_cta;  // 8, or 4 for "two CTAs of 4 warps"
  int ctas_per_sm;    // enforced with padded shared memory
  int smem;           // what the tile needs
  int mma_per_warp;   // per tile
  const char* note;
};

}  // namespace

int main(int argc, char** argv) {
  const bool json = argc > 1 && strcmp(argv[1], "--json") == 0;
  if (argc > 1 && !json) {
    fprintf(stderr, "usage: %s [--json]\n", argv[0]);
    return 2;
  }
  int dev = 0, sms = 0, smem_max = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  Buffers b;
  uint4* src;
  const size_t src_bytes = size_t(SOURCE_TILES) * SOURCE_CHUNKS * 16;
  CHECK(cudaMalloc(&b.out, size_t(sms) * 8 * THREADS * sizeof(float)));
  CHECK(cudaMalloc(&src, src_bytes));
  CHECK(cudaMemset(src, 0, src_bytes));
  CHECK(cudaMalloc(&b.dq, size_t(SOURCE_TILES) * BM * D * sizeof(float)));
  CHECK(cudaMemset(b.dq, 0, size_t(SOURCE_TILES) * BM * D * sizeof(float)));
  b.src = src;

  const int loop_iters = 2000;
  const float loop_ms = time_ms(mma_loop, sms * 8, THREADS, 0, loop_iters, b);
  const double loop_tflops = double(sms) * 8 * 8 * loop_iters * 8 * 2048 / loop_ms / 1e9;

  constexpr int F64 = 2 * 64 * ST * 2, F32 = 2 * 32 * ST * 2;  // K + V tiles, 64 / 32 keys
  const Case cases[] = {
      {"fwd 16 rows x 64 keys: GEMMs only", fwd_flow<1, 64, false, kNoLoads>, 8, 1, F64, 256, ""},
      {"fwd 16x64: + softmax", fwd_flow<1, 64, true, kNoLoads>, 8, 1, F64, 256, ""},
      {"fwd 16x64: + K/V copies, kBoth (shipped d128)", fwd_flow<1, 64, true, kBoth>, 8, 1, F64, 256, ""},
      {"fwd 16x64: + K/V copies, kDouble", fwd_flow<1, 64, true, kDouble>, 8, 1, 2 * F64, 256,
       "two K/V buffers: 70 KB, more than a T4 SM"},
      {"fwd 16x64: kBoth, barriers of 4 warps", fwd_flow<1, 64, true, kGroups, 4>, 8, 1, 2 * F64, 256,
       "each group would need its own K/V: 70 KB"},
      {"fwd 16x64: kBoth, 2 CTAs of 4 warps", fwd_flow<1, 64, true, kBoth>, 4, 2, F64, 256,
       "2 x 35 KB: more than a T4 SM"},
      {"fwd 16 rows x 32 keys: kBoth", fwd_flow<1, 32, true, kBoth>, 8, 1, F32, 128, ""},
      {"fwd 16x32: kDouble", fwd_flow<1, 32, true, kDouble>, 8, 1, 2 * F32, 128, ""},
      {"fwd 32 rows x 32 keys: + softmax", fwd_flow<2, 32, true, kNoLoads>, 8, 1, F32, 256,
       "Q in registers: 255 registers before masks and bounds"},
      {"fwd 32x32: kBoth", fwd_flow<2, 32, true, kBoth>, 8, 1, F32, 256,
       "Q in registers: 255 registers before masks and bounds"},
      {"bwd dV pass (K in registers)", bwd_flow<false>, 8, 1, BWD_SMEM, 128, ""},
      {"bwd dV pass, double-buffered Q/dO, 1 barrier", bwd_flow<false, 0, true>, 8, 1, BWD_SMEM, 128,
       "no K tile then: 35 KB"},
      {"bwd dK/dQ pass (V in registers, dQ atomics)", bwd_flow<true, 0>, 8, 1, BWD_SMEM, 256, ""},
      {"bwd dK/dQ pass, 2 barriers per tile", bwd_flow<true, 0, true>, 8, 1, BWD_SMEM, 256, ""},
      {"bwd dK/dQ pass, dQ stored", bwd_flow<true, 1>, 8, 1, BWD_SMEM, 256, "not a gradient"},
      {"bwd dK/dQ pass without the dQ step", bwd_flow<true, 2>, 8, 1, BWD_SMEM, 192, "not a gradient"},
  };
  if (json)
    printf("{\"device\": \"%s\", \"sms\": %d, \"mma_loop_tflops\": %.1f, \"cases\": [\n", prop.name, sms, loop_tflops);
  else
    printf("%s, %d SMs: mma.m16n8k8 register loop %.1f TFLOP/s\n%-48s %4s %8s %8s %8s %7s\n", prop.name, sms,
           loop_tflops, "case (d128)", "regs", "warps/SM", "smem", "TFLOP/s", "% loop");
  const int iters = 400;
  double dv_ms_per_flop = 0, dkdq_ms_per_flop = 0;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) {
    const Case& c = cases[i];
    const int pad = smem_max / c.ctas_per_sm - 1024 > c.smem ? smem_max / c.ctas_per_sm - 1024 : c.smem;
    CHECK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pad));
    cudaFuncAttributes fa;
    CHECK(cudaFuncGetAttributes(&fa, c.kernel));
    int ctas = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, c.kernel, c.warps_per_cta * 32, pad));
    const int blocks = sms * ctas * 4;
    const float ms = time_ms(c.kernel, blocks, c.warps_per_cta * 32, pad, iters, b);
    const double flop = double(blocks) * c.warps_per_cta * iters * c.mma_per_warp * 2048;
    const double tflops = flop / ms / 1e9;
    if (c.kernel == static_cast<Kernel>(bwd_flow<false>)) dv_ms_per_flop = ms / flop;
    if (c.kernel == static_cast<Kernel>(bwd_flow<true, 0>)) dkdq_ms_per_flop = ms / flop;
    if (json)
      printf("  {\"case\": \"%s\", \"regs\": %d, \"warps_per_sm\": %d, \"smem_bytes\": %d, \"tflops\": %.1f, "
             "\"pct_mma_loop\": %.1f, \"note\": \"%s\"},\n",
             c.name, fa.numRegs, ctas * c.warps_per_cta, c.smem, tflops, 100 * tflops / loop_tflops, c.note);
    else
      printf("%-48s %4d %8d %8d %8.1f %6.1f%%%s%s\n", c.name, fa.numRegs, ctas * c.warps_per_cta, c.smem, tflops,
             100 * tflops / loop_tflops, *c.note ? "  " : "", c.note);
  }
  // both passes over the same tiles: the dV pass does 128 MMAs per warp and tile, dK/dQ 256
  const double both = 384.0 / (128 * dv_ms_per_flop + 256 * dkdq_ms_per_flop) / 1e9;
  if (json)
    printf("  {\"case\": \"bwd both passes\", \"tflops\": %.1f, \"pct_mma_loop\": %.1f, \"note\": \"\"}\n]}\n", both,
           100 * both / loop_tflops);
  else
    printf("%-48s %4s %8s %8s %8.1f %6.1f%%\n", "bwd both passes", "", "", "", both, 100 * both / loop_tflops);
  return 0;
}
