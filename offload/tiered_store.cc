#include "offload/tiered_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <unistd.h>

#include "store/coding.h"

#include "offload/representatives.h"
#include "offload/store_records.h"
#include "offload/store_recovery.h"
#include "offload/store_state.h"
#include "offload/transfer_engine.h"

namespace kvtier {

using store_records::EncodeChunkMeta;
using store_records::EncodeSequenceRecord;
using store_records::SeqState;
using store_internal::LandingChunk;

// ---------------------------------------------------------------------------
// Internal state (chunks, layers, sequences: offload/store_state.h)

struct FetchHandle::State {
  TieredStore* store = nullptr;
  std::vector<uint64_t> chunk_ids;  // pinned chunks, request order
  std::vector<uint8_t> needs_load;
  std::vector<kernels::KvSpan> spans;
  std::vector<std::pair<uint64_t, int32_t>> awaited;  // (chunk id, slot) loading under another fetch
  // Whoever claims the loads first runs them: the transfer task, or the caller's Wait() when the
  // transfer workers are still busy with earlier work (a backlog of cold writes after a long
  // prefill must not stall a decode step's fetch behind it).
  std::atomic<bool> claimed{false};
  bool done = false;
  bool released = false;
  Status status;
};

// ---------------------------------------------------------------------------
// Options

Status StoreOptions::Validate() const {
  KVTIER_RETURN_IF_ERROR(geometry.Validate());
  auto positive = [](const char* name, int64_t v) -> Status {
    if (v <= 0) return InvalidArgument(std::string(name) + " must be > 0 (got " + std::to_string(v) + ")");
    return Status::Ok();
  };
  if (n_sink < 0) return InvalidArgument("n_sink must be >= 0 (got " + std::to_string(n_sink) + ")");
  KVTIER_RETURN_IF_ERROR(positive("n_local", n_local));
  KVTIER_RETURN_IF_ERROR(positive("chunk_size", chunk_size));
  KVTIER_RETURN_IF_ERROR(positive("repr_topk", repr_topk));
  KVTIER_RETURN_IF_ERROR(positive("pin_timeout_ms", pin_timeout_ms));
  if (pin_wait_ms < 0)
    return InvalidArgument("pin_wait_ms must be >= 0 (got " + std::to_string(pin_wait_ms) + ")");
  KVTIER_RETURN_IF_ERROR(positive("transfer_threads", transfer_threads));
  KVTIER_RETURN_IF_ERROR(positive("max_landing_chunks", max_landing_chunks));
  if (n_local % chunk_size != 0)
    return InvalidArgument("n_local (" + std::to_string(n_local) + ") must be a multiple of chunk_size (" +
                           std::to_string(chunk_size) + ")");
  if (repr_topk > chunk_size)
    return InvalidArgument("repr_topk (" + std::to_string(repr_topk) + ") must be <= chunk_size (" +
                           std::to_string(chunk_size) + ")");
  if (hot_bytes < chunk_bytes())
    return InvalidArgument("hot_bytes (" + std::to_string(hot_bytes) + ") is smaller than one chunk (" +
                           std::to_string(chunk_bytes()) + " bytes)");
  if (warm_bytes < chunk_bytes())
    return InvalidArgument("warm_bytes (" + std::to_string(warm_bytes) + ") is smaller than one chunk (" +
                           std::to_string(chunk_bytes()) + " bytes)");
  if (!data_dir.empty() && std::filesystem::exists(data_dir) && !std::filesystem::is_directory(data_dir))
    return InvalidArgument("data_dir '" + data_dir + "' is a file, not a directory");
  {
    auto p = MakeDemotionPolicy(hot_policy);
    if (!p.ok()) return InvalidArgument("hot_policy: " + p.status().message());
    auto w = MakeDemotionPolicy(warm_policy);
    if (!w.ok()) return InvalidArgument("warm_policy: " + w.status().message());
  }
  if (!hot_tier_factory) {
    // Keeps the registry's code: Unavailable for "cuda" without a CUDA build or a device, InvalidArgument otherwise.
    Status h = CheckHotTierSpec(hot_tier);
    if (!h.ok()) return Status(h.code(), "hot_tier: " + h.message());
  }
  if (clock == nullptr) return InvalidArgument("clock must not be null (the default is the steady clock)");
  if (!remote.empty()) {
    auto r = ParseRemoteSpec(remote);
    if (!r.ok()) return InvalidArgument("remote: " + r.status().message());
  }
  if (!remote_namespace.empty()) {
    RemoteTierOptions ro;
    ro.endpoints.push_back(RedisEndpoint{"localhost", 6379});
    ro.ns = remote_namespace;
    Status st = ro.Validate();
    if (!st.ok()) return InvalidArgument("remote_namespace: " + st.message());
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// FetchHandle

FetchHandle::~FetchHandle() { Release(); }
FetchHandle::FetchHandle(FetchHandle&& o) noexcept : state_(std::move(o.state_)) {}
FetchHandle& FetchHandle::operator=(FetchHandle&& o) noexcept {
  if (this != &o) { Release(); state_ = std::move(o.state_); }
  return *this;
}

bool FetchHandle::Ready() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> l(state_->store->mu_);
  return state_->store->FetchCompleteLocked(state_.get());
}

Status FetchHandle::Wait(std::chrono::milliseconds timeout) {
  if (!state_) return FailedPrecondition("fetch handle is empty (released or never started)");
  TieredStore* store = state_->store;
  if (!state_->claimed.exchange(true)) store->RunFetch(state_);  // not started yet: load on this thread
  std::unique_lock<std::mutex> l(store->mu_);
  if (!store->cv_.wait_for(l, timeout, [&] { return store->FetchCompleteLocked(state_.get()); }))
    return TimedOut("fetch of " + std::to_string(state_->chunk_ids.size()) + " chunks not done after " +
                    std::to_string(timeout.count()) + " ms (the transfer continues)");
  if (!state_->status.ok()) return state_->status;
  // Chunks another fetch was loading: make sure that load succeeded.
  for (auto [id, slot] : state_->awaited) {
    auto it = store->chunk_by_id_.find(id);
    if (it == store->chunk_by_id_.end() || it->second->hot_slot != slot)
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
  TieredStore* store = state_->store;
  {
    // Wait for the transfer to finish first: the task still writes into the slots.
    std::unique_lock<std::mutex> l(store->mu_);
    store->cv_.wait(l, [&] { return state_->done; });
  }
  store->ReleasePins(state_.get());
  state_.reset();
}

// ---------------------------------------------------------------------------
// Open / recover / close

TieredStore::TieredStore(const StoreOptions& options) : options_(options) {}

TieredStore::~TieredStore() {
  if (engine_) {
    // Downloads in flight write into warm slots: land them (which issues their write-through).
    std::unique_lock<std::mutex> l(mu_);
    LandEverythingLocked(l);
  }
  // Transfer tasks call back into the store: let them finish first.
  if (engine_) engine_->WaitIdle();
  for (auto& [id, seq] : sequences_) {
    for (auto& ls : seq->layers) {
      if (ls.sink_k) hot_->FreeRegion(ls.sink_k, 0);
      if (ls.sink_v) hot_->FreeRegion(ls.sink_v, 0);
      if (ls.ring_k) hot_->FreeRegion(ls.ring_k, 0);
      if (ls.ring_v) hot_->FreeRegion(ls.ring_v, 0);
      for (Chunk* c : ls.chunks) delete c;
    }
  }
}

Result<std::unique_ptr<TieredStore>> TieredStore::Open(const StoreOptions& options) {
  KVTIER_RETURN_IF_ERROR(options.Validate());
  auto store = std::unique_ptr<TieredStore>(new TieredStore(options));
  KVTIER_RETURN_IF_ERROR(store->Init());
  return store;
}

Status TieredStore::Init() {
  token_bytes_ = options_.geometry.token_elems() * DTypeSize(options_.geometry.dtype);
  chunk_bytes_ = options_.chunk_bytes();
  if (options_.hot_tier_factory) {
    KVTIER_ASSIGN_OR_RETURN(hot_, options_.hot_tier_factory(options_.hot_bytes, chunk_bytes_));
    if (hot_ == nullptr) return InvalidArgument("hot_tier_factory returned no hot tier");
  } else {
    KVTIER_ASSIGN_OR_RETURN(hot_, MakeHotTier(options_.hot_tier, options_.hot_bytes, chunk_bytes_));
  }
  // Every slot holds one chunk ([K][V]); spans and copies assume exactly that size.
  if (hot_->slot_bytes() != chunk_bytes_ || hot_->slot_capacity() < 1)
    return InvalidArgument("hot tier (" + std::string(hot_->device()) + ") has " +
                           std::to_string(hot_->slot_capacity()) + " slots of " + std::to_string(hot_->slot_bytes()) +
                           " bytes; the store needs at least one slot of one chunk (" + std::to_string(chunk_bytes_) +
                           " bytes)");
  // A device tier ("cuda") is accepted: nothing in the store dereferences hot memory on the
  // host. Attention runs on the Session's backend for the tier's device
  // (offload/attention_backend.h); chunk scoring reads representatives, which are host data
  // chosen when a sealed chunk lands, from the warm copy it was downloaded into; every other
  // read of hot memory goes through HotTier::Download (ReadTokens, CloseSequence's sinks,
  // ObserveQueries, see there).
  KVTIER_ASSIGN_OR_RETURN(warm_, SlotPool::Create("warm_bytes", options_.warm_bytes, chunk_bytes_, true));
  KVTIER_ASSIGN_OR_RETURN(hot_policy_, MakeDemotionPolicy(options_.hot_policy));
  KVTIER_ASSIGN_OR_RETURN(warm_policy_, MakeDemotionPolicy(options_.warm_policy));
  if (!options_.data_dir.empty()) {
    ColdTierOptions co;
    co.path = options_.data_dir;
    co.compression = options_.compression;
    co.sync_writes = options_.sync_writes;
    co.fault_injector = options_.cold_fault_injector;
    co.accept_lost_chunks = options_.accept_lost_chunks;
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<ColdTier> cold, ColdTier::Open(co));
    cold_ = cold.get();
    lower_.push_back(MakeColdLowerTier(std::move(cold)));
  }
  if (!options_.remote.empty()) {
    KVTIER_ASSIGN_OR_RETURN(RemoteTierOptions ro, ParseRemoteSpec(options_.remote));
    if (!options_.remote_namespace.empty()) {
      ro.ns = options_.remote_namespace;
    } else {
      // Sequence ids restart at 1 in every store: a namespace of its own per Open keeps
      // two stores on one Redis from overwriting each other's chunks.
      char host[64] = {0};
      gethostname(host, sizeof(host) - 1);
      std::string h;
      for (const char* p = host; *p; ++p) h += std::isalnum(static_cast<unsigned char>(*p)) ? *p : '-';
      ro.ns = (h.empty() ? "host" : h) + "-" + std::to_string(getpid()) + "-" +
              std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
    }
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<RemoteTier> remote, RemoteTier::Open(ro));
    remote_ = remote.get();
    lower_.push_back(MakeRemoteLowerTier(std::move(remote)));
  }
  for (const auto& tier : lower_) error_window_ = std::min(error_window_, tier->error_window());
  TransferEngine::Options eo;
  eo.threads = options_.transfer_threads;
  eo.chunk_bytes = chunk_bytes_;
  eo.hot = hot_.get();
  for (const auto& tier : lower_) eo.lower.push_back(tier.get());
  KVTIER_ASSIGN_OR_RETURN(engine_, TransferEngine::Create(eo));
  if (cold_) {
    RecoveredStore rec;
    Status st = RecoverStore(options_, cold_, hot_.get(), &rec);
    // Adopt whatever was rebuilt even on failure: the destructor frees it.
    sequences_ = std::move(rec.sequences);
    chunk_by_id_ = std::move(rec.chunk_by_id);
    next_chunk_id_ = rec.next_chunk_id;
    next_seq_id_ = rec.next_seq_id;
    counters_.cold_chunks += rec.cold_chunks;
    counters_.cold_bytes += rec.cold_bytes;
    region_bytes_ += rec.region_bytes;
    KVTIER_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Sequences

Result<SequenceId> TieredStore::CreateSequence() {
  return ReturnOnBadAlloc("CreateSequence: the sinks and local window of every layer", [&]() -> Result<SequenceId> {
  auto seq = std::make_unique<Sequence>();
  const int L = options_.geometry.layers;
  seq->layers.resize(L);
  const size_t ring = static_cast<size_t>(options_.n_local + options_.chunk_size);
  for (auto& ls : seq->layers) {
    // Sinks may be zero tokens; keep a non-null region so spans are valid.
    KVTIER_ASSIGN_OR_RETURN(ls.sink_k, hot_->AllocateRegion(std::max<size_t>(1, options_.n_sink * token_bytes_)));
    KVTIER_ASSIGN_OR_RETURN(ls.sink_v, hot_->AllocateRegion(std::max<size_t>(1, options_.n_sink * token_bytes_)));
    KVTIER_ASSIGN_OR_RETURN(ls.ring_k, hot_->AllocateRegion(ring * token_bytes_));
    KVTIER_ASSIGN_OR_RETURN(ls.ring_v, hot_->AllocateRegion(ring * token_bytes_));
    ls.ring_mass.assign(static_cast<size_t>(options_.geometry.kv_heads) * ring, 0.0f);
  }
  std::lock_guard<std::mutex> l(mu_);
  seq->id = next_seq_id_++;
  region_bytes_ += L * 2 * (options_.n_sink + ring) * token_bytes_;
  if (cold_) {
    const std::string rec = EncodeSequenceRecord(SeqState::kOpen, std::vector<int64_t>(L, 0));
    KVTIER_RETURN_IF_ERROR(cold_->PutSequence(seq->id, rec));
  }
  const SequenceId id = seq->id;
  sequences_[id] = std::move(seq);
  return id;
  });
}

std::vector<SequenceId> TieredStore::ListSequences() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<SequenceId> ids;
  for (auto& [id, s] : sequences_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

Status TieredStore::CheckLayerLocked(SequenceId seq, int layer, bool for_write, Sequence** out) const {
  auto it = sequences_.find(seq);
  if (it == sequences_.end())
    return NotFound("sequence " + std::to_string(seq) + " does not exist (never created or dropped)");
  if (layer < 0 || layer >= options_.geometry.layers)
    return InvalidArgument("layer " + std::to_string(layer) + " is out of range [0, " +
                           std::to_string(options_.geometry.layers) + ")");
  if (for_write && it->second->state != SeqState::kOpen)
    return FailedPrecondition("sequence " + std::to_string(seq) +
                              (it->second->state == SeqState::kClosed
                                   ? " is closed; it is read-only"
                                   : " was not closed before the store stopped; its chunks are readable but it cannot be appended to"));
  *out = it->second.get();
  return Status::Ok();
}

Result<int64_t> TieredStore::SequenceLength(SequenceId seq, int layer) const {
  std::lock_guard<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  return s->layers[layer].n_tokens;
}

Status TieredStore::Append(SequenceId seq, int layer, const void* k, const void* v, int n, DType dtype,
                           MemorySpace space) {
  Sequence* s = nullptr;
  {
    std::unique_lock<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, true, &s));
    if (n <= 0) return InvalidArgument("Append: token count must be > 0 (got " + std::to_string(n) + ")");
    if (k == nullptr || v == nullptr) return InvalidArgument("Append: k and v must not be null");
    if (dtype != options_.geometry.dtype)
      return InvalidArgument(std::string("Append: dtype ") + DTypeName(dtype) + " does not match the store's " +
                             DTypeName(options_.geometry.dtype));
    if (space != MemorySpace::kHost && space != MemorySpace::kDevice)
      return InvalidArgument("Append: unknown memory space " + std::to_string(static_cast<int>(space)) +
                             " (kHost or kDevice)");
    // Chunks sealed by earlier Appends whose downloads are complete land now (never waiting);
    // a failed one is reported here, before anything is appended.
    LandLayerLocked(l, s, layer, 0, true);
    KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s->layers[layer]));
    // A lower tier that failed a background write: say so now, before appending anything,
    // rather than after waiting for warm room behind it.
    KVTIER_RETURN_IF_ERROR(BackgroundErrorLocked());
    s->busy++;
  }
  // kDevice K/V are already in the tier's memory space: copied within it, never through the host.
  const auto copy_in = [this, space](uint8_t* dst, const uint8_t* src, size_t bytes) {
    return space == MemorySpace::kDevice ? hot_->CopyWithin(dst, src, bytes) : hot_->Upload(dst, src, bytes);
  };
  LayerState& ls = s->layers[layer];
  const auto* kb = static_cast<const uint8_t*>(k);
  const auto* vb = static_cast<const uint8_t*>(v);
  const int64_t ring = options_.n_local + options_.chunk_size;
  Status status;
  int done = 0;
  while (done < n) {
    if (ls.n_tokens < options_.n_sink) {
      const int take = static_cast<int>(std::min<int64_t>(n - done, options_.n_sink - ls.n_tokens));
      status = copy_in(ls.sink_k + ls.n_tokens * token_bytes_, kb + done * token_bytes_, take * token_bytes_);
      if (status.ok())
        status = copy_in(ls.sink_v + ls.n_tokens * token_bytes_, vb + done * token_bytes_, take * token_bytes_);
      if (!status.ok()) break;
      ls.n_tokens += take;
      ls.sealed_end = ls.n_tokens;
      done += take;
      continue;
    }
    if (ls.n_tokens - ls.sealed_end == ring) {
      status = ReturnOnBadAlloc("Append: sealing a chunk", [&] { return SealOldestChunk(s, layer); });
      if (!status.ok()) break;
    }
    // Copy up to the ring's free space, split at the wrap point.
    const int64_t free_tokens = ring - (ls.n_tokens - ls.sealed_end);
    const int64_t slot = (ls.n_tokens - options_.n_sink) % ring;
    const int take = static_cast<int>(std::min<int64_t>({n - done, free_tokens, ring - slot}));
    status = copy_in(ls.ring_k + slot * token_bytes_, kb + done * token_bytes_, take * token_bytes_);
    if (status.ok()) status = copy_in(ls.ring_v + slot * token_bytes_, vb + done * token_bytes_, take * token_bytes_);
    if (!status.ok()) break;
    ls.n_tokens += take;
    done += take;
  }
  std::lock_guard<std::mutex> l(mu_);
  s->busy--;
  cv_.notify_all();
  return status;
}

