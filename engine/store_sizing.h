// How big a store for a context: the tier sizes `kvtier infinite`, the Python module's
// model (kvtier.tools.decode_bench) and kvtier.hf.KvtierCache give a store that serves one
// sequence of up to `context` tokens.
#pragma once

#include <cstdint>

#include "kvtier/options.h"

namespace kvtier {

struct StoreSize {
  uint64_t hot_bytes = 0;   ///< the hot slot pool (StoreOptions::hot_bytes)
  uint64_t warm_bytes = 0;  ///< the warm tier (StoreOptions::warm_bytes)
};

/// Tier sizes for one sequence of up to `context` tokens over `store`'s geometry and chunk
/// size (its chunk_bytes()). The warm tier holds every chunk of every layer: context /
/// chunk_size + 2 chunks a layer (the partial chunk and the one sealing), at least 4 chunks
/// in all. The hot slot pool holds what one layer may attend: with `retrieve`, k =
/// budget_tokens / chunk_size chunks, which the entropy allocator may raise to layers * k + 1
/// for one layer (capped at a layer's chunks) and never below k + 1 (a session refuses a pool
/// smaller than its budget, however short the context); without, every chunk of a layer
/// (full attention pins them all at once). Both at least one chunk.
StoreSize SizeStoreForContext(const StoreOptions& store, int64_t context, int budget_tokens, bool retrieve);

}  // namespace kvtier
