// TieredStore, part "landing": completes sealed chunks. A sealed chunk's download (ring ->
// warm slot) may still be in flight on a device tier; landing waits for it, chooses the
// chunk's representative keys from the warm copy, publishes the chunk to the warm tier
// (warm policy, counters) and issues its write-through to the lower tiers. Until then the
// chunk is not fetchable, not indexed, not written down and not demotable (see "Landing"
// in offload/tiered_store.h).
//
// Who lands: the sequence's driver, never a reader. The appending thread lands what is
// complete at each Append and keeps at most max_landing_chunks in flight per layer
// (SealOldestChunk); the layer step's door (BeginLayerStep) lands its layer; the calls that
// change or end the sequence land it (FetchChunks, SetChunkScores and DropChunks their layer;
// Flush, CloseSequence, DropSequence, PublishSequence all layers); WaitForDurable and the
// destructor land every sequence, and an Append that finds the warm tier full of landing
// chunks lands them (their slots are the only room left). Readers (ListChunks, ChunkCount,
// GetRepresentatives, ChunkUpdatesSince, ReadTokens, counters(), ...) are const in spirit and
// in signature where they can be: they see the landed chunks only (Chunk::landing) and report
// the rest (StoreCounters::chunks_landing). So a reader on one thread never runs the device
// waits and representative choices of a sequence another thread drives.
//
// Locking: the landing queue (LayerState::landing, landers, landing_error) and the
// counters are under mu_. A lander claims the queue's oldest entry under mu_, then drops
// mu_ to wait for the download and choose representatives (nobody reads the chunk's repr
// before it is published, under mu_ again). Sequence::busy is held while mu_ is dropped,
// so a concurrent DropSequence waits instead of freeing the layer.

#include "offload/representatives.h"
#include "offload/store_state.h"
#include "offload/tiered_store.h"