bool TieredStore::DropWarmCopyLocked() {
  uint64_t victim_id = 0;
  if (!warm_policy_->PickVictim(
          [&](uint64_t id) {
            const Chunk* c = chunk_by_id_.at(id);
            return c->warm_pins == 0 && !c->cold_writing && c->cold_acked;
          },
          &victim_id))
    return false;
  // The cold tier already acknowledged it: the warm copy may leave now.
  Chunk* c = chunk_by_id_.at(victim_id);
  warm_->Release(c->warm_slot);
  c->warm_slot = -1;
  c->tiers &= ~kTierWarm;
  warm_policy_->OnRemove(victim_id);
  counters_.demotions++;
  return true;
}

int32_t TieredStore::AcquireWarmSlotForReadLocked() {
  // A chunk read back from cold was just retrieved, and retrieval tends to come back to
  // the same chunks over the next steps: keep a warm copy, making room by dropping the
  // policy's victim among warm chunks the cold tier already holds. Never waits and never
  // writes: a transfer task must not block on others.
  const int32_t ws = warm_->Acquire();
  if (ws >= 0 || !DropWarmCopyLocked()) return ws;
  return warm_->Acquire();
}

Status TieredStore::MakeWarmRoom(std::unique_lock<std::mutex>& lock) {
  while (warm_->full()) {
    auto movable = [&](uint64_t id) {
      const Chunk* c = chunk_by_id_.at(id);
      return c->warm_pins == 0 && !c->cold_writing;
    };
    if (DropWarmCopyLocked()) continue;
    uint64_t victim_id = 0;
    if (has_lower() && warm_policy_->PickVictim(movable, &victim_id)) {
      // Not yet in cold: write it, and only then let it leave warm.
      KVTIER_RETURN_IF_ERROR(WriteWarmChunkToColdLocked(lock, chunk_by_id_.at(victim_id)));
      continue;
    }
    // Slots held by chunks still landing become warm chunks (movable once acknowledged).
    // (A chunk another thread is between sealing and submitting is not landable yet: the
    // wait below lets that thread go on.)
    if (landing_chunks_ > 0 && LandEverythingLocked(lock)) continue;
    if (!has_lower())
      return ResourceExhausted("warm tier is full (" + std::to_string(warm_->capacity()) +
                               " chunks) and there is no cold tier (data_dir) or remote tier (remote) to demote to");
    // The writes this would wait for are failing: the error, not a wait behind them.
    KVTIER_RETURN_IF_ERROR(BackgroundErrorLocked());
    // Every warm chunk is busy (being copied or written): wait for one to finish.
    cv_.wait_for(lock, std::chrono::milliseconds(100));
  }
  return Status::Ok();
}

