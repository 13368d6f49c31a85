// The op layer of sm7x core: schemas, validation, device/stream handling and dispatch
// to the CPU or CUDA kernels. Written against torch's stable ABI only (compiled with
// TORCH_TARGET_VERSION of the torch floor, targets.json torch.min, so one build loads in
// every torch from it up) and linked
// against no torch library: the aoti_torch_* / torch_* C shims it calls are resolved
// from the torch already loaded in the process.
//
// Every failed check throws std::runtime_error, which torch turns into a Python
// RuntimeError carrying the message: each message names the op and the argument, says
// what was found and how to fix it.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "check.h"
#include "cuda_stream.h"
#include "kernels.h"
#include "tensor_text.h"

namespace sm7x {
namespace core {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;


// size/stride with Python-style negative dims (the stable Tensor takes dims >= 0).
int64_t size_at(const Tensor& t, int64_t d) { return t.size(d < 0 ? d + t.dim() : d); }
int64_t stride_at(const Tensor& t, int64_t d) { return t.stride(d < 0 ? d + t.dim() : d); }

std::string device_str(const Tensor& t) {
  std::ostringstream oss;
  if (t.is_cuda())
    oss << "cuda:" << t.get_device_index();
  else if (t.is_cpu())
    oss << "cpu";
  else
    oss << "a device that is neither CPU nor CUDA";
  return oss.str();
}

// ---------------------------------------------------------------------------------------
// Checks.

DType float_dtype(const char* op, const char* name, const Tensor& t) {
  const ScalarType s = t.scalar_type();
  switch (s) {
    case ScalarType::Float: return DType::F32;
    case ScalarType::Half: return DType::F16;
    case ScalarType::BFloat16: return DType::BF16;
    default:
      fail(op, name, " has dtype ", scalar_name(s),
           "; supported: float16, bfloat16, float32 (cast with .half(), .bfloat16() or .float())");
  }
}

IType index_dtype(const char* op, const char* name, const Tensor& t) {
  const ScalarType s = t.scalar_type();
  if (s == ScalarType::Long) return IType::I64;
  if (s == ScalarType::Int) return IType::I32;
  fail(op, name, " has dtype ", scalar_name(s), "; it must be int64 or int32 (cast with .long())");
}

void check_same_dtype(const char* op, const char* name, const Tensor& t, const char* ref_name,
                      const Tensor& ref) {
  SM7X_CHECK(t.scalar_type() == ref.scalar_type(), op, name, " has dtype ",
             scalar_name(t.scalar_type()), " but ", ref_name, " has dtype ",
             scalar_name(ref.scalar_type()), "; they must match (cast ", name, " with .to(",
             ref_name, ".dtype))");
}

// CPU or CUDA, and the same device as the reference tensor.
void check_device(const char* op, const char* name, const Tensor& t, const char* ref_name,
                  const Tensor& ref) {
  SM7X_CHECK(t.is_cpu() || t.is_cuda(), op, name, " is on ", device_str(t),
             "; sm7x ops run on CPU and CUDA tensors");
  const bool same = t.is_cuda() == ref.is_cuda() &&
                    (!t.is_cuda() || t.get_device_index() == ref.get_device_index());
  SM7X_CHECK(same, op, name, " is on ", device_str(t), " but ", ref_name, " is on ",
             device_str(ref), "; move all tensors to one device (e.g. ", name, ".to(",
             ref_name, ".device))");
}

void check_dim(const char* op, const char* name, const Tensor& t, int64_t dim,
               const char* layout) {
  SM7X_CHECK(t.dim() == dim, op, name, " must be ", dim, "-D ", layout, ", got shape ",
             shape_str(t));
}

void check_size(const char* op, const char* name, const Tensor& t, int64_t d, int64_t want,
                const char* what) {
  SM7X_CHECK(t.size(d) == want, op, name, ".shape[", d, "] is ", t.size(d), " but must be ",
             want, " (", what, "); ", name, " has shape ", shape_str(t));
}

void check_contiguous(const char* op, const char* name, const Tensor& t) {
  SM7X_CHECK(t.is_contiguous(), op, name, " (shape ", shape_str(t), ", strides ",
             strides_str(t), ") must be contiguous; call ", name, ".contiguous() first");
}

// A tensor seen as rows of `inner` contiguous elements: the last dim (or, with
// inner_dims == 2, the last two) form a row; the leading dims must collapse into one
// row index with a single stride. That covers contiguous tensors and row slices such
// as x[:, :n] or one part of a fused qkv projection.
struct Rows {
  int64_t rows = 0;
  int64_t stride = 0;
};

Rows as_rows(const char* op, const char* name, const Tensor& t, int64_t inner_dims,
             bool writable) {
  const int64_t nd = t.dim();
  const int64_t last = nd - 1;
  SM7X_CHECK(t.size(last) <= 1 || t.stride(last) == 1, op, name, " (shape ", shape_str(t),
             ", strides ", strides_str(t), ") must have a contiguous last dimension "
             "(stride 1); call ", name, ".contiguous() first");
  int64_t row_elems = 1;
  for (int64_t d = nd - inner_dims; d < nd; ++d) row_elems *= t.size(d);
  Rows r;
  r.rows = 1;
  bool have = false;
  int64_t expect = 0;
  for (int64_t d = nd - inner_dims - 1; d >= 0; --d) {
    const int64_t n = t.size(d);
    r.rows *= n;
    if (n == 1) continue;
    if (!have) {
      r.stride = t.stride(d);
      expect = r.stride * n;
      have = true;
    } else {
      SM7X_CHECK(t.stride(d) == expect, op, name, " (shape ", shape_str(t), ", strides ",
                 strides_str(t), ") has leading dimensions that do not collapse into rows "
                 "of one stride; call ", name, ".contiguous() first");
      expect *= n;
    }
  }
  if (!have) r.stride = row_elems;  // at most one row: any stride will do
  if (writable && r.rows > 1 && row_elems > 0)
    SM7X_CHECK(r.stride >= row_elems, op, name, " (shape ", shape_str(t), ", strides ",
               strides_str(t), ") is written to, so its rows must not overlap; pass a "
               "tensor with its own storage (e.g. ", name, ".contiguous())");
  return r;
}

// A Tensor argument given None reaches the op as an undefined tensor (the schema allows
// it for direct torch.ops calls): refuse it by name before anything reads it.
void check_defined(const char* op,
                   std::initializer_list<std::pair<const char*, const Tensor*>> args) {
  for (auto [name, t] : args)
    SM7X_CHECK(t->defined(), op, name, " is None; it must be a tensor");
}

// Memory rules of the ops that write (python/sm7x/_args.py states them for the Python
// wrappers; these apply them again to direct torch.ops calls): a written tensor's
// elements must not share memory, and an output must not certainly overlap another
// tensor of the call (both contiguous with intersecting spans, or the same view, which
// an op that runs in place allows). Strided views whose spans interleave (K and V halves
// of one packed cache) may not share an element and pass, as in torch's checks.
int64_t elem_size(const Tensor& t) {
  switch (t.scalar_type()) {
    case ScalarType::Half:
    case ScalarType::BFloat16:
      return 2;
    case ScalarType::Float:
    case ScalarType::Int:
      return 4;
    case ScalarType::Long:
    case ScalarType::Double:
      return 8;
    default:
      return 1;
  }
}

// Each dim's stride clears everything the smaller-stride dims span: a sufficient rule
// for distinct elements (an expanded dim, stride 0 and size > 1, always fails it).
bool overlaps_itself(const Tensor& t) {
  int64_t st[16], n[16];
  int64_t k = 0;
  for (int64_t d = 0; d < t.dim() && k < 16; ++d)
    if (t.size(d) > 1) {
      n[k] = t.size(d);
      st[k++] = t.stride(d);
    }
  for (int64_t i = 1; i < k; ++i)  // insertion sort by stride
    for (int64_t j = i; j > 0 && st[j] < st[j - 1]; --j) {
      std::swap(st[j], st[j - 1]);
      std::swap(n[j], n[j - 1]);
    }
  int64_t extent = 1;
  for (int64_t i = 0; i < k; ++i) {
    if (st[i] < extent) return true;
    extent += (n[i] - 1) * st[i];
  }
  return false;
}

bool same_view(const Tensor& a, const Tensor& b) {
  if (a.const_data_ptr() != b.const_data_ptr() || a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) != b.size(d) || a.stride(d) != b.stride(d)) return false;
  return true;
}

bool certainly_overlap(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto span = [](const Tensor& t, uintptr_t& lo, uintptr_t& hi) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    lo = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    hi = lo + (last + 1) * elem_size(t) - 1;
  };
  uintptr_t a0, a1, b0, b1;
  span(a, a0, a1);
  span(b, b0, b1);
  if (!(a0 <= b1 && b0 <= a1)) return false;
  return same_view(a, b) || (a.is_contiguous() && b.is_contiguous());
}

