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

// The one rule for the serving kernel of compiled head dim D and `rows` packed query rows
// per kv head (max_seqlen_q x GQA group): few rows run the decode kernel where this
// library has one for D (fa2.decode_kernels), many rows the prefill tiles (serving_wide),
// the rest the narrow serving tiles.
enum class ServingKernel { kDecode, kNarrow, kWide };
template <int D>
ServingKernel serving_kernel(int rows) {
  if (decode_compiled(D) && rows <= kDecodeRows) return ServingKernel::kDecode;
  return rows > kServingWideRows ? ServingKernel::kWide : ServingKernel::kNarrow;
}

// A serving instantiation: its launcher and its tile (with resident CTAs per SM).
struct ServingInstance {
  int (*run)(const FwdParams&, cudaStream_t);
  ServingTile (*tile)();
};

// The instantiation of kernel k of head dim D over a cache of format fmt (KvFormat): fp16,
// fp8 codes (_kv8) or int8 with row scales (_int8).
template <int D>
ServingInstance serving_instance(ServingKernel k, int fmt) {
  const int f = fmt == kKvInt8 ? 2 : fmt != kKvF16 ? 1 : 0;
  if (k == ServingKernel::kDecode) {
    if constexpr (decode_compiled(D)) {
      constexpr ServingInstance decode[3] = {{run_decode<D>, tile_decode<D>},
                                             {run_decode_kv8<D>, tile_decode_kv8<D>},
                                             {run_decode_int8<D>, tile_decode_int8<D>}};
      return decode[f];
    }
  }
  constexpr ServingInstance narrow[3] = {{run_serving<D>, tile_serving<D>},
                                         {run_serving_kv8<D>, tile_serving_kv8<D>},
                                         {run_serving_int8<D>, tile_serving_int8<D>}};
  constexpr ServingInstance wide[3] = {{run_serving_wide<D>, tile_serving_wide<D>},
                                       {run_serving_wide_kv8<D>, tile_serving_wide_kv8<D>},
                                       {run_serving_wide_int8<D>, tile_serving_wide_int8<D>}};
  return k == ServingKernel::kWide ? wide[f] : narrow[f];
}

// The instance serving() runs for head_dim and `rows` (the first compiled head dim >= it,
// from index I on); null members for a head dim no kernel covers.
template <std::size_t I = 0>
ServingInstance serving_for(int head_dim, int rows, int fmt) {
  if constexpr (I == kNumHeadDims) {
    return {nullptr, nullptr};
  } else {
    constexpr int D = kCompiledHeadDims[I];
    if (head_dim > D) return serving_for<I + 1>(head_dim, rows, fmt);
    return serving_instance<D>(serving_kernel<D>(rows), fmt);
  }
}

template <std::size_t I = 0>
int bwd_from(const BwdParams& p, cudaStream_t stream) {
  if constexpr (I == kNumHeadDims || kCompiledHeadDims[I] > kMaxBwdHeadDim) {
    return static_cast<int>(cudaErrorInvalidValue);
  } else {
    constexpr int D = kCompiledHeadDims[I];
    if (p.head_dim <= D) {
      // A dq_pass head dim takes dQ from the dQ kernel as a deterministic call does: the
      // preprocess then leaves dq_accum alone and nothing converts it.
      BwdParams q = p;
      q.deterministic = p.deterministic || bwd_dq_pass(D);
      if (const int e = run_bwd_preprocess(q, stream)) return e;
      if (const int e = run_bwd_main<D>(q, stream)) return e;
      return q.deterministic ? run_bwd_dq<D>(q, stream) : run_bwd_convert_dq(q, stream);
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
    return bwd_from(p, stream);
  }
}

}  // namespace

bool bwd_supported(int head_dim) {
  return kHasBwd && head_dim > 0 && head_dim % kHeadDimMultiple == 0 &&
         head_dim <= kMaxBwdHeadDim;
}

bool bwd_uses_dq_accum(int head_dim) {
  if (!bwd_supported(head_dim)) return false;
  for (const int d : kCompiledHeadDims)  // the head dim bwd_from runs it on
    if (head_dim <= d) return !bwd_dq_pass(d);
  return false;
}

int bwd(const BwdParams& p, cudaStream_t stream) {
  if (!bwd_supported(p.head_dim)) return static_cast<int>(cudaErrorInvalidValue);
  return bwd_all(p, stream);
}

ServingTile serving_tile(int head_dim, int rows, int kv_format) {
  const ServingInstance k = serving_for(head_dim, rows, kv_format);
  return k.tile != nullptr ? k.tile() : ServingTile{0, 0, 0};
}

int fwd(const FwdParams& p, cudaStream_t stream) { return fwd_from(p, stream); }

int serving(const FwdParams& p, cudaStream_t stream) {
  const ServingInstance k = serving_for(p.head_dim, p.seqlen_q * p.group, p.kv_format);
  if (k.run == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (const int e = k.run(p, stream)) return e;
  return p.o_accum != nullptr ? run_combine(p, stream) : 0;
}

const char* cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // namespace fa2
}  // namespace sm7x
