// Attention over the hot tier's layout: dense parts (sinks, the local ring as one or two
// runs) plus retrieved chunks read from a slot pool through an index list, with no gather
// copy. This is the CPU twin that defines the CUDA decode/window attention kernel
// (kernels/cuda/kernels.h); on the CPU it maps every selected slot to a KvSpan pointing into
// the pool and runs kernels::Attention, so the arithmetic (fp32 accumulation, online softmax,
// LSE merge of split-K partials, causal mask, GQA, mass) is Attention's.
//
// MergeAttentionStates is the LSE merge of two partial results over disjoint key sets:
//   M = max(lse_a, lse_b), out = (out_a e^(lse_a - M) + out_b e^(lse_b - M)) / (e^(lse_a - M) + e^(lse_b -
//   M)), lse = M + log(e^(lse_a - M) + e^(lse_b - M));
// a side with lse = -inf (it saw no key) contributes nothing; both -inf gives zeros and -inf.
#pragma once

#include <cstdint>

#include "kernels/cpu/attention.h"

namespace kvtier::kernels {

/// Dense runs: sinks and the local window (a ring that wraps is two runs).
inline constexpr int kMaxDenseParts = 4;

struct DenseKv {
  const void* k = nullptr;     ///< [n_tokens, kv_heads, head_dim] storage dtype
  const void* v = nullptr;     ///< [n_tokens, kv_heads, head_dim] storage dtype
  int n_tokens = 0;            ///< >= 0
  int64_t first_position = 0;  ///< absolute position of token 0
  float* mass = nullptr;       ///< optional [kv_heads, n_tokens], ADDED to (KvSpan::mass)
};

struct SlotAttentionParams {
  int q_heads = 0;                       ///< > 0, multiple of kv_heads
  int kv_heads = 0;                      ///< > 0
  int head_dim = 0;                      ///< 1 .. kMaxHeadDim (CUDA: 16, 32, 64, 128, 256)
  DType dtype = DType::kF16;             ///< storage dtype of every K and V
  float scale = 0.0f;                    ///< softmax scale; 0 means 1/sqrt(head_dim)
  bool causal = true;                    ///< mask keys whose position > the query's
  int n_queries = 0;                     ///< >= 0 (1 for decode)
  const float* q = nullptr;              ///< [n_queries, q_heads, head_dim] fp32
  const int64_t* q_positions = nullptr;  ///< [n_queries]; may be null iff !causal
  DenseKv dense[kMaxDenseParts];         ///< the first n_dense are used
  int n_dense = 0;                       ///< 0 .. kMaxDenseParts
  int n_leading_dense = -1;              ///< the twin concatenates dense[0 .. n) | slots | the other dense
                                         ///< parts; -1 = every dense part first. It changes rounding only
                                         ///< (Session's order is sinks | chunks | local, kept bit for bit);
                                         ///< the CUDA kernel ignores it (its splits have their own order)
  const void* pool_k = nullptr;          ///< [pool_slots, slot_tokens, kv_heads, head_dim] storage dtype
  const void* pool_v = nullptr;          ///< same layout as pool_k
  int pool_slots = 0;                    ///< slots in the pool (>= 0)
  int slot_tokens = 0;                   ///< tokens per slot (one chunk), > 0 when n_slots > 0
  int n_slots = 0;                       ///< selected slots (>= 0)
  const int32_t* slot_index = nullptr;   ///< [n_slots] slot of each selected chunk, in [0, pool_slots)
  const int64_t* slot_first_position = nullptr;  ///< [n_slots] absolute position of each chunk's token 0
  const int32_t* slot_n_tokens =
      nullptr;                 ///< optional [n_slots] tokens used in each slot (<= slot_tokens); null = full
  float* slot_mass = nullptr;  ///< optional [n_slots, kv_heads, slot_tokens], ADDED to (a partly
                               ///< filled slot: its first slot_n_tokens[i] of each row)
  float* out = nullptr;        ///< [n_queries, q_heads, head_dim] fp32
  float* lse = nullptr;        ///< optional [n_queries, q_heads] natural-log LSE; -inf when no key
};

/// Host-side checks of everything a launcher can check without reading device memory
/// (shapes, dtype, null pointers); shared by the CPU twin and the CUDA launcher.
KernelError CheckSlotAttentionParams(const SlotAttentionParams& p);

/// CPU twin. Also checks slot_index values and slot_n_tokens (kBadShape when out of range).
KernelError SlotAttention(const SlotAttentionParams& p);

/// LSE merge (see above) of rows [rows, head_dim]: out/lse may alias out_a/lse_a.
void MergeAttentionStates(int rows, int head_dim, const float* out_a, const float* lse_a, const float* out_b,
                          const float* lse_b, float* out, float* lse);

}  // namespace kvtier::kernels
