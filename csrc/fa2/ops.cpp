// The op layer of sm7x's FlashAttention-2 for Turing (_fa2_sm75.abi3.so) and
// Volta (_fa2_sm70.abi3.so): schemas, validation, device/stream handling and dispatch to
// the kernels (fa2.h).
// Written against torch's stable ABI only (TORCH_TARGET_VERSION of the torch floor,
// targets.json torch.min), like csrc/core: one build loads in every torch from it up. Each library of the FA2 family registers its
// own namespace (sm7x_fa2_sm75, sm7x_fa2_sm70: SM7X_FA2_NAMESPACE below), so the sm70
// and sm75 libraries can share a process.
//
// Every failed check throws (FA2_CHECK, ../core/check.h), which torch turns into a Python
// RuntimeError with the message: it names the op and argument, what was found and the fix.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>

#include "../core/check.h"
#include "../core/cuda_stream.h"
#include "../core/tensor_text.h"
#include "fa2.h"

// The library's arch (messages) and op namespace: one ops.cpp for every library of the
// family, compiled once per library with its own definitions (csrc/fa2/CMakeLists.txt).
#if !defined(SM7X_FA2_ARCH) || !defined(SM7X_FA2_NAMESPACE)
#error "SM7X_FA2_ARCH and SM7X_FA2_NAMESPACE must be defined (csrc/fa2/CMakeLists.txt does)"
#endif
// Indirection so that SM7X_FA2_NAMESPACE is expanded before torch's macros paste it.
#define SM7X_FA2_LIBRARY(ns, m) STABLE_TORCH_LIBRARY(ns, m)
#define SM7X_FA2_LIBRARY_IMPL(ns, k, m) STABLE_TORCH_LIBRARY_IMPL(ns, k, m)

namespace sm7x {
namespace fa2 {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

std::atomic<bool> g_check_inputs{true};  // set_input_checks

// "sm7x.fa2_sm75.<op>: <what>" (../core/check.h: no source path or line in messages)
#define FA2_CHECK(cond, op, ...)                                          \
  do {                                                                    \
    if (!(cond)) ::sm7x::fail_in("fa2_" SM7X_FA2_ARCH, op, __VA_ARGS__);  \
  } while (0)


std::string device_str(const Tensor& t) {
  return t.is_cuda() ? "cuda:" + std::to_string(t.get_device_index()) : std::string("cpu");
}

// Every tensor on q's device. Whether that is a CUDA device is checked once, by
// require_cuda after all the other checks of the op: so the op's messages about shapes,
// dtypes and layouts are the same on CPU tensors (which the CPU registration gets, and
// which CI without a GPU can test) as on CUDA ones.
void check_cuda(const char* op, const char* name, const Tensor& t, const Tensor& q) {
  FA2_CHECK(t.is_cuda() == q.is_cuda() && t.get_device_index() == q.get_device_index(), op,
            name, " is on ", device_str(t), " but q is on ", device_str(q),
            "; move all tensors to one device");
}

void require_cuda(const char* op, const Tensor& q) {
  FA2_CHECK(q.is_cuda(), op, "q must be a CUDA tensor (sm7x FA2 runs on the GPU only)");
}

void check_half(const char* op, const char* name, const Tensor& t) {
  FA2_CHECK(t.scalar_type() == ScalarType::Half, op, name, " has dtype ",
            scalar_name(t.scalar_type()),
            "; sm7x FA2 supports float16 only (Volta/Turing have no bf16 tensor cores): "
            "cast with .half()");
}

// Data 16-byte aligned and every stride but the last a multiple of `multiple` elements
// (size-1 dims aside).
bool aligned(const Tensor& t, int64_t multiple, int64_t data_align = 16) {
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % data_align == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ok = ok && (t.size(d) <= 1 || t.stride(d) % multiple == 0);
  return ok;
}

// Last dim contiguous, other strides multiples of 8 elements, data 16-byte aligned: the
// kernels read and write 16-byte chunks.
void check_layout(const char* op, const char* name, const Tensor& t) {
  const int64_t last = t.dim() - 1;
  FA2_CHECK(t.stride(last) == 1 || t.size(last) <= 1, op, name, " (shape ", shape_str(t),
            ", strides ", strides_str(t), ") must have a contiguous last dimension; call ",
            name, ".contiguous() first");
  FA2_CHECK(aligned(t, 8), op, name, " (shape ", shape_str(t), ", strides ", strides_str(t),
            ") must be 16-byte aligned with strides that are multiples of 8 elements; call ",
            name, ".contiguous() first");
}

void check_int32(const char* op, const char* what, int64_t v) {
  FA2_CHECK(v <= std::numeric_limits<int32_t>::max(), op, what, " is ", v,
            ", larger than the kernels support (2^31 - 1)");
}

// "32, 64, ...": the compiled head dims, for messages.
std::string head_dims_text() {
  std::string text;
  for (int d : kCompiledHeadDims) text += (text.empty() ? "" : ", ") + std::to_string(d);
  return text;
}

// A head dim the kernels run, and query heads a multiple of the kv heads (GQA/MQA).
// How to run a head dim no kernel takes: the next multiple that one does (message only).
std::string pad_hint(int64_t hd) {
  const int64_t up = (hd + kHeadDimMultiple - 1) / kHeadDimMultiple * kHeadDimMultiple;
  if (hd <= 0 || up > kMaxHeadDim) return "";
  return "; or zero-pad q, k, v to " + std::to_string(up) + ", pass softmax_scale=" +
         std::to_string(hd) + "**-0.5 and slice the output back to " + std::to_string(hd);
}

void check_heads(const char* op, int64_t hd, int64_t heads, int64_t kv_heads) {
  FA2_CHECK(hd > 0 && hd % kHeadDimMultiple == 0 && hd <= kMaxHeadDim, op, "head dim ", hd,
            " is not supported: it must be a multiple of ", kHeadDimMultiple, " and at most ",
            kMaxHeadDim, " (kernels are compiled for ", head_dims_text(),
            "; other sizes run padded)", pad_hint(hd));
  FA2_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, "num_heads (", heads,
            ") must be a multiple of num_kv_heads (", kv_heads, ") for GQA/MQA");
}

struct Common {
  int heads, kv_heads, head_dim;
};

// q/k/v/out with `lead` leading dims before [heads, head_dim].
Common check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& out, int lead, const char* layout) {
  const int64_t nd = lead + 2;
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"q", &q}, {"k", &k}, {"v", &v},
                      {"out", &out}}) {
    FA2_CHECK(t->dim() == nd, op, n, " must be ", nd, "-D ", layout, ", got shape ",
              shape_str(*t));
    check_cuda(op, n, *t, q);
    check_half(op, n, *t);
  }
  const int64_t hd = q.size(nd - 1);
  FA2_CHECK(k.size(nd - 1) == hd && v.size(nd - 1) == hd, op,
            "q, k and v must have the same head dim, got q ", shape_str(q), ", k ",
            shape_str(k), ", v ", shape_str(v));
  const int64_t heads = q.size(nd - 2), kv_heads = k.size(nd - 2);
  FA2_CHECK(v.size(nd - 2) == kv_heads, op, "k has ", kv_heads, " heads but v has ",
            v.size(nd - 2), "; they must match");
  check_heads(op, hd, heads, kv_heads);
  for (int64_t d = 0; d < lead; ++d)
    FA2_CHECK(k.size(d) == v.size(d), op, "k ", shape_str(k), " and v ", shape_str(v),
              " must agree in every dim but the last");
  bool same = true;
  for (int64_t d = 0; d < nd; ++d) same = same && out.size(d) == q.size(d);
  FA2_CHECK(same, op, "out has shape ", shape_str(out), " but must have q's shape ",
            shape_str(q));
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"q", &q}, {"k", &k}, {"v", &v},
                      {"out", &out}})
    check_layout(op, n, *t);
  check_int32(op, "num_heads", heads);
  return {static_cast<int>(heads), static_cast<int>(kv_heads), static_cast<int>(hd)};
}

