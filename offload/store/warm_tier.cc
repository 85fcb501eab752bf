// TieredStore, part "warm tier": room in the warm slab pool. MakeWarmRoom (before a seal)
// drops warm copies the lower tiers already acknowledged, writes an unacknowledged victim
// down first, lands chunks still landing, and otherwise waits for a busy chunk to finish;
// AcquireWarmSlotForReadLocked gives a chunk read back from a lower tier a warm slot
// without ever waiting. A chunk leaves warm only once a lower tier acknowledged it, and its
// representatives leave memory with it when that tier reads metas alone (MaybeReleaseReprLocked).
//
// Locking: TieredStore's one mutex (mu_) guards every field this file touches, except where
// offload/store_state.h says otherwise (a layer's sinks and ring belong to the sequence's
// driving thread). A function named ...Locked is called with mu_ held; one that takes the
// std::unique_lock may drop it while it waits or copies bytes, and holds it again on return.

#include "offload/store_state.h"
#include "offload/tiered_store.h"

namespace kvtier {

bool TieredStore::DropWarmCopyLocked() {
  uint64_t victim_id = 0;
  if (!warm_policy_->PickVictim(
          [&](uint64_t id) {
            const Chunk* c = chunk_by_id_.at(id);
            return c->warm_pins == 0 && !c->lower_writing && c->lower_acked;
          },
          &victim_id))
    return false;
  // A lower tier already acknowledged it: the warm copy may leave now.
  Chunk* c = chunk_by_id_.at(victim_id);
  warm_->Release(c->warm_slot);
  c->warm_slot = -1;
  c->tiers &= ~kTierWarm;
  warm_policy_->OnRemove(victim_id);
  counters_.demotions++;
  MaybeReleaseReprLocked(c);
  return true;
}

void TieredStore::MaybeReleaseReprLocked(Chunk* c) {
  // The meta record in such a tier is then the other copy of these bytes (write_through.cc
  // encodes it from c->repr), and nothing writes this chunk's meta again: every write of a
  // chunk to the lower tiers (landing, demotion, CloseSequence) is of an unacknowledged one,
  // and PublishSequence reads released representatives back (sharing.cc).
  if (c->repr.empty() || c->warm_slot >= 0 || !c->lower_acked || c->lower_writing ||
      (c->tiers & lower_.meta_tiers()) == 0)
    return;
  std::vector<uint8_t>().swap(c->repr);
  repr_chunks_--;
}

int32_t TieredStore::AcquireWarmSlotForReadLocked() {
  // A chunk read back from a lower tier was just retrieved, and retrieval tends to come back to
  // the same chunks over the next steps: keep a warm copy, making room by dropping the
  // policy's victim among warm chunks a lower tier already holds. Never waits and never
  // writes: a transfer task must not block on others.
  const int32_t ws = warm_->Acquire();
  if (ws >= 0 || !DropWarmCopyLocked()) return ws;
  return warm_->Acquire();
}

Status TieredStore::MakeWarmRoom(std::unique_lock<CountingMutex>& lock) {
  while (warm_->full()) {
    auto movable = [&](uint64_t id) {
      const Chunk* c = chunk_by_id_.at(id);
      return c->warm_pins == 0 && !c->lower_writing;
    };
    if (DropWarmCopyLocked()) continue;
    uint64_t victim_id = 0;
    if (!lower_.empty() && warm_policy_->PickVictim(movable, &victim_id)) {
      // Not yet in a lower tier: write it, and only then let it leave warm.
      KVTIER_RETURN_IF_ERROR(WriteWarmChunkDownLocked(lock, chunk_by_id_.at(victim_id)));
      continue;
    }
    // Slots held by chunks still landing become warm chunks (movable once acknowledged).
    // (A chunk another thread is between sealing and submitting is not landable yet: the
    // wait below lets that thread go on.)
    if (landing_chunks_ > 0 && LandEverythingLocked(lock)) continue;
    if (!!lower_.empty())
      return ResourceExhausted(
          "warm tier is full (" + std::to_string(warm_->capacity()) +
          " chunks) and there is no cold tier (data_dir) or remote tier (remote) to demote to");
    // The writes this would wait for are failing: the error, not a wait behind them.
    KVTIER_RETURN_IF_ERROR(lower_.BackgroundErrorLocked());
    // Every warm chunk is busy (being copied or written): wait for one to finish.
    cv_.wait_for(lock, std::chrono::milliseconds(100));
  }
  return Status::Ok();
}

}  // namespace kvtier
