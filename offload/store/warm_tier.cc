// WarmTier: see offload/store/warm_tier.h.

#include "offload/store/warm_tier.h"

#include <algorithm>
#include <chrono>

#include "offload/store/lower_writer.h"

namespace kvtier {

using store_internal::Chunk;

WarmReaderFence::~WarmReaderFence() = default;

Result<std::unique_ptr<WarmTier>> WarmTier::Create(const StoreOptions& options, size_t chunk_bytes,
                                                   ChunkCatalog* catalog, const LowerTiers* lower,
                                                   StoreCounters* counters) {
  auto warm = std::unique_ptr<WarmTier>(new WarmTier());
  KVTIER_ASSIGN_OR_RETURN(warm->slots_,
                          SlotPool::Create("warm_bytes", options.warm_bytes, chunk_bytes, true));
  KVTIER_ASSIGN_OR_RETURN(warm->policy_, MakeDemotionPolicy(options.warm_policy));
  warm->catalog_ = catalog;
  warm->lower_ = lower;
  warm->counters_ = counters;
  warm->exposed_.assign(static_cast<size_t>(warm->slots_->capacity()), 0);
  return warm;
}

void WarmTier::Hold(Chunk* c, int32_t slot) {
  c->warm_slot = slot;
  c->tiers |= kTierWarm;
  policy_->OnInsert(c->id);
}

void WarmTier::Forget(Chunk* c) {
  if (c->warm_slot < 0) return;
  // The caller fenced (FenceFor); a mark left here would outlive the slot's owner.
  if (exposed(c->warm_slot)) {
    exposed_[static_cast<size_t>(c->warm_slot)] = 0;
    exposed_count_--;
  }
  slots_->Release(c->warm_slot);
  policy_->OnRemove(c->id);
  c->warm_slot = -1;
  c->tiers &= ~kTierWarm;
}

Result<bool> WarmTier::DropVictimCopy() {
  uint64_t victim_id = 0;
  if (!policy_->PickVictim(
          [&](uint64_t id) {
            const Chunk* c = catalog_->Find(id);
            return c->warm_pins == 0 && !c->lower_writing && c->lower_acked;
          },
          &victim_id))
    return false;
  // A lower tier already acknowledged it: the warm copy may leave now, once no device reader
  // can still be reading its slot.
  Chunk* c = catalog_->Find(victim_id);
  KVTIER_RETURN_IF_ERROR(FenceFor(c));
  Forget(c);
  counters_->demotions++;
  catalog_->ReleaseReprIfDurable(c, lower_->meta_tiers());
  return true;
}

int32_t WarmTier::AcquireForRead() {
  // A chunk read back from a lower tier was just retrieved, and retrieval tends to come back to
  // the same chunks over the next steps: keep a warm copy, making room by dropping the
  // policy's victim among warm chunks a lower tier already holds. Never waits on other chunks
  // and never writes: a transfer task must not block on others (an exposed victim waits on the
  // reader fence, which waits on device work only). A fence failure leaves the victim in
  // place: the read keeps no warm copy, as when no victim could be found.
  const int32_t ws = slots_->Acquire();
  if (ws >= 0) return ws;
  const Result<bool> dropped = DropVictimCopy();
  if (!dropped.ok() || !*dropped) return -1;
  return slots_->Acquire();
}

Status WarmTier::MakeRoom(std::unique_lock<CountingMutex>& lock, StoreSync& sync, LowerWriter& writer,
                          const std::function<bool()>& land) {
  while (slots_->full()) {
    auto movable = [&](uint64_t id) {
      const Chunk* c = catalog_->Find(id);
      return c->warm_pins == 0 && !c->lower_writing;
    };
    KVTIER_ASSIGN_OR_RETURN(const bool dropped, DropVictimCopy());
    if (dropped) continue;
    uint64_t victim_id = 0;
    if (!lower_->empty() && policy_->PickVictim(movable, &victim_id)) {
      // Not yet in a lower tier: write it, and only then let it leave warm.
      Chunk* c = catalog_->Find(victim_id);
      KVTIER_RETURN_IF_ERROR(writer.WriteDown(lock, c, slots_->slot_data(c->warm_slot)));
      continue;
    }
    // Slots held by chunks still landing become warm chunks (movable once acknowledged).
    // (A chunk another thread is between sealing and submitting is not landable yet: the
    // wait below lets that thread go on.)
    if (land()) continue;
    if (lower_->empty())
      return ResourceExhausted(
          "warm tier is full (" + std::to_string(slots_->capacity()) +
          " chunks) and there is no cold tier (data_dir) or remote tier (remote) to demote to");
    // The writes this would wait for are failing: the error, not a wait behind them.
    KVTIER_RETURN_IF_ERROR(lower_->BackgroundErrorLocked());
    // Every warm chunk is busy (being copied or written): wait for one to finish.
    sync.cv.wait_for(lock, std::chrono::milliseconds(100));
  }
  return Status::Ok();
}

const uint8_t* WarmTier::Expose(const Chunk* c) {
  const auto slot = static_cast<size_t>(c->warm_slot);
  if (exposed_[slot] == 0) {
    exposed_[slot] = 1;
    exposed_count_++;
  }
  return slots_->slot_data(c->warm_slot);
}

Status WarmTier::FenceReaders() {
  if (exposed_count_ == 0) return Status::Ok();
  // Before the wait: a reader that checks the epoch after the fence took its lock sees it moved.
  epoch_.fetch_add(1, std::memory_order_acq_rel);
  if (fence_ != nullptr) {
    counters_->warm_reader_fences++;
    Status st = fence_->WaitForReaders();
    if (!st.ok())
      return Status(st.code(),
                    "waiting for the device readers of the warm tier before reusing a slot "
                    "whose address was handed out: " +
                        st.message());
  }
  std::fill(exposed_.begin(), exposed_.end(), 0);
  exposed_count_ = 0;
  return Status::Ok();
}

Status WarmTier::FenceFor(const Chunk* c) { return exposed(c->warm_slot) ? FenceReaders() : Status::Ok(); }

}  // namespace kvtier
