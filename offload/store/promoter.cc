// Promoter: see offload/store/promoter.h.

#include "offload/store/promoter.h"

#include <algorithm>
#include <thread>
#include <unordered_set>

#include "offload/transfer_engine.h"

namespace kvtier {

using store_internal::Chunk;
using store_internal::LayerState;
using store_internal::Sequence;

// A live fetch is a HotPool::Holder: its pinned chunks (chunk_ids, request order) and the
// thread whose FetchChunks took them (thread).
struct FetchHandle::State : HotPool::Holder {
  Promoter* promoter = nullptr;
  std::vector<uint8_t> needs_load;
  std::vector<kernels::KvSpan> spans;
  std::vector<std::pair<uint64_t, int32_t>> awaited;  // (chunk id, slot) loading under another fetch
  // Whoever claims the loads first runs them: the transfer task, or the caller's Wait() when the
  // transfer workers are still busy with earlier work (a backlog of lower-tier writes after a long
  // prefill must not stall a decode step's fetch behind it).
  std::atomic<bool> claimed{false};
  // Every chunk was hot, none loading, when FetchChunks returned: Wait has nothing to wait
  // for and takes no lock. Set before the handle is handed out, never changed.
  bool complete_at_issue = false;
  bool done = false;
  bool released = false;
  Status status;
};

FetchHandle::~FetchHandle() { Release(); }

FetchHandle::FetchHandle(FetchHandle&& o) noexcept : state_(std::move(o.state_)) {}

FetchHandle& FetchHandle::operator=(FetchHandle&& o) noexcept {
  if (this != &o) {
    Release();
    state_ = std::move(o.state_);
  }
  return *this;
}

bool FetchHandle::Ready() const {
  if (!state_) return true;
  std::lock_guard<CountingMutex> l(state_->promoter->parts_.sync->mu);
  return state_->promoter->CompleteLocked(state_.get());
}

Status FetchHandle::Wait(std::chrono::milliseconds timeout) {
  if (!state_) return FailedPrecondition("fetch handle is empty (released or never started)");
  if (state_->complete_at_issue) return Status::Ok();
  Promoter* p = state_->promoter;
  if (!state_->claimed.exchange(true)) p->Run(state_);  // not started yet: load on this thread
  std::unique_lock<CountingMutex> l(p->parts_.sync->mu);
  if (!p->parts_.sync->cv.wait_for(l, timeout, [&] { return p->CompleteLocked(state_.get()); }))
    return TimedOut("fetch of " + std::to_string(state_->chunk_ids.size()) + " chunks not done after " +
                    std::to_string(timeout.count()) + " ms (the transfer continues)");
  if (!state_->status.ok()) return state_->status;
  // Chunks another fetch was loading: make sure that load succeeded.
  for (auto [id, slot] : state_->awaited) {
    const Chunk* c = p->parts_.catalog->Find(id);
    if (c == nullptr || c->hot_slot != slot)
      return Unavailable("fetch: a chunk loaded by a concurrent fetch did not arrive (that fetch failed)");
  }
  return Status::Ok();
}

const std::vector<kernels::KvSpan>& FetchHandle::spans() const {
  static const std::vector<kernels::KvSpan> kEmpty;
  return state_ ? state_->spans : kEmpty;
}

void FetchHandle::Release() {
  if (!state_) return;
  state_->promoter->Release(state_.get());
  state_.reset();
}

bool Promoter::CompleteLocked(const FetchHandle::State* st) const {
  if (!st->done) return false;
  for (auto [id, slot] : st->awaited) {
    const Chunk* c = parts_.catalog->Find(id);
    if (c != nullptr && c->hot_loading && c->hot_slot == slot) return false;
  }
  return true;
}

Result<FetchHandle> Promoter::Fetch(SequenceId seq, int layer, const std::vector<uint64_t>& asked,
                                    FetchFit fit) {
  return ReturnOnBadAlloc("FetchChunks: the fetch's chunk lists", [&]() -> Result<FetchHandle> {
    auto st = std::make_shared<FetchHandle::State>();
    st->promoter = this;
    st->thread = std::this_thread::get_id();
    // The chunks this attempt fetches: `asked`, or (kWithinClaims) its first ones.
    std::vector<uint64_t> fitted;
    const std::vector<uint64_t>* chunks_ptr = &asked;
    bool any_load = false;
    bool all_warm = true;  // every load has a warm copy (none reads a lower tier)
    {
      std::unique_lock<CountingMutex> l(parts_.sync->mu);
      Sequence* s = nullptr;
      LayerState* lsp = nullptr;
      std::vector<uint64_t> requested;  // chunk ids, sorted, each once
      // One clock reading per attempt: the leases it finds expired and the ones it grants.
      Clock::time_point now{};
      // Waiting for slots (see FetchChunks in the header): started when the first check finds
      // too little room, so a fetch that never waits reads no clock for it.
      std::chrono::steady_clock::time_point wait_start{}, wait_deadline{};
      bool waited = false;
      uint64_t ticket = 0;  // in the pool's waiters while this call waits
      const auto end_wait = [&] {
        if (!waited) return;
        parts_.counters->pin_wait_us +=
            static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                      std::chrono::steady_clock::now() - wait_start)
                                      .count());
        waited = false;
        parts_.pool->EndWaitLocked(ticket);
        parts_.sync->cv.notify_all();  // the next waiter may be the oldest now
      };
      for (;;) {
        // (Re)checked after every wait: the lock was dropped.
        Status checked = parts_.sequences->Check(seq, layer, false, &s);
        if (!checked.ok()) {
          end_wait();
          return checked;
        }
        parts_.landing->LandLayer(l, s, layer);
        checked = Landing::TakeError(s->layers[layer]);
        if (!checked.ok()) {
          end_wait();
          return checked;
        }
        lsp = &s->layers[layer];
        now = hooks_.clock->Now();
        if (fit == FetchFit::kWithinClaims) {
          const size_t keep = parts_.pool->FitWithinClaimsLocked(seq, asked.size(), now);
          if (keep < asked.size()) {
            fitted.assign(asked.begin(), asked.begin() + static_cast<ptrdiff_t>(keep));
            chunks_ptr = &fitted;
          } else {
            chunks_ptr = &asked;
          }
        }
        const std::vector<uint64_t>& chunk_indices = *chunks_ptr;
        if (static_cast<int64_t>(chunk_indices.size()) > parts_.hot->slot_capacity()) {
          end_wait();
          return ResourceExhausted("fetch of " + std::to_string(chunk_indices.size()) +
                                   " chunks exceeds the hot tier's " +
                                   std::to_string(parts_.hot->slot_capacity()) + " slots (hot_bytes)");
        }
        requested.clear();
        int64_t need = 0;  // chunks with no hot slot, each once
        // The chunks' records are scattered and cold in the cache after a search: each is read
        // through the layer's table, with no chunk_by_id_ lookup unless a chunk is asked twice.
        for (uint64_t idx : chunk_indices) {
          if (idx >= lsp->chunks.size() || lsp->chunks[idx] == nullptr) {
            end_wait();
            return InvalidArgument(
                "fetch: chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                " does not exist (layer has " + std::to_string(lsp->chunks.size()) + " chunks)");
          }
          const Chunk* c = lsp->chunks[idx];
          requested.push_back(c->id);
          if (c->hot_slot < 0) need++;
        }
        std::sort(requested.begin(), requested.end());
        const size_t listed = requested.size();
        requested.erase(std::unique(requested.begin(), requested.end()), requested.end());
        if (requested.size() != listed) {  // a chunk asked for twice: count its slot once
          need = 0;
          for (uint64_t id : requested)
            if (parts_.catalog->Find(id)->hot_slot < 0) need++;
        }
        if (need == 0) break;
        // An older fetch waits: one that holds no pin queues behind it (see the header).
        const bool behind = options_.pin_wait_ms > 0 && parts_.pool->BehindLocked(ticket);
        const HotPool::Room room = parts_.pool->RoomLocked(seq, need, requested, now, behind);
        if (room.available >= need && (!behind || room.held_self > 0)) break;
        // Too few slots. Waiting is safe while this sequence holds no pin, or stays within its
        // reservation with this fetch (the header says why); otherwise it could wait for
        // itself, or for a sequence that waits for it. A sequence that holds pins never queues
        // behind others: the oldest waiter may be waiting for exactly those pins.
        const int64_t reserved = parts_.pool->ReservedForLocked(seq);
        const bool may_wait = room.held_self == 0 || room.held_self + need <= reserved;
        const std::string numbers =
            "the fetch needs " + std::to_string(need) + " more hot slots; of the pool's " +
            std::to_string(parts_.hot->slot_capacity()) + ", " + std::to_string(room.held_other) +
            " are pinned or loading for other sequences and " + std::to_string(room.held_self) +
            " for this one (sequence " + std::to_string(seq) + ", reservation " + std::to_string(reserved) +
            ")";
        if (!may_wait) {
          end_wait();
          return ResourceExhausted(
              "hot tier: " + numbers +
              "; waiting could deadlock, as this sequence would hold more than its reservation: "
              "release its other fetch handles (LayerParts) first, or raise hot_bytes");
        }
        const auto real_now = std::chrono::steady_clock::now();
        if (!waited) {  // the first wait of this call
          // Only other threads can free slots while this one waits: if what they hold cannot
          // cover the need, the wait could only end by this thread's own releases. (Checked
          // once: this thread's pins cannot grow while it waits.)
          const int64_t mine = room.available < need ? parts_.pool->HeldByThreadLocked(st->thread, now) : 0;
          if (room.available + room.held_self + room.held_other - mine < need) {
            return ResourceExhausted(
                "hot tier: " + numbers + "; the calling thread holds " + std::to_string(mine) +
                " of them through its own live fetch handles (LayerParts), so it would wait for itself "
                "(pin_wait_ms): release those handles before fetching more, or raise hot_bytes");
          }
          wait_start = real_now;
          wait_deadline = real_now + std::chrono::milliseconds(options_.pin_wait_ms);
          parts_.counters->pin_waits++;
          waited = true;
          ticket = parts_.pool->StartWaitLocked();
        }
        if (real_now >= wait_deadline) {
          if (room.available >= need) break;  // queued behind a waiter for that long: go ahead
          end_wait();
          parts_.counters->pin_wait_timeouts++;
          return ResourceExhausted(
              "hot tier: " + numbers + "; waited " + std::to_string(options_.pin_wait_ms) +
              " ms (pin_wait_ms) for them to be unpinned; release fetch handles or raise hot_bytes");
        }
        // Unpins and finished loads notify; an expiring lease does not, hence the slice.
        parts_.sync->cv.wait_until(l, std::min(wait_deadline, real_now + std::chrono::milliseconds(20)));
      }
      end_wait();
      LayerState& ls = *lsp;
      const std::vector<uint64_t>& chunk_indices = *chunks_ptr;
      const auto deadline = now + std::chrono::milliseconds(options_.pin_timeout_ms);
      // Allocated before any chunk is pinned, so an allocation failure leaves nothing to undo.
      st->chunk_ids.reserve(chunk_indices.size());
      st->needs_load.reserve(chunk_indices.size());
      st->spans.reserve(chunk_indices.size());
      // On failure, give back what this call took: pins, and slots it assigned
      // but never filled (they would otherwise look "loading" forever).
      const auto undo = [&] {
        for (size_t i = 0; i < st->chunk_ids.size(); ++i) {
          Chunk* c = parts_.catalog->Find(st->chunk_ids[i]);
          c->hot_pins--;
          if (st->needs_load[i]) {
            parts_.hot->ReleaseSlot(c->hot_slot);
            parts_.pool->policy().OnRemove(c->id);
            c->hot_slot = -1;
            c->hot_loading = false;
          }
        }
      };
      for (uint64_t idx : chunk_indices) {
        Chunk* c = ls.chunks[idx];
        bool load = false;
        if (c->hot_slot >= 0) {
          if (c->hot_loading) st->awaited.emplace_back(c->id, c->hot_slot);
          parts_.counters->hits++;
          parts_.pool->policy().OnAccess(c->id);
        } else {
          const int32_t slot = parts_.pool->AcquireSlotLocked(now, parts_.counters);
          if (slot < 0) {  // not expected: RoomLocked counted the room under this lock
            undo();
            return Internal("hot tier: no slot for a fetch the pool was found to have room for (" +
                            std::to_string(parts_.hot->slot_capacity()) + " slots)");
          }
          c->hot_slot = slot;
          c->hot_loading = true;
          parts_.pool->policy().OnInsert(c->id);
          parts_.counters->misses++;
          load = true;
          any_load = true;
          all_warm = all_warm && c->warm_slot >= 0;
        }
        c->hot_pins++;
        c->pin_deadline = std::max(c->pin_deadline, deadline);
        st->chunk_ids.push_back(c->id);
        st->needs_load.push_back(load ? 1 : 0);
        const uint8_t* base = parts_.hot->slot_data(c->hot_slot);
        st->spans.push_back(
            kernels::KvSpan{base, base + chunk_bytes_ / 2, options_.chunk_size, c->first_token, nullptr});
      }
      parts_.counters->hot_chunks = parts_.hot->slots_used();
      if (!any_load) st->done = true;
      st->complete_at_issue = !any_load && st->awaited.empty();
      if (!st->chunk_ids.empty()) parts_.pool->AddHolderLocked(st.get());
    }
    if (any_load && all_warm && parts_.hot->device() == Device::kCpu) {
      // Only memcpys between host tiers (a few microseconds): done here, as the caller would do
      // them on its first Wait, without waking a transfer worker (which then spins for more
      // work, a core's worth of CPU at a fetch per layer step). Reads from a lower tier and
      // uploads to a device tier go to the engine, to overlap with the caller.
      st->claimed = true;
      Run(st);
    } else if (any_load) {
      parts_.engine->Enqueue([this, st] {
        if (!st->claimed.exchange(true)) Run(st);
      });
    } else {
      st->claimed = true;
    }
    FetchHandle h;
    h.state_ = st;
    return h;
  });
}