Status TieredStore::WriteWarmChunkToColdLocked(std::unique_lock<std::mutex>& lock, Chunk* c) {
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
    std::lock_guard<std::mutex> l(mu_);
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

Status TieredStore::SealOldestChunk(Sequence* s, int layer) {
  LayerState& ls = s->layers[layer];
  const int64_t ring = options_.n_local + options_.chunk_size;
  const int64_t first = ls.sealed_end;
  const int64_t slot0 = (first - options_.n_sink) % ring;  // multiple of chunk_size: chunks never wrap
  const int kv_heads = options_.geometry.kv_heads;
  // The statistics of the positions the chunk leaves, taken now: they are reset below and
  // the positions refilled before the chunk lands.
  LandingChunk landing;
  landing.mass.resize(static_cast<size_t>(kv_heads) * options_.chunk_size);
  for (int h = 0; h < kv_heads; ++h)
    std::copy_n(ls.ring_mass.data() + h * ring + slot0, options_.chunk_size,
                landing.mass.data() + static_cast<size_t>(h) * options_.chunk_size);
  Chunk* c = nullptr;
  uint8_t* dst = nullptr;
  // Allocated before anything changes, so that running out of memory here loses nothing.
  std::vector<uint8_t> repr(static_cast<size_t>(options_.repr_topk) * token_bytes_);
  {
    std::unique_lock<std::mutex> lock(mu_);
    KVTIER_RETURN_IF_ERROR(MakeWarmRoom(lock));
    const int32_t slot = warm_->Acquire();
    if (slot < 0) return Internal("warm tier reported room but had no free slot");
    c = new Chunk();
    c->id = next_chunk_id_++;
    c->key = ChunkKey{s->id, static_cast<uint32_t>(layer), ls.chunks.size()};
    c->first_token = first;
    c->repr = std::move(repr);  // chosen when the chunk lands
    c->warm_slot = slot;
    c->warm_pins = 1;  // being filled
    chunk_by_id_[c->id] = c;
    ls.chunks.push_back(c);
    landing_chunks_++;  // from here on its warm slot is not counted as a warm chunk
    dst = warm_->slot_data(c->warm_slot);
  }
  // Submit the download into the (pinned) warm slot, [K chunk][V chunk], and return without
  // waiting: on a device tier the copy overlaps what the engine does next. The ring
  // positions it reads are refilled by this sequence's next Append before the chunk lands;
  // that is safe because every copy into hot memory (Upload, CopyWithin) goes through the
  // same tier, which runs its copies in submission order (CudaHotTier: one transfer
  // stream), so the refill is ordered after the download read the old bytes.
  const size_t half = static_cast<size_t>(options_.chunk_size) * token_bytes_;
  const HotTier::DownloadOp ops[] = {{dst, ls.ring_k + slot0 * token_bytes_, half},
                                     {dst + half, ls.ring_v + slot0 * token_bytes_, half}};
  Result<TransferTicket> ticket = hot_->DownloadBatchAsync(ops, 2);
  std::unique_lock<std::mutex> lock(mu_);
  if (!ticket.ok()) {
    // Nothing was submitted: the chunk stays in the ring, and the next Append seals it again.
    ls.chunks.pop_back();
    chunk_by_id_.erase(c->id);
    warm_->Release(c->warm_slot);
    landing_chunks_--;
    delete c;
    return ticket.status();
  }
  for (int h = 0; h < kv_heads; ++h) std::fill_n(ls.ring_mass.data() + h * ring + slot0, options_.chunk_size, 0.0f);
  ls.sealed_end += options_.chunk_size;
  landing.chunk = c;
  landing.ticket = *ticket;
  ls.landing.push_back(std::move(landing));
  // A host tier's download is complete already: the chunk lands here, as if sealing were
  // synchronous. A device tier's lands at the next reader, or when too many are in flight.
  LandLayerLocked(lock, s, layer, static_cast<size_t>(options_.max_landing_chunks), false);
  LandLayerLocked(lock, s, layer, 0, true);
  return Status::Ok();
}

void TieredStore::LandLayerLocked(std::unique_lock<std::mutex>& lock, Sequence* s, int layer, size_t keep,
                                  bool only_complete) {
  LayerState& ls = s->layers[layer];
  if (ls.landing.size() <= keep && ls.landers == 0) return;  // the common case: nothing in flight
  // Busy while the lock is dropped below: a DropSequence on another thread (counters() and
  // WaitForDurable land every sequence) waits for this landing instead of freeing `ls`.
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
        warm_->Release(c->warm_slot);
        delete c;
      } else {
        c->tiers = kTierWarm;
        warm_policy_->OnInsert(c->id);
        counters_.warm_chunks = warm_->used() - landing_chunks_;
        counters_.chunks_sealed++;
        counters_.bytes_moved += chunk_bytes_;
        if (options_.write_through && has_lower()) {
          c->cold_writing = true;  // keeps the warm pin until the write is done
          const float score = c->score;  // snapshot under the lock (see Chunk::score)
          lock.unlock();
          SubmitColdWrite(c, warm_copy, score);
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

void TieredStore::LandSequenceLocked(std::unique_lock<std::mutex>& lock, Sequence* s) {
  for (int l = 0; l < static_cast<int>(s->layers.size()); ++l) LandLayerLocked(lock, s, l);
}

bool TieredStore::LandEverythingLocked(std::unique_lock<std::mutex>& lock) {
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
      std::lock_guard<std::mutex> l(mu_);
      listener = AckColdWriteLocked(c, acks);
    }
    // Still pinned (cold_writing): nobody frees the chunk while the listener runs.
    if (listener) listener(c->key);
    std::lock_guard<std::mutex> l(mu_);
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
  std::lock_guard<std::mutex> l(mu_);
  return BackgroundErrorLocked();
}

Status TieredStore::WaitForDurable() {
  Status landed;
  {
    // Chunks still landing have no write issued yet: land them, which issues it.
    std::unique_lock<std::mutex> l(mu_);
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
    std::lock_guard<std::mutex> l(mu_);
    if (error_window_ != std::chrono::milliseconds::max() && !BackgroundErrorLocked().ok()) break;
  }
  std::lock_guard<std::mutex> l(mu_);
  if (!landed.ok()) return landed;
  // A failed write-through leaves its chunk unacknowledged in warm, where the
  // next demotion or CloseSequence writes it again (or, with both tiers and only Redis
  // failing, acknowledged by the cold tier alone); report the failure once.
  Status st = background_error_;
  background_error_ = Status::Ok();
  return st;
}

void TieredStore::SetColdAckListener(std::function<void(const ChunkKey&)> listener) {
  std::lock_guard<std::mutex> l(mu_);
  ack_listener_ = std::move(listener);
}

std::vector<ChunkRange> TieredStore::AcknowledgedChunks() const {
  return cold_ ? cold_->AcknowledgedChunks() : std::vector<ChunkRange>{};
}

std::vector<ChunkRange> TieredStore::LostChunks() const {
  return cold_ ? cold_->lost_chunks() : std::vector<ChunkRange>{};
}

// ---------------------------------------------------------------------------
// Statistics for representative keys

Status TieredStore::ObserveQueries(SequenceId seq, int layer, const float* q, const int64_t* positions, int m) {
  if (m <= 0) return InvalidArgument("ObserveQueries: query count must be > 0 (got " + std::to_string(m) + ")");
  if (q == nullptr || positions == nullptr) return InvalidArgument("ObserveQueries: q and positions must not be null");
  KVTIER_ASSIGN_OR_RETURN(HotView view, GetHotView(seq, layer));
  const Geometry& g = options_.geometry;
  // This attention (for the representative-key statistics) runs on the host. With a device
  // tier the sinks and local window are read back into host copies first: one download of
  // at most n_sink + n_local + chunk_size tokens per call, and only prefill windows call it
  // (decode steps do not observe). A host mirror kept by Append would save that copy but
  // would have to be kept in step by every path that fills the regions (Append, reopen,
  // recovery, attach); the read-back cannot go stale.
  std::vector<std::vector<uint8_t>> host_copy;
  if (std::string(hot_->device()) != "cpu") {
    std::vector<kernels::KvSpan*> spans{&view.sinks};
    for (int i = 0; i < view.n_local_spans; ++i) spans.push_back(&view.local[i]);
    host_copy.resize(2 * spans.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      kernels::KvSpan& sp = *spans[i];
      const size_t bytes = static_cast<size_t>(sp.n_tokens) * token_bytes_;
      host_copy[2 * i].resize(std::max<size_t>(1, bytes));
      host_copy[2 * i + 1].resize(std::max<size_t>(1, bytes));
      KVTIER_RETURN_IF_ERROR(hot_->Download(host_copy[2 * i].data(), static_cast<const uint8_t*>(sp.k), bytes));
      KVTIER_RETURN_IF_ERROR(hot_->Download(host_copy[2 * i + 1].data(), static_cast<const uint8_t*>(sp.v), bytes));
      sp.k = host_copy[2 * i].data();
      sp.v = host_copy[2 * i + 1].data();
    }
  }
  std::vector<float> mass_sinks(static_cast<size_t>(g.kv_heads) * std::max(1, view.sinks.n_tokens), 0.0f);
  std::vector<std::vector<float>> mass_local(view.n_local_spans);
  std::vector<kernels::KvSpan> parts;
  parts.push_back(view.sinks);
  parts.back().mass = mass_sinks.data();
  for (int i = 0; i < view.n_local_spans; ++i) {
    mass_local[i].assign(static_cast<size_t>(g.kv_heads) * view.local[i].n_tokens, 0.0f);
    parts.push_back(view.local[i]);
    parts.back().mass = mass_local[i].data();
  }
  std::vector<float> out(static_cast<size_t>(m) * g.q_heads * g.head_dim);
  kernels::AttentionParams p;
  p.q_heads = g.q_heads; p.kv_heads = g.kv_heads; p.head_dim = g.head_dim; p.dtype = g.dtype;
  p.scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
  p.n_queries = m; p.q = q; p.q_positions = positions;
  p.parts = parts.data(); p.n_parts = static_cast<int>(parts.size());
  p.out = out.data();
  const kernels::KernelError err = kernels::Attention(p);
  if (err != kernels::KernelError::kOk)
    return InvalidArgument(std::string("ObserveQueries: attention failed: ") + kernels::KernelErrorString(err));
  for (int i = 0; i < view.n_local_spans; ++i) {
    KVTIER_RETURN_IF_ERROR(AddLocalAttention(seq, layer, view.local[i].first_position, view.local[i].n_tokens,
                                             mass_local[i].data()));
  }
  return Status::Ok();
}

Status TieredStore::AddLocalAttention(SequenceId seq, int layer, int64_t first_position, int n, const float* mass) {
  Sequence* s = nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, true, &s));
  }
  if (n <= 0 || mass == nullptr) return InvalidArgument("AddLocalAttention: need n > 0 and a mass array");
  LayerState& ls = s->layers[layer];
  if (first_position < ls.sealed_end || first_position + n > ls.n_tokens || ls.n_tokens <= options_.n_sink)
    return InvalidArgument("AddLocalAttention: tokens [" + std::to_string(first_position) + ", " +
                           std::to_string(first_position + n) + ") are not in the local window [" +
                           std::to_string(ls.sealed_end) + ", " + std::to_string(ls.n_tokens) + ")");
  const int64_t ring = options_.n_local + options_.chunk_size;
  for (int h = 0; h < options_.geometry.kv_heads; ++h) {
    float* dst = ls.ring_mass.data() + h * ring;
    for (int t = 0; t < n; ++t) dst[(first_position + t - options_.n_sink) % ring] += mass[static_cast<size_t>(h) * n + t];
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Reading

Result<HotView> TieredStore::GetHotView(SequenceId seq, int layer) {
  Sequence* s = nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  }
  LayerState& ls = s->layers[layer];
  if (!ls.sinks_restored)
    return FailedPrecondition("sequence " + std::to_string(seq) +
                              " was recovered without its sinks and local window (it was not closed)");
  HotView v;
  v.n_tokens = ls.n_tokens;
  v.sinks = kernels::KvSpan{ls.sink_k, ls.sink_v, static_cast<int>(std::min<int64_t>(ls.n_tokens, options_.n_sink)), 0,
                            nullptr};
  const int64_t ring = options_.n_local + options_.chunk_size;
  int64_t pos = std::max<int64_t>(ls.sealed_end, options_.n_sink);
  int64_t remaining = ls.n_tokens - pos;
  while (remaining > 0) {
    const int64_t slot = (pos - options_.n_sink) % ring;
    const int64_t take = std::min(remaining, ring - slot);
    v.local[v.n_local_spans++] = kernels::KvSpan{ls.ring_k + slot * token_bytes_, ls.ring_v + slot * token_bytes_,
                                                 static_cast<int>(take), pos, nullptr};
    pos += take;
    remaining -= take;
  }
  return v;
}