void check_lse(const char* op, const Tensor& lse, const Tensor& q, int64_t d0, int64_t d1,
               int64_t d2, int nd, const char* layout) {
  check_cuda(op, "lse", lse, q);
  FA2_CHECK(lse.scalar_type() == ScalarType::Float, op, "lse has dtype ",
            scalar_name(lse.scalar_type()), "; it must be float32");
  FA2_CHECK(lse.dim() == nd, op, "lse must be ", layout, ", got shape ", shape_str(lse));
  const bool ok = nd == 3 ? lse.size(0) == d0 && lse.size(1) == d1 && lse.size(2) == d2
                          : lse.size(0) == d1 && lse.size(1) == d2;
  FA2_CHECK(ok, op, "lse has shape ", shape_str(lse), " but must be ", layout);
  FA2_CHECK(lse.stride(nd - 1) == 1 || lse.size(nd - 1) <= 1, op,
            "lse must have a contiguous last dimension; pass a contiguous tensor");
}

void check_options(const char* op, double scale, int64_t wl, int64_t wr, double softcap) {
  FA2_CHECK(std::isfinite(scale) && scale > 0, op, "softmax_scale must be a finite number > 0, got ",
            scale);
  FA2_CHECK(wl >= -1 && wr >= -1, op, "window_size must be (left, right) with -1 for "
            "unbounded and values >= 0 otherwise, got (", wl, ", ", wr, ")");
  check_int32(op, "window_size[0]", wl);
  check_int32(op, "window_size[1]", wr);
  FA2_CHECK(std::isfinite(softcap) && softcap >= 0, op,
            "softcap must be a finite number >= 0 (0 = off), got ", softcap);
}

// torch's current stream on q's device (the caller holds a DeviceGuard for it).
cudaStream_t current_stream(const char* op, const Tensor& q) {
  void* s = nullptr;
  FA2_CHECK(sm7x::core::current_cuda_stream(q.get_device_index(), &s), op,
            "cannot get torch's current CUDA stream (aoti_torch_get_current_cuda_stream was "
            "not found in the loaded libtorch_cuda.so or failed); sm7x needs a CUDA build of "
            "torch >= " SM7X_TORCH_MIN);
  return static_cast<cudaStream_t>(s);
}

void launch(const char* op, const Tensor& q, const FwdParams& p) {
  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  const int err = sm7x::fa2::fwd(p, current_stream(op, q));
  FA2_CHECK(err == 0, op, "CUDA kernel launch failed: ", cuda_error_string(err));
}

// A [batch, rows, heads, dim] (lead 2) or [rows, heads, dim] (lead 1) tensor's strides in
// elements; batch 0 for the packed layout.
void strides(const Tensor& t, int lead, int64_t& batch, int64_t& row, int64_t* head) {
  batch = lead == 2 ? t.stride(0) : 0;
  row = t.stride(lead - 1);
  if (head != nullptr) *head = t.stride(lead);
}

// What both ops fill alike: pointers, strides (lead == 2: [batch, rows, heads, dim];
// lead == 1: [rows, heads, dim]) and sizes. The caller adds the sequence lengths, the
// LSE strides and the options.
FwdParams base_params(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& out, const Tensor& lse, const Common& c, int64_t batch,
                      int lead) {
  FA2_CHECK(batch <= 65535 && c.heads <= 65535, op, "batch (", batch, ") and num_heads (",
            c.heads, ") must be at most 65535 (CUDA grid limit)");
  FwdParams p{};
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.o = out.mutable_data_ptr();
  p.lse = static_cast<float*>(lse.mutable_data_ptr());
  strides(q, lead, p.q_batch_stride, p.q_row_stride, &p.q_head_stride);
  strides(k, lead, p.k_batch_stride, p.k_row_stride, &p.k_head_stride);
  strides(v, lead, p.v_batch_stride, p.v_row_stride, &p.v_head_stride);
  strides(out, lead, p.o_batch_stride, p.o_row_stride, &p.o_head_stride);
  p.batch = static_cast<int>(batch);
  p.heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  return p;
}

// Attention sinks: float32 [num_heads], contiguous, on q's device (one logit per query head).
const float* sinks_ptr(const char* op, const std::optional<Tensor>& sinks, const Tensor& q,
                       int64_t heads) {
  if (!sinks.has_value()) return nullptr;
  const Tensor& s = *sinks;
  check_cuda(op, "sinks", s, q);
  FA2_CHECK(s.scalar_type() == ScalarType::Float, op, "sinks has dtype ",
            scalar_name(s.scalar_type()), "; it must be float32 (cast with .float())");
  FA2_CHECK(s.dim() == 1 && s.size(0) == heads, op, "sinks must be [num_heads] = [", heads,
            "], one logit per query head, got shape ", shape_str(s));
  FA2_CHECK(s.is_contiguous(), op, "sinks must be contiguous");
  return static_cast<const float*>(s.const_data_ptr());
}

void fill_options(FwdParams& p, double scale, bool causal, int64_t wl, int64_t wr,
                  double softcap) {
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.window_left = static_cast<int>(wl);
  p.window_right = causal ? (wr < 0 ? 0 : std::min<int64_t>(wr, 0)) : static_cast<int>(wr);
}

void fwd_op(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, double softmax_scale,
            bool causal, int64_t window_left, int64_t window_right, double softcap,
            std::optional<Tensor> sinks) {
  const char* op = "fwd";
  const Common c = check_qkv(op, q, k, v, out, 2, "[batch, seqlen, num_heads, head_dim]");
  FA2_CHECK(k.size(0) == q.size(0), op, "q has batch ", q.size(0), " but k has ", k.size(0));
  const int64_t B = q.size(0), sq = q.size(1), sk = k.size(1);
  check_lse(op, lse, q, B, c.heads, sq, 3, "[batch, num_heads, seqlen_q]");
  check_options(op, softmax_scale, window_left, window_right, softcap);
  check_int32(op, "batch", B);
  check_int32(op, "seqlen_q", sq);
  check_int32(op, "seqlen_k", sk);
  const float* sink = sinks_ptr(op, sinks, q, c.heads);
  require_cuda(op, q);
  if (B == 0 || sq == 0 || c.heads == 0) return;
  FwdParams p = base_params(op, q, k, v, out, lse, c, B, 2);
  p.lse_batch_stride = lse.stride(0);
  p.lse_head_stride = lse.stride(1);
  p.seqlen_q = static_cast<int>(sq);
  p.seqlen_k = static_cast<int>(sk);
  fill_options(p, softmax_scale, causal, window_left, window_right, softcap);
  p.sinks = sink;
  launch(op, q, p);
}