void Promoter::Run(const std::shared_ptr<FetchHandle::State>& st) {
  // Three phases, so the store lock is taken twice per fetch, not twice per chunk:
  // (1) under the lock, pin each load's warm copy, or reserve the warm slot a chunk coming
  // back from a lower tier will keep its copy in (retrieval tends to come back to the same chunks);
  // (2) without it, the transfer engine reads lower-tier chunks into those slots and uploads to
  // the hot slots; (3) under the lock, unpin, attach the warm copies that arrived, and mark
  // the loads done.
  std::vector<TransferEngine::Load> loads;
  std::vector<Chunk*> chunks;       // parallel to loads
  std::vector<int32_t> read_slots;  // warm slot reserved for a lower-tier read (-1: none was free)
  // Sized once (an upper bound: hits need no load), outside the lock: no regrowth per chunk.
  loads.reserve(st->chunk_ids.size());
  chunks.reserve(st->chunk_ids.size());
  read_slots.reserve(st->chunk_ids.size());
  {
    std::lock_guard<CountingMutex> l(parts_.sync->mu);
    for (size_t i = 0; i < st->chunk_ids.size(); ++i) {
      if (!st->needs_load[i]) continue;
      Chunk* c = parts_.catalog->Find(st->chunk_ids[i]);
      TransferEngine::Load ld;
      ld.key = c->key;
      ld.hot_dst = parts_.hot->slot_data(c->hot_slot);
      ld.ref.key = c->key;
      if (const Sequence* s = parts_.sequences->Find(c->key.seq); store_internal::SharedChunk(s, c->key)) {
        // Its bytes sit under the publisher's namespace and sequence id, in no local tier.
        ld.ref.ns = &s->remote_ns;
        ld.ref.key.seq = s->remote_seq;
      }
      int32_t read_slot = -1;
      if (c->warm_slot >= 0) {
        c->warm_pins++;
        ld.warm_src = parts_.warm->slot_data(c->warm_slot);
        parts_.warm->OnAccess(c->id);
      } else {
        read_slot = parts_.warm->AcquireForRead();
        if (read_slot >= 0) ld.read_buf = parts_.warm->slot_data(read_slot);
      }
      loads.push_back(std::move(ld));
      chunks.push_back(c);
      read_slots.push_back(read_slot);
    }
  }
  parts_.engine->CopyLoads(&loads);

  std::lock_guard<CountingMutex> l(parts_.sync->mu);
  Status first_error;
  for (size_t j = 0; j < loads.size(); ++j) {
    const TransferEngine::Load& ld = loads[j];
    Chunk* c = chunks[j];
    if (ld.warm_src != nullptr) {
      c->warm_pins--;
    } else {
      parts_.counters->cold_reads++;
      if (read_slots[j] >= 0) {
        if (ld.status.ok() && c->warm_slot < 0) {
          parts_.warm->Hold(c, read_slots[j]);
          parts_.counters->promotions++;
          parts_.counters->bytes_moved += chunk_bytes_;
        } else {
          parts_.warm->Release(read_slots[j]);
        }
      }
    }
    if (ld.status.ok()) {
      parts_.counters->promotions++;
      parts_.counters->bytes_moved += chunk_bytes_;
      if (ld.source == nullptr)
        parts_.counters->warm_loads++;
      else
        ld.source->CountLoad(parts_.counters);
    } else if (first_error.ok()) {
      first_error = ld.status;
    }
  }
  for (Chunk* c : chunks) {
    c->hot_loading = false;
    if (first_error.ok()) c->tiers |= kTierHot;
  }
  if (!first_error.ok()) {
    // Failed loads must not stay in hot slots holding garbage.
    for (Chunk* c : chunks) {
      parts_.hot->ReleaseSlot(c->hot_slot);
      parts_.pool->policy().OnRemove(c->id);
      c->hot_slot = -1;
      c->tiers &= ~kTierHot;
    }
  }
  parts_.counters->warm_chunks = parts_.warm->used();
  st->status = first_error;
  st->done = true;
  parts_.sync->cv.notify_all();
}

