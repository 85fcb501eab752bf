// TieredStore, part "write-through": chunks going down to the lower tiers (the ordered
// LowerTier list, offload/lower_tier.h) and coming back. SubmitColdWrite hands a landed
// chunk's write to the transfer engine; WriteCold writes one synchronously (demotion,
// CloseSequence). AckColdWriteLocked marks what the tiers acknowledged; a failed write
// becomes the sticky background error (BackgroundErrorLocked, CheckBackgroundError) until
// WaitForDurable reports it or the tiers' error window passes. ReadLowerTier reads a chunk
// no memory tier holds, falling through the list in order; ReadLowerTierRepr reads back the
// representatives a chunk released from memory (MaybeReleaseReprLocked, warm_tier.cc) from
// its meta record, the same way.
//
// Locking: TieredStore's one mutex (mu_) guards every field this file touches, except where
// offload/store_state.h says otherwise (a layer's sinks and ring belong to the sequence's
// driving thread). A function named ...Locked is called with mu_ held; one that takes the
// std::unique_lock may drop it while it waits or copies bytes, and holds it again on return.
// A chunk being written is pinned (cold_writing, warm_pins) so its warm slot and key stay
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

Status TieredStore::WriteWarmChunkToColdLocked(std::unique_lock<CountingMutex>& lock, Chunk* c) {
  // Pinned and marked while the lock is dropped: nobody frees or reuses the slot.
  c->cold_writing = true;
  c->warm_pins++;
  const uint8_t* payload = warm_->slot_data(c->warm_slot);
  const float score = c->score;  // snapshot under the lock (see Chunk::score)
  lock.unlock();
  Status st = WriteCold(c, payload, score);
  lock.lock();
  c->cold_writing = false;
  c->warm_pins--;
  cv_.notify_all();
  return st;
}

Status TieredStore::WriteCold(Chunk* c, const uint8_t* payload, float score) {
  // first_token and repr never change once the chunk is sealed, so encoding them here,
  // without the lock, is safe; the score is the caller's snapshot.
  const std::string meta = EncodeChunkMeta(c->first_token, c->repr.data(), c->repr.size(), score);
  TransferEngine::WriteAcks acks = 0;
  const Status st = engine_->WriteChunk(c->key, meta, payload, &acks);
  // A later tier refused what an earlier one acknowledged (Redis after RocksDB): durable all
  // the same (see WaitForDurable), and the refusal is still the caller's error.
  if (!st.ok() && acks == 0) return st;
  std::function<void(const ChunkKey&)> listener;
  {
    std::lock_guard<CountingMutex> l(mu_);
    listener = AckColdWriteLocked(c, acks);
  }
  // The chunk is still pinned (cold_writing) by the caller: its key stays valid.
  if (listener) listener(c->key);
  return st;
}

std::function<void(const ChunkKey&)> TieredStore::AckColdWriteLocked(Chunk* c, uint8_t acks) {
  if (!c->cold_acked) {
    c->cold_acked = true;
    c->tiers |= acks;
    if (acks & kTierCold) {
      counters_.cold_chunks++;
      counters_.cold_bytes += chunk_bytes_;
    }
    counters_.cold_writes++;
    counters_.bytes_moved += chunk_bytes_;
  }
  return ack_listener_;
}

void TieredStore::SubmitColdWrite(Chunk* c, const uint8_t* payload, float score) {
  // Encoded here, on the appending thread: the transfer thread then reads no chunk field
  // the store mutex guards (SetChunkScores may change the score meanwhile; that change is
  // persisted by the chunk's next cold write, as SetChunkScores documents).
  TransferEngine::ColdWrite w;
  w.key = c->key;
  w.meta = EncodeChunkMeta(c->first_token, c->repr.data(), c->repr.size(), score);
  w.payload = payload;
  engine_->SubmitColdWrite(std::move(w), [this, c](Status st, TransferEngine::WriteAcks acks) {
    std::function<void(const ChunkKey&)> listener;
    if (st.ok() || acks != 0) {
      // What an earlier tier acknowledged is durable even if a later one refused it.
      std::lock_guard<CountingMutex> l(mu_);
      listener = AckColdWriteLocked(c, acks);
    }
    // Still pinned (cold_writing): nobody frees the chunk while the listener runs.
    if (listener) listener(c->key);
    std::lock_guard<CountingMutex> l(mu_);
    c->cold_writing = false;
    c->warm_pins--;
    if (!st.ok() && (background_error_.ok() || std::chrono::steady_clock::now() >= background_error_until_)) {
      background_error_ = st;
      // Sticky for the lower tiers' error window (the remote's retry window: its node fails
      // every command at once for that long), or until WaitForDurable reports it.
      background_error_until_ = error_window_ == std::chrono::milliseconds::max()
                                    ? std::chrono::steady_clock::time_point::max()
                                    : std::chrono::steady_clock::now() + error_window_;
    }
    cv_.notify_all();  // CloseSequence, DropChunks and MakeWarmRoom wait for cold_writing to clear
  });
}

