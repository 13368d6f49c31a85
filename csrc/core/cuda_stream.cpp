// The current CUDA stream of torch, without a link-time dependency on libtorch_cuda.so.
//
// The stable-ABI shim aoti_torch_get_current_cuda_stream lives in libtorch_cuda.so.
// Linking it would add a DT_NEEDED on libtorch_cuda.so, and the library would then fail
// to load in a CPU-only torch. So it is looked up at run time in the already loaded
// libtorch_cuda.so (RTLD_NOLOAD: never load it ourselves); a CUDA tensor cannot exist
// without it being loaded.
#include "cuda_stream.h"

#include <dlfcn.h>

#include <cstdint>

namespace sm7x {
namespace core {

namespace {
// AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret_stream);
using GetStreamFn = int32_t (*)(int32_t, void**);

GetStreamFn resolve() {
  void* sym = nullptr;
  // The reference from RTLD_NOLOAD is kept on purpose: the symbol must stay valid.
  if (void* lib = dlopen("libtorch_cuda.so", RTLD_NOLOAD | RTLD_LAZY))
    sym = dlsym(lib, "aoti_torch_get_current_cuda_stream");
  if (sym == nullptr)  // e.g. a torch whose CUDA library goes by another soname
    sym = dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
  return reinterpret_cast<GetStreamFn>(sym);
}
}  // namespace

bool current_cuda_stream(int32_t device_index, void** stream) {
  static const GetStreamFn fn = resolve();  // thread-safe static initialisation
  if (fn == nullptr) return false;
  *stream = nullptr;
  return fn(device_index, stream) == 0;
}

}  // namespace core
}  // namespace sm7x