// The sequence arguments of the varlen ops (fwd_varlen, bwd_varlen): cu_seqlens_q /
// cu_seqlens_k int32 [batch + 1] on q's device, the max lengths >= 0, and the token
// counts and max lengths within int32 (the kernels' index type).
void check_varlen(const char* op, const Tensor& q, const Tensor& k, const Tensor& cu_seqlens_q,
                  const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"cu_seqlens_q", &cu_seqlens_q},
                      {"cu_seqlens_k", &cu_seqlens_k}}) {
    check_cuda(op, n, *t, q);
    FA2_CHECK(t->scalar_type() == ScalarType::Int, op, n, " has dtype ",
              scalar_name(t->scalar_type()), "; it must be int32 (cast with .int())");
    FA2_CHECK(t->dim() == 1 && t->size(0) >= 1, op, n, " must be 1-D [batch + 1], got shape ",
              shape_str(*t));
    FA2_CHECK(t->is_contiguous(), op, n, " must be contiguous");
  }
  FA2_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), op, "cu_seqlens_q has ",
            cu_seqlens_q.size(0), " entries but cu_seqlens_k has ", cu_seqlens_k.size(0),
            "; both must be [batch + 1]");
  FA2_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, op, "max_seqlen_q/max_seqlen_k must be >= 0");
  check_int32(op, "total_q", q.size(0));
  check_int32(op, "total_k", k.size(0));
  check_int32(op, "max_seqlen_q", max_seqlen_q);
  check_int32(op, "max_seqlen_k", max_seqlen_k);
}

// What the varlen ops fill alike once checked: the LSE [num_heads, total_q] strides, the
// cu_seqlens pointers and the grid's max lengths.
void fill_varlen(FwdParams& p, const Tensor& lse, const Tensor& cu_seqlens_q,
                 const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  p.lse_batch_stride = 0;
  p.lse_head_stride = lse.stride(0);
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q.const_data_ptr());
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_seqlens_k.const_data_ptr());
  p.seqlen_q = static_cast<int>(max_seqlen_q);
  p.seqlen_k = static_cast<int>(max_seqlen_k);
}

