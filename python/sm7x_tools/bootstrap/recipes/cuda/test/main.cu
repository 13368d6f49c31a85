#include <cstdio>
extern "C" int run_axpy(int* runtime_version);
int main() {
  int version = 0, r = run_axpy(&version);
  std::printf("run_axpy: %d (0 ok, >0 CUDA error such as no GPU), cudart %d\n", r, version);
  return r < 0;
}