// A warm-only fetch: the chunks it reads (ids, with their keys for messages), and its outcome,
// published by `done` (release) once the last read was attached.
struct WarmFetchHandle::State {
  Promoter* promoter = nullptr;
  int layer = 0;
  std::vector<uint64_t> chunk_ids;  // the chunks this fetch reads (warm_reading set by it)
  std::atomic<bool> done{false};
  Status status;  // written before `done`
};

bool WarmFetchHandle::Ready() const {
  return state_ == nullptr || state_->done.load(std::memory_order_acquire);
}

Status WarmFetchHandle::Wait(std::chrono::milliseconds timeout) const {
  if (Ready()) return status();
  StoreSync* sync = state_->promoter->parts_.sync;
  std::unique_lock<CountingMutex> l(sync->mu);
  if (!sync->cv.wait_for(l, timeout, [&] { return state_->done.load(std::memory_order_acquire); }))
    return TimedOut("warm-only fetch of " + std::to_string(state_->chunk_ids.size()) + " chunks of layer " +
                    std::to_string(state_->layer) + " not done after " + std::to_string(timeout.count()) +
                    " ms (the reads continue)");
  return state_->status;
}

Status WarmFetchHandle::status() const {
  if (state_ == nullptr) return Status::Ok();
  if (!state_->done.load(std::memory_order_acquire))
    return FailedPrecondition("warm-only fetch not done yet (WarmFetchHandle::Ready)");
  return state_->status;
}