void check_written(const char* op, const char* name, const Tensor& t) {
  SM7X_CHECK(t.numel() <= 1 || !overlaps_itself(t), op, name, " (shape ", shape_str(t),
             ", strides ", strides_str(t), ") is written, but its elements may share memory "
             "(an expanded or overlapping view); pass a tensor with its own storage (e.g. ",
             name, ".contiguous() or torch.empty_like)");
}

// out (written) against another tensor of the call; allow_same: in place is allowed.
void check_apart(const char* op, const char* out_name, const Tensor& out, const char* name,
                 const Tensor& t, bool allow_same = false) {
  if (allow_same && same_view(out, t)) return;
  SM7X_CHECK(!certainly_overlap(out, t), op, out_name, " overlaps ", name, " in memory; ",
             out_name, " is written while ", name, " is read or written: pass separate "
             "tensors");
}

void check_int32(const char* op, const char* what, int64_t v) {
  SM7X_CHECK(v <= std::numeric_limits<int32_t>::max(), op, what, " is ", v,
             ", larger than the kernels support (2^31 - 1)");
}

void check_eps(const char* op, double eps) {
  SM7X_CHECK(std::isfinite(eps) && eps >= 0, op, "eps must be a finite number >= 0, got ",
             eps);
}

// ---------------------------------------------------------------------------------------
// Running on a device.

