// TieredStore, the facade: the public API declared in offload/tiered_store.h, with the
// store's lifecycle here (options, Open and recovery, sequences, Close, Drop, counters)
// and the rest in parts a reader can name, each opening with what it owns:
//   offload/store/ring.cc           sinks, local ring, sealing, attention statistics
//   offload/store/landing.cc        completing sealed chunks (representatives, warm, write-through)
//   offload/store/warm_tier.cc      room in the warm tier
//   offload/store/write_through.cc  the lower tiers: writes, acknowledgement, errors, reads
//   offload/store/chunks.cc         chunk metadata, ReadTokens, scores, drops
//   offload/store/fetch.cc          promotion into hot slots: pins, leases, hot room
//   offload/store/layer_step.cc     the layer step's door (BeginLayerStep)
//   offload/store/sharing.cc        publish and attach through the remote tier
//
// Locking: TieredStore's one mutex (mu_) guards every field this file touches, except where
// offload/store_state.h says otherwise (a layer's sinks and ring belong to the sequence's
// driving thread). A function named ...Locked is called with mu_ held; one that takes the
// std::unique_lock may drop it while it waits or copies bytes, and holds it again on return.

#include "offload/tiered_store.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "offload/store/layer_regions.h"
#include "offload/store_records.h"
#include "offload/store_recovery.h"
#include "offload/store_state.h"
#include "offload/transfer_engine.h"

