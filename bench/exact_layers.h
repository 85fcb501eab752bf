// Random Exact indexes for the search benchmarks (exact_screen_bench.cc, exact_decode_bench.cc):
// `layers` indexes of `chunks` chunks each, their representatives drawn from a normal
// distribution and stored in `shape`'s dtype, and one random probe. Built once per shape and
// chunk count and index spec and kept for the process (the same seed: every spec indexes the
// same keys); null when building failed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "retrieval/exact_index.h"

namespace kvtier::bench {

struct ExactLayers {
  std::vector<std::unique_ptr<ExactChunkIndex>> index;
  std::vector<float> probe;
};

inline const ExactLayers* RandomExactLayers(int layers, const ChunkShape& shape, size_t chunks,
                                            const std::string& spec = "Exact:heads=max") {
  using Key = std::tuple<int, int, int, int, int, size_t, std::string>;
  static std::map<Key, std::unique_ptr<ExactLayers>> cache;
  auto& slot = cache[Key{layers, shape.kv_heads, shape.head_dim, shape.repr, static_cast<int>(shape.dtype),
                         chunks, spec}];
  if (slot) return slot.get();
  auto built = std::make_unique<ExactLayers>();
  auto options = ExactIndexOptions::Parse(spec);
  if (!options.ok()) return nullptr;
  std::mt19937 rng(static_cast<uint32_t>(chunks));
  std::normal_distribution<float> normal;
  std::vector<uint64_t> ids(chunks);
  for (size_t i = 0; i < chunks; ++i) ids[i] = i;
  for (int l = 0; l < layers; ++l) {
    auto index = ExactChunkIndex::Create(shape, *options);
    if (!index.ok()) return nullptr;
    const Status st = (*index)->Add(ids, [&](uint64_t, float* repr) {
      for (size_t i = 0; i < shape.repr_floats(); ++i) repr[i] = normal(rng);
      return Status::Ok();
    });
    if (!st.ok()) return nullptr;
    built->index.push_back(std::move(*index));
  }
  built->probe.resize(static_cast<size_t>(shape.dim()));
  for (float& x : built->probe) x = normal(rng);
  slot = std::move(built);
  return slot.get();
}

}  // namespace kvtier::bench
