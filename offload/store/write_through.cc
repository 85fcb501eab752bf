// TieredStore, part "write-through": chunks going down to the lower tiers (LowerTiers,
// offload/store/lower_tiers.h, the ordered list behind offload/lower_tier.h) and the chunk
// state around it. SubmitLowerWrite hands a landed chunk's write to the transfer engine;
// WriteLower writes one synchronously (demotion, CloseSequence). LowerTiers acknowledges them
// and keeps the sticky background error (CheckBackgroundError) until WaitForDurable reports
// it or the tiers' error window passes. Reads from the lower tiers (a chunk's payload, its
// representatives from its meta record) go through LowerTiers too.
//
// Locking: TieredStore's one mutex (mu_) guards every field this file touches, except where
// offload/store_state.h says otherwise (a layer's sinks and ring belong to the sequence's
// driving thread). A function named ...Locked is called with mu_ held; one that takes the
// std::unique_lock may drop it while it waits or copies bytes, and holds it again on return.
// A chunk being written is pinned (lower_writing, warm_pins) so its warm slot and key stay
// valid while transfer threads read them without mu_.

#include <algorithm>
#include <cstring>

#include "offload/store_records.h"
#include "offload/store_state.h"
#include "offload/tiered_store.h"
#include "offload/transfer_engine.h"

namespace kvtier {

using store_records::DecodeChunkMeta;
using store_records::EncodeChunkMeta;

Status TieredStore::WriteWarmChunkDownLocked(std::unique_lock<CountingMutex>& lock, Chunk* c) {
  // Pinned and marked while the lock is dropped: nobody frees or reuses the slot.
  c->lower_writing = true;
  c->warm_pins++;
  const uint8_t* payload = warm_->slot_data(c->warm_slot);
  const float score = c->score;  // snapshot under the lock (see Chunk::score)
  lock.unlock();
  Status st = WriteLower(c, payload, score);
  lock.lock();
  c->lower_writing = false;
  c->warm_pins--;
  cv_.notify_all();
  return st;
}

Status TieredStore::WriteLower(Chunk* c, const uint8_t* payload, float score) {
  // first_token and repr never change once the chunk is sealed, so encoding them here,
  // without the lock, is safe; the score is the caller's snapshot.
  const std::string meta = EncodeChunkMeta(c->first_token, c->repr.data(), c->repr.size(), score);
  TransferEngine::WriteAcks acks = 0;
  const Status st = engine_->WriteChunk(c->key, meta, payload, &acks);
  // A later tier refused what an earlier one acknowledged (Redis after RocksDB): durable all
  // the same (see WaitForDurable), and the refusal is still the caller's error.
  if (!st.ok() && acks == 0) return st;
  LowerTiers::AckListener listener;
  {
    std::lock_guard<CountingMutex> l(mu_);
    listener = lower_.AckLocked(c, acks, chunk_bytes_, &counters_);
  }
  // The chunk is still pinned (lower_writing) by the caller: its key stays valid.
  if (listener) listener(c->key);
  return st;
}

void TieredStore::SubmitLowerWrite(Chunk* c, const uint8_t* payload, float score) {
  // Encoded here, on the appending thread: the transfer thread then reads no chunk field
  // the store mutex guards (SetChunkScores may change the score meanwhile; that change is
  // persisted by the chunk's next lower-tier write, as SetChunkScores documents).
  TransferEngine::LowerWrite w;
  w.key = c->key;
  w.meta = EncodeChunkMeta(c->first_token, c->repr.data(), c->repr.size(), score);
  w.payload = payload;
  engine_->SubmitLowerWrite(std::move(w), [this, c](Status st, TransferEngine::WriteAcks acks) {
    LowerTiers::AckListener listener;
    if (st.ok() || acks != 0) {
      // What an earlier tier acknowledged is durable even if a later one refused it.
      std::lock_guard<CountingMutex> l(mu_);
      listener = lower_.AckLocked(c, acks, chunk_bytes_, &counters_);
    }
    // Still pinned (lower_writing): nobody frees the chunk while the listener runs.
    if (listener) listener(c->key);
    std::lock_guard<CountingMutex> l(mu_);
    c->lower_writing = false;
    c->warm_pins--;
    if (!st.ok()) lower_.RecordWriteFailureLocked(st);
    cv_.notify_all();  // CloseSequence, DropChunks and MakeWarmRoom wait for lower_writing to clear
  });
}

Status TieredStore::CheckBackgroundError() {
  CountVisit();
  std::lock_guard<CountingMutex> l(mu_);
  return lower_.BackgroundErrorLocked();
}

Status TieredStore::WaitForDurable() {
  CountVisit();
  Status landed;
  {
    // Chunks still landing have no write issued yet: land them, which issues it.
    std::unique_lock<CountingMutex> l(mu_);
    LandEverythingLocked(l);
    for (auto& [id, seq] : sequences_) {
      Status st = TakeLandingErrorLocked(seq.get());
      if (landed.ok()) landed = std::move(st);
    }
  }
  // Every write issued so far has finished or, where errors expire (a remote tier), one
  // failed: then the rest is not waited for (writes queued behind a dead node are refused
  // anyway), and the error says that not everything is durable.
  while (!engine_->WaitIdleFor(std::chrono::milliseconds(20))) {
    std::lock_guard<CountingMutex> l(mu_);
    if (lower_.errors_expire() && !lower_.BackgroundErrorLocked().ok()) break;
  }
  std::lock_guard<CountingMutex> l(mu_);
  if (!landed.ok()) return landed;
  // A failed write-through leaves its chunk unacknowledged in warm, where the
  // next demotion or CloseSequence writes it again (or, with both tiers and only Redis
  // failing, acknowledged by the cold tier alone); report the failure once.
  return lower_.TakeBackgroundErrorLocked();
}

void TieredStore::SetAckListener(std::function<void(const ChunkKey&)> listener) {
  std::lock_guard<CountingMutex> l(mu_);
  lower_.SetAckListenerLocked(std::move(listener));
}

std::vector<ChunkRange> TieredStore::AcknowledgedChunks() const {
  CountVisit();
  return lower_.cold() ? lower_.cold()->AcknowledgedChunks() : std::vector<ChunkRange>{};
}

std::vector<ChunkRange> TieredStore::LostChunks() const {
  CountVisit();
  return lower_.cold() ? lower_.cold()->lost_chunks() : std::vector<ChunkRange>{};
}

Status TieredStore::ReadLowerTierRepr(const Sequence* s, std::vector<ReprRead>* reads) const {
  return lower_.ReadReprs(s, static_cast<size_t>(options_.repr_topk) * token_bytes_, reads);
}

Status TieredStore::ReprBytes(const Sequence* s, const Chunk* c, std::vector<uint8_t>* out) {
  const size_t repr_bytes = static_cast<size_t>(options_.repr_topk) * token_bytes_;
  ChunkKey key;
  {
    std::lock_guard<CountingMutex> l(mu_);
    if (!c->repr.empty()) {
      out->assign(c->repr.begin(), c->repr.end());
      return Status::Ok();
    }
    key = c->key;
  }
  out->resize(repr_bytes);
  std::vector<ReprRead> reads{ReprRead{key, out->data(), Status::Ok()}};
  return ReadLowerTierRepr(s, &reads);
}

}  // namespace kvtier