void fwd_varlen_op(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q,
                   Tensor cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                   double softmax_scale, bool causal, int64_t window_left,
                   int64_t window_right, double softcap, std::optional<Tensor> sinks) {
  const char* op = "fwd_varlen";
  const Common c = check_qkv(op, q, k, v, out, 1, "[total_tokens, num_heads, head_dim]");
  const int64_t total_q = q.size(0);
  check_lse(op, lse, q, 0, c.heads, total_q, 2, "[num_heads, total_q]");
  check_varlen(op, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_options(op, softmax_scale, window_left, window_right, softcap);
  const int64_t B = cu_seqlens_q.size(0) - 1;
  const float* sink = sinks_ptr(op, sinks, q, c.heads);
  require_cuda(op, q);
  if (B == 0 || max_seqlen_q == 0 || total_q == 0 || c.heads == 0) return;
  FwdParams p = base_params(op, q, k, v, out, lse, c, B, 1);
  fill_varlen(p, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  fill_options(p, softmax_scale, causal, window_left, window_right, softcap);
  p.sinks = sink;
  launch(op, q, p);
}


// ---- Backward: dq, dk, dv from dout and the forward's q, k, v, out, lse.

// A tensor with exactly ref's shape (named for the message).
void check_same_shape(const char* op, const char* name, const Tensor& t, const char* ref_name,
                      const Tensor& ref) {
  bool same = t.dim() == ref.dim();
  for (int64_t d = 0; same && d < t.dim(); ++d) same = t.size(d) == ref.size(d);
  FA2_CHECK(same, op, name, " has shape ", shape_str(t), " but must have ", ref_name,
            "'s shape ", shape_str(ref));
}

// dout, dq like q; dk like k; dv like v (fp16, same layout rules); dq_accum fp32
// contiguous like q, or empty where this call does not sum dQ in it (deterministic, or a
// head dim whose dQ comes from the dQ kernel: bwd_uses_dq_accum); dsum fp32 like lse.
void check_grads(const char* op, const Tensor& dout, const Tensor& q, const Tensor& k,
                 const Tensor& v, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                 const Tensor& dv, const Tensor& dq_accum, const Tensor& dsum,
                 bool deterministic) {
  for (auto [n, t, rn, r] : {std::tuple<const char*, const Tensor*, const char*, const Tensor*>{
                                 "dout", &dout, "q", &q},
                             {"dq", &dq, "q", &q}, {"dk", &dk, "k", &k}, {"dv", &dv, "v", &v}}) {
    check_cuda(op, n, *t, q);
    check_half(op, n, *t);
    check_same_shape(op, n, *t, rn, *r);
    check_layout(op, n, *t);
  }
  const int64_t hd = q.size(q.dim() - 1);
  const bool uses_accum = !deterministic && bwd_uses_dq_accum(static_cast<int>(hd));
  FA2_CHECK(!uses_accum || dq_accum.numel() != 0, op, "dq_accum is empty, but head dim ", hd,
            " sums dQ in it when deterministic=False: pass a float32 tensor shaped like q "
            "(bwd_uses_dq_accum(", hd, ") says which head dims need one)");
  if (uses_accum) {
    check_cuda(op, "dq_accum", dq_accum, q);
    FA2_CHECK(dq_accum.scalar_type() == ScalarType::Float, op, "dq_accum has dtype ",
              scalar_name(dq_accum.scalar_type()), "; it must be float32");
    check_same_shape(op, "dq_accum", dq_accum, "q", q);
    FA2_CHECK(dq_accum.is_contiguous(), op, "dq_accum (strides ", strides_str(dq_accum),
              ") must be contiguous");
    FA2_CHECK(reinterpret_cast<uintptr_t>(dq_accum.const_data_ptr()) % 16 == 0, op,
              "dq_accum must be 16-byte aligned (allocate it with torch.empty)");
  }
  check_cuda(op, "dsum", dsum, q);
  FA2_CHECK(dsum.scalar_type() == ScalarType::Float, op, "dsum has dtype ",
            scalar_name(dsum.scalar_type()), "; it must be float32");
  check_same_shape(op, "dsum", dsum, "lse", lse);
  FA2_CHECK(dsum.stride(dsum.dim() - 1) == 1 || dsum.size(dsum.dim() - 1) <= 1, op,
            "dsum must have a contiguous last dimension; pass a contiguous tensor");
}

// The head dim must have a backward kernel in this library (kHasBwd).
void check_bwd_head_dim(const char* op, int hd) {
  FA2_CHECK(kHasBwd, op, "the FlashAttention-2 backward is not yet supported on ",
            SM7X_FA2_ARCH, " (this library has forward kernels only); compute gradients "
            "with torch.nn.functional.scaled_dot_product_attention instead");
  FA2_CHECK(bwd_supported(hd), op, "head dim ", hd, " has no backward kernel on ",
            SM7X_FA2_ARCH, " (compiled head dims: ", head_dims_text(), ")");
}

// What both backward ops fill alike (lead as in base_params).
BwdParams bwd_params(const char* op, const Tensor& dout, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, const Tensor& dq_accum,
                     const Tensor& dsum, const Common& c, int64_t batch, int lead) {
  BwdParams p{};
  static_cast<FwdParams&>(p) = base_params(op, q, k, v, out, lse, c, batch, lead);
  FA2_CHECK(c.kv_heads <= 65535, op, "num_kv_heads (", c.kv_heads,
            ") must be at most 65535 (CUDA grid limit)");
  p.dout = dout.const_data_ptr();
  p.dq = dq.mutable_data_ptr();
  p.dk = dk.mutable_data_ptr();
  p.dv = dv.mutable_data_ptr();
  p.dq_accum = static_cast<float*>(dq_accum.mutable_data_ptr());
  p.dsum = static_cast<float*>(dsum.mutable_data_ptr());
  strides(dout, lead, p.do_batch_stride, p.do_row_stride, &p.do_head_stride);
  strides(dq, lead, p.dq_batch_stride, p.dq_row_stride, &p.dq_head_stride);
  strides(dk, lead, p.dk_batch_stride, p.dk_row_stride, &p.dk_head_stride);
  strides(dv, lead, p.dv_batch_stride, p.dv_row_stride, &p.dv_head_stride);
  // (an unused dq_accum may be empty: check_grads)
  if (dq_accum.dim() == q.dim())
    strides(dq_accum, lead, p.acc_batch_stride, p.acc_row_stride, nullptr);  // heads: head_dim
  return p;
}

void launch_bwd(const char* op, const Tensor& q, BwdParams& p, bool deterministic) {
  p.deterministic = deterministic;
  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  const int err = sm7x::fa2::bwd(p, current_stream(op, q));
  FA2_CHECK(err == 0, op, "CUDA kernel launch failed: ", cuda_error_string(err));
}

void bwd_op(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dq,
            Tensor dk, Tensor dv, Tensor dq_accum, Tensor dsum, double softmax_scale,
            bool causal, int64_t window_left, int64_t window_right, double softcap,
            bool deterministic) {
  const char* op = "bwd";
  const Common c = check_qkv(op, q, k, v, out, 2, "[batch, seqlen, num_heads, head_dim]");
  FA2_CHECK(k.size(0) == q.size(0), op, "q has batch ", q.size(0), " but k has ", k.size(0));
  const int64_t B = q.size(0), sq = q.size(1), sk = k.size(1);
  check_lse(op, lse, q, B, c.heads, sq, 3, "[batch, num_heads, seqlen_q]");
  check_grads(op, dout, q, k, v, lse, dq, dk, dv, dq_accum, dsum, deterministic);
  check_options(op, softmax_scale, window_left, window_right, softcap);
  check_bwd_head_dim(op, c.head_dim);
  check_int32(op, "batch", B);
  check_int32(op, "seqlen_q", sq);
  check_int32(op, "seqlen_k", sk);
  check_int32(op, "batch * seqlen_q", B * sq);
  require_cuda(op, q);
  if (B == 0 || c.heads == 0) return;
  BwdParams p = bwd_params(op, dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, c, B, 2);
  p.lse_batch_stride = lse.stride(0);
  p.lse_head_stride = lse.stride(1);
  p.dsum_batch_stride = dsum.stride(0);
  p.dsum_head_stride = dsum.stride(1);
  p.seqlen_q = static_cast<int>(sq);
  p.seqlen_k = static_cast<int>(sk);
  p.total_q = static_cast<int>(B * sq);
  fill_options(p, softmax_scale, causal, window_left, window_right, softcap);
  launch_bwd(op, q, p, deterministic);
}

void bwd_varlen_op(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                   Tensor dq, Tensor dk, Tensor dv, Tensor dq_accum, Tensor dsum,
                   Tensor cu_seqlens_q, Tensor cu_seqlens_k, int64_t max_seqlen_q,
                   int64_t max_seqlen_k, double softmax_scale, bool causal,
                   int64_t window_left, int64_t window_right, double softcap,
                   bool deterministic) {
  const char* op = "bwd_varlen";
  const Common c = check_qkv(op, q, k, v, out, 1, "[total_tokens, num_heads, head_dim]");
  const int64_t total_q = q.size(0);
  check_lse(op, lse, q, 0, c.heads, total_q, 2, "[num_heads, total_q]");
  check_grads(op, dout, q, k, v, lse, dq, dk, dv, dq_accum, dsum, deterministic);
  check_varlen(op, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_options(op, softmax_scale, window_left, window_right, softcap);
  check_bwd_head_dim(op, c.head_dim);
  const int64_t B = cu_seqlens_q.size(0) - 1;
  require_cuda(op, q);
  if (B == 0 || c.heads == 0) return;
  BwdParams p = bwd_params(op, dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, c, B, 1);
  fill_varlen(p, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  p.dsum_batch_stride = 0;
  p.dsum_head_stride = dsum.stride(0);
  p.total_q = static_cast<int>(total_q);
  fill_options(p, softmax_scale, causal, window_left, window_right, softcap);
  launch_bwd(op, q, p, deterministic);
}

bool bwd_supported_op(int64_t head_dim) {
  return head_dim > 0 && head_dim <= kMaxHeadDim &&
         sm7x::fa2::bwd_supported(static_cast<int>(head_dim));
}

bool bwd_uses_dq_accum_op(int64_t head_dim) {
  return bwd_supported_op(head_dim) && sm7x::fa2::bwd_uses_dq_accum(static_cast<int>(head_dim));
}

// ---- Serving: q against a paged or contiguous KV cache, packed GQA rows, split-KV.

void check_index(const char* op, const char* name, const Tensor& t, const Tensor& q,
                 int64_t rows, int64_t cols) {
  check_cuda(op, name, t, q);
  FA2_CHECK(t.scalar_type() == ScalarType::Int, op, name, " has dtype ",
            scalar_name(t.scalar_type()), "; it must be int32 (cast with .int())");
  const bool shape_ok = cols < 0 ? t.dim() == 1 && t.size(0) == rows
                                 : t.dim() == 2 && t.size(0) == rows && t.size(1) == cols;
  FA2_CHECK(shape_ok, op, name, " has shape ", shape_str(t), " but must be [", rows,
            cols < 0 ? "" : ", ", cols < 0 ? "" : std::to_string(cols), "]");
  FA2_CHECK(t.stride(t.dim() - 1) == 1 || t.size(t.dim() - 1) <= 1, op, name,
            " must have a contiguous last dimension; pass ", name, ".contiguous()");
}

const int32_t* index_ptr(const std::optional<Tensor>& t) {
  return t.has_value() ? static_cast<const int32_t*>(t->const_data_ptr()) : nullptr;
}

// What validate_serving found, as the argument and the fix.
void fail_serving(const char* op, const int bad[4], const FwdParams& p) {
  const int seq = bad[1], idx = bad[2], val = bad[3];
  switch (bad[0]) {
    case 1:
      FA2_CHECK(false, op, "block_table[", seq, ", ", idx, "] = ", val, " is not a page of "
                "k_cache/v_cache, which hold ", p.num_pages, " blocks: every page a sequence "
                "uses (the first ceil(seqlen / page_size) entries of its row) must be in [0, ",
                p.num_pages, ")");
    case 2:
      FA2_CHECK(false, op, "sequence ", seq, " has ", val, " keys (seqused_k / cache_seqlens",
                p.seqused_add ? " plus the appended tokens" : "", ") but the cache holds at most ",
                p.kv_capacity, " per sequence (",
                p.block_table ? "block_table columns x page_size" : "k_cache.shape[1]",
                "); lengths must be in [0, ", p.kv_capacity, "]");
    case 3:
      FA2_CHECK(false, op, "cu_seqlens_q[", idx, "] = ", val, " is inconsistent: it must start "
                "at 0, never decrease, hold no sequence longer than max_seqlen_q (", p.seqlen_q,
                ") and end at q's token count (", p.total_q, ")");
    case 4:
      FA2_CHECK(false, op, "cache_leftpad[", seq, "] = ", val, " is outside [0, the sequence's "
                "key count]");
    case 5:
      FA2_CHECK(false, op, "cache_batch_idx[", seq, "] = ", val, " is not a row of k_cache, "
                "which has ", p.num_pages, "; entries must be in [0, ", p.num_pages, ")");
    case 6:
      FA2_CHECK(false, op, "the split plan (partitions / split_offsets) is inconsistent at "
                "sequence ", seq, " (entry ", idx, " = ", val, "); make it with "
                "sm7x.fa2.plan_decode for this batch");
    case 7:
      FA2_CHECK(false, op, "sequence ", seq, " has ", val, " keys but the call was planned for "
                "at most ", idx, " (max_seqlen_k, or plan_decode's max_seqlen_k): pass a bound "
                "that holds every sequence");
    default:
      FA2_CHECK(false, op, "input check failed (code ", bad[0], ")");
  }
}

// The cache dtype against kv_format (fa2.h KvFormat): fp16, or one-byte codes as
// float8_e4m3fn / float8_e5m2, or uint8 (vLLM's fp8 caches) with the format named.
// Descales: float32 on q's device, one value or one per (sequence, kv head), broadcast:
// shape [], [1], [kv_heads] or [batch or 1, kv_heads or 1].
void check_kv_format(const char* op, int64_t kv_format, const Tensor& k_cache,
                     const Tensor& v_cache, const std::optional<Tensor>& k_descale,
                     const std::optional<Tensor>& v_descale, const Tensor& q, int64_t batch) {
  FA2_CHECK(kv_format >= kKvF16 && kv_format <= kKvInt8, op, "kv_format must be 0 (float16), "
            "1 (fp8 e4m3), 2 (fp8 e5m2) or 3 (int8 with row scales), got ", kv_format);
  FA2_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), op, "k_cache has dtype ",
            scalar_name(k_cache.scalar_type()), " but v_cache ",
            scalar_name(v_cache.scalar_type()), "; both caches must have one dtype");
  const ScalarType t = k_cache.scalar_type();
  const char* names[] = {"float16", "fp8 e4m3", "fp8 e5m2", "int8"};
  const bool ok = kv_format == kKvF16    ? t == ScalarType::Half
                  : kv_format == kKvInt8 ? t == ScalarType::Char
                                         : t == ScalarType::Byte ||
                                               t == (kv_format == kKvE4M3
                                                         ? ScalarType::Float8_e4m3fn
                                                         : ScalarType::Float8_e5m2);
  FA2_CHECK(ok, op, "the KV cache has dtype ", scalar_name(t), " but kv_format is ",
            names[kv_format], "; caches are float16, float8_e4m3fn or float8_e5m2 (or uint8 "
            "holding fp8 codes, with the format named), or int8 with row scales");
  const int64_t kv_heads = k_cache.size(2);
  if (kv_format == kKvInt8) {
    // the scale of every cached row: [num_blocks, page_size, kv_heads] (paged) or
    // [batch_cache, seqlen_cache, kv_heads], any strides (vLLM's are views into the cache)
    for (auto [n, d] : {std::pair<const char*, const std::optional<Tensor>*>{"k_scale_cache", &k_descale},
                        {"v_scale_cache", &v_descale}}) {
      FA2_CHECK(d->has_value(), op, "an int8 cache needs ", n, " (float32 [", k_cache.size(0),
                ", ", k_cache.size(1), ", ", kv_heads, "]: the scale of each cached row)");
      const Tensor& x = **d;
      check_cuda(op, n, x, q);
      FA2_CHECK(x.scalar_type() == ScalarType::Float, op, n, " has dtype ",
                scalar_name(x.scalar_type()), "; scale caches are float32");
      FA2_CHECK(x.dim() == 3 && x.size(0) == k_cache.size(0) && x.size(1) == k_cache.size(1) &&
                    x.size(2) == kv_heads, op, n, " has shape ", shape_str(x), "; it must be [",
                k_cache.size(0), ", ", k_cache.size(1), ", ", kv_heads, "] (the cache's first "
                "three dims: one scale per cached row and kv head)");
    }
    return;
  }
  for (auto [n, d] : {std::pair<const char*, const std::optional<Tensor>*>{"k_descale", &k_descale},
                      {"v_descale", &v_descale}}) {
    if (!d->has_value()) continue;
    const Tensor& x = **d;
    FA2_CHECK(kv_format != kKvF16, op, n, " applies to an 8-bit cache; this cache is float16");
    check_cuda(op, n, x, q);
    FA2_CHECK(x.scalar_type() == ScalarType::Float, op, n, " has dtype ",
              scalar_name(x.scalar_type()), "; descales are float32 (.float())");
    const bool shape_ok = x.dim() == 0 || (x.dim() == 1 && (x.size(0) == 1 || x.size(0) == kv_heads)) ||
                          (x.dim() == 2 && (x.size(0) == 1 || x.size(0) == batch) &&
                           (x.size(1) == 1 || x.size(1) == kv_heads));
    FA2_CHECK(shape_ok, op, n, " has shape ", shape_str(x), "; it must be one value ([] or [1]), "
              "one per kv head ([", kv_heads, "]) or one per sequence and kv head ([batch, ",
              kv_heads, "] or [", batch, ", ", kv_heads, "])");
  }
}

// A descale's pointer and its (sequence, kv head) strides, size-1 dims broadcast.
void set_descale(const float*& ptr, int64_t (&stride)[2], const std::optional<Tensor>& d) {
  ptr = nullptr;
  stride[0] = stride[1] = 0;
  if (!d.has_value()) return;
  const Tensor& x = *d;
  ptr = static_cast<const float*>(x.const_data_ptr());
  if (x.dim() == 1 && x.size(0) > 1) stride[1] = x.stride(0);
  if (x.dim() == 2) {
    stride[0] = x.size(0) > 1 ? x.stride(0) : 0;
    stride[1] = x.size(1) > 1 ? x.stride(1) : 0;
  }
}

void fwd_serving_op(Tensor q, Tensor k_cache, Tensor v_cache, Tensor out, Tensor lse,
                    std::optional<Tensor> cu_seqlens_q, std::optional<Tensor> seqused_k,
                    std::optional<Tensor> cu_seqlens_k, std::optional<Tensor> block_table,
                    std::optional<Tensor> cache_batch_idx, std::optional<Tensor> k_start,
                    Tensor partitions, Tensor split_offsets, Tensor o_accum, Tensor lse_accum,
                    int64_t max_seqlen_q, int64_t seqlen_k, int64_t seqused_add,
                    double softmax_scale, bool causal, int64_t window_left,
                    int64_t window_right, double softcap, int64_t kv_format,
                    std::optional<Tensor> k_descale, std::optional<Tensor> v_descale,
                    std::optional<Tensor> sinks, bool check_inputs) {
  const char* op = "fwd_serving";
  const bool varlen = cu_seqlens_q.has_value(), paged = block_table.has_value();
  const int qd = varlen ? 3 : 4;
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"q", &q}, {"out", &out}}) {
    FA2_CHECK(t->dim() == qd, op, n, " must be ", qd, "-D ",
              varlen ? "[total_q, num_heads, head_dim]" : "[batch, seqlen_q, num_heads, head_dim]",
              ", got shape ", shape_str(*t));
  }
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"k_cache", &k_cache},
                      {"v_cache", &v_cache}}) {
    FA2_CHECK(t->dim() == 4, op, n, " must be 4-D ",
              paged ? "[num_blocks, page_size, num_kv_heads, head_dim]"
                    : "[batch_cache, seqlen_cache, num_kv_heads, head_dim]",
              ", got shape ", shape_str(*t));
  }
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"q", &q}, {"k_cache", &k_cache},
                      {"v_cache", &v_cache}, {"out", &out}})
    check_cuda(op, n, *t, q);
  check_half(op, "q", q);
  check_half(op, "out", out);
  bool same = true;
  for (int64_t d = 0; d < qd; ++d) same = same && out.size(d) == q.size(d);
  for (int64_t d = 0; d < 4; ++d) same = same && k_cache.size(d) == v_cache.size(d);
  FA2_CHECK(same, op, "out must have q's shape and v_cache k_cache's: got q ", shape_str(q),
            ", out ", shape_str(out), ", k_cache ", shape_str(k_cache), ", v_cache ",
            shape_str(v_cache));
  const int64_t hd = q.size(qd - 1), heads = q.size(qd - 2), kv_heads = k_cache.size(2);
  FA2_CHECK(k_cache.size(3) == hd, op, "q has head dim ", hd, " but k_cache has ",
            k_cache.size(3));
  check_heads(op, hd, heads, kv_heads);
  check_layout(op, "q", q);
  check_layout(op, "out", out);
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"k_cache", &k_cache},
                      {"v_cache", &v_cache}}) {
    if (kv_format == kKvInt8)  // vLLM's int8 rows are 4-byte aligned (each ends in its scale)
      FA2_CHECK(t->stride(3) == 1 && aligned(*t, 4, 4), op, n, " (shape ", shape_str(*t),
                ", strides ", strides_str(*t), ") must have a contiguous last dimension and "
                "start (rows, pages) at multiples of 4 bytes");
    else
      check_layout(op, n, *t);
  }
  const int64_t B = varlen ? cu_seqlens_q->size(0) - 1 : q.size(0);
  const int64_t total_q = varlen ? q.size(0) : q.size(0) * q.size(1);
  const int64_t sq_max = varlen ? max_seqlen_q : q.size(1);
  FA2_CHECK(B >= 0 && sq_max >= 0, op, "cu_seqlens_q must have batch + 1 >= 1 entries and "
            "max_seqlen_q must be >= 0");
  check_kv_format(op, kv_format, k_cache, v_cache, k_descale, v_descale, q, B);
  if (varlen) {
    check_index(op, "cu_seqlens_q", *cu_seqlens_q, q, B + 1, -1);
    check_lse(op, lse, q, 0, heads, total_q, 2, "[num_heads, total_q]");
  } else {
    check_lse(op, lse, q, B, heads, q.size(1), 3, "[batch, num_heads, seqlen_q]");
  }
  if (seqused_k.has_value()) check_index(op, "seqused_k", *seqused_k, q, B, -1);
  if (cu_seqlens_k.has_value()) check_index(op, "cu_seqlens_k", *cu_seqlens_k, q, B + 1, -1);
  const int64_t n_blocks = k_cache.size(0), rows_per = k_cache.size(1);
  int64_t capacity = rows_per;
  int page_shift = 0;
  if (paged) {
    FA2_CHECK(!cache_batch_idx.has_value() && !k_start.has_value(), op,
              "cache_batch_idx and cache_leftpad apply to a contiguous cache, not with block_table");
    FA2_CHECK(block_table->dim() == 2, op, "block_table must be 2-D [batch, max_blocks], got "
              "shape ", shape_str(*block_table));
    check_index(op, "block_table", *block_table, q, B, block_table->size(1));
    FA2_CHECK(rows_per > 0 && (rows_per & (rows_per - 1)) == 0, op, "page_size (k_cache.shape[1]"
              ") is ", rows_per, "; the kernels support powers of two (16, 32, 64, 128, ...)");
    while ((int64_t{1} << page_shift) < rows_per) ++page_shift;
    capacity = block_table->size(1) * rows_per;
  } else {
    if (cache_batch_idx.has_value()) check_index(op, "cache_batch_idx", *cache_batch_idx, q, B, -1);
    else FA2_CHECK(n_blocks >= B, op, "k_cache has ", n_blocks, " rows for a batch of ", B,
                   "; pass cache_batch_idx or a cache with a row per sequence");
    if (k_start.has_value()) check_index(op, "cache_leftpad", *k_start, q, B, -1);
  }
  FA2_CHECK(seqused_k.has_value() || cu_seqlens_k.has_value() || (seqlen_k >= 0 &&
            seqlen_k <= capacity), op, "seqlen_k (", seqlen_k, ") must be in [0, ", capacity,
            "] when neither seqused_k nor cu_seqlens_k is given");
  check_index(op, "split_offsets", split_offsets, q, B + 1, -1);
  FA2_CHECK(partitions.dim() == 2 && partitions.size(1) == 3, op, "partitions must be [P, 3] "
            "(seq, kv_start, kv_end), got shape ", shape_str(partitions));
  const int64_t P = partitions.size(0);
  check_index(op, "partitions", partitions, q, P, 3);
  FA2_CHECK(P >= B && P <= 65535, op, "the plan has ", P, " partitions for ", B,
            " sequences; it must have between batch and 65535");
  const int64_t group = heads / kv_heads, accum_rows = sq_max * group;
  const bool split = P > B;
  if (split) {
    check_cuda(op, "o_accum", o_accum, q);
    check_cuda(op, "lse_accum", lse_accum, q);
    FA2_CHECK(o_accum.scalar_type() == ScalarType::Float &&
              lse_accum.scalar_type() == ScalarType::Float, op,
              "o_accum and lse_accum must be float32");
    FA2_CHECK(o_accum.dim() == 4 && o_accum.size(0) == P && o_accum.size(1) == kv_heads &&
              o_accum.size(2) == accum_rows && o_accum.size(3) == hd && o_accum.is_contiguous() &&
              lse_accum.dim() == 3 && lse_accum.size(0) == P && lse_accum.size(1) == kv_heads &&
              lse_accum.size(2) == accum_rows && lse_accum.is_contiguous(), op,
              "the split workspace must be contiguous o_accum [", P, ", ", kv_heads, ", ",
              accum_rows, ", ", hd, "] and lse_accum [", P, ", ", kv_heads, ", ", accum_rows,
              "] (partitions x kv heads x max_seqlen_q * group); got ", shape_str(o_accum), " and ",
              shape_str(lse_accum));
  }
  check_options(op, softmax_scale, window_left, window_right, softcap);
  for (auto [n, v] : {std::pair<const char*, int64_t>{"total_q", total_q}, {"max_seqlen_q", sq_max},
                      {"rows per kv head (max_seqlen_q * group)", accum_rows},
                      {"cache capacity", capacity}, {"num_blocks", n_blocks},
                      {"seqused_add", seqused_add}})
    check_int32(op, n, v);
  const float* sink = sinks_ptr(op, sinks, q, heads);
  require_cuda(op, q);
  if (B == 0 || sq_max == 0 || total_q == 0) return;
  FwdParams p{};
  p.q = q.const_data_ptr();
  p.k = k_cache.const_data_ptr();
  p.v = v_cache.const_data_ptr();
  p.o = out.mutable_data_ptr();
  p.lse = static_cast<float*>(lse.mutable_data_ptr());
  strides(q, qd - 2, p.q_batch_stride, p.q_row_stride, &p.q_head_stride);
  strides(out, qd - 2, p.o_batch_stride, p.o_row_stride, &p.o_head_stride);
  // caches [num_blocks or batch_cache, page_size or seqlen, kv heads, dim]
  strides(k_cache, 2, p.k_batch_stride, p.k_row_stride, &p.k_head_stride);
  strides(v_cache, 2, p.v_batch_stride, p.v_row_stride, &p.v_head_stride);
  p.lse_batch_stride = varlen ? 0 : lse.stride(0);
  p.lse_head_stride = lse.stride(varlen ? 0 : 1);
  p.cu_seqlens_q = index_ptr(cu_seqlens_q);
  p.cu_seqlens_k = index_ptr(cu_seqlens_k);
  p.batch = static_cast<int>(B);
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.seqlen_q = static_cast<int>(sq_max);
  p.seqlen_k = static_cast<int>(std::max<int64_t>(seqlen_k, 0));
  p.head_dim = static_cast<int>(hd);
  fill_options(p, softmax_scale, causal, window_left, window_right, softcap);
  p.sinks = sink;
  p.group = static_cast<int>(group);
  p.total_q = static_cast<int>(total_q);
  p.seqused_k = index_ptr(seqused_k);
  p.seqused_add = static_cast<int>(seqused_add);
  p.kv_capacity = static_cast<int>(capacity);
  p.block_table = index_ptr(block_table);
  p.bt_stride = paged ? block_table->stride(0) : 0;
  p.page_shift = page_shift;
  p.num_pages = static_cast<int>(n_blocks);
  p.cache_batch_idx = index_ptr(cache_batch_idx);
  p.k_start = index_ptr(k_start);
  p.partitions = static_cast<const int32_t*>(partitions.const_data_ptr());
  p.split_offsets = static_cast<const int32_t*>(split_offsets.const_data_ptr());
  p.num_partitions = static_cast<int>(P);
  p.o_accum = split ? static_cast<float*>(o_accum.mutable_data_ptr()) : nullptr;
  p.lse_accum = split ? static_cast<float*>(lse_accum.mutable_data_ptr()) : nullptr;
  p.accum_rows = static_cast<int>(accum_rows);
  p.kv_format = static_cast<int>(kv_format);
  // 8-bit caches load 16 codes at once where every row (and page) starts 16-byte aligned
  // (strides of 16 one-byte elements), else 8 or (int8) 4 at a time
  p.kv_align = 4;
  for (int a : {16, 8})
    if (p.kv_align == 4 && aligned(k_cache, a, a) && aligned(v_cache, a, a)) p.kv_align = a;
  if (kv_format == kKvInt8) {
    for (auto [ptr, stride, x] :
         {std::tuple{&p.k_row_scale, &p.k_row_scale_stride, &*k_descale},
          std::tuple{&p.v_row_scale, &p.v_row_scale_stride, &*v_descale}}) {
      *ptr = static_cast<const float*>(x->const_data_ptr());
      for (int d = 0; d < 3; ++d) (*stride)[d] = x->stride(d);
    }
  } else {
    set_descale(p.k_descale, p.k_descale_stride, k_descale);
    set_descale(p.v_descale, p.v_descale_stride, v_descale);
  }

  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  const cudaStream_t stream = current_stream(op, q);
  // The values the kernels read from the device are checked there first (one sync), except
  // while a CUDA graph is being captured, with the checks turned off (set_input_checks) or
  // for a call whose caller built those values itself (check_inputs false): the kernels
  // clamp every index, so a bad value can only give a wrong answer.
  if (check_inputs && g_check_inputs.load(std::memory_order_relaxed)) {
    bool checked = false;
    int bad[4];
    const int err = validate_serving(p, stream, &checked, bad);
    FA2_CHECK(err == 0, op, "input check failed: ", cuda_error_string(err));
    if (checked && bad[0] != 0) fail_serving(op, bad, p);
  }
  const int err = sm7x::fa2::serving(p, stream);
  FA2_CHECK(err == 0, op, "CUDA kernel launch failed: ", cuda_error_string(err));
}