size_t WarmFetchHandle::reads() const { return state_ ? state_->chunk_ids.size() : 0; }

Result<WarmFetchHandle> Promoter::FetchToWarm(SequenceId seq, int layer, const std::vector<uint64_t>& asked) {
  return ReturnOnBadAlloc("FetchToWarm: the fetch's chunk list", [&]() -> Result<WarmFetchHandle> {
    auto st = std::make_shared<WarmFetchHandle::State>();
    st->promoter = this;
    st->layer = layer;
    st->chunk_ids.reserve(asked.size());
    {
      // One lock entry: checks, and marks the chunks to read. Nothing here waits: no landing
      // (a chunk still landing holds its warm slot already), no room made (the worker makes it).
      std::lock_guard<CountingMutex> l(parts_.sync->mu);
      Sequence* s = nullptr;
      KVTIER_RETURN_IF_ERROR(parts_.sequences->Check(seq, layer, false, &s));
      const LayerState& ls = s->layers[layer];
      for (uint64_t idx : asked)
        if (idx >= ls.chunks.size() || ls.chunks[idx] == nullptr)
          return InvalidArgument(
              "FetchToWarm: chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
              " does not exist (layer has " + std::to_string(ls.chunks.size()) + " chunks)");
      for (uint64_t idx : asked) {
        Chunk* c = ls.chunks[idx];
        // In warm (or landing into it), or an earlier warm-only fetch reads it: nothing to do.
        if (c->warm_slot >= 0 || c->warm_reading) continue;
        c->warm_reading = true;
        st->chunk_ids.push_back(c->id);
      }
    }
    if (st->chunk_ids.empty()) {
      st->done.store(true, std::memory_order_release);
    } else {
      parts_.engine->Enqueue([this, st] { RunToWarm(st); });
    }
    WarmFetchHandle h;
    h.state_ = std::move(st);
    return h;
  });
}

