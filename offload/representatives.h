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
// topic) over keys a few queries attend strongly. ReprChoice::kCluster starts from kDiverse's
// keys as seeds, puts every key of the chunk with the seed it has the highest cosine with (a
// seed with itself; ties to the earlier seed) and stores each group's mean key, rounded to the
// storage dtype: a query's logit against a group's mean is its mean logit over the group's
// keys. Keys that share a direction (a needle's tokens) then stand for it with their noise
// averaged out, where the best single key of a chunk also carries the best of its noise, and
// so does every competing chunk's (at 1M, 32K chunks of topic compete; docs/benchmarks.md).
// With one representative it is the chunk's mean key; with repr_topk = chunk_size every key
// is its own group and the choice is kDiverse's. When no statistics
// reached the chunk for a head (all its mass is zero), the most typical keys
// are taken instead: those with the highest summed cosine to every key of the
// chunk (= cosine to the mean of the unit keys), a medoid-like choice that one
// outlier cannot drag towards itself. Ties go to the earlier token, so the
// choice is deterministic. kMass and kDiverse copy the chosen keys in the storage dtype,
// bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvtier/options.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

/// "mass" / "diverse" / "cluster".
const char* ReprChoiceName(ReprChoice c);
/// Parses "mass|diverse|cluster"; false when unknown.
bool ParseReprChoice(const std::string& name, ReprChoice* out);
/// "kv" / "query".
const char* ReprHeadsName(ReprHeads h);
/// Parses "kv|query"; false when unknown.
bool ParseReprHeads(const std::string& name, ReprHeads* out);

struct RepresentativeInput {
  Geometry geometry;   ///< kv_heads, head_dim and the storage dtype are used
  int chunk_size = 0;  ///< tokens in the chunk
  int repr_topk = 0;   ///< keys to choose per out head (<= chunk_size)
  /// Heads the representatives are chosen for: 0 (= kv_heads) chooses per kv head; q_heads (a
  /// multiple of kv_heads: ReprHeads::kQuery) chooses per query head, each by its own mass row,
  /// query head h taking the keys of its kv head h / (out_heads / kv_heads).
  int out_heads = 0;
  const uint8_t* keys = nullptr;  ///< [chunk_size, kv_heads, head_dim], storage dtype
  /// Attention mass per token: out head h, token t at mass[h * mass_stride + t]. Null:
  /// no statistics for any head (every head takes the fallback).
  const float* mass = nullptr;
  size_t mass_stride = 0;                 ///< >= chunk_size when mass is given
  ReprChoice choice = ReprChoice::kMass;  ///< how tokens with statistics are chosen
};

/// Writes [repr_topk, out heads, head_dim] keys (storage dtype) to `out`: a query head's
/// representatives are its own choice (InfLLM's ContextManager: each query head's top repr_topk
/// tokens by the attention it gave them), and every choice rule runs per out head as written above.
/// InvalidArgument naming the field for a bad shape or a null pointer.
Status ChooseRepresentatives(const RepresentativeInput& in, uint8_t* out);

}  // namespace kvtier
