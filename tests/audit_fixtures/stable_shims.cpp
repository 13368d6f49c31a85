// Uses only C shims of torch's stable ABI, declared by hand (extern "C") so the test needs
// no torch headers. Versions from torch/csrc/stable/c/shim.h and aoti_torch/c/shim.h:
//   aoti_torch_dtype_float16, aoti_torch_get_numel  outside any guard (<= 2.9)
//   torch_library_impl                             TORCH_VERSION_2_10_0
//   torch_from_blob                                TORCH_VERSION_2_11_0
//   torch_tag_core (with -DSHIMS_2_12)             TORCH_VERSION_2_12_0
// It also names a CUDA-only shim as a string for dlsym, as sm7x's loader does; with
// -DCUDA_DIRECT it imports that shim instead (then it cannot load in a CPU-only torch).
#include <cstdint>
#include <cstring>

extern "C" {
typedef int32_t AOTITorchError;
struct AtenTensorOpaque;
int32_t aoti_torch_dtype_float16();
AOTITorchError aoti_torch_get_numel(AtenTensorOpaque* t, int64_t* ret);
AOTITorchError torch_library_impl(void* self, const char* name,
                                  void (*fn)(uint64_t*, uint64_t, uint64_t), uint64_t v);
AOTITorchError torch_from_blob(void* data, int64_t ndim, const int64_t* sizes,
                               const int64_t* strides, int64_t offset, int32_t dtype,
                               int32_t device_type, int32_t device_index,
                               AtenTensorOpaque** ret, int32_t layout, const uint8_t* meta,
                               int64_t meta_size, void (*deleter)(void*, void*), void* ctx);
#ifdef SHIMS_2_12
int32_t torch_tag_core();
#endif
#ifdef CUDA_DIRECT
AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret_stream);
#endif
void* dlsym(void* handle, const char* symbol);
}

static void kernel(uint64_t*, uint64_t, uint64_t) {}

extern "C" int64_t stable_entry(AtenTensorOpaque* t, void* lib, void* handle) {
  int64_t n = 0;
  aoti_torch_get_numel(t, &n);
  torch_library_impl(lib, "op", kernel, 0x020A000000000000ULL);
  AtenTensorOpaque* out = nullptr;
  torch_from_blob(nullptr, 0, nullptr, nullptr, 0, aoti_torch_dtype_float16(), 0, 0, &out,
                  0, nullptr, 0, nullptr, nullptr);
#ifdef CUDA_DIRECT
  void* stream_fn = nullptr;
  aoti_torch_get_current_cuda_stream(0, &stream_fn);
  (void)handle;
#else
  void* stream_fn = dlsym(handle, "aoti_torch_get_current_cuda_stream");
#endif
#ifdef SHIMS_2_12
  n += torch_tag_core();
#endif
  return n + (stream_fn != nullptr);
}
