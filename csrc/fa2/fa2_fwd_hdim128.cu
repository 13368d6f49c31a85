// FA2 forward, head dim 128 (sm_75): FwdConfig<128, 128, 64, KvPrefetch::kBoth, Q in registers>.
#include "fa2_fwd_kernel.cuh"

namespace sm7x {
namespace fa2 {

template <>
int run_fwd<128>(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd<FwdConfig<128, 128, 64, KvPrefetch::kBoth, /*Q_IN_REGS=*/true>>(p, stream);
}

}  // namespace fa2
}  // namespace sm7x