void run_parallel(int64_t n, int64_t grain, ParallelFn fn, void* ctx) {
  torch::stable::parallel_for(0, n, grain, [fn, ctx](int64_t b, int64_t e) { fn(b, e, ctx); });
}

#ifdef SM7X_WITH_CUDA
// Sets the tensor's device for the launch and finds torch's current stream on it.
struct CudaLaunch {
  torch::stable::accelerator::DeviceGuard guard;
  cudaStream_t stream = nullptr;

  CudaLaunch(const char* op, const Tensor& t) : guard(t.get_device_index()) {
    void* s = nullptr;
    SM7X_CHECK(current_cuda_stream(t.get_device_index(), &s), op,
               "cannot get torch's current CUDA stream (aoti_torch_get_current_cuda_stream "
               "was not found in the loaded libtorch_cuda.so or failed); sm7x needs a CUDA "
               "build of torch >= " SM7X_TORCH_MIN);
    stream = static_cast<cudaStream_t>(s);
  }

  void check(const char* op, int err) const {
    SM7X_CHECK(err == 0, op, "CUDA kernel launch failed: ", cuda_error_string(err));
  }
};
#define SM7X_CUDA_RUN(op, ref, call) \
  do {                               \
    CudaLaunch launch_(op, ref);     \
    launch_.check(op, call(launch_.stream)); \
  } while (0)
#else
#define SM7X_CUDA_RUN(op, ref, call)                                                      \
  fail(op, "this build of sm7x's _core library has no CUDA kernels (it was compiled "   \
           "without a CUDA compiler); install an sm7x-core package built with CUDA, or " \
           "rebuild with nvcc on the PATH")
#endif

// ---------------------------------------------------------------------------------------
// Ops.

// The checks both norms share: x [..., hidden] in a float dtype, weight [hidden] of x's
// dtype, eps, and the second tensor (out or residual) on x's device; its dtype is each
// norm's own rule. Returns hidden.
int64_t check_norm_args(const char* op, const Tensor& x, const char* other_name,
                        const Tensor& other, const Tensor& weight, double eps) {
  SM7X_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension (..., hidden_size)");
  const int64_t hidden = size_at(x, -1);
  SM7X_CHECK(hidden > 0, op, "x has hidden size 0 (shape ", shape_str(x),
             "); the last dimension must not be empty");
  check_int32(op, "hidden size", hidden);
  check_eps(op, eps);
  check_device(op, other_name, other, "x", x);
  check_device(op, "weight", weight, "x", x);
  check_same_dtype(op, "weight", weight, "x", x);
  check_dim(op, "weight", weight, 1, "[hidden_size]");
  check_size(op, "weight", weight, 0, hidden, "x.shape[-1]");
  check_contiguous(op, "weight", weight);
  return hidden;
}