void Promoter::RunToWarm(const std::shared_ptr<WarmFetchHandle::State>& st) {
  // As Run's three phases, with warm slots as the only destination: (1) under the lock, a warm
  // slot for each chunk (a free one, or one an acknowledged victim leaves: WarmTier::AcquireForRead,
  // so no chunk leaves warm that no lower tier holds); (2) without it, the reads; (3) under it,
  // each chunk read is held by warm.
  std::vector<TransferEngine::Load> loads;
  std::vector<uint64_t> ids;        // parallel to loads
  std::vector<int32_t> read_slots;  // parallel to loads
  std::string refused;              // the first chunk warm had no room for
  {
    std::lock_guard<CountingMutex> l(parts_.sync->mu);
    for (uint64_t id : st->chunk_ids) {
      Chunk* c = parts_.catalog->Find(id);
      if (c == nullptr) continue;  // dropped meanwhile
      if (c->warm_slot >= 0) {     // came back some other way meanwhile
        c->warm_reading = false;
        continue;
      }
      const int32_t slot = parts_.warm->AcquireForRead();
      if (slot < 0) {
        c->warm_reading = false;
        if (refused.empty()) refused = c->key.ToString();
        continue;
      }
      TransferEngine::Load ld;
      ld.key = c->key;
      ld.read_buf = parts_.warm->slot_data(slot);
      ld.ref.key = c->key;
      if (const Sequence* s = parts_.sequences->Find(c->key.seq); store_internal::SharedChunk(s, c->key)) {
        ld.ref.ns = &s->remote_ns;
        ld.ref.key.seq = s->remote_seq;
      }
      loads.push_back(std::move(ld));
      ids.push_back(id);
      read_slots.push_back(slot);
    }
  }
  if (!loads.empty()) parts_.engine->CopyLoads(&loads);  // hot_dst null: reads only

  std::lock_guard<CountingMutex> l(parts_.sync->mu);
  Status first_error;
  for (size_t j = 0; j < loads.size(); ++j) {
    const TransferEngine::Load& ld = loads[j];
    Chunk* c = parts_.catalog->Find(ids[j]);
    if (c != nullptr) c->warm_reading = false;
    if (ld.status.ok() && c != nullptr && c->warm_slot < 0) {
      parts_.warm->Hold(c, read_slots[j]);
      parts_.counters->cold_reads++;
      parts_.counters->promotions++;
      parts_.counters->bytes_moved += chunk_bytes_;
      if (ld.source != nullptr) ld.source->CountLoad(parts_.counters);
    } else {
      parts_.warm->Release(read_slots[j]);
      if (!ld.status.ok() && first_error.ok())
        first_error =
            Status(ld.status.code(), "bringing chunk " + ld.key.ToString() +
                                         " back to warm from the lower tiers: " + ld.status.message());
    }
  }
  if (first_error.ok() && !refused.empty())
    first_error = ResourceExhausted(
        "warm tier: no room to bring chunk " + refused + " back from the lower tiers: its " +
        std::to_string(parts_.warm->capacity()) +
        " slots hold chunks no lower tier has acknowledged yet, chunks being copied, or chunks a device "
        "reader may still read (the warm reader fence failed); warm_bytes bounds it. It stays in the lower "
        "tiers");
  parts_.counters->warm_chunks = parts_.warm->used();
  st->status = first_error;
  st->done.store(true, std::memory_order_release);
  parts_.sync->cv.notify_all();
}

void Promoter::Release(FetchHandle::State* st) {
  std::unique_lock<CountingMutex> l(parts_.sync->mu);
  // The transfer finishes first: its task still writes into the slots.
  parts_.sync->cv.wait(l, [&] { return st->done; });
  if (st->released) return;
  st->released = true;
  parts_.pool->RemoveHolderLocked(st);
  for (uint64_t id : st->chunk_ids) {
    Chunk* c = parts_.catalog->Find(id);
    if (c == nullptr) continue;  // dropped meanwhile
    if (c->hot_pins > 0) c->hot_pins--;
  }
  parts_.sync->cv.notify_all();
}

}  // namespace kvtier
