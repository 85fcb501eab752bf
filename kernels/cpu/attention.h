// CPU reference attention kernel of kvtier (FlashInfer style).
//
// Queries attend over keys/values given as a list of "parts" (sinks, the
// retrieved chunks, the local window -- in any order), each a KvSpan of
// contiguous tokens in the storage dtype. The kernel:
//   * validates every parameter first and returns a KernelError, never throws
//     and never dereferences a pointer it has not validated;
//   * writes only caller-owned outputs (`out`, `lse`, the spans' `mass`);
//   * allocates only small per-thread scratch, kept between calls (a
//     converted K/V tile, the packed queries of one block and their
//     accumulators: ~100 KiB for head_dim 128), plus, when it splits the key
//     range across threads (split-K), per-call partial results of
//     n_splits * n_queries * q_heads * (head_dim + 2) floats (n_splits <= 4 x
//     threads, only used when n_queries * q_heads is small);
//   * accumulates in fp32 regardless of the storage dtype.
//
// Algorithm (see attention.cc for details): work items of (kv-head block,
// query block, key range) run in parallel with oneTBB (tbb::parallel_for) in
// the caller's task arena; for decode with few kv heads the key range is split
// (split-K) so every thread is busy, and the partial softmaxes (max, sum of
// exp, weighted V) are merged with log-sum-exp merging. Keys are processed in
// tiles of 16..128 tokens; each key row is converted to fp32 once per tile and
// used by every q head of the GQA group and every query of the block; scores
// go through an online softmax.
//
// Masking: with `causal`, a key at absolute position p is visible to a query at
// position qp iff p <= qp. A query that sees no key at all (no parts, or all
// keys in its future) gets an output row of zeros and lse = -inf.
//
// Mass: the probabilities added to KvSpan::mass are the FINAL normalised
// softmax probabilities. They are computed by a second pass over the keys of
// the spans that ask for mass (K only, not V), once the final log-sum-exp of
// every (query, q head) row is known: p = exp(score - lse). That pass is
// skipped when no span has `mass`; with it, decode takes ~1.6-1.8x as long.
//
// Threading: safe to call concurrently from several threads (scratch is per
// thread); outputs of concurrent calls must not overlap.
#pragma once

#include <cstdint>

#include "kernels/dtype.h"

namespace kvtier::kernels {

enum class KernelError {
  kOk = 0,
  kBadShape,     ///< a size, count, position range or scale is invalid
  kNullPointer,  ///< a required pointer is null
  kBadDType,     ///< dtype is not one of kF32, kF16, kBF16
  kOutOfMemory,  ///< per-thread scratch or split-K buffers could not be allocated
  kDeviceError,  ///< a CUDA call failed (kernels/cuda: LastCudaError says which)
  kWorkspace,    ///< the caller's workspace is null or smaller than its ...WorkspaceBytes query
};

/// Static string naming the error ("ok", "bad shape", ...); never null.
const char* KernelErrorString(KernelError e);

/// Largest head_dim the kernel accepts (kBadShape above it).
inline constexpr int kMaxHeadDim = 1024;

/// The head_dim values the kernel accepts (kBadShape otherwise): 1 .. kMaxHeadDim.
/// Geometry::Validate (store/) uses this same predicate, so every geometry the store accepts
/// is one the kernel runs.
constexpr bool HeadDimSupported(int64_t head_dim) { return head_dim >= 1 && head_dim <= kMaxHeadDim; }

/// A run of tokens whose K and V are contiguous in memory.
/// Token t (0 <= t < n_tokens) has absolute position first_position + t.
struct KvSpan {
  const void* k = nullptr;     // [n_tokens, kv_heads, head_dim] storage dtype (AttentionParams::dtype)
  const void* v = nullptr;     // [n_tokens, kv_heads, head_dim] storage dtype
  int n_tokens = 0;            // >= 0; k and v may be null when 0
  int64_t first_position = 0;  // absolute position of token 0; first_position + n_tokens - 1 must fit int64
  float* mass = nullptr;       // optional [kv_heads, n_tokens] fp32, ADDED to (+=): for each key, its final
                               // softmax probability summed over all queries and the q heads of its GQA group
};

struct AttentionParams {
  int q_heads = 0;            // > 0, multiple of kv_heads
  int kv_heads = 0;           // > 0; q head h uses kv head h / (q_heads / kv_heads)
  int head_dim = 0;           // 1 .. kMaxHeadDim
  DType dtype = DType::kF16;  // storage dtype of every span's k and v
  float scale = 0.0f;         // softmax scale applied to q.k; must be finite; 0 means 1/sqrt(head_dim)
  int n_queries = 0;          // m >= 0 (1 for decode); m == 0 is a no-op (pointers unchecked)
  const float* q = nullptr;   // [n_queries, q_heads, head_dim] fp32
  const int64_t* q_positions = nullptr;  // [n_queries] int64 absolute positions; may be null iff !causal
  const KvSpan* parts = nullptr;         // [n_parts] sinks, chunks..., local window, in any order
  int n_parts = 0;                       // >= 0; parts may be null when 0
  float* out = nullptr;                  // [n_queries, q_heads, head_dim] fp32, every element written
  float* lse = nullptr;                  // optional [n_queries, q_heads] fp32: natural-log log-sum-exp of the
                                         // scaled, masked scores; -inf for a query that sees no key
  bool causal = true;                    // mask out keys whose position > the query's position
};

/// Attention of n_queries queries over all keys of all parts (decode: m = 1;
/// window: m queries, causal inside the local part via positions).
/// out must not overlap any input; the spans' mass arrays must not overlap
/// each other. On an error other than kOutOfMemory nothing has been written;
/// on kOutOfMemory the outputs may be partially written.
KernelError Attention(const AttentionParams& params);

}  // namespace kvtier::kernels