void rms_norm(Tensor out, Tensor x, Tensor weight, double eps) {
  const char* op = "rms_norm";
  check_defined(op, {{"out", &out}, {"x", &x}, {"weight", &weight}});
  const DType dt = float_dtype(op, "x", x);
  const int64_t hidden = check_norm_args(op, x, "out", out, weight, eps);
  check_same_dtype(op, "out", out, "x", x);
  SM7X_CHECK(out.dim() == x.dim() && out.numel() == x.numel(), op, "out has shape ",
             shape_str(out), " but x has shape ", shape_str(x), "; they must match");
  for (int64_t d = 0; d < x.dim(); ++d)
    SM7X_CHECK(out.size(d) == x.size(d), op, "out has shape ", shape_str(out),
               " but x has shape ", shape_str(x), "; they must match");
  const Rows xr = as_rows(op, "x", x, 1, false);
  const Rows orow = as_rows(op, "out", out, 1, true);
  check_written(op, "out", out);
  check_apart(op, "out", out, "x", x, /*allow_same=*/true);
  check_apart(op, "out", out, "weight", weight);
  if (xr.rows == 0) return;
  RmsNormArgs a{out.mutable_data_ptr(), x.const_data_ptr(), weight.const_data_ptr(),
                xr.rows, hidden, orow.stride, xr.stride, static_cast<float>(eps)};
  if (x.is_cuda())
    SM7X_CUDA_RUN(op, x, [&](cudaStream_t s) { return rms_norm_cuda(dt, a, s); });
  else
    rms_norm_cpu(dt, a, run_parallel);
}

void fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, double eps) {
  const char* op = "fused_add_rms_norm";
  check_defined(op, {{"x", &x}, {"residual", &residual}, {"weight", &weight}});
  const DType dt = float_dtype(op, "x", x);
  // the residual in x's dtype, or float32: the residual stream kept in fp32 (a model
  // trained in bf16 run in fp16, whose residual outgrows fp16's 65504)
  const DType rt = float_dtype(op, "residual", residual);
  SM7X_CHECK(rt == dt || rt == DType::F32, op, "residual has dtype ", dtype_name(rt),
             " but x has ", dtype_name(dt), "; it must be x's dtype, or float32 to keep the "
             "residual stream in fp32");
  const int64_t hidden = check_norm_args(op, x, "residual", residual, weight, eps);
  bool same = residual.dim() == x.dim();
  for (int64_t d = 0; same && d < x.dim(); ++d) same = residual.size(d) == x.size(d);
  SM7X_CHECK(same, op, "residual has shape ", shape_str(residual), " but x has shape ",
             shape_str(x), "; they must match");
  const Rows xr = as_rows(op, "x", x, 1, true);
  const Rows rr = as_rows(op, "residual", residual, 1, true);
  check_written(op, "x", x);
  check_written(op, "residual", residual);
  check_apart(op, "x", x, "residual", residual);
  check_apart(op, "x", x, "weight", weight);
  check_apart(op, "residual", residual, "weight", weight);
  if (xr.rows == 0) return;
  FusedAddRmsNormArgs a{x.mutable_data_ptr(), residual.mutable_data_ptr(),
                        weight.const_data_ptr(), xr.rows, hidden, xr.stride, rr.stride,
                        static_cast<float>(eps)};
  if (x.is_cuda())
    SM7X_CUDA_RUN(op, x, [&](cudaStream_t s) { return fused_add_rms_norm_cuda(dt, rt, a, s); });
  else
    fused_add_rms_norm_cpu(dt, rt, a, run_parallel);
}

void silu_and_mul(Tensor out, Tensor x) {
  const char* op = "silu_and_mul";
  check_defined(op, {{"out", &out}, {"x", &x}});
  const DType dt = float_dtype(op, "x", x);
  SM7X_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension (..., 2 * d)");
  const int64_t two_d = size_at(x, -1);
  SM7X_CHECK(two_d % 2 == 0, op, "x.shape[-1] is ", two_d,
             " but must be even: x is [gate | up] along the last dimension");
  const int64_t d = two_d / 2;
  check_int32(op, "d", d);
  check_device(op, "out", out, "x", x);
  check_same_dtype(op, "out", out, "x", x);
  bool same = out.dim() == x.dim() && size_at(out, -1) == d;
  for (int64_t i = 0; same && i + 1 < x.dim(); ++i) same = out.size(i) == x.size(i);
  SM7X_CHECK(same, op, "out has shape ", shape_str(out), " but must be x.shape[:-1] + [",
             d, "] for x of shape ", shape_str(x));
  const Rows xr = as_rows(op, "x", x, 1, false);
  const Rows orow = as_rows(op, "out", out, 1, true);
  check_written(op, "out", out);
  check_apart(op, "out", out, "x", x);
  if (xr.rows == 0 || d == 0) return;
  SiluAndMulArgs a{out.mutable_data_ptr(), x.const_data_ptr(), xr.rows, d, orow.stride,
                   xr.stride};
  if (x.is_cuda())
    SM7X_CUDA_RUN(op, x, [&](cudaStream_t s) { return silu_and_mul_cuda(dt, a, s); });
  else
    silu_and_mul_cpu(dt, a, run_parallel);
}

// query or key of rotary_embedding: positions.shape + [heads * head_size] or
// positions.shape + [heads, head_size]. Returns heads and the token/head strides.
struct Heads {
  int64_t heads = 0, token_stride = 0, head_stride = 0;
};

