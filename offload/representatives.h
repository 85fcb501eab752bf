// Representative keys of a chunk: the few keys per kv head that retrieval
// scores a chunk by (offload/tiered_store.h keeps repr_topk of them per head,
// chosen when the chunk is sealed and stored with it).
//
// The choice follows InfLLM: per kv head, the chunk's tokens that received the
// most attention while they were in the local window. When no statistics
// reached the chunk for a head (all its mass is zero), the most typical keys
// are taken instead: those with the highest summed cosine to every key of the
// chunk (= cosine to the mean of the unit keys), a medoid-like choice that one
// outlier cannot drag towards itself. Ties go to the earlier token, so the
// choice is deterministic. The chosen keys are copied in the storage dtype,
// bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

struct RepresentativeInput {
  Geometry geometry;              ///< kv_heads, head_dim and the storage dtype are used
  int chunk_size = 0;             ///< tokens in the chunk
  int repr_topk = 0;              ///< keys to choose per kv head (<= chunk_size)
  const uint8_t* keys = nullptr;  ///< [chunk_size, kv_heads, head_dim], storage dtype
  /// Attention mass per token: head h, token t at mass[h * mass_stride + t]. Null:
  /// no statistics for any head (every head takes the fallback).
  const float* mass = nullptr;
  size_t mass_stride = 0;  ///< >= chunk_size when mass is given
};

/// Writes [repr_topk, kv_heads, head_dim] keys (storage dtype) to `out`.
/// InvalidArgument naming the field for a bad shape or a null pointer.
Status ChooseRepresentatives(const RepresentativeInput& in, uint8_t* out);

}  // namespace kvtier
