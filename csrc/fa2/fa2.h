// sm7x FlashAttention-2 (prefill, serving, backward) for Volta (sm_70) and Turing (sm_75): the interface
// between the op layer (ops.cpp, torch stable ABI) and the kernels (sm70/ or sm75/
// fwd_kernel.cuh, instantiated once per compiled head dim by the generated
// fwd_hdim*.cu files, which see no torch header). Each library compiles this with its own
// compiled_head_dims.h, generated from python/sm7x/targets.json.
//
// Plain C++17: raw pointers, strides in elements, a cudaStream_t. The op layer has
// validated shapes, dtypes, devices and alignment (every pointer 16-byte aligned, every
// stride but the last a multiple of 8 elements, the last dim contiguous).
#pragma once

#include <cstdint>

#include "compiled_head_dims.h"  // kCompiledHeadDims, kMaxHeadDim, kHeadDimMultiple

typedef struct CUstream_st* cudaStream_t;

namespace sm7x {
namespace fa2 {

struct FwdParams {
  // fp16 tensors. Batched: [B, S, H, D]; varlen: [total, H, D] (batch stride unused).
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // batched: [B, H, Sq]; varlen: [H, total_q]
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;  // lse rows are contiguous
  // Varlen: [B + 1] int32 prefix sums (device); null for batched inputs.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int batch, heads, kv_heads;
  int seqlen_q, seqlen_k;  // varlen: max_seqlen_q / max_seqlen_k (grid size only)
  int head_dim;            // actual head dim (multiple of 8, <= the compiled one)
  float scale;             // softmax scale
  float softcap;           // 0: off; else s = softcap * tanh(s * scale / softcap)
  int window_left, window_right;  // -1: unbounded; causal is window_right = 0
  // Attention sinks (null: none): float32 [heads], one logit per query head that joins
  // every row's softmax denominator with no value (gpt-oss). Applied where a row's output
  // is final (the epilogues; run_combine for split rows), never in fp32 partials.
  const float* sinks;

