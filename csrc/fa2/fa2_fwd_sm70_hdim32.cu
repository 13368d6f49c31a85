// FA2 forward, head dim 32 (sm_70): Sm70Config<32, 64, 64, true>.
#include "fa2_fwd_sm70_kernel.cuh"

namespace sm7x {
namespace fa2 {

template <>
int run_fwd<32>(const FwdParams& p, cudaStream_t stream) {
  return sm70::launch_fwd_sm70<sm70::Sm70Config<32, 64, 64, true>>(p, stream);
}

}  // namespace fa2
}  // namespace sm7x
