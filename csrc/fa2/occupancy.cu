// Occupancy emulation (fa2.h): a T4 holds 64 KB of shared memory and 1024 threads per SM,
// an H200 228 KB and 2048, so on the H200 a forced sm75 kernel can run two or three CTAs
// per SM where a T4 runs one, and its speed says little about the T4's. Padding each
// launch's dynamic shared memory caps the CTAs per SM at what the emulated card fits.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace {

std::atomic<int> g_smem_per_sm{0}, g_threads_per_sm{0};

}  // namespace

void set_occupancy_emulation(int smem_per_sm, int threads_per_sm) {
  g_smem_per_sm.store(smem_per_sm > 0 ? smem_per_sm : 0);
  g_threads_per_sm.store(threads_per_sm > 0 ? threads_per_sm : 0);
}

int launch_smem_bytes(int smem_bytes, int threads) {
  const int cap = g_smem_per_sm.load(), tcap = g_threads_per_sm.load();
  if (cap <= 0) return smem_bytes;
  // CTAs per SM on the emulated card (shared memory and threads; at least one)
  int n = smem_bytes > 0 ? cap / smem_bytes : 32;
  if (tcap > 0) n = std::min(n, tcap / threads);
  n = std::max(n, 1);
  int dev = 0, per_sm = 0, reserved = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return smem_bytes;
  // n CTAs of (padded + reserved) fit in per_sm, n + 1 do not
  const int padded = std::min(per_sm / n - reserved, optin);
  return std::max(padded, smem_bytes);
}

}  // namespace fa2
}  // namespace sm7x
