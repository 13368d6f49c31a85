// Calls libtorch/c10 C++ API directly: the ABI changes with every torch release.
// Linked without libtorch (-shared leaves the symbols undefined), like an extension
// built with torch/extension.h.
namespace c10 {
void some_function();
namespace detail {
[[noreturn]] void torchCheckFail(const char* func, const char* file, unsigned line,
                                 const char* msg);
}
}  // namespace c10
namespace at {
struct Tensor {
  long numel() const;
};
}  // namespace at
// a C shim as well: one C++ import is enough to make the file UNSTABLE
extern "C" int aoti_torch_dtype_float16();

extern "C" long unstable_entry(const at::Tensor* t, int check) {
  c10::some_function();
  if (!check) c10::detail::torchCheckFail("unstable_entry", __FILE__, __LINE__, "check");
  return t->numel() + aoti_torch_dtype_float16();
}