Heads rotary_heads(const char* op, const char* name, const Tensor& t, const Tensor& positions,
                   int64_t head_size) {
  const int64_t pd = positions.dim();
  SM7X_CHECK(t.dim() == pd + 1 || t.dim() == pd + 2, op, name, " has shape ", shape_str(t),
             "; with positions of shape ", shape_str(positions), " it must be ",
             "positions.shape + [num_heads * head_size] or positions.shape + [num_heads, "
             "head_size]");
  for (int64_t d = 0; d < pd; ++d)
    SM7X_CHECK(t.size(d) == positions.size(d), op, name, ".shape[", d, "] is ", t.size(d),
               " but positions.shape[", d, "] is ", positions.size(d),
               " (one position per token); ", name, " has shape ", shape_str(t));
  Heads h;
  if (t.dim() == pd + 1) {
    const int64_t n = size_at(t, -1);
    SM7X_CHECK(n % head_size == 0, op, name, ".shape[-1] is ", n,
               ", not a multiple of head_size ", head_size);
    h.heads = n / head_size;
    h.head_stride = head_size;
    h.token_stride = as_rows(op, name, t, 1, true).stride;
  } else {
    SM7X_CHECK(size_at(t, -1) == head_size, op, name, ".shape[-1] is ", size_at(t, -1),
               " but head_size is ", head_size);
    h.heads = size_at(t, -2);
    h.head_stride = size_at(t, -2) > 1 ? stride_at(t, -2) : head_size;
    const Rows r = as_rows(op, name, t, 2, false);
    h.token_stride = r.stride;
    SM7X_CHECK(h.heads <= 1 || h.head_stride >= head_size, op, name, " (shape ",
               shape_str(t), ", strides ", strides_str(t), ") has overlapping heads; call ",
               name, ".contiguous() first");
  }
  return h;
}

void rotary_embedding(Tensor positions, Tensor query, std::optional<Tensor> key,
                      int64_t head_size, Tensor cos_sin_cache, bool is_neox) {
  const char* op = "rotary_embedding";
  check_defined(op, {{"positions", &positions}, {"query", &query},
                     {"cos_sin_cache", &cos_sin_cache}});
  if (key.has_value()) check_defined(op, {{"key", &*key}});
  const DType dt = float_dtype(op, "query", query);
  const IType pt = index_dtype(op, "positions", positions);
  SM7X_CHECK(head_size > 0, op, "head_size must be > 0, got ", head_size);
  SM7X_CHECK(positions.dim() == 1 || positions.dim() == 2, op,
             "positions must be [num_tokens] or [batch, seq_len], got shape ",
             shape_str(positions));
  check_contiguous(op, "positions", positions);
  check_device(op, "positions", positions, "query", query);
  check_device(op, "cos_sin_cache", cos_sin_cache, "query", query);
  const DType ct = float_dtype(op, "cos_sin_cache", cos_sin_cache);
  SM7X_CHECK(ct == dt || ct == DType::F32, op, "cos_sin_cache has dtype ", dtype_name(ct),
             " but query has dtype ", dtype_name(dt), "; the cache must have the query's dtype "
             "or float32 (cast it with .to(query.dtype))");
  check_dim(op, "cos_sin_cache", cos_sin_cache, 2, "[max_position, rot_dim]");
  const int64_t max_pos = cos_sin_cache.size(0), rot_dim = cos_sin_cache.size(1);
  // every position would be outside an empty cache (on CUDA those tokens are skipped)
  SM7X_CHECK(max_pos > 0, op, "cos_sin_cache has no rows (shape ", shape_str(cos_sin_cache),
             "): it must hold one [cos | sin] row per position");
  SM7X_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_size, op,
             "cos_sin_cache.shape[1] (rot_dim = ", rot_dim, ") must be even, > 0 and <= "
             "head_size (", head_size, "): each row is [cos | sin] of rot_dim / 2 each");
  const Rows cr = as_rows(op, "cos_sin_cache", cos_sin_cache, 1, false);
  const Heads q = rotary_heads(op, "query", query, positions, head_size);
  Heads k;
  void* key_ptr = nullptr;
  if (key.has_value()) {
    const Tensor& kt = *key;
    check_device(op, "key", kt, "query", query);
    check_same_dtype(op, "key", kt, "query", query);
    k = rotary_heads(op, "key", kt, positions, head_size);
  }
  check_written(op, "query", query);
  check_apart(op, "query", query, "positions", positions);
  check_apart(op, "query", query, "cos_sin_cache", cos_sin_cache);
  if (key.has_value()) {
    check_written(op, "key", *key);
    check_apart(op, "query", query, "key", *key);
    check_apart(op, "key", *key, "positions", positions);
    check_apart(op, "key", *key, "cos_sin_cache", cos_sin_cache);
  }
  const int64_t tokens = positions.numel();
  check_int32(op, "number of heads", q.heads + k.heads);
  if (tokens == 0 || q.heads + k.heads == 0) return;
  if (key.has_value()) key_ptr = key->mutable_data_ptr();
  RotaryArgs a{positions.const_data_ptr(), query.mutable_data_ptr(), key_ptr,
               cos_sin_cache.const_data_ptr(), tokens, q.heads, k.heads, head_size, rot_dim,
               max_pos, q.token_stride, q.head_stride, k.token_stride, k.head_stride,
               cr.stride, is_neox};
  if (query.is_cuda()) {
    SM7X_CUDA_RUN(op, query,
                  [&](cudaStream_t s) { return rotary_embedding_cuda(dt, ct, pt, a, s); });
  } else {
    // Positions index the cache: check them (on CUDA the kernel skips bad ones instead
    // of syncing to check).
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t p = pt == IType::I64 ? static_cast<const int64_t*>(a.positions)[t]
                                         : static_cast<const int32_t*>(a.positions)[t];
      SM7X_CHECK(p >= 0 && p < max_pos, op, "positions[", t, "] = ", p,
                 " is outside the cos_sin_cache (max_position ", max_pos, ")");
    }
    rotary_embedding_cpu(dt, ct, pt, a, run_parallel);
  }
}