Status TieredStore::BackgroundErrorLocked() {
  // After the remote's window a new attempt may succeed: no longer in the way (WaitForDurable
  // still reports it).
  if (background_error_.ok() || std::chrono::steady_clock::now() >= background_error_until_)
    return Status::Ok();
  return background_error_;
}

Status TieredStore::CheckBackgroundError() {
  CountVisit();
  std::lock_guard<CountingMutex> l(mu_);
  return BackgroundErrorLocked();
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
    if (error_window_ != std::chrono::milliseconds::max() && !BackgroundErrorLocked().ok()) break;
  }
  std::lock_guard<CountingMutex> l(mu_);
  if (!landed.ok()) return landed;
  // A failed write-through leaves its chunk unacknowledged in warm, where the
  // next demotion or CloseSequence writes it again (or, with both tiers and only Redis
  // failing, acknowledged by the cold tier alone); report the failure once.
  Status st = background_error_;
  background_error_ = Status::Ok();
  return st;
}

void TieredStore::SetColdAckListener(std::function<void(const ChunkKey&)> listener) {
  std::lock_guard<CountingMutex> l(mu_);
  ack_listener_ = std::move(listener);
}

std::vector<ChunkRange> TieredStore::AcknowledgedChunks() const {
  CountVisit();
  return cold_ ? cold_->AcknowledgedChunks() : std::vector<ChunkRange>{};
}

std::vector<ChunkRange> TieredStore::LostChunks() const {
  CountVisit();
  return cold_ ? cold_->lost_chunks() : std::vector<ChunkRange>{};
}

Status TieredStore::ReadLowerTier(const Sequence* s, const Chunk* c, void* dst) {
  LowerChunkRef ref;
  ref.key = c->key;
  if (store_internal::SharedChunk(s, c->key)) {
    ref.ns = &s->remote_ns;
    ref.key.seq = s->remote_seq;
  }
  // Each tier serves what the ones before it lost or damaged; every failure is reported.
  Status st = Internal("chunk " + c->key.ToString() + " is in no tier");
  bool tried = false;
  for (const auto& tier : lower_) {
    if (ref.ns != nullptr && !tier->serves_published()) continue;
    Status got = tier->GetChunk(ref, dst, chunk_bytes_);
    if (got.ok()) return got;
    st = tried ? Status(got.code(), st.message() + "; " + got.message()) : std::move(got);
    tried = true;
  }
  return st;
}

Status TieredStore::ReadLowerTierRepr(const Sequence* s, std::vector<ReprRead>* reads) const {
  const size_t repr_bytes = static_cast<size_t>(options_.repr_topk) * token_bytes_;
  // Bounded batches: a first index sync over a long sequence reads every chunk's meta.
  constexpr size_t kBatch = 256;
  std::vector<LowerTier::MetaGet> batch;
  std::vector<size_t> pending, asked, still;  // positions in *reads
  std::vector<uint8_t> tried(reads->size(), 0);
  for (size_t b = 0; b < reads->size(); b += kBatch) {
    const size_t e = std::min(reads->size(), b + kBatch);
    pending.clear();
    for (size_t i = b; i < e; ++i) {
      (*reads)[i].status = Internal("no lower tier that reads chunk metas holds it");
      pending.push_back(i);
    }
    for (const auto& tier : lower_) {
      if (pending.empty()) break;
      if (!tier->reads_chunk_meta()) continue;
      batch.clear();
      asked.clear();
      for (size_t i : pending) {
        LowerTier::MetaGet g;
        g.ref.key = (*reads)[i].key;
        if (store_internal::SharedChunk(s, g.ref.key)) {
          if (!tier->serves_published()) continue;  // a publisher's chunk: not in this tier
          g.ref.ns = &s->remote_ns;
          g.ref.key.seq = s->remote_seq;
        }
        batch.push_back(std::move(g));
        asked.push_back(i);
      }
      if (batch.empty()) continue;
      tier->GetChunkMetas(&batch);
      for (size_t j = 0; j < batch.size(); ++j) {
        const size_t i = asked[j];
        ReprRead& r = (*reads)[i];
        Status got = std::move(batch[j].status);
        if (got.ok()) {
          Result<store_records::ChunkMeta> m = DecodeChunkMeta(batch[j].meta, r.key, repr_bytes);
          if (m.ok()) {
            std::memcpy(r.dst, m->repr.data(), repr_bytes);
            r.status = Status::Ok();
            continue;
          }
          got = m.status();
        }
        // Each tier serves what the ones before it lost or damaged; every failure is reported.
        r.status = tried[i] ? Status(got.code(), r.status.message() + "; " + got.message()) : std::move(got);
        tried[i] = 1;
      }
      still.clear();
      for (size_t i : pending)
        if (!(*reads)[i].status.ok()) still.push_back(i);
      pending.swap(still);
    }
  }
  Status first;
  for (ReprRead& r : *reads) {
    if (r.status.ok()) continue;
    r.status =
        Status(r.status.code(), "representatives of chunk " + r.key.ToString() +
                                    " could not be read back from the lower tiers: " + r.status.message());
    if (first.ok()) first = r.status;
  }
  return first;
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
