// torch's current CUDA stream through the stable-ABI shim, resolved at run time
// (see cuda_stream.cpp for why it is not linked).
#pragma once

#include <cstdint>

namespace sm7x {
namespace core {

// Stores torch's current stream of `device_index` in *stream (a cudaStream_t) and
// returns true; false when the shim cannot be found or fails.
bool current_cuda_stream(int32_t device_index, void** stream);

}  // namespace core
}  // namespace sm7x
