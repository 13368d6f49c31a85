// A real torch stable-ABI op library, as sm7x-core is built: only torch/csrc/stable and
// torch/headeronly APIs, registered with STABLE_TORCH_LIBRARY. The test compiles it
// against the installed torch's headers with -DTORCH_TARGET_VERSION=0x020A000000000000
// (runs on torch >= 2.10), and once without (targets the headers' own torch version).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

using torch::stable::Tensor;

Tensor scaled_copy(Tensor x, double alpha) {
  STD_TORCH_CHECK(x.scalar_type() == torch::headeronly::ScalarType::Float, "float32 only");
  Tensor out = torch::stable::empty_like(x);
  const float* src = x.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = static_cast<float>(alpha) * src[i];
  return out;
}

STABLE_TORCH_LIBRARY(sm7x_audit_fixture, m) {
  m.def("scaled_copy(Tensor x, float alpha) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(sm7x_audit_fixture, CPU, m) {
  m.impl("scaled_copy", TORCH_BOX(&scaled_copy));
}
