// Landing: see offload/store/landing.h.

#include "offload/store/landing.h"

#include <vector>

#include "offload/representatives.h"

namespace kvtier {

using store_internal::Chunk;
using store_internal::LandingChunk;
using store_internal::LayerState;
using store_internal::Sequence;

Landing::Landing(const StoreOptions& options, size_t chunk_bytes, const LayerRing& ring, const Parts& parts)
    : options_(options), chunk_bytes_(chunk_bytes), ring_(ring), parts_(parts) {}

Status Landing::Seal(Sequence* s, int layer) {
  LayerState& ls = s->layers[layer];
  const int64_t first = ls.sealed_end;
  const int64_t slot0 = ring_.OldestChunkSlot(ls);
  const size_t token_bytes = chunk_bytes_ / 2 / static_cast<size_t>(options_.chunk_size);
  // The statistics of the positions the chunk leaves, taken now: they are reset below and
  // the positions refilled before the chunk lands. Allocated before anything changes, with the
  // representatives' room, so that running out of memory here loses nothing.
  LandingChunk landing;
  landing.mass = ring_.OldestChunkMass(ls);
  std::vector<uint8_t> repr(options_.repr_bytes());
  Chunk* c = nullptr;
  uint8_t* dst = nullptr;
  {
    std::unique_lock<CountingMutex> lock(parts_.sync->mu);
    KVTIER_RETURN_IF_ERROR(parts_.warm->MakeRoom(lock, *parts_.sync, *parts_.writer,
                                                 [&] { return in_flight_ > 0 && LandEverything(lock); }));
    const int32_t slot = parts_.warm->Acquire();
    if (slot < 0) return Internal("warm tier reported room but had no free slot");
    c = parts_.catalog->Create(ChunkKey{s->id, static_cast<uint32_t>(layer), ls.chunks.size()}, first,
                               std::move(repr));  // representatives chosen when the chunk lands
    c->warm_slot = slot;
    c->warm_pins = 1;  // being filled
    c->landing = true;
    ls.chunks.push_back(c);
    in_flight_++;  // from here on its warm slot is not counted as a warm chunk
    dst = parts_.warm->slot_data(c->warm_slot);
  }
  // Submit the download into the (pinned) warm slot, [K chunk][V chunk], and return without
  // waiting: on a device tier the copy overlaps what the engine does next. The ring
  // positions it reads are refilled by this sequence's next Append before the chunk lands;
  // that is safe because every copy into hot memory (Upload, CopyWithin) goes through the
  // same tier, which runs its copies in submission order (CudaHotTier: one transfer
  // stream), so the refill is ordered after the download read the old bytes.
  const size_t half = chunk_bytes_ / 2;
  const HotTier::DownloadOp ops[] = {{dst, ls.ring_k + slot0 * token_bytes, half},
                                     {dst + half, ls.ring_v + slot0 * token_bytes, half}};
  Result<TransferTicket> ticket = parts_.hot->DownloadBatchAsync(ops, 2);
  std::unique_lock<CountingMutex> lock(parts_.sync->mu);
  if (!ticket.ok()) {
    // Nothing was submitted: the chunk stays in the ring, and the next Append seals it again.
    ls.chunks.pop_back();
    parts_.warm->Release(c->warm_slot);
    parts_.catalog->Forget(c);
    in_flight_--;
    return ticket.status();
  }
  ring_.AdvancePastOldestChunk(ls);
  landing.chunk = c;
  landing.ticket = *ticket;
  ls.landing.push_back(std::move(landing));
  // A host tier's download is complete already: the chunk lands here, as if sealing were
  // synchronous. A device tier's lands at this sequence's next driving call (Append, the
  // layer step's door, Flush, ...), or here when too many are in flight.
  LandLayer(lock, s, layer, static_cast<size_t>(options_.max_landing_chunks), false);
  LandLayer(lock, s, layer, 0, true);
  return Status::Ok();
}

void Landing::LandLayer(std::unique_lock<CountingMutex>& lock, Sequence* s, int layer, size_t keep,
                        bool only_complete) {
  LayerState& ls = s->layers[layer];
  if (ls.landing.size() <= keep && ls.landers == 0) return;  // the common case: nothing in flight
  StoreSync& sync = *parts_.sync;
  // Busy while the lock is dropped below: a DropSequence on another thread (WaitForDurable
  // lands every sequence) waits for this landing instead of freeing `ls`.
  s->busy++;
  struct Unbusy {
    StoreSync& sync;
    Sequence* s;
    ~Unbusy() {  // the lock is held again on every way out
      s->busy--;
      sync.cv.notify_all();
    }
  } unbusy{sync, s};
  for (;;) {
    while (ls.landing.size() > keep) {
      if (only_complete) {
        if (parts_.hold_landing && parts_.hold_landing()) break;
        const Result<bool> done = parts_.hot->TransferDone(ls.landing.front().ticket);
        if (done.ok() && !*done) break;  // an error: WaitTransfer below reports it
      }
      // Claimed: this thread lands it without the lock; others that need the layer landed
      // wait for `landers` to drop.
      LandingChunk p = std::move(ls.landing.front());
      ls.landing.pop_front();
      ls.landers++;
      Chunk* c = p.chunk;
      const uint8_t* warm_copy = parts_.warm->slot_data(c->warm_slot);
      lock.unlock();
      Status st = parts_.hot->WaitTransfer(p.ticket);
      if (st.ok()) {
        // The keys from the warm copy just landed ([K chunk] first): the same bytes as the
        // ring's were, and host memory whatever device the hot tier is on. Nobody reads
        // c->repr before the chunk is published below, under the lock.
        st = ReturnOnBadAlloc("landing a chunk: its representatives", [&] {
          RepresentativeInput ri;
          ri.geometry = options_.geometry;
          ri.chunk_size = options_.chunk_size;
          ri.repr_topk = options_.repr_topk;
          ri.out_heads = options_.repr_head_count();
          ri.choice = options_.repr_choice;
          ri.keys = warm_copy;
          ri.mass = p.mass.data();  // head h at h * chunk_size
          ri.mass_stride = static_cast<size_t>(options_.chunk_size);
          return ChooseRepresentatives(ri, c->repr.data());
        });
      }
      lock.lock();
      in_flight_--;
      StoreCounters& counters = *parts_.counters;
      if (!st.ok()) {
        failures_++;
        // Lost before any lower tier acknowledged it: its index becomes a hole (as a chunk
        // dropped by compression), and the failure goes to the next call that lands the layer.
        if (ls.landing_error.ok())
          ls.landing_error = Status(st.code(), "sealing chunk " + c->key.ToString() +
                                                   " failed and its tokens are lost: " + st.message());
        ls.chunks[c->key.index] = nullptr;
        // A device reader may have been handed its slot (WarmAddresses with include_landing): a
        // free slot is never exposed.
        (void)parts_.warm->FenceFor(c);
        parts_.warm->Release(c->warm_slot);
        parts_.catalog->Forget(c);
      } else {
        c->landing = false;
        parts_.warm->Hold(c, c->warm_slot);
        counters.warm_chunks = parts_.warm->used() - in_flight_;
        counters.chunks_sealed++;
        counters.bytes_moved += chunk_bytes_;
        if (options_.write_through && !parts_.lower->empty()) {
          c->lower_writing = true;       // keeps the warm pin until the write is done
          const float score = c->score;  // snapshot under the lock (see Chunk::score)
          lock.unlock();
          parts_.writer->Submit(c, warm_copy, score);
          lock.lock();
        } else {
          c->warm_pins = 0;
        }
      }
      ls.landers--;
      sync.cv.notify_all();
    }
    // Landed completely only once the landings other threads claimed are published too (and
    // whatever was sealed meanwhile is landed by this loop).
    if (keep > 0 || only_complete || (ls.landers == 0 && ls.landing.empty())) return;
    sync.cv.wait(lock);
  }
}

void Landing::ListLanding(const LayerState& ls, std::vector<SealingChunk>* out) const {
  out->reserve(ls.landing.size());
  for (const LandingChunk& p : ls.landing) {
    SealingChunk c;
    c.index = p.chunk->key.index;
    c.first_position = p.chunk->first_token;
    c.mass = p.mass;
    out->push_back(std::move(c));
  }
}

void Landing::LandSequence(std::unique_lock<CountingMutex>& lock, Sequence* s) {
  for (int l = 0; l < static_cast<int>(s->layers.size()); ++l) LandLayer(lock, s, l);
}

bool Landing::LandEverything(std::unique_lock<CountingMutex>& lock) {
  if (in_flight_ == 0) return false;
  const uint64_t before = parts_.counters->chunks_sealed + failures_;
  // Ids first: the table may change while a landing drops the lock (a drop waits for the
  // landings of its sequence, so a sequence found here stays while it is landed).
  for (SequenceId id : parts_.sequences->Ids())
    if (Sequence* s = parts_.sequences->Find(id)) LandSequence(lock, s);
  return parts_.counters->chunks_sealed + failures_ != before;
}

Status Landing::TakeError(LayerState& ls) {
  Status st = std::move(ls.landing_error);
  ls.landing_error = Status::Ok();
  return st;
}

Status Landing::TakeError(Sequence* s) {
  Status first;
  for (LayerState& ls : s->layers) {
    Status st = TakeError(ls);
    if (first.ok()) first = std::move(st);
  }
  return first;
}

}  // namespace kvtier