// vLLM's kv_cache_dtype strings: what the caches hold ("fp8" is E4M3, as in vLLM).
KvCache kv_cache_kind(const char* op, const std::string& s) {
  if (s == "auto") return KvCache::Same;
  if (s == "fp8" || s == "fp8_e4m3") return KvCache::Fp8E4M3;
  if (s == "fp8_e5m2") return KvCache::Fp8E5M2;
  if (s == "int8_per_token_head") return KvCache::Int8;
  SM7X_CHECK(false, op, "kv_cache_dtype '", s, "' is not one of 'auto', 'fp8', 'fp8_e4m3', "
             "'fp8_e5m2', 'int8_per_token_head'");
  return KvCache::Same;
}

// An fp8 cache is 1 byte per element: uint8 (as vLLM allocates it) or the float8 dtype
// of its format.
void check_fp8_cache(const char* op, const char* name, const Tensor& t, KvCache kind) {
  const ScalarType s = t.scalar_type();
  if (kind == KvCache::Int8) {
    SM7X_CHECK(s == ScalarType::Char, op, name, " has dtype ", scalar_name(s), " but "
               "kv_cache_dtype 'int8_per_token_head' stores int8 codes: allocate it as torch.int8");
    return;
  }
  const bool e4m3 = kind == KvCache::Fp8E4M3;
  const ScalarType own = e4m3 ? ScalarType::Float8_e4m3fn : ScalarType::Float8_e5m2;
  SM7X_CHECK(s == ScalarType::Byte || s == own, op, name, " has dtype ", scalar_name(s),
             " but kv_cache_dtype '", e4m3 ? "fp8_e4m3" : "fp8_e5m2", "' stores 1-byte codes: "
             "allocate it as torch.uint8 or ", e4m3 ? "torch.float8_e4m3fn" : "torch.float8_e5m2");
}

// The scale of an fp8 cache: one float32 on the cache's device (read there: no sync).
const float* fp8_scale(const char* op, const char* name, const std::optional<Tensor>& t,
                       const Tensor& cache) {
  SM7X_CHECK(t.has_value() && t->defined(), op, name, " is required with an fp8 kv_cache_dtype: "
             "a float32 tensor of one element (the cache stores round(value / ", name, "))");
  SM7X_CHECK(t->scalar_type() == ScalarType::Float, op, name, " has dtype ",
             scalar_name(t->scalar_type()), "; it must be float32");
  SM7X_CHECK(t->numel() == 1, op, name, " has ", t->numel(), " elements (shape ",
             shape_str(*t), "); it must have one (a per-tensor scale)");
  check_device(op, name, *t, "the caches", cache);
  if (t->is_cpu()) {
    const float v = *static_cast<const float*>(t->const_data_ptr());
    SM7X_CHECK(std::isfinite(v) && v > 0.0f, op, name, " is ", v, "; a scale must be finite "
               "and positive");
  }
  return static_cast<const float*>(t->const_data_ptr());
}

