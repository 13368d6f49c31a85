// Head-dim dispatch of the FA2 forward (the kernels live in fa2_fwd_hdim*.cu).
#include <cuda_runtime.h>

#include "fa2.h"

namespace sm7x {
namespace fa2 {

int compiled_head_dim(int head_dim) {
  for (int d : kCompiledHeadDims)
    if (head_dim <= d) return d;
  return 0;
}

int fwd(const FwdParams& p, cudaStream_t stream) {
  switch (compiled_head_dim(p.head_dim)) {
    case 32: return run_fwd<32>(p, stream);
    case 64: return run_fwd<64>(p, stream);
    case 96: return run_fwd<96>(p, stream);
    case 128: return run_fwd<128>(p, stream);
    case 256: return run_fwd<256>(p, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

const char* cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // namespace fa2
}  // namespace sm7x