// The serving kernel serving() runs for `rows` query rows per sequence and kv head at
// head_dim over a cache of kv_format on `device`: (block_m, block_n, resident CTAs per SM),
// which the split planner reads instead of deriving the choice again.
std::tuple<int64_t, int64_t, int64_t> serving_tile_op(int64_t device, int64_t head_dim,
                                                      int64_t rows, int64_t kv_format) {
  const char* op = "serving_tile";
  FA2_CHECK(head_dim > 0 && head_dim <= kMaxHeadDim, op, "head_dim must be in [1, ",
            kMaxHeadDim, "], got ", head_dim);
  FA2_CHECK(rows >= 0, op, "rows must be >= 0, got ", rows);
  FA2_CHECK(kv_format >= kKvF16 && kv_format <= kKvInt8, op, "kv_format must be 0 (float16), "
            "1 (fp8 e4m3), 2 (fp8 e5m2) or 3 (int8 with row scales), got ", kv_format);
  torch::stable::accelerator::DeviceGuard guard(static_cast<int32_t>(device));
  const ServingTile t = sm7x::fa2::serving_tile(
      static_cast<int>(head_dim),
      static_cast<int>(std::min<int64_t>(rows, std::numeric_limits<int>::max())),
      static_cast<int>(kv_format));
  return {t.block_m, t.block_n, t.ctas_per_sm};
}

