// Text about stable-ABI tensors for error messages, shared by the op layers of sm7x's
// libraries (core, the FA2 family): shapes, strides, dtype names.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace sm7x {

inline std::string shape_str(const torch::stable::Tensor& t) {
  std::ostringstream oss;
  oss << "[";
  for (int64_t i = 0; i < t.dim(); ++i) oss << (i ? ", " : "") << t.size(i);
  oss << "]";
  return oss.str();
}

inline std::string strides_str(const torch::stable::Tensor& t) {
  std::ostringstream oss;
  oss << "(";
  for (int64_t i = 0; i < t.dim(); ++i) oss << (i ? ", " : "") << t.stride(i);
  oss << ")";
  return oss.str();
}

inline const char* scalar_name(torch::headeronly::ScalarType s) {
  using torch::headeronly::ScalarType;
  switch (s) {
    case ScalarType::Float: return "float32";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Double: return "float64";
    case ScalarType::Long: return "int64";
    case ScalarType::Int: return "int32";
    case ScalarType::Short: return "int16";
    case ScalarType::Char: return "int8";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Bool: return "bool";
    case ScalarType::Float8_e4m3fn: return "float8_e4m3fn";
    case ScalarType::Float8_e5m2: return "float8_e5m2";
    default: return "an unsupported dtype";
  }
}

}  // namespace sm7x