namespace kvtier {

using store_internal::LandingChunk;

void TieredStore::LandLayerLocked(std::unique_lock<CountingMutex>& lock, Sequence* s, int layer, size_t keep,
                                  bool only_complete) {
  LayerState& ls = s->layers[layer];
  if (ls.landing.size() <= keep && ls.landers == 0) return;  // the common case: nothing in flight
  // Busy while the lock is dropped below: a DropSequence on another thread (WaitForDurable
  // lands every sequence) waits for this landing instead of freeing `ls`.
  s->busy++;
  struct Unbusy {
    TieredStore* store;
    Sequence* s;
    ~Unbusy() {  // the lock is held again on every way out
      s->busy--;
      store->cv_.notify_all();
    }
  } unbusy{this, s};
  for (;;) {
    while (ls.landing.size() > keep) {
      if (only_complete) {
        const Result<bool> done = hot_->TransferDone(ls.landing.front().ticket);
        if (done.ok() && !*done) break;  // an error: WaitTransfer below reports it
      }
      // Claimed: this thread lands it without the lock; others that need the layer landed
      // wait for `landers` to drop.
      LandingChunk p = std::move(ls.landing.front());
      ls.landing.pop_front();
      ls.landers++;
      Chunk* c = p.chunk;
      const uint8_t* warm_copy = warm_->slot_data(c->warm_slot);
      lock.unlock();
      Status st = hot_->WaitTransfer(p.ticket);
      if (st.ok()) {
        // The keys from the warm copy just landed ([K chunk] first): the same bytes as the
        // ring's were, and host memory whatever device the hot tier is on. Nobody reads
        // c->repr before the chunk is published below, under the lock.
        st = ReturnOnBadAlloc("landing a chunk: its representatives", [&] {
          RepresentativeInput ri;
          ri.geometry = options_.geometry;
          ri.chunk_size = options_.chunk_size;
          ri.repr_topk = options_.repr_topk;
          ri.choice = options_.repr_choice;
          ri.keys = warm_copy;
          ri.mass = p.mass.data();  // head h at h * chunk_size
          ri.mass_stride = static_cast<size_t>(options_.chunk_size);
          return ChooseRepresentatives(ri, c->repr.data());
        });
      }
      lock.lock();
      landing_chunks_--;
      if (!st.ok()) {
        landing_failures_++;
        // Lost before any lower tier acknowledged it: its index becomes a hole (as a chunk
        // dropped by compression), and the failure goes to the next call that lands the layer.
        if (ls.landing_error.ok())
          ls.landing_error = Status(st.code(), "sealing chunk " + c->key.ToString() +
                                                   " failed and its tokens are lost: " + st.message());
        ls.chunks[c->key.index] = nullptr;
        chunk_by_id_.erase(c->id);
        repr_chunks_--;
        warm_->Release(c->warm_slot);
        delete c;
      } else {
        c->tiers = kTierWarm;
        c->landing = false;
        warm_policy_->OnInsert(c->id);
        counters_.warm_chunks = warm_->used() - landing_chunks_;
        counters_.chunks_sealed++;
        counters_.bytes_moved += chunk_bytes_;
        if (options_.write_through && !lower_.empty()) {
          c->lower_writing = true;       // keeps the warm pin until the write is done
          const float score = c->score;  // snapshot under the lock (see Chunk::score)
          lock.unlock();
          SubmitLowerWrite(c, warm_copy, score);
          lock.lock();
        } else {
          c->warm_pins = 0;
        }
      }
      ls.landers--;
      cv_.notify_all();
    }
    // Landed completely only once the landings other threads claimed are published too (and
    // whatever was sealed meanwhile is landed by this loop).
    if (keep > 0 || only_complete || (ls.landers == 0 && ls.landing.empty())) return;
    cv_.wait(lock);
  }
}

void TieredStore::LandSequenceLocked(std::unique_lock<CountingMutex>& lock, Sequence* s) {
  for (int l = 0; l < static_cast<int>(s->layers.size()); ++l) LandLayerLocked(lock, s, l);
}

bool TieredStore::LandEverythingLocked(std::unique_lock<CountingMutex>& lock) {
  if (landing_chunks_ == 0) return false;
  const uint64_t before = counters_.chunks_sealed + landing_failures_;
  // Ids first: the map may change while a landing drops the lock (a drop waits for the
  // landings of its sequence, so a sequence found here stays while it is landed).
  std::vector<SequenceId> ids;
  for (const auto& [id, seq] : sequences_) ids.push_back(id);
  for (SequenceId id : ids) {
    auto it = sequences_.find(id);
    if (it != sequences_.end()) LandSequenceLocked(lock, it->second.get());
  }
  return counters_.chunks_sealed + landing_failures_ != before;
}

uint64_t TieredStore::LandedEndLocked(const LayerState& ls) const {
  size_t in_flight = ls.landing.size() + static_cast<size_t>(ls.landers);
  if (in_flight == 0) return ls.chunks.size();
  // The landing chunks are among the newest, not always the last ones (two threads may land
  // a layer's chunks out of order): the first of them ends what readers see.
  uint64_t end = ls.chunks.size();
  for (size_t i = ls.chunks.size(); i > 0 && in_flight > 0; --i)
    if (const Chunk* c = ls.chunks[i - 1]; c != nullptr && c->landing) {
      end = i - 1;
      in_flight--;
    }
  return end;
}

Status TieredStore::Flush(SequenceId seq) {
  CountVisit();
  std::unique_lock<CountingMutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, 0, false, &s));
  LandSequenceLocked(l, s);
  return TakeLandingErrorLocked(s);
}

Status TieredStore::TakeLandingErrorLocked(LayerState& ls) {
  Status st = std::move(ls.landing_error);
  ls.landing_error = Status::Ok();
  return st;
}

Status TieredStore::TakeLandingErrorLocked(Sequence* s) {
  Status first;
  for (LayerState& ls : s->layers) {
    Status st = TakeLandingErrorLocked(ls);
    if (first.ok()) first = std::move(st);
  }
  return first;
}

}  // namespace kvtier
