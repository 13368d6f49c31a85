// sm7x scheduling planner: pure C++17, no Python, no CUDA.
//
// The CPU-side "plan" step of split-KV decode (the GPU "run" step consumes the int32
// arrays produced here):
//
//  * split_kv_plan  - FlashDecoding-style split-KV plan for decode: how many chunks each
//                     sequence's keys are cut into so that a small batch still fills
//                     the device, and the exact [kv_start, kv_end) of every chunk.
//
// Every function validates its input and throws std::invalid_argument with a message
// that names the argument, the offending value and the fix. The Python bindings
// (sched_bindings.cpp) map that to ValueError.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sm7x {
namespace sched {

// Columns of one split-KV partition row: sequence index, kv_start, kv_end.
inline constexpr int kPartitionColumns = 3;

struct SplitKvPlan {
  std::vector<std::int32_t> num_splits;     // (batch,)
  std::vector<std::int32_t> split_offsets;  // (batch + 1,), exclusive prefix sum
  std::vector<std::int32_t> partitions;     // row-major (total_splits, 3)
  std::int64_t total_splits = 0;
  // ceil(num_heads * total_splits / num_sms): estimated number of waves of CTAs.
  std::int64_t waves = 0;
  // Largest chunk of the plan, in KV blocks (0 if every sequence is empty).
  std::int64_t max_chunk_blocks = 0;
};

// seqlens_k: per-sequence key lengths (>= 0, fitting int32).
// Throws std::invalid_argument on bad input.
SplitKvPlan split_kv_plan(const std::vector<std::int64_t>& seqlens_k, std::int64_t num_heads,
                          std::int64_t num_sms, std::int64_t block_n, std::int64_t max_splits);

// Checks 0 < value <= INT32_MAX; throws std::invalid_argument naming `name` otherwise.
void check_positive_int32(const char* name, std::int64_t value);

}  // namespace sched
}  // namespace sm7x
