// sm7x scheduling planner (see sched.hpp for the contract of each function).
#include "sched.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace sm7x {
namespace sched {
namespace {

constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();

// ceil(a / b) for a >= 0, b > 0, without the overflow of (a + b - 1) / b.
constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return a / b + (a % b != 0 ? 1 : 0);
}

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string item(const char* name, std::size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

void check_batch_size(const char* what, std::size_t batch) {
  if (batch > static_cast<std::size_t>(kInt32Max)) {
    fail(std::string(what) + ": batch of " + std::to_string(batch) +
         " sequences does not fit int32; split the batch");
  }
}

}  // namespace

void check_positive_int32(const char* name, std::int64_t value) {
  if (value <= 0) {
    fail(std::string(name) + " must be a positive integer, got " + std::to_string(value));
  }
  if (value > kInt32Max) {
    fail(std::string(name) + "=" + std::to_string(value) +
         " does not fit int32 (max 2147483647)");
  }
}

// Split-KV model (FlashDecoding).
//
// A decode step runs one CTA per (sequence, head, split); a CTA handling a chunk of c KV
// blocks takes time proportional to c, and the num_sms SMs run the CTAs in waves. The
// splits of all sequences are partial results that a second, cheap kernel combines, so
// more splits cost extra memory traffic: we want the fewest splits that keep the SMs
// busy.
//
//  1. If batch * num_heads >= 0.8 * num_sms (flash-attn's heuristic), one split per
//     sequence already fills the device: no splitting.
//  2. Otherwise pick a chunk size C (in KV blocks) shared by all sequences: sequence i
//     with nb_i = ceil(len_i / block_n) blocks gets s_i = min(max_splits,
//     max(1, ceil(nb_i / C))) splits, the blocks spread evenly (chunks differ by at most
//     one block). The estimated makespan is
//         waves(C) * chunk(C),  waves = ceil(num_heads * sum_i s_i / num_sms),
//                               chunk = max_i ceil(nb_i / s_i),
//     i.e. the number of waves times the longest CTA (a wave lasts as long as its
//     slowest CTA). We choose the C of smallest makespan, ties toward the smaller total
//     number of splits (less combine work).
//
// The s_i are non-increasing step functions of C that change only where
// C = ceil(nb_i / k) for some k < max_splits (and at C = 1), so it suffices to evaluate
// those breakpoints: O(sqrt(nb)) candidates per distinct length instead of every C up to
// max nb. Since all s_i move in the same direction with C, two candidates with the same
// total number of splits have the same s vector, so the rule picks a unique plan.
SplitKvPlan split_kv_plan(const std::vector<std::int64_t>& seqlens_k, std::int64_t num_heads,
                          std::int64_t num_sms, std::int64_t block_n,
                          std::int64_t max_splits) {
  check_positive_int32("num_heads", num_heads);
  check_positive_int32("num_sms", num_sms);
  check_positive_int32("block_n", block_n);
  check_positive_int32("max_splits", max_splits);
  const std::size_t batch = seqlens_k.size();
  check_batch_size("split_kv_plan", batch);
  for (std::size_t i = 0; i < batch; ++i) {
    if (seqlens_k[i] < 0) {
      fail("seqlens_k must hold key lengths >= 0, but " + item("seqlens_k", i) + "=" +
           std::to_string(seqlens_k[i]) +
           " is negative (pass per-sequence lengths, not cumulative offsets)");
    }
    if (seqlens_k[i] > kInt32Max) {
      fail("seqlens_k value " + item("seqlens_k", i) + "=" + std::to_string(seqlens_k[i]) +
           " does not fit int32 (max 2147483647)");
    }
  }

  std::vector<std::int64_t> nblocks(batch);
  for (std::size_t i = 0; i < batch; ++i) nblocks[i] = ceil_div(seqlens_k[i], block_n);

  SplitKvPlan plan;
  plan.num_splits.assign(batch, 1);

  // 5 * work >= 4 * num_sms, written so that it cannot overflow (work <= 2^62).
  const std::int64_t work = static_cast<std::int64_t>(batch) * num_heads;
  const bool fills_device = work >= num_sms || 5 * work >= 4 * num_sms;

  if (!fills_device && batch > 0) {
    // Distinct block counts with multiplicities: s_i depends on nb_i only.
    std::vector<std::int64_t> sorted_nb(nblocks);
    std::sort(sorted_nb.begin(), sorted_nb.end());
    std::vector<std::pair<std::int64_t, std::int64_t>> groups;  // (nb, count)
    for (std::int64_t nb : sorted_nb) {
      if (!groups.empty() && groups.back().first == nb) {
        ++groups.back().second;
      } else {
        groups.emplace_back(nb, 1);
      }
    }

    auto splits_for = [max_splits](std::int64_t nb, std::int64_t chunk) {
      return nb == 0 ? std::int64_t{1} : std::min(max_splits, ceil_div(nb, chunk));
    };

    // Candidate chunk sizes: the breakpoints ceil(nb / k), k = 1 .. min(nb, max_splits),
    // enumerated in O(sqrt(nb)) steps: after value q, the next k with a smaller
    // ceil(nb / k) is ceil(nb / (q - 1)).
    std::vector<std::int64_t> candidates{1};
    for (const auto& g : groups) {
      const std::int64_t nb = g.first;
      const std::int64_t k_max = std::min(nb, max_splits);
      std::int64_t k = 1;
      while (k <= k_max) {
        const std::int64_t q = ceil_div(nb, k);
        candidates.push_back(q);
        if (q == 1) break;
        k = ceil_div(nb, q - 1);
      }
    }
    std::sort(candidates.begin(), candidates.end());
    candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());

    std::int64_t best_chunk_size = 0, best_makespan = 0, best_total = 0;
    for (std::int64_t c : candidates) {
      std::int64_t total = 0, chunk = 0;
      for (const auto& g : groups) {
        const std::int64_t s = splits_for(g.first, c);
        total += s * g.second;  // <= batch * max_splits < 2^62
        chunk = std::max(chunk, ceil_div(g.first, s));
      }
      // Plans whose split count does not fit int32 cannot be expressed; C = max nb
      // (total = batch) always can.
      if (total > kInt32Max) continue;
      // num_heads * total < 0.8 * num_sms * max_splits here, so waves <= max_splits and
      // the product below stays far from overflow.
      const std::int64_t makespan = ceil_div(num_heads * total, num_sms) * chunk;
      if (best_chunk_size == 0 || makespan < best_makespan ||
          (makespan == best_makespan && total < best_total)) {
        best_chunk_size = c;
        best_makespan = makespan;
        best_total = total;
      }
    }
    for (std::size_t i = 0; i < batch; ++i) {
      plan.num_splits[i] = static_cast<std::int32_t>(splits_for(nblocks[i], best_chunk_size));
    }
  }

