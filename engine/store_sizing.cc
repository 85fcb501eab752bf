#include "engine/store_sizing.h"

#include <algorithm>

namespace kvtier {

StoreSize SizeStoreForContext(const StoreOptions& store, int64_t context, int budget_tokens, bool retrieve) {
  const uint64_t cb = store.chunk_bytes();
  const int64_t chunk_size = std::max(store.chunk_size, 1);
  const uint64_t chunks = static_cast<uint64_t>(std::max<int64_t>(context, 0) / chunk_size + 2);
  const uint64_t layers = static_cast<uint64_t>(std::max(store.geometry.layers, 1));
  StoreSize s;
  s.warm_bytes = std::max<uint64_t>(layers * chunks * cb, 4 * cb);
  const uint64_t k = static_cast<uint64_t>(std::max(0, budget_tokens) / chunk_size);
  const uint64_t need = retrieve ? std::max(k + 1, std::min(chunks, layers * k + 1)) : chunks;
  s.hot_bytes = std::max<uint64_t>(need, 1) * cb;
  return s;
}

}  // namespace kvtier