Result<std::vector<ChunkInfo>> TieredStore::ListChunks(SequenceId seq, int layer) const {
  std::unique_lock<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  landing_self()->LandLayerLocked(l, s, layer);
  KVTIER_RETURN_IF_ERROR(landing_self()->TakeLandingErrorLocked(s->layers[layer]));
  std::vector<ChunkInfo> out;
  for (const Chunk* c : s->layers[layer].chunks) {
    if (c == nullptr) continue;
    out.push_back(ChunkInfo{c->key, c->first_token, options_.chunk_size, c->tiers, c->score});
  }
  return out;
}

Result<uint64_t> TieredStore::ChunkCount(SequenceId seq, int layer) const {
  std::unique_lock<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  landing_self()->LandLayerLocked(l, s, layer);
  KVTIER_RETURN_IF_ERROR(landing_self()->TakeLandingErrorLocked(s->layers[layer]));
  return static_cast<uint64_t>(s->layers[layer].chunks.size());
}

Status TieredStore::GetRepresentatives(const ChunkKey& key, float* out) const {
  std::unique_lock<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(key.seq, static_cast<int>(key.layer), false, &s));
  landing_self()->LandLayerLocked(l, s, static_cast<int>(key.layer));
  KVTIER_RETURN_IF_ERROR(landing_self()->TakeLandingErrorLocked(s->layers[key.layer]));
  const auto& chunks = s->layers[key.layer].chunks;
  if (key.index >= chunks.size() || chunks[key.index] == nullptr) return NotFound("chunk " + key.ToString() + " does not exist");
  const Chunk* c = chunks[key.index];
  ToFloat(options_.geometry.dtype, c->repr.data(), out, c->repr.size() / DTypeSize(options_.geometry.dtype));
  return Status::Ok();
}

Status TieredStore::ReadTokens(SequenceId seq, int layer, int64_t begin, int64_t end, void* k_out, void* v_out) {
  Sequence* s = nullptr;
  {
    std::unique_lock<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
    LandLayerLocked(l, s, layer);
    KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s->layers[layer]));
    if (begin < 0 || end < begin || end > s->layers[layer].n_tokens)
      return InvalidArgument("ReadTokens: range [" + std::to_string(begin) + ", " + std::to_string(end) +
                             ") is outside [0, " + std::to_string(s->layers[layer].n_tokens) + ")");
    if (k_out == nullptr || v_out == nullptr) return InvalidArgument("ReadTokens: outputs must not be null");
    s->busy++;
  }
  LayerState& ls = s->layers[layer];
  auto* ko = static_cast<uint8_t*>(k_out);
  auto* vo = static_cast<uint8_t*>(v_out);
  const int64_t ring = options_.n_local + options_.chunk_size;
  const size_t half = static_cast<size_t>(options_.chunk_size) * token_bytes_;
  std::vector<uint8_t> staging;
  Status st;
  int64_t p = begin;
  while (p < end && st.ok()) {
    const size_t off = static_cast<size_t>(p - begin) * token_bytes_;
    if (p < options_.n_sink && !ls.sinks_restored) {
      st = FailedPrecondition("sequence " + std::to_string(seq) +
                              " was recovered without its sinks (it was not closed before the store stopped)");
      break;
    }
    if (p < std::min<int64_t>(options_.n_sink, ls.n_tokens) && p < ls.sealed_end && ls.sinks_restored) {
      const int64_t take = std::min<int64_t>(end, options_.n_sink) - p;
      st = hot_->Download(ko + off, ls.sink_k + p * token_bytes_, take * token_bytes_);
      if (st.ok()) st = hot_->Download(vo + off, ls.sink_v + p * token_bytes_, take * token_bytes_);
      p += take;
    } else if (p < ls.sealed_end) {
      const uint64_t idx =
          static_cast<uint64_t>(ChunkOfPosition(p, options_.n_sink, options_.chunk_size, kAnyChunkCount));
      const int64_t in_chunk = (p - options_.n_sink) % options_.chunk_size;
      const int64_t take = std::min<int64_t>(end - p, options_.chunk_size - in_chunk);
      Chunk* c = nullptr;
      const uint8_t* src = nullptr;
      bool from_hot = false;
      {
        std::lock_guard<std::mutex> l(mu_);
        c = idx < ls.chunks.size() ? ls.chunks[idx] : nullptr;
        if (c == nullptr) {
          st = NotFound("chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                        " is missing (dropped by compression, lost before it was acknowledged, or lost "
                        "from a damaged cold tier and accepted at open)");
          break;
        }
        if (c->warm_slot >= 0) { c->warm_pins++; src = warm_->slot_data(c->warm_slot); }
        else if (c->hot_slot >= 0 && !c->hot_loading) { c->hot_pins++; from_hot = true; src = hot_->slot_data(c->hot_slot); }
      }
      if (src == nullptr) {
        st = ReturnOnBadAlloc("ReadTokens: a cold chunk's staging buffer",
                              [&] { staging.resize(chunk_bytes_); return Status::Ok(); });
        if (st.ok()) st = ReadLowerTier(s, c, staging.data());
        src = staging.data();
        if (st.ok()) { std::lock_guard<std::mutex> l(mu_); counters_.cold_reads++; }
      }
      if (st.ok()) {
        auto copy = [&](uint8_t* dst, const uint8_t* from, size_t n) {
          return from_hot ? hot_->Download(dst, from, n) : (std::memcpy(dst, from, n), Status::Ok());
        };
        st = copy(ko + off, src + in_chunk * token_bytes_, take * token_bytes_);
        if (st.ok()) st = copy(vo + off, src + half + in_chunk * token_bytes_, take * token_bytes_);
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        if (src != staging.data()) (from_hot ? c->hot_pins : c->warm_pins)--;
        cv_.notify_all();
      }
      p += take;
    } else {
      if (!ls.sinks_restored) { st = FailedPrecondition("sequence " + std::to_string(seq) + " lost its local window (not closed)"); break; }
      const int64_t slot = (p - options_.n_sink) % ring;
      const int64_t take = std::min(end - p, ring - slot);
      st = hot_->Download(ko + off, ls.ring_k + slot * token_bytes_, take * token_bytes_);
      if (st.ok()) st = hot_->Download(vo + off, ls.ring_v + slot * token_bytes_, take * token_bytes_);
      p += take;
    }
  }
  std::lock_guard<std::mutex> l(mu_);
  s->busy--;
  cv_.notify_all();
  return st;
}

