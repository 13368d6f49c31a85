// FA2 forward, head dim 96 (sm_75): FwdConfig<96, 128, 64>.
#include "fa2_fwd_kernel.cuh"

namespace sm7x {
namespace fa2 {

template <>
int run_fwd<96>(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd<FwdConfig<96, 128, 64>>(p, stream);
}

}  // namespace fa2
}  // namespace sm7x
