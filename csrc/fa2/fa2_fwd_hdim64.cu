// FA2 forward, head dim 64 (sm_75): FwdConfig<64, 128, 64>.
#include "fa2_fwd_kernel.cuh"

namespace sm7x {
namespace fa2 {

template <>
int run_fwd<64>(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd<FwdConfig<64, 128, 64>>(p, stream);
}

}  // namespace fa2
}  // namespace sm7x