namespace kvtier {

using store_records::EncodeSequenceRecord;
using store_records::SeqState;

TieredStore::TieredStore(const StoreOptions& options, const StoreHooks& hooks)
    : options_(options), hooks_(hooks) {}

TieredStore::~TieredStore() {
  if (engine_) {
    // Downloads in flight write into warm slots: land them (which issues their write-through).
    std::unique_lock<CountingMutex> l(mu_);
    LandEverythingLocked(l);
  }
  // Transfer tasks call back into the store: let them finish first.
  if (engine_) engine_->WaitIdle();
  for (auto& [id, seq] : sequences_) {
    for (auto& ls : seq->layers) {
      store_internal::FreeLayerRegions(hot_.get(), &ls);
      for (Chunk* c : ls.chunks) delete c;
    }
  }
}

Result<std::unique_ptr<TieredStore>> TieredStore::Open(const StoreOptions& options) {
  return Open(options, StoreHooks{});
}

Result<std::unique_ptr<TieredStore>> TieredStore::Open(const StoreOptions& options, const StoreHooks& hooks) {
  KVTIER_RETURN_IF_ERROR(hooks.Validate());
  if (hooks.hot_tier_factory) {
    // The hot tier is the hook's: `device` names none of kvtier's to build, so it is not checked.
    StoreOptions checked = options;
    checked.device = Device::kCpu;
    KVTIER_RETURN_IF_ERROR(checked.Validate());
  } else {
    KVTIER_RETURN_IF_ERROR(options.Validate());
  }
  auto store = std::unique_ptr<TieredStore>(new TieredStore(options, hooks));
  KVTIER_RETURN_IF_ERROR(store->Init());
  return store;
}

Status TieredStore::Init() {
  token_bytes_ = options_.geometry.token_elems() * DTypeSize(options_.geometry.dtype);
  chunk_bytes_ = options_.chunk_bytes();
  if (hooks_.hot_tier_factory) {
    KVTIER_ASSIGN_OR_RETURN(hot_, hooks_.hot_tier_factory(options_.hot_bytes, chunk_bytes_));
    if (hot_ == nullptr) return InvalidArgument("hot_tier_factory returned no hot tier");
  } else {
    KVTIER_ASSIGN_OR_RETURN(hot_, MakeHotTier(options_.device, options_.hot_bytes, chunk_bytes_));
  }
  // Every slot holds one chunk ([K][V]); spans and copies assume exactly that size.
  if (hot_->slot_bytes() != chunk_bytes_ || hot_->slot_capacity() < 1)
    return InvalidArgument("hot tier (" + std::string(DeviceName(hot_->device())) + ") has " +
                           std::to_string(hot_->slot_capacity()) + " slots of " +
                           std::to_string(hot_->slot_bytes()) +
                           " bytes; the store needs at least one slot of one chunk (" +
                           std::to_string(chunk_bytes_) + " bytes)");
  // A device tier ("cuda") is accepted: nothing in the store dereferences hot memory on the
  // host. Attention runs on the Session's backend for the tier's device
  // (offload/attention_backend.h); chunk scoring reads representatives, which are host data
  // chosen when a sealed chunk lands, from the warm copy it was downloaded into; every other
  // read of hot memory goes through HotTier::Download (ReadTokens, CloseSequence's sinks,
  // ObserveQueries, see there).
  KVTIER_ASSIGN_OR_RETURN(warm_, SlotPool::Create("warm_bytes", options_.warm_bytes, chunk_bytes_, true));
  {
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<DemotionPolicy> hot_policy,
                            MakeDemotionPolicy(options_.hot_policy));
    hot_pool_ = std::make_unique<HotPool>(hot_.get(), std::move(hot_policy), &chunk_by_id_);
  }
  KVTIER_ASSIGN_OR_RETURN(warm_policy_, MakeDemotionPolicy(options_.warm_policy));
  if (!options_.data_dir.empty()) {
    ColdTierOptions co;
    co.path = options_.data_dir;
    co.compression = options_.compression;
    co.sync_writes = options_.sync_writes;
    co.fault_injector = hooks_.cold_fault_injector;
    co.accept_lost_chunks = options_.accept_lost_chunks;
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<ColdTier> cold, ColdTier::Open(co));
    lower_.AddCold(std::move(cold));
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
    lower_.AddRemote(std::move(remote));
  }
  TransferEngine::Options eo;
  eo.threads = options_.transfer_threads;
  eo.chunk_bytes = chunk_bytes_;
  eo.hot = hot_.get();
  for (const auto& tier : lower_) eo.lower.push_back(tier.get());
  KVTIER_ASSIGN_OR_RETURN(engine_, TransferEngine::Create(eo));
  if (lower_.cold()) {
    RecoveredStore rec;
    Status st = RecoverStore(options_, lower_.cold(), hot_.get(), &rec);
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

Result<SequenceId> TieredStore::CreateSequence() {
  CountVisit();
  return ReturnOnBadAlloc(
      "CreateSequence: the sinks and local window of every layer", [&]() -> Result<SequenceId> {
        auto seq = std::make_unique<Sequence>();
        const int L = options_.geometry.layers;
        seq->layers.resize(L);
        for (auto& ls : seq->layers)
          KVTIER_RETURN_IF_ERROR(
              store_internal::AllocateLayerRegions(options_, token_bytes_, hot_.get(), &ls));
        std::lock_guard<CountingMutex> l(mu_);
        seq->id = next_seq_id_++;
        region_bytes_ += L * store_internal::LayerRegionBytes(options_, token_bytes_);
        if (lower_.cold()) {
          const std::string rec = EncodeSequenceRecord(SeqState::kOpen, std::vector<int64_t>(L, 0));
          KVTIER_RETURN_IF_ERROR(lower_.cold()->PutSequence(seq->id, rec));
        }
        const SequenceId id = seq->id;
        sequences_[id] = std::move(seq);
        return id;
      });
}

std::vector<SequenceId> TieredStore::ListSequences() const {
  CountVisit();
  std::lock_guard<CountingMutex> l(mu_);
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
                                   : " was not closed before the store stopped; its chunks are readable but "
                                     "it cannot be appended to"));
  *out = it->second.get();
  return Status::Ok();
}

Result<int64_t> TieredStore::SequenceLength(SequenceId seq, int layer) const {
  CountVisit();
  std::lock_guard<CountingMutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  return s->layers[layer].n_tokens;
}