// ---------------------------------------------------------------------------
// Fetch: promotion into hot slots

bool TieredStore::FetchCompleteLocked(const FetchHandle::State* st) const {
  if (!st->done) return false;
  for (auto [id, slot] : st->awaited) {
    auto it = chunk_by_id_.find(id);
    if (it != chunk_by_id_.end() && it->second->hot_loading && it->second->hot_slot == slot) return false;
  }
  return true;
}

bool TieredStore::PinnedLocked(const Chunk* c, Clock::time_point now) const {
  if (c->hot_pins == 0) return false;
  return now < c->pin_deadline;
}

int32_t TieredStore::AcquireHotSlotLocked(Clock::time_point now) {
  int32_t slot = hot_->AcquireSlot();
  if (slot >= 0) return slot;
  uint64_t victim = 0;
  auto can_leave = [&](uint64_t id) {
    const Chunk* c = chunk_by_id_.at(id);
    return !c->hot_loading && !PinnedLocked(c, now);
  };
  if (!hot_policy_->PickVictim(can_leave, &victim)) return -1;
  Chunk* c = chunk_by_id_.at(victim);
  if (c->hot_pins > 0) {  // an expired lease: the pin no longer protects it
    counters_.lease_expired += c->hot_pins;
    c->hot_pins = 0;
  }
  // The hot slot is a cache: warm or cold still holds the chunk.
  slot = c->hot_slot;
  c->hot_slot = -1;
  c->tiers &= ~kTierHot;
  hot_policy_->OnRemove(victim);
  counters_.demotions++;
  return slot;
}

TieredStore::HotRoom TieredStore::HotRoomLocked(SequenceId seq, int64_t need,
                                                const std::vector<uint64_t>& requested, Clock::time_point now,
                                                bool full) {
  HotRoom room;
  room.available = hot_->slot_capacity() - hot_->slots_used();
  if (room.available >= need && !full) return room;
  // Every hot chunk is in the policy: walk it (stopping once enough are evictable). A chunk
  // the fetch asks for is not room: it is a hit, and evicting it would only move it.
  uint64_t unused = 0;
  hot_policy_->PickVictim(
      [&](uint64_t id) {
        const Chunk* c = chunk_by_id_.at(id);
        if (c->hot_loading || PinnedLocked(c, now)) {
          (c->key.seq == seq ? room.held_self : room.held_other)++;
        } else if (!std::binary_search(requested.begin(), requested.end(), id)) {
          room.available++;
        }
        return !full && room.available >= need;  // true stops the walk
      },
      &unused);
  return room;
}

int64_t TieredStore::ReservedForLocked(SequenceId seq) const {
  int64_t r = 0;
  for (const auto& [id, res] : reservations_)
    if (res.seq == seq) r = std::max<int64_t>(r, res.slots);
  return r;
}

int64_t TieredStore::ReservedTotalLocked() const {
  std::unordered_map<SequenceId, int64_t> by_seq;
  for (const auto& [id, res] : reservations_) {
    int64_t& r = by_seq[res.seq];
    r = std::max<int64_t>(r, res.slots);
  }
  int64_t total = 0;
  for (const auto& [seq, r] : by_seq) total += r;
  return total;
}

Result<uint64_t> TieredStore::ReserveHotSlots(SequenceId seq, int32_t slots) {
  if (slots < 0)
    return InvalidArgument("ReserveHotSlots: slots must be >= 0 (got " + std::to_string(slots) + ")");
  std::lock_guard<std::mutex> l(mu_);
  if (sequences_.find(seq) == sequences_.end())
    return NotFound("ReserveHotSlots: sequence " + std::to_string(seq) +
                    " does not exist (never created or dropped)");
  const int64_t pool = hot_->slot_capacity();
  const int64_t reserved = ReservedTotalLocked();
  const int64_t mine = ReservedForLocked(seq);
  // Sessions of one sequence count once, at their largest reservation.
  const int64_t after = reserved - mine + std::max<int64_t>(mine, slots);
  if (after > pool)
    return ResourceExhausted(
        "hot tier: " + std::to_string(pool) + " slots, " + std::to_string(reserved) +
        " reserved by the open sessions (" + std::to_string(reservations_.size()) + "), this one asks " +
        std::to_string(slots) +
        " (its budget in chunks): the pool cannot hold the budgets of the sessions open at once; "
        "close or drop a session, lower budget_tokens or raise hot_bytes");
  const uint64_t id = next_reservation_++;
  reservations_.emplace(id, HotReservation{seq, slots});
  counters_.hot_reserved = static_cast<uint64_t>(after);
  return id;
}

void TieredStore::ReleaseHotSlots(uint64_t reservation) {
  std::lock_guard<std::mutex> l(mu_);
  if (reservations_.erase(reservation) == 0) return;
  counters_.hot_reserved = static_cast<uint64_t>(ReservedTotalLocked());
}

Result<FetchHandle> TieredStore::FetchChunks(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices) {
  return ReturnOnBadAlloc("FetchChunks: the fetch's chunk lists", [&]() -> Result<FetchHandle> {
  auto st = std::make_shared<FetchHandle::State>();
  st->store = this;
  bool any_load = false;
  {
    std::unique_lock<std::mutex> l(mu_);
    Sequence* s = nullptr;
    LayerState* lsp = nullptr;
    std::vector<uint64_t> requested;  // chunk ids, sorted, each once
    // One clock reading per attempt: the leases it finds expired and the ones it grants.
    Clock::time_point now{};
    // Waiting for slots (see FetchChunks in the header): started when the first check finds
    // too little room, so a fetch that never waits reads no clock for it.
    std::chrono::steady_clock::time_point wait_start{}, wait_deadline{};
    bool waited = false;
    uint64_t ticket = 0;  // in pin_waiters_ while this call waits
    const auto end_wait = [&] {
      if (!waited) return;
      counters_.pin_wait_us += static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - wait_start)
              .count());
      waited = false;
      pin_waiters_.erase(ticket);
      cv_.notify_all();  // the next waiter may be the oldest now
    };
    for (;;) {
      // (Re)checked after every wait: the lock was dropped.
      Status checked = CheckLayerLocked(seq, layer, false, &s);
      if (!checked.ok()) {
        end_wait();
        return checked;
      }
      LandLayerLocked(l, s, layer);
      checked = TakeLandingErrorLocked(s->layers[layer]);
      if (!checked.ok()) {
        end_wait();
        return checked;
      }
      lsp = &s->layers[layer];
      if (static_cast<int64_t>(chunk_indices.size()) > hot_->slot_capacity()) {
        end_wait();
        return ResourceExhausted("fetch of " + std::to_string(chunk_indices.size()) +
                                 " chunks exceeds the hot tier's " + std::to_string(hot_->slot_capacity()) +
                                 " slots (hot_bytes)");
      }
      requested.clear();
      int64_t need = 0;  // chunks with no hot slot, each once
      for (uint64_t idx : chunk_indices) {
        if (idx >= lsp->chunks.size() || lsp->chunks[idx] == nullptr) {
          end_wait();
          return InvalidArgument(
              "fetch: chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
              " does not exist (layer has " + std::to_string(lsp->chunks.size()) + " chunks)");
        }
        requested.push_back(lsp->chunks[idx]->id);
      }
      std::sort(requested.begin(), requested.end());
      requested.erase(std::unique(requested.begin(), requested.end()), requested.end());
      for (uint64_t id : requested)
        if (chunk_by_id_.at(id)->hot_slot < 0) need++;
      now = options_.clock->Now();
      if (need == 0) break;
      // An older fetch waits: one that holds no pin queues behind it (see the header).
      const bool behind =
          options_.pin_wait_ms > 0 && !pin_waiters_.empty() && *pin_waiters_.begin() != ticket;
      const HotRoom room = HotRoomLocked(seq, need, requested, now, behind);
      if (room.available >= need && (!behind || room.held_self > 0)) break;
      // Too few slots. Waiting is safe while this sequence holds no pin, or stays within its
      // reservation with this fetch (the header says why); otherwise it could wait for
      // itself, or for a sequence that waits for it. A sequence that holds pins never queues
      // behind others: the oldest waiter may be waiting for exactly those pins.
      const int64_t reserved = ReservedForLocked(seq);
      const bool may_wait = room.held_self == 0 || room.held_self + need <= reserved;
      const std::string numbers = "the fetch needs " + std::to_string(need) +
                                  " more hot slots; of the pool's " + std::to_string(hot_->slot_capacity()) +
                                  ", " + std::to_string(room.held_other) +
                                  " are pinned or loading for other sequences and " +
                                  std::to_string(room.held_self) + " for this one (sequence " +
                                  std::to_string(seq) + ", reservation " + std::to_string(reserved) + ")";
      if (!may_wait) {
        end_wait();
        return ResourceExhausted(
            "hot tier: " + numbers +
            "; waiting could deadlock, as this sequence would hold more than its reservation: "
            "release its other fetch handles (LayerParts) first, or raise hot_bytes");
      }
      const auto real_now = std::chrono::steady_clock::now();
      if (!waited) {  // the first wait of this call
        wait_start = real_now;
        wait_deadline = real_now + std::chrono::milliseconds(options_.pin_wait_ms);
        counters_.pin_waits++;
        waited = true;
        ticket = next_pin_ticket_++;
        pin_waiters_.insert(ticket);
      }
      if (real_now >= wait_deadline) {
        if (room.available >= need) break;  // queued behind a waiter for that long: go ahead
        end_wait();
        counters_.pin_wait_timeouts++;
        return ResourceExhausted(
            "hot tier: " + numbers + "; waited " + std::to_string(options_.pin_wait_ms) +
            " ms (pin_wait_ms) for them to be unpinned; release fetch handles or raise hot_bytes");
      }
      // Unpins and finished loads notify; an expiring lease does not, hence the slice.
      cv_.wait_until(l, std::min(wait_deadline, real_now + std::chrono::milliseconds(20)));
    }
    end_wait();
    LayerState& ls = *lsp;
    const auto deadline = now + std::chrono::milliseconds(options_.pin_timeout_ms);
    // Allocated before any chunk is pinned, so an allocation failure leaves nothing to undo.
    st->chunk_ids.reserve(chunk_indices.size());
    st->needs_load.reserve(chunk_indices.size());
    st->spans.reserve(chunk_indices.size());
    // On failure, give back what this call took: pins, and slots it assigned
    // but never filled (they would otherwise look "loading" forever).
    const auto undo = [&] {
      for (size_t i = 0; i < st->chunk_ids.size(); ++i) {
        Chunk* c = chunk_by_id_.at(st->chunk_ids[i]);
        c->hot_pins--;
        if (st->needs_load[i]) {
          hot_->ReleaseSlot(c->hot_slot);
          hot_policy_->OnRemove(c->id);
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
        counters_.hits++;
        hot_policy_->OnAccess(c->id);
      } else {
        const int32_t slot = AcquireHotSlotLocked(now);
        if (slot < 0) {  // not expected: HotRoomLocked counted the room under this lock
          undo();
          return Internal("hot tier: no slot for a fetch the pool was found to have room for (" +
                          std::to_string(hot_->slot_capacity()) + " slots)");
        }
        c->hot_slot = slot;
        c->hot_loading = true;
        hot_policy_->OnInsert(c->id);
        counters_.misses++;
        load = true;
        any_load = true;
      }
      c->hot_pins++;
      c->pin_deadline = std::max(c->pin_deadline, deadline);
      st->chunk_ids.push_back(c->id);
      st->needs_load.push_back(load ? 1 : 0);
      const uint8_t* base = hot_->slot_data(c->hot_slot);
      st->spans.push_back(kernels::KvSpan{base, base + chunk_bytes_ / 2, options_.chunk_size, c->first_token, nullptr});
    }
    counters_.hot_chunks = hot_->slots_used();
    if (!any_load) st->done = true;
  }
  if (any_load) engine_->Enqueue([this, st] {
    if (!st->claimed.exchange(true)) RunFetch(st);
  });
  else st->claimed = true;
  FetchHandle h;
  h.state_ = st;
  return h;
  });
}