// An int8 cache's scale cache: float32 [num_blocks, block_size, kv_heads] on the cache's
// device, any strides (vLLM's are views into the padding of its cache rows).
float* int8_scale_cache(const char* op, const char* name, std::optional<Tensor>& t,
                        const Tensor& cache) {
  SM7X_CHECK(t.has_value() && t->defined(), op, name, " is required with kv_cache_dtype "
             "'int8_per_token_head': a float32 tensor [num_blocks, block_size, num_kv_heads] "
             "that receives each cached row's scale");
  check_device(op, name, *t, "key_cache", cache);
  SM7X_CHECK(t->scalar_type() == ScalarType::Float, op, name, " has dtype ",
             scalar_name(t->scalar_type()), "; it must be float32");
  SM7X_CHECK(t->dim() == 3 && t->size(0) == cache.size(0) && t->size(1) == cache.size(1) &&
                 t->size(2) == cache.size(2), op, name, " has shape ", shape_str(*t),
             "; it must be [", cache.size(0), ", ", cache.size(1), ", ", cache.size(2),
             "] (key_cache's first three dims)");
  check_written(op, name, *t);
  return static_cast<float*>(t->mutable_data_ptr());
}

void reshape_and_cache(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache,
                       Tensor slot_mapping, std::string kv_cache_dtype,
                       std::optional<Tensor> k_scale, std::optional<Tensor> v_scale,
                       std::optional<Tensor> k_scale_cache, std::optional<Tensor> v_scale_cache) {
  const char* op = "reshape_and_cache";
  check_defined(op, {{"key", &key}, {"value", &value}, {"key_cache", &key_cache},
                     {"value_cache", &value_cache}, {"slot_mapping", &slot_mapping}});
  const DType dt = float_dtype(op, "key", key);
  const IType st = index_dtype(op, "slot_mapping", slot_mapping);
  const KvCache kind = kv_cache_kind(op, kv_cache_dtype);
  check_dim(op, "key", key, 3, "[num_tokens, num_kv_heads, head_size]");
  check_dim(op, "value", value, 3, "[num_tokens, num_kv_heads, head_size]");
  check_dim(op, "key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]");
  check_dim(op, "value_cache", value_cache, 4,
            "[num_blocks, block_size, num_kv_heads, head_size]");
  check_dim(op, "slot_mapping", slot_mapping, 1, "[num_tokens]");
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"value", &value},
                      {"key_cache", &key_cache},
                      {"value_cache", &value_cache}}) {
    check_device(op, n, *t, "key", key);
    if (kind == KvCache::Same || t == &value)
      check_same_dtype(op, n, *t, "key", key);
    else
      check_fp8_cache(op, n, *t, kind);
  }
  check_device(op, "slot_mapping", slot_mapping, "key", key);
  check_contiguous(op, "slot_mapping", slot_mapping);
  const int64_t tokens = key.size(0), heads = key.size(1), hs = key.size(2);
  const int64_t vhs = value.size(2);
  check_size(op, "value", value, 0, tokens, "num_tokens = key.shape[0]");
  check_size(op, "value", value, 1, heads, "num_kv_heads = key.shape[1]");
  check_size(op, "slot_mapping", slot_mapping, 0, tokens, "num_tokens = key.shape[0]");
  const int64_t nb = key_cache.size(0), bs = key_cache.size(1);
  SM7X_CHECK(bs > 0, op, "key_cache has block_size 0 (shape ", shape_str(key_cache), ")");
  SM7X_CHECK(nb > 0, op, "key_cache has no blocks (shape ", shape_str(key_cache),
             "): every slot would be outside it");
  check_size(op, "key_cache", key_cache, 2, heads, "num_kv_heads = key.shape[1]");
  check_size(op, "key_cache", key_cache, 3, hs, "head_size = key.shape[2]");
  check_size(op, "value_cache", value_cache, 0, nb, "num_blocks = key_cache.shape[0]");
  check_size(op, "value_cache", value_cache, 1, bs, "block_size = key_cache.shape[1]");
  check_size(op, "value_cache", value_cache, 2, heads, "num_kv_heads = key.shape[1]");
  check_size(op, "value_cache", value_cache, 3, vhs, "head_size = value.shape[2]");
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"key", &key}, {"value", &value},
                      {"key_cache", &key_cache}, {"value_cache", &value_cache}})
    SM7X_CHECK(size_at(*t, -1) <= 1 || stride_at(*t, -1) == 1, op, n, " (shape ", shape_str(*t),
               ", strides ", strides_str(*t), ") must have a contiguous last dimension; "
               "call ", n, ".contiguous() first");
  check_int32(op, "num_kv_heads * (key + value head size)", heads * (hs + vhs));
  check_written(op, "key_cache", key_cache);
  check_written(op, "value_cache", value_cache);
  check_apart(op, "key_cache", key_cache, "value_cache", value_cache);
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"key", &key}, {"value", &value},
                      {"slot_mapping", &slot_mapping}}) {
    check_apart(op, "key_cache", key_cache, n, *t);
    check_apart(op, "value_cache", value_cache, n, *t);
  }
  const bool fp8 = kind == KvCache::Fp8E4M3 || kind == KvCache::Fp8E5M2;
  const float* ks = fp8 ? fp8_scale(op, "k_scale", k_scale, key_cache) : nullptr;
  const float* vs = fp8 ? fp8_scale(op, "v_scale", v_scale, key_cache) : nullptr;
  float* ksc = nullptr;
  float* vsc = nullptr;
  if (kind == KvCache::Int8) {
    ksc = int8_scale_cache(op, "k_scale_cache", k_scale_cache, key_cache);
    vsc = int8_scale_cache(op, "v_scale_cache", v_scale_cache, key_cache);
    check_apart(op, "k_scale_cache", *k_scale_cache, "v_scale_cache", *v_scale_cache);
    for (auto [n, t] : {std::pair<const char*, const Tensor*>{"key", &key}, {"value", &value},
                        {"key_cache", &key_cache}, {"value_cache", &value_cache},
                        {"slot_mapping", &slot_mapping}}) {
      check_apart(op, "k_scale_cache", *k_scale_cache, n, *t);
      check_apart(op, "v_scale_cache", *v_scale_cache, n, *t);
    }
  } else {
    SM7X_CHECK(!k_scale_cache.has_value() && !v_scale_cache.has_value(), op,
               "k_scale_cache / v_scale_cache apply to kv_cache_dtype 'int8_per_token_head' only");
  }
  if (tokens == 0 || heads == 0) return;
  if (key_cache.is_cpu()) {
    const int64_t nslots = nb * bs;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t s = st == IType::I64 ? static_cast<const int64_t*>(slot_mapping.const_data_ptr())[t]
                                         : static_cast<const int32_t*>(slot_mapping.const_data_ptr())[t];
      SM7X_CHECK(s < nslots, op, "slot_mapping[", t, "] = ", s, " is outside the cache (",
                 nb, " blocks x ", bs, " slots = ", nslots, " slots; negative slots mark "
                 "padding tokens and are skipped)");
    }
  }
  ReshapeAndCacheArgs a{key.const_data_ptr(), value.const_data_ptr(),
                        key_cache.mutable_data_ptr(), value_cache.mutable_data_ptr(),
                        slot_mapping.const_data_ptr(), tokens, heads, hs, vhs, nb, bs,
                        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                        kind, ks, vs, ksc, vsc};
  if (kind == KvCache::Int8) {
    a.ks_b = k_scale_cache->stride(0), a.ks_o = k_scale_cache->stride(1), a.ks_h = k_scale_cache->stride(2);
    a.vs_b = v_scale_cache->stride(0), a.vs_o = v_scale_cache->stride(1), a.vs_h = v_scale_cache->stride(2);
  }
  if (key.is_cuda())
    SM7X_CUDA_RUN(op, key, [&](cudaStream_t s) { return reshape_and_cache_cuda(dt, st, a, s); });
  else
    reshape_and_cache_cpu(dt, st, a, run_parallel);
}

}  // namespace
}  // namespace core
}  // namespace sm7x

// Schemas follow vLLM's _C ops (out-params and in-place, nothing returned), so the
// kernels can back vLLM-style layers directly.
STABLE_TORCH_LIBRARY(sm7x, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype=\"auto\", "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor(c!)? k_scale_cache=None, "
      "Tensor(d!)? v_scale_cache=None) -> ()");
}

// One implementation per op serves both keys: it validates, then branches on the device.
#define SM7X_IMPLS(m)                                                          \
  m.impl("rms_norm", TORCH_BOX(&sm7x::core::rms_norm));                        \
  m.impl("fused_add_rms_norm", TORCH_BOX(&sm7x::core::fused_add_rms_norm));    \
  m.impl("silu_and_mul", TORCH_BOX(&sm7x::core::silu_and_mul));                \
  m.impl("rotary_embedding", TORCH_BOX(&sm7x::core::rotary_embedding));        \
  m.impl("reshape_and_cache", TORCH_BOX(&sm7x::core::reshape_and_cache))

STABLE_TORCH_LIBRARY_IMPL(sm7x, CPU, m) { SM7X_IMPLS(m); }
STABLE_TORCH_LIBRARY_IMPL(sm7x, CUDA, m) { SM7X_IMPLS(m); }