Status TieredStore::CloseSequence(SequenceId seq) {
  CountVisit();
  Sequence* s = nullptr;
  {
    std::unique_lock<CountingMutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, 0, true, &s));
    LandSequenceLocked(l, s);
    KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s));
    s->busy++;
  }
  Status st;
  if (!lower_.empty()) {
    // Every chunk must be acknowledged before the record says "closed".
    for (auto& ls : s->layers) {
      for (Chunk* c : ls.chunks) {
        std::unique_lock<CountingMutex> l(mu_);
        if (c == nullptr) continue;  // dropped, or a hole left by a crash
        cv_.wait(l, [&] { return !c->lower_writing; });
        if (c->lower_acked) continue;
        st = WriteWarmChunkDownLocked(l, c);
        if (!st.ok()) break;
      }
      if (!st.ok()) break;
    }
  }
  if (lower_.cold() && !s->attached) {  // an attached sequence is not persisted here (its publisher holds it)
    std::vector<int64_t> n_tokens;
    for (int l = 0; l < options_.geometry.layers && st.ok(); ++l) {
      n_tokens.push_back(s->layers[l].n_tokens);
      std::string sinks, local;
      st = CopySinksAndLocal(seq, s, l, &sinks, &local);
      if (st.ok()) st = lower_.cold()->PutBlob(seq, l, store_records::kSinksBlob, sinks.data(), sinks.size());
      if (st.ok()) st = lower_.cold()->PutBlob(seq, l, store_records::kLocalBlob, local.data(), local.size());
    }
    if (st.ok()) {
      const std::string rec = EncodeSequenceRecord(SeqState::kClosed, n_tokens);
      st = lower_.cold()->PutSequence(seq, rec);
    }
  }
  std::lock_guard<CountingMutex> l(mu_);
  s->busy--;
  if (st.ok()) s->state = SeqState::kClosed;
  cv_.notify_all();
  return st;
}

Status TieredStore::CopySinksAndLocal(SequenceId seq, Sequence* s, int l, std::string* sinks,
                                      std::string* local) {
  LayerState& ls = s->layers[l];
  const int64_t n_sink_tokens = std::min<int64_t>(ls.n_tokens, options_.n_sink);
  sinks->assign(2 * n_sink_tokens * token_bytes_, '\0');
  Status st = hot_->Download(sinks->data(), ls.sink_k, n_sink_tokens * token_bytes_);
  if (st.ok())
    st =
        hot_->Download(sinks->data() + n_sink_tokens * token_bytes_, ls.sink_v, n_sink_tokens * token_bytes_);
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

Status TieredStore::DropSequence(SequenceId seq) {
  CountVisit();
  std::unique_lock<CountingMutex> l(mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end())
    return NotFound("sequence " + std::to_string(seq) + " does not exist (never created or dropped)");
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
        if (c && (c->warm_pins > 0 || c->lower_writing || c->hot_loading)) return false;
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
    store_internal::FreeLayerRegions(hot_.get(), &ls);
    region_bytes_ -= store_internal::LayerRegionBytes(options_, token_bytes_);
  }
  sequences_.erase(seq);  // by key: `it` may be stale after the waits above (a CreateSequence can rehash)
  counters_.warm_chunks = warm_->used();
  counters_.hot_chunks = hot_->slots_used();
  l.unlock();
  return lower_.RemoveSequence(seq, tier_keys);
}

StoreCounters TieredStore::counters() const {
  CountVisit();
  std::lock_guard<CountingMutex> l(mu_);
  StoreCounters c = counters_;
  c.hot_chunks = hot_->slots_used();
  c.hot_bytes = c.hot_chunks * chunk_bytes_ + region_bytes_;
  c.warm_chunks = warm_->used() - landing_chunks_;  // a chunk still landing is not warm yet
  c.chunks_landing = landing_chunks_;
  c.warm_bytes = c.warm_chunks * chunk_bytes_;
  lower_.AddCounters(&c);
  return c;
}

uint64_t TieredStore::metadata_bytes() const {
  CountVisit();
  std::lock_guard<CountingMutex> l(mu_);
  const size_t per_chunk = sizeof(Chunk) + 64;
  return chunk_by_id_.size() * per_chunk +
         repr_chunks_ * static_cast<size_t>(options_.repr_topk) * token_bytes_;
}

uint64_t TieredStore::lower_tier_memory_bytes() const {
  CountVisit();
  return lower_.memory_bytes();
}

}  // namespace kvtier
