// Failed checks of the op layers (core, the FA2 family): a std::runtime_error, which
// torch turns into a Python RuntimeError carrying the message. The message is
// "sm7x.<op>: <what>" and nothing else: no function name, source path or line (torch's
// STD_TORCH_CHECK prepends those), since users act on the op and the argument.
#pragma once

#include <sstream>
#include <stdexcept>

namespace sm7x {

template <typename... Args>
[[noreturn]] void fail(const char* op, const Args&... args) {
  std::ostringstream oss;
  oss << "sm7x." << op << ": ";
  ((oss << args), ...);
  throw std::runtime_error(oss.str());
}

// The same for an op of one library of a family: "sm7x.<lib>.<op>: <what>".
template <typename... Args>
[[noreturn]] void fail_in(const char* lib, const char* op, const Args&... args) {
  std::ostringstream oss;
  oss << "sm7x." << lib << "." << op << ": ";
  ((oss << args), ...);
  throw std::runtime_error(oss.str());
}

}  // namespace sm7x

#define SM7X_CHECK(cond, op, ...)                     \
  do {                                                \
    if (!(cond)) ::sm7x::fail(op, __VA_ARGS__);       \
  } while (0)