// The benchmark's tensor-core ceiling (peak.cu): out is a float32 CUDA tensor of
// blocks x kMmaPeakThreads elements; returns the FLOP done, to be divided by the time the
// caller measured on the current stream.
int64_t mma_peak_op(Tensor out, int64_t iters) {
  const char* op = "mma_peak";
  FA2_CHECK(out.is_cuda(), op, "out must be a CUDA tensor");
  FA2_CHECK(out.scalar_type() == ScalarType::Float, op, "out has dtype ",
            scalar_name(out.scalar_type()), "; it must be float32");
  FA2_CHECK(out.is_contiguous() && out.numel() > 0 && out.numel() % kMmaPeakThreads == 0 &&
                out.numel() / kMmaPeakThreads <= 65535,
            op, "out must be contiguous with a multiple of ", kMmaPeakThreads,
            " elements (one per thread, at most 65535 blocks), got ", out.numel());
  FA2_CHECK(iters > 0 && iters <= (1 << 20), op, "iters must be in [1, 2^20], got ", iters);
  torch::stable::accelerator::DeviceGuard guard(out.get_device_index());
  int64_t flop = 0;
  const int err = run_mma_peak(static_cast<float*>(out.mutable_data_ptr()),
                               static_cast<int>(out.numel() / kMmaPeakThreads),
                               static_cast<int>(iters), current_stream(op, out), &flop);
  FA2_CHECK(err == 0, op, "CUDA kernel launch failed: ", cuda_error_string(err));
  return flop;
}