void TieredStore::RunFetch(const std::shared_ptr<FetchHandle::State>& st) {
  // Three phases, so the store lock is taken twice per fetch, not twice per chunk:
  // (1) under the lock, pin each load's warm copy, or reserve the warm slot a chunk coming
  // back from cold will keep its copy in (retrieval tends to come back to the same chunks);
  // (2) without it, the transfer engine reads cold chunks into those slots and uploads to
  // the hot slots; (3) under the lock, unpin, attach the warm copies that arrived, and mark
  // the loads done.
  std::vector<TransferEngine::Load> loads;
  std::vector<Chunk*> chunks;        // parallel to loads
  std::vector<int32_t> read_slots;   // warm slot reserved for a cold read (-1: none was free)
  // Sized once (an upper bound: hits need no load), outside the lock: no regrowth per chunk.
  loads.reserve(st->chunk_ids.size());
  chunks.reserve(st->chunk_ids.size());
  read_slots.reserve(st->chunk_ids.size());
  {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < st->chunk_ids.size(); ++i) {
      if (!st->needs_load[i]) continue;
      Chunk* c = chunk_by_id_.at(st->chunk_ids[i]);
      TransferEngine::Load ld;
      ld.key = c->key;
      ld.hot_dst = hot_->slot_data(c->hot_slot);
      ld.ref.key = c->key;
      if (const Sequence* s = sequences_.at(c->key.seq).get(); store_internal::SharedChunk(s, c->key)) {
        // Its bytes sit under the publisher's namespace and sequence id, in no local tier.
        ld.ref.ns = &s->remote_ns;
        ld.ref.key.seq = s->remote_seq;
      }
      int32_t read_slot = -1;
      if (c->warm_slot >= 0) {
        c->warm_pins++;
        ld.warm_src = warm_->slot_data(c->warm_slot);
        warm_policy_->OnAccess(c->id);
      } else {
        read_slot = AcquireWarmSlotForReadLocked();
        if (read_slot >= 0) ld.read_buf = warm_->slot_data(read_slot);
      }
      loads.push_back(std::move(ld));
      chunks.push_back(c);
      read_slots.push_back(read_slot);
    }
  }
  engine_->CopyLoads(&loads);

  std::lock_guard<std::mutex> l(mu_);
  Status first_error;
  for (size_t j = 0; j < loads.size(); ++j) {
    const TransferEngine::Load& ld = loads[j];
    Chunk* c = chunks[j];
    if (ld.warm_src != nullptr) {
      c->warm_pins--;
    } else {
      counters_.cold_reads++;
      if (read_slots[j] >= 0) {
        if (ld.status.ok() && c->warm_slot < 0) {
          c->warm_slot = read_slots[j];
          c->tiers |= kTierWarm;
          warm_policy_->OnInsert(c->id);
          counters_.promotions++;
          counters_.bytes_moved += chunk_bytes_;
        } else {
          warm_->Release(read_slots[j]);
        }
      }
    }
    if (ld.status.ok()) {
      counters_.promotions++;
      counters_.bytes_moved += chunk_bytes_;
      if (ld.source == nullptr)
        counters_.warm_loads++;
      else
        ld.source->CountLoad(&counters_);
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
      hot_->ReleaseSlot(c->hot_slot);
      hot_policy_->OnRemove(c->id);
      c->hot_slot = -1;
      c->tiers &= ~kTierHot;
    }
  }
  counters_.warm_chunks = warm_->used();
  st->status = first_error;
  st->done = true;
  cv_.notify_all();
}

void TieredStore::EvictHot() {
  std::lock_guard<std::mutex> l(mu_);
  const Clock::time_point now = options_.clock->Now();
  uint64_t victim = 0;
  while (hot_policy_->PickVictim(
      [&](uint64_t id) {
        const Chunk* c = chunk_by_id_.at(id);
        return !c->hot_loading && !PinnedLocked(c, now);
      },
      &victim)) {
    Chunk* c = chunk_by_id_.at(victim);
    hot_->ReleaseSlot(c->hot_slot);
    c->hot_slot = -1;
    c->tiers &= ~kTierHot;
    c->hot_pins = 0;
    hot_policy_->OnRemove(victim);
  }
}

void TieredStore::ReleasePins(FetchHandle::State* st) {
  std::lock_guard<std::mutex> l(mu_);
  if (st->released) return;
  st->released = true;
  for (uint64_t id : st->chunk_ids) {
    auto it = chunk_by_id_.find(id);
    if (it == chunk_by_id_.end()) continue;  // dropped meanwhile
    if (it->second->hot_pins > 0) it->second->hot_pins--;
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------
// Close / drop

Status TieredStore::CloseSequence(SequenceId seq) {
  Sequence* s = nullptr;
  {
    std::unique_lock<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, 0, true, &s));
    LandSequenceLocked(l, s);
    KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s));
    s->busy++;
  }
  Status st;
  if (has_lower()) {
    // Every chunk must be acknowledged before the record says "closed".
    for (auto& ls : s->layers) {
      for (Chunk* c : ls.chunks) {
        std::unique_lock<std::mutex> l(mu_);
        if (c == nullptr) continue;  // dropped, or a hole left by a crash
        cv_.wait(l, [&] { return !c->cold_writing; });
        if (c->cold_acked) continue;
        st = WriteWarmChunkToColdLocked(l, c);
        if (!st.ok()) break;
      }
      if (!st.ok()) break;
    }
  }
  if (cold_ && !s->attached) {  // an attached sequence is not persisted here (its publisher holds it)
    std::vector<int64_t> n_tokens;
    for (int l = 0; l < options_.geometry.layers && st.ok(); ++l) {
      n_tokens.push_back(s->layers[l].n_tokens);
      std::string sinks, local;
      st = CopySinksAndLocal(seq, s, l, &sinks, &local);
      if (st.ok()) st = cold_->PutBlob(seq, l, store_records::kSinksBlob, sinks.data(), sinks.size());
      if (st.ok()) st = cold_->PutBlob(seq, l, store_records::kLocalBlob, local.data(), local.size());
    }
    if (st.ok()) {
      const std::string rec = EncodeSequenceRecord(SeqState::kClosed, n_tokens);
      st = cold_->PutSequence(seq, rec);
    }
  }
  std::lock_guard<std::mutex> l(mu_);
  s->busy--;
  if (st.ok()) s->state = SeqState::kClosed;
  cv_.notify_all();
  return st;
}

