// sm7x scheduling planner: pure C++17, no Python, no CUDA.
//
// Two CPU-side "plan" steps for the attention kernels (the GPU "run" step consumes the
// int32 arrays produced here):
//
//  * varlen_tiles   - the work list of a variable-length (packed, cu_seqlens) prefill
//                     batch: one tile per (sequence, head, query block), each with its
//                     cost in KV blocks, ordered longest-processing-time first so that a
//                     persistent kernel that takes tiles in order balances its SMs.
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

// Columns of one tile row: sequence index, head index, query-block index, cost.
inline constexpr int kTileColumns = 4;
// Columns of one split-KV partition row: sequence index, kv_start, kv_end.
inline constexpr int kPartitionColumns = 3;

struct TilePlan {
  // Row-major (num_tiles, kTileColumns) array: seq, head, m_block, cost.
  std::vector<std::int32_t> tiles;
  std::int64_t num_tiles = 0;
  // Sum of all tile costs, in KV blocks (can exceed int32).
  std::int64_t total_cost = 0;
};

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

// Number of KV blocks (of block_n keys) that query block m_block of a sequence with
// len_q queries and len_k keys must visit. Causal masking uses bottom-right alignment
// (flash-attn >= 2.1): query row i sees keys j <= i + len_k - len_q.
// Preconditions (not checked): len_q, len_k >= 0, block sizes > 0,
// 0 <= m_block < ceil(len_q / block_m).
std::int64_t tile_cost(std::int64_t len_q, std::int64_t len_k, std::int64_t m_block,
                       std::int64_t block_m, std::int64_t block_n, bool causal);

// cu_seqlens_q / cu_seqlens_k: cumulative lengths, batch + 1 entries, starting at 0,
// non-decreasing, values fitting int32. Throws std::invalid_argument on bad input.
TilePlan varlen_tiles(const std::vector<std::int64_t>& cu_seqlens_q,
                      const std::vector<std::int64_t>& cu_seqlens_k, std::int64_t num_heads,
                      std::int64_t block_m, std::int64_t block_n, bool causal);

// seqlens_k: per-sequence key lengths (>= 0, fitting int32).
// Throws std::invalid_argument on bad input.
SplitKvPlan split_kv_plan(const std::vector<std::int64_t>& seqlens_k, std::int64_t num_heads,
                          std::int64_t num_sms, std::int64_t block_n, std::int64_t max_splits);

// Checks 0 < value <= INT32_MAX; throws std::invalid_argument naming `name` otherwise.
void check_positive_int32(const char* name, std::int64_t value);

}  // namespace sched
}  // namespace sm7x