// Whether fwd_serving checks the device-side values (block_table entries, key counts,
// cu_seqlens_q, cache_batch_idx / cache_leftpad, the plan) before it launches: a small
// kernel and one stream sync per eager call. Engines that build those tensors themselves
// turn it off (sm7x.fa2.set_input_checks).
void set_input_checks_op(bool enabled) { g_check_inputs.store(enabled); }

// The benchmark's occupancy emulation (fa2.h set_occupancy_emulation); 0, 0 turns it off.
void set_occupancy_emulation_op(int64_t smem_per_sm, int64_t threads_per_sm) {
  const char* op = "set_occupancy_emulation";
  FA2_CHECK(smem_per_sm >= 0 && smem_per_sm <= (1 << 30), op,
            "smem_per_sm must be in [0, 2^30] bytes (0 = off), got ", smem_per_sm);
  FA2_CHECK(threads_per_sm >= 0 && threads_per_sm <= 4096, op,
            "threads_per_sm must be in [0, 4096] (0 = no thread cap), got ", threads_per_sm);
  set_occupancy_emulation(static_cast<int>(smem_per_sm), static_cast<int>(threads_per_sm));
}

}  // namespace
}  // namespace fa2
}  // namespace sm7x

SM7X_FA2_LIBRARY(SM7X_FA2_NAMESPACE, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, float softmax_scale, "
      "bool causal, int window_left, int window_right, float softcap, Tensor? sinks=None) -> ()");
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
      "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
      "Tensor? sinks=None) -> ()");
  m.def(
      "fwd_serving(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, Tensor(b!) lse, "
      "Tensor? cu_seqlens_q, Tensor? seqused_k, Tensor? cu_seqlens_k, Tensor? block_table, "
      "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor partitions, Tensor split_offsets, "
      "Tensor(c!) o_accum, Tensor(d!) lse_accum, int max_seqlen_q, int seqlen_k, "
      "int seqused_add, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, int kv_format, Tensor? k_descale, Tensor? v_descale, "
      "Tensor? sinks=None, bool check_inputs=True) -> ()");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor(a!) dq, "
      "Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dq_accum, Tensor(e!) dsum, float softmax_scale, "
      "bool causal, int window_left, int window_right, float softcap, bool deterministic) -> ()");
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dq_accum, Tensor(e!) dsum, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
      "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
      "bool deterministic) -> ()");
  m.def("bwd_supported(int head_dim) -> bool");
  m.def("bwd_uses_dq_accum(int head_dim) -> bool");
  m.def("serving_tile(int device, int head_dim, int rows, int kv_format) -> (int, int, int)");
  m.def("mma_peak(Tensor(a!) out, int iters) -> int");
  m.def("set_occupancy_emulation(int smem_per_sm, int threads_per_sm) -> ()");
  m.def("set_input_checks(bool enabled) -> ()");
}

