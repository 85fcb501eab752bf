// SequenceTable: see offload/store/sequence_table.h.

#include "offload/store/sequence_table.h"

#include <algorithm>

#include "offload/store/layer_regions.h"

namespace kvtier {

using store_internal::Sequence;
using store_records::SeqState;

SequenceTable::SequenceTable(const StoreOptions& options, size_t token_bytes, HotTier* hot)
    : options_(options), token_bytes_(token_bytes), hot_(hot) {}

SequenceTable::~SequenceTable() {
  for (auto& [id, seq] : map_)
    for (auto& ls : seq->layers) {
      store_internal::FreeLayerRegions(hot_, &ls);
      for (store_internal::Chunk* c : ls.chunks) delete c;
    }
}

Status SequenceTable::Check(SequenceId seq, int layer, bool for_write, Sequence** out) const {
  auto it = map_.find(seq);
  if (it == map_.end())
    return NotFound("sequence " + std::to_string(seq) + " does not exist (never created or dropped)");
  if (layer < 0 || layer >= options_.geometry.layers)
    return InvalidArgument("layer " + std::to_string(layer) + " is out of range [0, " +
                           std::to_string(options_.geometry.layers) + ")");
  if (for_write && it->second->state != SeqState::kOpen)
    return FailedPrecondition("sequence " + std::to_string(seq) +
                              (it->second->state == SeqState::kClosed
                                   ? " is closed; it is read-only"
                                   : " was not closed before the store stopped; its chunks are readable but "
                                     "it cannot be appended to"));
  *out = it->second.get();
  return Status::Ok();
}

Sequence* SequenceTable::Find(SequenceId seq) const {
  auto it = map_.find(seq);
  return it == map_.end() ? nullptr : it->second.get();
}

SequenceId SequenceTable::Add(std::unique_ptr<Sequence> s) {
  const SequenceId id = next_id_++;
  s->id = id;
  region_bytes_ += s->layers.size() * store_internal::LayerRegionBytes(options_, token_bytes_);
  map_[id] = std::move(s);
  return id;
}

void SequenceTable::Erase(SequenceId seq) {
  auto it = map_.find(seq);
  if (it == map_.end()) return;
  for (auto& ls : it->second->layers) {
    // A sequence recovered without its sinks and local window holds no regions.
    if (ls.ring_k != nullptr) region_bytes_ -= store_internal::LayerRegionBytes(options_, token_bytes_);
    store_internal::FreeLayerRegions(hot_, &ls);
  }
  map_.erase(it);
}

std::vector<SequenceId> SequenceTable::Ids() const {
  std::vector<SequenceId> ids;
  ids.reserve(map_.size());
  for (const auto& [id, s] : map_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

void SequenceTable::Adopt(Map sequences, SequenceId next_id, uint64_t region_bytes) {
  map_ = std::move(sequences);
  next_id_ = next_id;
  region_bytes_ += region_bytes;
}

}  // namespace kvtier