  // Offsets and partitions: the blocks of sequence i are spread evenly over its splits,
  // the first (nb % s) splits taking one block more; boundaries are multiples of block_n
  // and the last split ends at len (it may be a partial block).
  plan.split_offsets.resize(batch + 1);
  plan.split_offsets[0] = 0;
  std::int64_t total = 0;
  for (std::size_t i = 0; i < batch; ++i) {
    total += plan.num_splits[i];
    plan.split_offsets[i + 1] = static_cast<std::int32_t>(total);  // total <= INT32_MAX
  }
  plan.total_splits = total;
  plan.partitions.reserve(static_cast<std::size_t>(total) * kPartitionColumns);
  for (std::size_t i = 0; i < batch; ++i) {
    const std::int64_t len = seqlens_k[i];
    const std::int64_t nb = nblocks[i];
    const std::int64_t s = plan.num_splits[i];
    const std::int64_t base = nb / s, extra = nb % s;
    std::int64_t block = 0;
    for (std::int64_t j = 0; j < s; ++j) {
      const std::int64_t count = base + (j < extra ? 1 : 0);
      plan.partitions.push_back(static_cast<std::int32_t>(i));
      plan.partitions.push_back(static_cast<std::int32_t>(block * block_n));
      plan.partitions.push_back(
          static_cast<std::int32_t>(std::min((block + count) * block_n, len)));
      block += count;
    }
    plan.max_chunk_blocks = std::max(plan.max_chunk_blocks, ceil_div(nb, s));
  }
  plan.waves = ceil_div(num_heads * total, num_sms);
  return plan;
}

}  // namespace sched
}  // namespace sm7x