// CPU too, only so that CPU tensors get the op's own message ("must be a CUDA tensor")
// instead of torch's "could not run ... with arguments from the 'CPU' backend".
#define SM7X_FA2_IMPLS(m)                                  \
  m.impl("fwd", TORCH_BOX(&sm7x::fa2::fwd_op));            \
  m.impl("fwd_varlen", TORCH_BOX(&sm7x::fa2::fwd_varlen_op));  \
  m.impl("fwd_serving", TORCH_BOX(&sm7x::fa2::fwd_serving_op)); \
  m.impl("bwd", TORCH_BOX(&sm7x::fa2::bwd_op));            \
  m.impl("bwd_varlen", TORCH_BOX(&sm7x::fa2::bwd_varlen_op));  \
  m.impl("mma_peak", TORCH_BOX(&sm7x::fa2::mma_peak_op))

SM7X_FA2_LIBRARY_IMPL(SM7X_FA2_NAMESPACE, CUDA, m) { SM7X_FA2_IMPLS(m); }
SM7X_FA2_LIBRARY_IMPL(SM7X_FA2_NAMESPACE, CPU, m) { SM7X_FA2_IMPLS(m); }
// No tensor argument to dispatch on: one kernel for every backend.
SM7X_FA2_LIBRARY_IMPL(SM7X_FA2_NAMESPACE, CompositeExplicitAutograd, m) {
  m.impl("serving_tile", TORCH_BOX(&sm7x::fa2::serving_tile_op));
  m.impl("bwd_supported", TORCH_BOX(&sm7x::fa2::bwd_supported_op));
  m.impl("bwd_uses_dq_accum", TORCH_BOX(&sm7x::fa2::bwd_uses_dq_accum_op));
  m.impl("set_occupancy_emulation", TORCH_BOX(&sm7x::fa2::set_occupancy_emulation_op));
  m.impl("set_input_checks", TORCH_BOX(&sm7x::fa2::set_input_checks_op));
}