Status TieredStore::CopySinksAndLocal(SequenceId seq, Sequence* s, int l, std::string* sinks, std::string* local) {
  LayerState& ls = s->layers[l];
  const int64_t n_sink_tokens = std::min<int64_t>(ls.n_tokens, options_.n_sink);
  sinks->assign(2 * n_sink_tokens * token_bytes_, '\0');
  Status st = hot_->Download(sinks->data(), ls.sink_k, n_sink_tokens * token_bytes_);
  if (st.ok()) st = hot_->Download(sinks->data() + n_sink_tokens * token_bytes_, ls.sink_v, n_sink_tokens * token_bytes_);
  const int64_t n_local = ls.n_tokens - std::max<int64_t>(ls.sealed_end, n_sink_tokens);
  local->assign(2 * std::max<int64_t>(0, n_local) * token_bytes_, '\0');
  if (st.ok() && n_local > 0) {
    std::vector<uint8_t> k(n_local * token_bytes_), v(n_local * token_bytes_);
    st = ReadTokens(seq, l, ls.n_tokens - n_local, ls.n_tokens, k.data(), v.data());
    std::memcpy(local->data(), k.data(), k.size());
    std::memcpy(local->data() + k.size(), v.data(), v.size());
  }
  return st;
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

void TieredStore::FreeChunkLocked(Chunk* c) {
  if (c->warm_slot >= 0) { warm_->Release(c->warm_slot); warm_policy_->OnRemove(c->id); }
  if (c->hot_slot >= 0) { hot_->ReleaseSlot(c->hot_slot); hot_policy_->OnRemove(c->id); }
  if (c->cold_acked && (c->tiers & kTierCold) && counters_.cold_chunks > 0) { counters_.cold_chunks--; counters_.cold_bytes -= chunk_bytes_; }
  chunk_by_id_.erase(c->id);
  delete c;
}

Status TieredStore::DropSequence(SequenceId seq) {
  std::unique_lock<std::mutex> l(mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return NotFound("sequence " + std::to_string(seq) + " does not exist (never created or dropped)");
  Sequence* s = it->second.get();
  // Wait for appends, reads and transfers that touch this sequence to finish; chunks still
  // landing land first (their downloads read the regions freed below). A landing failure
  // changes nothing here: the sequence goes anyway.
  for (;;) {
    cv_.wait(l, [&] { return s->busy == 0; });
    LandSequenceLocked(l, s);
    if (s->busy == 0) break;
  }
  cv_.wait(l, [&] {
    if (s->busy > 0) return false;
    for (auto& ls : s->layers)
      if (!ls.landing.empty() || ls.landers > 0) return false;
    for (auto& ls : s->layers)
      for (Chunk* c : ls.chunks)
        if (c && (c->warm_pins > 0 || c->cold_writing || c->hot_loading)) return false;
    return true;
  });
  // Per lower tier, the chunks it holds; an attached sequence's chunks belong to its publisher.
  std::vector<std::vector<ChunkKey>> tier_keys(lower_.size());
  for (auto& ls : s->layers) {
    for (Chunk* c : ls.chunks) {
      if (c == nullptr) continue;
      for (size_t t = 0; t < lower_.size(); ++t)
        if ((c->tiers & lower_[t]->tier_bit()) &&
            !(lower_[t]->serves_published() && store_internal::SharedChunk(s, c->key)))
          tier_keys[t].push_back(c->key);
      FreeChunkLocked(c);
    }
    ls.chunks.clear();
    const size_t ring = static_cast<size_t>(options_.n_local + options_.chunk_size);
    hot_->FreeRegion(ls.sink_k, 0); hot_->FreeRegion(ls.sink_v, 0);
    hot_->FreeRegion(ls.ring_k, 0); hot_->FreeRegion(ls.ring_v, 0);
    region_bytes_ -= 2 * (options_.n_sink + ring) * token_bytes_;
  }
  sequences_.erase(seq);  // by key: `it` may be stale after the waits above (a CreateSequence can rehash)
  counters_.warm_chunks = warm_->used();
  counters_.hot_chunks = hot_->slots_used();
  l.unlock();
  for (size_t t = 0; t < lower_.size(); ++t)
    KVTIER_RETURN_IF_ERROR(lower_[t]->RemoveSequence(seq, tier_keys[t]));
  return Status::Ok();
}

Status TieredStore::SetChunkScores(SequenceId seq, int layer, const std::vector<std::pair<uint64_t, float>>& scores) {
  std::unique_lock<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  LandLayerLocked(l, s, layer);
  KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s->layers[layer]));
  LayerState& ls = s->layers[layer];
  for (const auto& [idx, score] : scores) {
    if (idx >= ls.chunks.size())
      return InvalidArgument("SetChunkScores: chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                             " does not exist (layer has " + std::to_string(ls.chunks.size()) + " chunks)");
    if (!std::isfinite(score))
      return InvalidArgument("SetChunkScores: score of chunk " + std::to_string(idx) + " is not finite");
  }
  for (const auto& [idx, score] : scores) {
    Chunk* c = ls.chunks[idx];
    if (c == nullptr) continue;
    c->score = score;
    hot_policy_->OnScore(c->id, score);
    warm_policy_->OnScore(c->id, score);
  }
  return Status::Ok();
}

Status TieredStore::DropChunks(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices) {
  std::vector<std::vector<ChunkKey>> tier_keys(lower_.size());  // per lower tier, what it may hold
  {
    std::unique_lock<std::mutex> l(mu_);
    Sequence* s = nullptr;
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
    LandLayerLocked(l, s, layer);
    KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s->layers[layer]));
    LayerState& ls = s->layers[layer];
    for (uint64_t idx : chunk_indices)
      if (idx >= ls.chunks.size())
        return InvalidArgument("DropChunks: chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                               " does not exist (layer has " + std::to_string(ls.chunks.size()) + " chunks)");
    const Clock::time_point now = options_.clock->Now();
    for (uint64_t idx : chunk_indices) {
      const Chunk* c = ls.chunks[idx];
      if (c && PinnedLocked(c, now))
        return FailedPrecondition("DropChunks: chunk " + c->key.ToString() +
                                  " is pinned by a live fetch handle; release it first");
    }
    // Transfers in flight finish first: a warm read, a cold write, a hot load.
    cv_.wait(l, [&] {
      for (uint64_t idx : chunk_indices) {
        const Chunk* c = ls.chunks[idx];
        if (c && (c->warm_pins > 0 || c->cold_writing || c->hot_loading)) return false;
      }
      return true;
    });
    for (uint64_t idx : chunk_indices) {
      Chunk* c = ls.chunks[idx];
      if (c == nullptr) continue;
      // Written (or being written) to the lower tiers; a publisher's chunk is not this store's to remove.
      if (c->cold_acked || c->cold_writing)
        for (size_t t = 0; t < lower_.size(); ++t)
          if (!(lower_[t]->serves_published() && store_internal::SharedChunk(s, c->key)))
            tier_keys[t].push_back(c->key);
      FreeChunkLocked(c);
      ls.chunks[idx] = nullptr;
      counters_.dropped_chunks++;
    }
    counters_.warm_chunks = warm_->used();
    counters_.hot_chunks = hot_->slots_used();
  }
  // The chunk is gone from memory; removing its lower-tier copies is what makes the drop
  // survive a reopen.
  for (size_t t = 0; t < lower_.size(); ++t) KVTIER_RETURN_IF_ERROR(lower_[t]->RemoveChunks(tier_keys[t]));
  return Status::Ok();
}

StoreCounters TieredStore::counters() const {
  std::unique_lock<std::mutex> l(mu_);
  // Statistics count landed chunks: land what is in flight (a failure stays in its layer's
  // landing_error for the next call that can return it).
  landing_self()->LandEverythingLocked(l);
  StoreCounters c = counters_;
  c.hot_chunks = hot_->slots_used();
  c.hot_bytes = c.hot_chunks * chunk_bytes_ + region_bytes_;
  c.warm_chunks = warm_->used() - landing_chunks_;  // a chunk another thread is landing is not warm yet
  c.warm_bytes = c.warm_chunks * chunk_bytes_;
  for (const auto& tier : lower_) tier->AddCounters(&c);
  return c;
}

uint64_t TieredStore::metadata_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  const size_t per_chunk = sizeof(Chunk) + static_cast<size_t>(options_.repr_topk) * token_bytes_ + 64;
  return chunk_by_id_.size() * per_chunk;
}

// ---------------------------------------------------------------------------
// Sharing through the remote tier
//
// Publication format (bodies of the remote tier's framed values, little-endian):
//   layer part l   u32 magic "KVPL" (0x4c50564b)  u32 version (1)
//                  i64 n_tokens  i64 sealed_end  u64 n_chunks
//                  per chunk: u8 present, then (if present) the length-prefixed chunk meta
//                  length-prefixed sinks (K then V), length-prefixed local window (K then V)
//   manifest       u32 magic "KVPM" (0x4d50564b)  u32 version (1)
//                  length-prefixed store record (the layout), length-prefixed chunk
//                  namespace, u64 sequence id, u32 layers

namespace {
constexpr uint32_t kPubLayerMagic = 0x4c50564b;
constexpr uint32_t kPubManifestMagic = 0x4d50564b;
constexpr uint32_t kPubVersion = 1;
}  // namespace

Status TieredStore::PublishSequence(SequenceId seq, std::string_view name) {
  if (!remote_) return FailedPrecondition("PublishSequence: the store has no remote tier (StoreOptions::remote)");
  Sequence* s = nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, 0, false, &s));
    if (s->state != SeqState::kClosed)
      return FailedPrecondition("PublishSequence: sequence " + std::to_string(seq) +
                                " is not closed; close it first (readers must see a complete sequence)");
    if (s->attached)
      return FailedPrecondition("PublishSequence: sequence " + std::to_string(seq) +
                                " is attached from another store's publication; publish from the store that wrote it");
    s->busy++;
  }
  {
    // A closed sequence has nothing landing (CloseSequence landed it); kept for the invariant.
    std::unique_lock<std::mutex> l(mu_);
    LandSequenceLocked(l, s);
    Status landed = TakeLandingErrorLocked(s);
    if (!landed.ok()) {
      s->busy--;
      cv_.notify_all();
      return landed;
    }
  }
  Status st;
  const size_t repr_bytes = static_cast<size_t>(options_.repr_topk) * token_bytes_;
  std::vector<std::string> parts;
  std::vector<uint8_t> buf(chunk_bytes_);
  // Phase 1: every chunk acknowledged by the remote tier. Chunks written before the store
  // had a remote tier (recovered from cold) are copied up now.
  for (int l = 0; l < options_.geometry.layers && st.ok(); ++l) {
    LayerState& ls = s->layers[l];
    for (Chunk* c : ls.chunks) {
      if (c == nullptr) continue;
      float score;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (c->tiers & kTierRemote) continue;
        score = c->score;
      }
      st = ReadLowerTier(s, c, buf.data());
      if (!st.ok()) {
        // Not in the lower tiers: the warm copy (write_through off) is the only one.
        std::unique_lock<std::mutex> lk(mu_);
        if (c->warm_slot < 0) break;
        std::memcpy(buf.data(), warm_->slot_data(c->warm_slot), chunk_bytes_);
        st = Status::Ok();
      }
      const std::string meta = EncodeChunkMeta(c->first_token, c->repr.data(), c->repr.size(), score);
      st = remote_->PutChunk(c->key, meta, buf.data(), chunk_bytes_);
      if (!st.ok()) break;
      std::lock_guard<std::mutex> lk(mu_);
      c->tiers |= kTierRemote;
    }
  }
  // Phase 2: the layer records, then the manifest (RemoteTier::PutPublication keeps the order).
  for (int l = 0; l < options_.geometry.layers && st.ok(); ++l) {
    LayerState& ls = s->layers[l];
    std::string rec;
    PutFixed32(&rec, kPubLayerMagic);
    PutFixed32(&rec, kPubVersion);
    PutInt64(&rec, ls.n_tokens);
    PutInt64(&rec, ls.sealed_end);
    {
      std::lock_guard<std::mutex> lk(mu_);
      PutFixed64(&rec, ls.chunks.size());
      for (const Chunk* c : ls.chunks) {
        PutFixed8(&rec, c ? 1 : 0);
        if (c) PutLengthPrefixed(&rec, EncodeChunkMeta(c->first_token, c->repr.data(), repr_bytes, c->score));
      }
    }
    std::string sinks, local;
    st = CopySinksAndLocal(seq, s, l, &sinks, &local);
    PutLengthPrefixed(&rec, sinks);
    PutLengthPrefixed(&rec, local);
    parts.push_back(std::move(rec));
  }
  if (st.ok()) {
    std::string manifest;
    PutFixed32(&manifest, kPubManifestMagic);
    PutFixed32(&manifest, kPubVersion);
    PutLengthPrefixed(&manifest, store_records::EncodeStoreRecord(store_records::StoreLayout{
                                     options_.geometry, options_.n_sink, options_.n_local, options_.chunk_size,
                                     options_.repr_topk}));
    PutLengthPrefixed(&manifest, remote_->ns());
    PutFixed64(&manifest, seq);
    PutFixed32(&manifest, static_cast<uint32_t>(options_.geometry.layers));
    st = remote_->PutPublication(name, parts, manifest);
  }
  std::lock_guard<std::mutex> l(mu_);
  s->busy--;
  cv_.notify_all();
  return st;
}

