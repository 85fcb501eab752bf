// SequenceTable: the store's sequences by id. It owns each Sequence (offload/store_state.h),
// the next id, and the hot bytes their layers' regions take (sinks and local ring, see
// offload/store/layer_regions.h); it checks the (sequence, layer) a call names and frees a
// sequence's regions when it goes. A sequence's chunks are the ChunkCatalog's records: the
// table deletes those its sequences still hold only when the store itself goes.
//
// Locking: guarded by the coordinator's mutex (StoreSync::mu), except the destructor (the
// store is idle then).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "kvtier/options.h"
#include "offload/hot_tier.h"
#include "offload/store_state.h"
#include "store/status.h"

namespace kvtier {

class SequenceTable {
 public:
  using Map = std::unordered_map<SequenceId, std::unique_ptr<store_internal::Sequence>>;

  /// `hot` holds the regions and outlives the table.
  SequenceTable(const StoreOptions& options, size_t token_bytes, HotTier* hot);
  /// Frees every sequence's regions and the chunk records they hold.
  ~SequenceTable();
  SequenceTable(const SequenceTable&) = delete;
  SequenceTable& operator=(const SequenceTable&) = delete;

  /// The sequence `seq`, with `layer` in range and, for a write, open: NotFound (never created
  /// or dropped), InvalidArgument (layer out of range) or FailedPrecondition (closed, or not
  /// closed before the store stopped) otherwise.
  Status Check(SequenceId seq, int layer, bool for_write, store_internal::Sequence** out) const;
  /// The sequence, or null.
  store_internal::Sequence* Find(SequenceId seq) const;
  /// The id the next Add gives.
  SequenceId next_id() const { return next_id_; }
  /// Adds a sequence whose layers' regions are allocated; it gets next_id(), which is returned.
  SequenceId Add(std::unique_ptr<store_internal::Sequence> s);
  /// Removes a sequence and frees its layers' regions; its chunks must be gone already.
  void Erase(SequenceId seq);
  /// The ids, ascending.
  std::vector<SequenceId> Ids() const;
  /// Takes over what recovery rebuilt: its sequences (regions allocated), the next id and the
  /// hot bytes of those regions.
  void Adopt(Map sequences, SequenceId next_id, uint64_t region_bytes);
  /// Hot bytes held by the sequences' layer regions.
  uint64_t region_bytes() const { return region_bytes_; }
  Map::const_iterator begin() const { return map_.begin(); }
  Map::const_iterator end() const { return map_.end(); }

 private:
  const StoreOptions& options_;
  size_t token_bytes_;
  HotTier* hot_;
  Map map_;
  SequenceId next_id_ = 1;
  uint64_t region_bytes_ = 0;
};

}  // namespace kvtier