  // ---- Serving (run_serving only; zero for the prefill kernels). Query heads of one GQA
  // group are packed into the rows: packed row r of sequence b is query token r / group of
  // head hk * group + r % group, so one CTA of kv head hk reads each K/V tile once for its
  // whole group. Keys come from a cache:
  //   paged (block_table != null): k is [num_pages, page_size, kv_heads, D]; key j of
  //     sequence b is row j & (page_size - 1) of page block_table[b * bt_stride + j >>
  //     page_shift] (entries outside [0, num_pages) are clamped: never read out of bounds;
  //     the op rejects them before the launch where it can);
  //   contiguous: k is [batch_cache, S, kv_heads, D]: row cache_batch_idx[b] (or b), keys
  //     from k_start[b] (or 0).
  // Keys of sequence b: [k_start, seqused_k[b] + seqused_add), clamped to kv_capacity.
  int group;
  int total_q;               // rows of a packed q (cu_seqlens_q entries are clamped to it)
  const int32_t* seqused_k;  // [batch]; null: cu_seqlens_k or seqlen_k as in prefill
  int seqused_add;           // added to seqused_k[b] (with_kvcache: the appended tokens)
  int kv_capacity;           // keys a sequence can hold (max_blocks * page_size, or S)
  const int32_t* block_table;
  int64_t bt_stride;
  int page_shift, num_pages;
  const int32_t* cache_batch_idx;
  const int32_t* k_start;
  // Split-KV (sm7x._sched.split_kv_plan): the grid's z runs over partitions [P, 3] = (seq,
  // kv_start, kv_end); split_offsets [batch + 1] gives each sequence's partitions. A
  // sequence with one partition writes o / lse directly; one with more writes fp32
  // partials o_accum [P, kv_heads, accum_rows, D] and lse_accum [P, kv_heads, accum_rows]
  // (accum_rows = max_seqlen_q * group) that run_combine merges. Split boundaries are best multiples of
  // the kernel's block_n (others are masked, not wrong).
  const int32_t* partitions;
  const int32_t* split_offsets;
  int num_partitions;
  float* o_accum;
  float* lse_accum;
  int accum_rows;
  // 8-bit caches (KvFormat; kv_format 0: fp16 like q). k/v then hold one-byte codes
  // (strides and offsets above count them), which the kernels widen to fp16 in registers
  // on their way to shared memory: never a 16-bit copy of the cache. The dequantized key
  // of sequence b, kv head hk is code x k_descale[b * k_descale_stride[0] + hk *
  // k_descale_stride[1]] (null: 1), likewise V; both fold into the softmax scale and 1 / l.
  int kv_format;
  // 8-bit caches: 16, 8 or 4 when both caches' rows (and pages) start at multiples of that
  // many bytes (the widest load a row chunk takes)
  int kv_align;
  const float* k_descale;
  const float* v_descale;
  int64_t k_descale_stride[2], v_descale_stride[2];
  // int8 caches (kKvInt8): the scale of every cached row, float32 scale caches addressed
  // like the rows: [block (paged) or cache row (contiguous), slot, kv head] strides, in
  // floats. The dequantized key is code x k_row_scale[...] (likewise V).
  const float* k_row_scale;
  const float* v_row_scale;
  int64_t k_row_scale_stride[3], v_row_scale_stride[3];
};

// How the serving kernels read a cache (FwdParams::kv_format): fp16, or OCP FP8 codes
// (torch.float8_e4m3fn / float8_e5m2, vLLM's fp8 / fp8_e4m3 / fp8_e5m2) with per-tensor,
// per-kv-head or per-(sequence, kv head) descales, or int8 codes with a scale per cached
// row and kv head (vLLM's int8_per_token_head).
enum KvFormat : int { kKvF16 = 0, kKvE4M3 = 1, kKvE5M2 = 2, kKvInt8 = 3 };

// The serving kernel instantiations by what they read (fwd_kernel's KV argument): fp16,
// 8-bit codes whose scales fold into the softmax scale and 1 / l (fp8), or int8 codes
// whose row scales multiply each key's scores and probabilities (their own kernels: the
// row scales take registers and shared memory).
enum KvRead : int { kReadF16 = 0, kReadCodes = 1, kReadRowScaled = 2 };

// The backward (bwd.cu, <arch>/bwd_kernel.cuh): the forward's inputs (o = the forward's
// output, lse its LSE) plus dO, the gradients and the fp32 work tensors.
struct BwdParams : FwdParams {
  const void* dout;  // like q
  void* dq;          // like q
  void* dk;          // like k
  void* dv;          // like v
  float* dq_accum;   // fp32, q's shape, contiguous; zeroed by the preprocess kernel
  float* dsum;       // fp32 like lse: rowsum(dO * O)
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t dsum_batch_stride, dsum_head_stride;
  int64_t acc_batch_stride, acc_row_stride;  // dq_accum (head stride: head_dim)
  bool deterministic;  // dQ by its own kernel (no atomics): bit-identical run to run
};

// Launches on `stream` (current device); returns a cudaError_t as int (0 = success).
// One specialization per entry of kCompiledHeadDims (generated fwd_hdim*.cu).
template <int kHeadDim>
int run_fwd(const FwdParams& p, cudaStream_t stream);

// The serving kernel of head dim kHeadDim (paged / contiguous cache, packed GQA, split-KV),
// then, when some sequence has several partitions, the combine kernel.
template <int kHeadDim>
int run_serving(const FwdParams& p, cudaStream_t stream);
template <int kHeadDim>  // the prefill tiles: more than kServingWideRows rows
int run_serving_wide(const FwdParams& p, cudaStream_t stream);
// The same two over an 8-bit cache (kv_format != kKvF16): their own instantiations, so
// the fp16 kernels carry nothing of the 8-bit path.
template <int kHeadDim>
int run_serving_kv8(const FwdParams& p, cudaStream_t stream);
template <int kHeadDim>
int run_serving_wide_kv8(const FwdParams& p, cudaStream_t stream);
// And over an int8 cache with row scales (kKvInt8).
template <int kHeadDim>
int run_serving_int8(const FwdParams& p, cudaStream_t stream);
template <int kHeadDim>
int run_serving_wide_int8(const FwdParams& p, cudaStream_t stream);
// The decode kernel (sm75/decode_kernel.cuh; fa2.decode_kernels.<arch>, decode_compiled): keys
// on the MMA's M dimension, at most kDecodeRows packed query rows per CTA. Serving calls
// with that few rows per kv head run it instead of run_serving*.
constexpr int kDecodeRows = 8;
template <int kHeadDim>
int run_decode(const FwdParams& p, cudaStream_t stream);
template <int kHeadDim>
int run_decode_kv8(const FwdParams& p, cudaStream_t stream);
template <int kHeadDim>
int run_decode_int8(const FwdParams& p, cudaStream_t stream);
int serving(const FwdParams& p, cudaStream_t stream);
// The tile of each serving instantiation and its resident CTAs per SM on the current device
// (0 on error). The split planner reads serving_tile, so the rule that picks the kernel
// (dispatch.cu serving_kernel) lives in the library only.
struct ServingTile {
  int block_m, block_n, ctas_per_sm;
};
template <int kHeadDim>
ServingTile tile_serving();
template <int kHeadDim>
ServingTile tile_serving_wide();
template <int kHeadDim>
ServingTile tile_serving_kv8();
template <int kHeadDim>
ServingTile tile_serving_wide_kv8();
template <int kHeadDim>
ServingTile tile_serving_int8();
template <int kHeadDim>
ServingTile tile_serving_wide_int8();
template <int kHeadDim>
ServingTile tile_decode();
template <int kHeadDim>
ServingTile tile_decode_kv8();
template <int kHeadDim>
ServingTile tile_decode_int8();
// The tile serving() runs for `rows` query rows per sequence and kv head (max_seqlen_q x
// GQA group) at head_dim over a cache of kv_format (KvFormat); block_m 0 for a head dim no
// kernel covers.
ServingTile serving_tile(int head_dim, int rows, int kv_format);
// Merges the split partials of the sequences with several partitions (serving.cu).
int run_combine(const FwdParams& p, cudaStream_t stream);

// Host-side input check of the serving call (serving.cu): block_table entries of the
// pages a sequence uses inside [0, num_pages), key counts within kv_capacity. Runs a small
// kernel and copies 4 ints back (a sync); skipped (returns 0, *checked = false) while the
// stream is capturing a CUDA graph, where the kernels' clamping still keeps every read in
// bounds. On a violation returns 0 and fills *bad: {kind (1 = page, 2 = length), seq,
// index, value}.
int validate_serving(const FwdParams& p, cudaStream_t stream, bool* checked, int bad[4]);

// The benchmark's tensor-core ceiling (peak.cu): `blocks` CTAs of kMmaPeakThreads run
// `iters` rounds of independent MMAs of this library's instruction into registers and
// write one float per thread to out; *flop is what they computed.
constexpr int kMmaPeakThreads = 256;
int run_mma_peak(float* out, int blocks, int iters, cudaStream_t stream, int64_t* flop);

// The backward kernels of head dim kHeadDim (generated bwd_main_hdim*.cu, bwd_dq_hdim*.cu):
// run_bwd_main: dK/dV (and, unless p.deterministic, dQ into p.dq_accum with atomics);
// run_bwd_dq: the deterministic dQ kernel (writes p.dq).
template <int kHeadDim>
int run_bwd_main(const BwdParams& p, cudaStream_t stream);
template <int kHeadDim>
int run_bwd_dq(const BwdParams& p, cudaStream_t stream);
// Whether this library has a backward for head_dim (kHasBwd: fa2.bwd_kernels.<arch>).
bool bwd_supported(int head_dim);
// Whether the backward of head_dim without determinism sums dQ in the fp32 dq_accum
// (atomics), i.e. its kernel's entry has no dq_pass; false where there is no backward.
bool bwd_uses_dq_accum(int head_dim);
// The whole backward (dispatch.cu, bwd.cu): dsum = rowsum(dO * O), run_bwd of the
// smallest compiled head dim >= p.head_dim, then dq = dq_accum * scale as fp16 (unless
// deterministic or dq_pass: then the dQ kernel writes dq). cudaErrorInvalidValue when the
// head dim has no backward kernel.
int bwd(const BwdParams& p, cudaStream_t stream);
int run_bwd_preprocess(const BwdParams& p, cudaStream_t stream);
int run_bwd_convert_dq(const BwdParams& p, cudaStream_t stream);
// Occupancy emulation, for measuring on a GPU larger than the arch's own card (the
// benchmark's --occupancy-of; occupancy.cu). With smem_per_sm > 0 every kernel launch pads
// its dynamic shared memory so that no more CTAs share an SM than would on a card with
// smem_per_sm bytes of shared memory and threads_per_sm threads per SM (registers: the
// same 64 K on every card these libraries target and on newer ones). 0: off (default).
void set_occupancy_emulation(int smem_per_sm, int threads_per_sm);
// The dynamic shared memory a launch of a kernel with smem_bytes and threads asks for on
// the current device: smem_bytes, or the padded size while emulation is on.
int launch_smem_bytes(int smem_bytes, int threads);

// run_fwd of the smallest compiled head dim >= p.head_dim (dispatch.cu);
// cudaErrorInvalidValue when p.head_dim is larger than all of them.
int fwd(const FwdParams& p, cudaStream_t stream);
const char* cuda_error_string(int err);

}  // namespace fa2
}  // namespace sm7x
