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
//
// Keys rotated as they are read (SlotAttentionParams::rope_inv_freq set): a store that keeps
// keys before RoPE (InfLLM positions) gives each part the position its keys are rotated at,
// which need not be where they are (causal masking always uses the true positions). Each key
// is widened to fp32 and rotated as kernels::Rope (kernels/cpu/rope.h) rotates it: rotate-half
// pairs (i, i + head_dim / 2), angle position * inv_freq[i] in double, cos and sin rounded to
// fp32 once. V is never rotated; the queries come rotated already (the caller's job), unless
// q_rope_positions asks the kernel to rotate them (SlotAttentionParams says how). The twin
// rotates fp32 copies of the keys with kernels::Rope and attends them (V widened to fp32 too),
// so its output is that of kernels::Rope on fp32 copies followed by an unrotated SlotAttention
// with dtype kF32, bit for bit.
#pragma once

#include <cstdint>

#include "kernels/cpu/attention.h"

namespace kvtier::kernels {

/// Dense runs: sinks and the local window (a ring that wraps is two runs).
inline constexpr int kMaxDenseParts = 4;

/// A rotation position (DenseKv::rope_position, SlotAttentionParams::slot_rope_position) that
/// rotates each key at its own absolute position. Any value >= 0 rotates every key of the part
/// (of every selected slot) at that one position; values below -1 are refused (kBadShape).
inline constexpr int64_t kRopeAtKeyPositions = -1;

struct DenseKv {
  const void* k = nullptr;     ///< [n_tokens, kv_heads, head_dim] storage dtype
  const void* v = nullptr;     ///< [n_tokens, kv_heads, head_dim] storage dtype
  int n_tokens = 0;            ///< >= 0
  int64_t first_position = 0;  ///< absolute position of token 0
  float* mass = nullptr;       ///< optional [kv_heads, n_tokens], ADDED to (KvSpan::mass)
  /// Where its keys are rotated when SlotAttentionParams::rope_inv_freq is set:
  /// kRopeAtKeyPositions (token t at first_position + t) or one position >= 0 for every token
  /// (InfLLM: the sinks at L0 once chunks separate them from the local window). Must stay
  /// kRopeAtKeyPositions when rope_inv_freq is null (kBadShape otherwise).
  int64_t rope_position = kRopeAtKeyPositions;
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
  int n_slots = 0;                       ///< selected slots (>= 0); the CAPACITY with n_slots_in_memory
  const int32_t* slot_index = nullptr;   ///< [n_slots] slot of each selected chunk, in [0, pool_slots)
  const int64_t* slot_first_position = nullptr;  ///< [n_slots] absolute position of each chunk's token 0
  const int32_t* slot_n_tokens =
      nullptr;                 ///< optional [n_slots] tokens used in each slot (<= slot_tokens); null = full
  float* slot_mass = nullptr;  ///< optional [n_slots, kv_heads, slot_tokens], ADDED to (a partly
                               ///< filled slot: its first slot_n_tokens[i] of each row)
  float* out = nullptr;        ///< [n_queries, q_heads, head_dim] fp32
  float* lse = nullptr;        ///< optional [n_queries, q_heads] natural-log LSE; -inf when no key
  /// Optional rotation of every key as it is read (see the top of this file): [head_dim / 2]
  /// inverse frequencies (kernels::RopeInvFreq), host memory for the twin, device memory for
  /// the CUDA launcher. null = keys as stored (head_dim may then be odd). With it, head_dim must
  /// be even (kBadShape) and q must hold rotated queries.
  const double* rope_inv_freq = nullptr;
  /// Where the selected slots' keys are rotated: kRopeAtKeyPositions (token t of slot i at
  /// slot_first_position[i] + t) or one position >= 0 for all of them (InfLLM: L0, the start of
  /// the local window). Must stay kRopeAtKeyPositions when rope_inv_freq is null.
  int64_t slot_rope_position = kRopeAtKeyPositions;
  /// Optional count of the selected slots read from memory (host memory for the twin, device
  /// memory for the CUDA launcher, which never reads it on the host): one int32 in [0, n_slots];
  /// n_slots is then the capacity of the slot arrays, and only their first count entries are read
  /// (slot_mass rows past the count are not written). The twin returns kBadShape for a count
  /// outside [0, n_slots]; the CUDA kernel clamps it into that range. null = n_slots slots.
  /// Equal means: out, lse and mass are those of the same call with n_slots = the count and
  /// n_slots_in_memory = null, bit for bit for out and lse (the twin always; the CUDA launcher
  /// when both calls split the keys alike, see cuda::SlotAttentionSplits, which decides from
  /// n_slots, the capacity), mass up to the order of its atomic adds on CUDA.
  const int32_t* n_slots_in_memory = nullptr;
  /// Optional rotation of the queries (needs rope_inv_freq; kBadShape without): [n_queries]
  /// positions, query row t rotated at q_rope_positions[t] before the score step, as
  /// kernels::Rope rotates it (rotate-half pairs, angle in double, cos and sin rounded to fp32
  /// once); q then holds the queries as projected (unrotated). Host memory for the twin (which
  /// rotates an fp32 copy of q with kernels::Rope), device memory for the CUDA launcher. The
  /// result is that of passing q already rotated by kernels::Rope, bit for bit in the twin.
  /// null = q holds the queries as they are to be scored.
  const int64_t* q_rope_positions = nullptr;
};

/// Host-side checks of everything a launcher can check without reading device memory
/// (shapes, dtype, null pointers); shared by the CPU twin and the CUDA launcher.
KernelError CheckSlotAttentionParams(const SlotAttentionParams& p);

/// CPU twin. Also checks slot_index values, slot_n_tokens and *n_slots_in_memory (kBadShape when
/// out of range).
/// With rope_inv_freq it allocates fp32 copies of every attended K and V (kOutOfMemory when it
/// cannot; kept per thread between calls).
KernelError SlotAttention(const SlotAttentionParams& p);

/// LSE merge (see above) of rows [rows, head_dim]: out/lse may alias out_a/lse_a.
void MergeAttentionStates(int rows, int head_dim, const float* out_a, const float* lse_a, const float* out_b,
                          const float* lse_b, float* out, float* lse);

}  // namespace kvtier::kernels