Result<SequenceId> TieredStore::AttachPublished(std::string_view name) {
  if (!remote_) return FailedPrecondition("AttachPublished: the store has no remote tier (StoreOptions::remote)");
  KVTIER_ASSIGN_OR_RETURN(std::string manifest, remote_->GetManifest(name));
  const std::string what = "remote tier: publication '" + std::string(name) + "'";
  RecordReader mr(manifest, what + " manifest");
  uint32_t magic = 0, version = 0, layers = 0;
  uint64_t remote_seq = 0;
  std::string layout_rec, ns;
  KVTIER_RETURN_IF_ERROR(mr.ReadFixed32(&magic, "magic"));
  KVTIER_RETURN_IF_ERROR(mr.ReadFixed32(&version, "version"));
  if (magic != kPubManifestMagic || version != kPubVersion)
    return Corruption(what + " manifest has a bad magic or version");
  KVTIER_RETURN_IF_ERROR(mr.ReadLengthPrefixed(&layout_rec, "layout"));
  KVTIER_RETURN_IF_ERROR(mr.ReadLengthPrefixed(&ns, "namespace"));
  KVTIER_RETURN_IF_ERROR(mr.ReadFixed64(&remote_seq, "sequence"));
  KVTIER_RETURN_IF_ERROR(mr.ReadFixed32(&layers, "layers"));
  KVTIER_RETURN_IF_ERROR(mr.ExpectEnd());
  KVTIER_ASSIGN_OR_RETURN(store_records::StoreLayout theirs, store_records::DecodeStoreRecord(layout_rec, what));
  const store_records::StoreLayout mine{options_.geometry, options_.n_sink, options_.n_local, options_.chunk_size,
                                        options_.repr_topk};
  if (theirs.ToString() != mine.ToString() || layers != static_cast<uint32_t>(options_.geometry.layers))
    return InvalidArgument(what + " was written with " + theirs.ToString() + "; this store has " + mine.ToString());

  const int L = options_.geometry.layers;
  const size_t repr_bytes = static_cast<size_t>(options_.repr_topk) * token_bytes_;
  const size_t ring = static_cast<size_t>(options_.n_local + options_.chunk_size);
  auto seq = std::make_unique<Sequence>();
  seq->state = SeqState::kOpen;  // the published prefix is read-only; tokens appended here are ours
  seq->attached = true;
  seq->remote_ns = ns;
  seq->remote_seq = remote_seq;
  seq->layers.resize(L);
  // Frees what was built so far when a part turns out bad (chunks are not registered yet).
  struct Cleanup {
    TieredStore* store;
    Sequence* s;
    bool armed = true;
    ~Cleanup() {
      if (!armed) return;
      for (auto& ls : s->layers) {
        for (uint8_t* r : {ls.sink_k, ls.sink_v, ls.ring_k, ls.ring_v})
          if (r) store->hot_->FreeRegion(r, 0);
        for (Chunk* c : ls.chunks) delete c;
      }
    }
  } cleanup{this, seq.get()};
  for (int l = 0; l < L; ++l) {
    KVTIER_ASSIGN_OR_RETURN(std::string part, remote_->GetPublicationPart(name, static_cast<uint32_t>(l)));
    RecordReader rr(part, what + " layer " + std::to_string(l));
    LayerState& ls = seq->layers[l];
    uint64_t n_chunks = 0;
    KVTIER_RETURN_IF_ERROR(rr.ReadFixed32(&magic, "magic"));
    KVTIER_RETURN_IF_ERROR(rr.ReadFixed32(&version, "version"));
    if (magic != kPubLayerMagic || version != kPubVersion)
      return Corruption(what + " layer " + std::to_string(l) + " has a bad magic or version");
    KVTIER_RETURN_IF_ERROR(rr.ReadInt64(&ls.n_tokens, "n_tokens"));
    KVTIER_RETURN_IF_ERROR(rr.ReadInt64(&ls.sealed_end, "sealed_end"));
    KVTIER_RETURN_IF_ERROR(rr.ReadFixed64(&n_chunks, "n_chunks"));
    ls.shared_chunks = n_chunks;
    const int64_t n_sink_tokens = std::min<int64_t>(ls.n_tokens, options_.n_sink);
    const int64_t n_local = ls.n_tokens - std::max<int64_t>(ls.sealed_end, n_sink_tokens);
    if (ls.n_tokens < 0 || n_local < 0 || n_local > options_.n_local + options_.chunk_size ||
        n_chunks > rr.remaining() ||
        (ls.sealed_end > options_.n_sink &&
         static_cast<uint64_t>(ls.sealed_end - options_.n_sink) != n_chunks * options_.chunk_size))
      return Corruption(what + " layer " + std::to_string(l) + ": token counts do not fit the layout");
    for (uint64_t i = 0; i < n_chunks; ++i) {
      uint8_t present = 0;
      KVTIER_RETURN_IF_ERROR(rr.ReadFixed8(&present, "present"));
      if (!present) {
        ls.chunks.push_back(nullptr);
        continue;
      }
      std::string meta;
      KVTIER_RETURN_IF_ERROR(rr.ReadLengthPrefixed(&meta, "chunk meta"));
      const ChunkKey remote_key{remote_seq, static_cast<uint32_t>(l), i};
      KVTIER_ASSIGN_OR_RETURN(store_records::ChunkMeta m, store_records::DecodeChunkMeta(meta, remote_key, repr_bytes));
      auto* c = new Chunk();
      ls.chunks.push_back(c);
      c->key = ChunkKey{0, static_cast<uint32_t>(l), i};  // seq set once the id is known
      c->first_token = m.first_token;
      c->repr = std::move(m.repr);
      c->score = m.score;
      c->tiers = kTierRemote;
      c->cold_acked = true;  // a lower tier (the remote one) holds it: warm copies may leave
    }
    std::string sinks, local;
    KVTIER_RETURN_IF_ERROR(rr.ReadLengthPrefixed(&sinks, "sinks"));
    KVTIER_RETURN_IF_ERROR(rr.ReadLengthPrefixed(&local, "local"));
    KVTIER_RETURN_IF_ERROR(rr.ExpectEnd());
    if (sinks.size() != 2 * n_sink_tokens * token_bytes_ || local.size() != 2 * n_local * token_bytes_)
      return Corruption(what + " layer " + std::to_string(l) + ": sinks/local do not match its token count");
    KVTIER_ASSIGN_OR_RETURN(ls.sink_k, hot_->AllocateRegion(std::max<size_t>(1, options_.n_sink * token_bytes_)));
    KVTIER_ASSIGN_OR_RETURN(ls.sink_v, hot_->AllocateRegion(std::max<size_t>(1, options_.n_sink * token_bytes_)));
    KVTIER_ASSIGN_OR_RETURN(ls.ring_k, hot_->AllocateRegion(ring * token_bytes_));
    KVTIER_ASSIGN_OR_RETURN(ls.ring_v, hot_->AllocateRegion(ring * token_bytes_));
    ls.ring_mass.assign(static_cast<size_t>(options_.geometry.kv_heads) * ring, 0.0f);
    const size_t sb = n_sink_tokens * token_bytes_;
    KVTIER_RETURN_IF_ERROR(hot_->Upload(ls.sink_k, sinks.data(), sb));
    KVTIER_RETURN_IF_ERROR(hot_->Upload(ls.sink_v, sinks.data() + sb, sb));
    for (int64_t t = 0; t < n_local; ++t) {
      const int64_t p = std::max<int64_t>(ls.sealed_end, n_sink_tokens) + t;
      const size_t slot = static_cast<size_t>((p - options_.n_sink) % static_cast<int64_t>(ring));
      KVTIER_RETURN_IF_ERROR(hot_->Upload(ls.ring_k + slot * token_bytes_, local.data() + t * token_bytes_, token_bytes_));
      KVTIER_RETURN_IF_ERROR(
          hot_->Upload(ls.ring_v + slot * token_bytes_, local.data() + (n_local + t) * token_bytes_, token_bytes_));
    }
  }
  std::lock_guard<std::mutex> l(mu_);
  cleanup.armed = false;
  const SequenceId id = next_seq_id_++;
  seq->id = id;
  region_bytes_ += L * 2 * (options_.n_sink + ring) * token_bytes_;
  for (auto& ls : seq->layers)
    for (Chunk* c : ls.chunks) {
      if (c == nullptr) continue;
      c->id = next_chunk_id_++;
      c->key.seq = id;
      chunk_by_id_[c->id] = c;
    }
  sequences_[id] = std::move(seq);
  return id;
}

}  // namespace kvtier
