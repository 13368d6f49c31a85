// Head-dim dispatch of the FA2 forward: a head dim runs on the kernel of the smallest
// compiled head dim >= it (loads past the real head dim read zeros, stores skip those
// columns). The list comes from the generated compiled_head_dims.h; its rules are checked
// here, at compile time.
#include <cuda_runtime.h>

#include <cstddef>
#include <iterator>

#include "fa2.h"

namespace sm7x {
namespace fa2 {
namespace {

constexpr std::size_t kNumHeadDims = std::size(kCompiledHeadDims);

constexpr bool ascending() {
  for (std::size_t i = 1; i < kNumHeadDims; ++i)
    if (kCompiledHeadDims[i - 1] >= kCompiledHeadDims[i]) return false;
  return true;
}
static_assert(ascending(), "targets.json: head dims of an arch must be distinct");
static_assert(kCompiledHeadDims[kNumHeadDims - 1] >= kMaxHeadDim,
              "targets.json: fa2.max_head_dim is larger than the largest compiled head dim");
static_assert(kHeadDimMultiple > 0 && kHeadDimMultiple % 8 == 0,
              "targets.json: fa2.head_dim_multiple must be a multiple of 8 (the kernels move "
              "rows in 16-byte chunks of 8 halves)");

// The first compiled head dim >= head_dim, from index I on (the list ascends).
template <std::size_t I = 0>
int fwd_from(const FwdParams& p, cudaStream_t stream) {
  if constexpr (I == kNumHeadDims) {
    return static_cast<int>(cudaErrorInvalidValue);
  } else {
    if (p.head_dim <= kCompiledHeadDims[I]) return run_fwd<kCompiledHeadDims[I]>(p, stream);
    return fwd_from<I + 1>(p, stream);
  }
}

template <std::size_t I = 0>
int serving_from(const FwdParams& p, bool wide, cudaStream_t stream) {
  if constexpr (I == kNumHeadDims) {
    return static_cast<int>(cudaErrorInvalidValue);
  } else {
    constexpr int D = kCompiledHeadDims[I];
    if (p.head_dim <= D) {
      if (p.kv_format == kKvInt8)
        return wide ? run_serving_wide_int8<D>(p, stream) : run_serving_int8<D>(p, stream);
      if (p.kv_format != kKvF16)
        return wide ? run_serving_wide_kv8<D>(p, stream) : run_serving_kv8<D>(p, stream);
      return wide ? run_serving_wide<D>(p, stream) : run_serving<D>(p, stream);
    }
    return serving_from<I + 1>(p, wide, stream);
  }
}

template <std::size_t I = 0>
ServingTile tile_from(int head_dim, bool wide) {
  if constexpr (I == kNumHeadDims) {
    return {0, 0, 0};
  } else {
    if (head_dim <= kCompiledHeadDims[I])
      return wide ? tile_serving_wide<kCompiledHeadDims[I]>()
                  : tile_serving<kCompiledHeadDims[I]>();
    return tile_from<I + 1>(head_dim, wide);
  }
}

// The one rule for the serving kernel: many query rows per kv head run the prefill tiles.
bool serving_wide(int rows) { return rows > kServingWideRows; }

template <std::size_t I = 0>
int bwd_from(const BwdParams& p, cudaStream_t stream) {
  if constexpr (I == kNumHeadDims) {
    return static_cast<int>(cudaErrorInvalidValue);
  } else {
    if (p.head_dim <= kCompiledHeadDims[I]) {
      if (const int e = run_bwd_main<kCompiledHeadDims[I]>(p, stream)) return e;
      return p.deterministic ? run_bwd_dq<kCompiledHeadDims[I]>(p, stream)
                             : run_bwd_convert_dq(p, stream);
    }
    return bwd_from<I + 1>(p, stream);
  }
}

// A template so that a library without backward kernels (kHasBwd false) never
// instantiates bwd_from, whose run_bwd_* it does not define.
template <bool HAS = kHasBwd>
int bwd_all(const BwdParams& p, cudaStream_t stream) {
  if constexpr (!HAS) {
    return static_cast<int>(cudaErrorNotSupported);
  } else {
    if (const int e = run_bwd_preprocess(p, stream)) return e;
    return bwd_from(p, stream);
  }
}

}  // namespace

bool bwd_supported(int head_dim) {
  return kHasBwd && head_dim > 0 && head_dim % kHeadDimMultiple == 0 && head_dim <= kMaxHeadDim;
}

int bwd(const BwdParams& p, cudaStream_t stream) {
  if (!bwd_supported(p.head_dim)) return static_cast<int>(cudaErrorInvalidValue);
  return bwd_all(p, stream);
}

ServingTile serving_tile(int head_dim, int rows) { return tile_from(head_dim, serving_wide(rows)); }

int fwd(const FwdParams& p, cudaStream_t stream) { return fwd_from(p, stream); }

int serving(const FwdParams& p, cudaStream_t stream) {
  if (const int e = serving_from(p, serving_wide(p.seqlen_q * p.group), stream)) return e;
  return p.o_accum != nullptr ? run_combine(p, stream) : 0;
}

const char* cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // namespace fa2
}  // namespace sm7x
