// Representative keys of a chunk: the few keys per kv head that retrieval
// scores a chunk by (offload/tiered_store.h keeps repr_topk of them per head,
// chosen when the chunk is sealed and stored with it).
//
// The choice starts from InfLLM's statistic: per kv head, the attention each of the chunk's
// tokens received while it was in the local window (the mass). ReprChoice::kMass takes the
// repr_topk most attended tokens, as InfLLM does. ReprChoice::kDiverse takes the most
// attended token, then repeatedly the token with the highest
//     mass / (the chunk's highest mass) - (its highest cosine with a token already taken):
// a chunk's score is its best representative's (retrieval/exact_index.h), so a second key
// along the direction of one already taken adds nothing to it, while a key no
// representative covers (a needle among filler that shares a topic) is missed by any query
// that seeks it. The summed mass favours keys many queries attend a little (the chunk's
// topic) over keys a few queries attend strongly. When no statistics
// reached the chunk for a head (all its mass is zero), the most typical keys
// are taken instead: those with the highest summed cosine to every key of the
// chunk (= cosine to the mean of the unit keys), a medoid-like choice that one
// outlier cannot drag towards itself. Ties go to the earlier token, so the
// choice is deterministic. The chosen keys are copied in the storage dtype,
// bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvtier/options.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

/// "mass" / "diverse".
const char* ReprChoiceName(ReprChoice c);
/// Parses "mass|diverse"; false when unknown.
bool ParseReprChoice(const std::string& name, ReprChoice* out);

struct RepresentativeInput {
  Geometry geometry;              ///< kv_heads, head_dim and the storage dtype are used
  int chunk_size = 0;             ///< tokens in the chunk
  int repr_topk = 0;              ///< keys to choose per kv head (<= chunk_size)
  const uint8_t* keys = nullptr;  ///< [chunk_size, kv_heads, head_dim], storage dtype
  /// Attention mass per token: head h, token t at mass[h * mass_stride + t]. Null:
  /// no statistics for any head (every head takes the fallback).
  const float* mass = nullptr;
  size_t mass_stride = 0;                 ///< >= chunk_size when mass is given
  ReprChoice choice = ReprChoice::kMass;  ///< how tokens with statistics are chosen
};

/// Writes [repr_topk, kv_heads, head_dim] keys (storage dtype) to `out`.
/// InvalidArgument naming the field for a bad shape or a null pointer.
Status ChooseRepresentatives(const RepresentativeInput& in, uint8_t* out);

}  // namespace kvtier
