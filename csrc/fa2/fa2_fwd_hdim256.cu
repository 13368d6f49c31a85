// FA2 forward, head dim 256 (sm_75): FwdConfig<256, 64, 16, KvPrefetch::kStaged>.
#include "fa2_fwd_kernel.cuh"

namespace sm7x {
namespace fa2 {

template <>
int run_fwd<256>(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd<FwdConfig<256, 64, 16, KvPrefetch::kStaged>>(p, stream);
}

}  // namespace fa2
}  // namespace sm7x
