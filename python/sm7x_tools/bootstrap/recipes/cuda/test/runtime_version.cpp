// Host-only use of the CUDA runtime: prints its version, checks it against argv[1].
#include <cuda_runtime_api.h>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  std::printf("cudart %d\n", v);
  return argc > 1 && v != std::atoi(argv[1]);
}
