// TieredStore, the coordinator: the public API declared in offload/tiered_store.h over the
// parts that own the store's state (each header says what it owns):
//   offload/store/sequence_table.h  the sequences and their layers' hot regions
//   offload/store/layer_ring.h      sinks and local ring of a layer: appends, the hot view, statistics
//   offload/store/chunk_catalog.h   the chunk records, what readers see of them, the change feed
//   offload/store/landing.h         sealing a ring chunk and landing it in warm
//   offload/store/warm_tier.h       the warm slabs, their policy, room
//   offload/store/lower_tiers.h     the tiers below warm, acknowledgements, the sticky error
//   offload/store/lower_writer.h    writes to the lower tiers
//   offload/store/hot_pool.h        who holds which hot slot; why nothing deadlocks
//   offload/store/promoter.h        fetches: promotion into hot slots
// This file has the store's lifecycle (Open and recovery, sequences, Close, Drop, Flush,
// durability, counters); offload/store/ring.cc the appends, chunks.cc the chunk calls,
// layer_step.cc the layer step's door and sharing.cc publish and attach.
//
// Locking: one mutex (sync_.mu) guards every part's mutable state, except where
// offload/store_state.h says otherwise (a layer's sinks and ring belong to the sequence's
// driving thread). A call that takes the std::unique_lock may drop it while it waits or copies
// bytes, and holds it again on return.

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
    std::unique_lock<CountingMutex> l(sync_.mu);
    landing_->LandEverything(l);
  }
  // Transfer tasks call back into the store: let them finish first. The parts go in the reverse
  // order of their declaration (the sequence table frees the layers' regions and chunk records).
  if (engine_) engine_->WaitIdle();
  if (warm_) {
    // The slabs go with the store: device reads of handed-out addresses finish first. A failed
    // wait has no caller to fail; the slabs are freed all the same.
    std::lock_guard<CountingMutex> l(sync_.mu);
    Status fenced = warm_->FenceReaders();
    (void)fenced;
  }
}

void TieredStore::SetWarmReaderFence(WarmReaderFence* fence) {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  warm_->SetReaderFence(fence);
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
  TieredStore& s = *store;
  const StoreOptions& o = s.options_;
  s.token_bytes_ = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  s.chunk_bytes_ = o.chunk_bytes();
  if (s.hooks_.hot_tier_factory) {
    KVTIER_ASSIGN_OR_RETURN(s.hot_, s.hooks_.hot_tier_factory(o.hot_bytes, s.chunk_bytes_));
    if (s.hot_ == nullptr) return InvalidArgument("hot_tier_factory returned no hot tier");
  } else {
    KVTIER_ASSIGN_OR_RETURN(s.hot_, MakeHotTier(o.device, o.hot_bytes, s.chunk_bytes_));
  }
  HotTier* hot = s.hot_.get();
  // Every slot holds one chunk ([K][V]); spans and copies assume exactly that size.
  if (hot->slot_bytes() != s.chunk_bytes_ || hot->slot_capacity() < 1)
    return InvalidArgument("hot tier (" + std::string(DeviceName(hot->device())) + ") has " +
                           std::to_string(hot->slot_capacity()) + " slots of " +
                           std::to_string(hot->slot_bytes()) +
                           " bytes; the store needs at least one slot of one chunk (" +
                           std::to_string(s.chunk_bytes_) + " bytes)");
  // A device tier ("cuda") is accepted: nothing in the store dereferences hot memory on the
  // host. Attention runs on the Session's backend for the tier's device
  // (offload/attention_backend.h); chunk scoring reads representatives, which are host data
  // chosen when a sealed chunk lands, from the warm copy it was downloaded into; every other
  // read of hot memory goes through HotTier::Download (ReadTokens, CloseSequence's sinks,
  // ObserveQueries, see there).
  s.ring_ = std::make_unique<LayerRing>(o, s.token_bytes_);
  s.sequences_ = std::make_unique<SequenceTable>(o, s.token_bytes_, hot);
  s.catalog_ = std::make_unique<ChunkCatalog>(o, s.token_bytes_);
  {
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<DemotionPolicy> hot_policy, MakeDemotionPolicy(o.hot_policy));
    s.hot_pool_ = std::make_unique<HotPool>(hot, std::move(hot_policy), &s.catalog_->by_id());
  }
  KVTIER_ASSIGN_OR_RETURN(s.warm_,
                          WarmTier::Create(o, s.chunk_bytes_, s.catalog_.get(), &s.lower_, &s.counters_));
  if (!o.data_dir.empty()) {
    ColdTierOptions co;
    co.path = o.data_dir;
    co.compression = o.compression;
    co.sync_writes = o.sync_writes;
    co.fault_injector = s.hooks_.cold_fault_injector;
    co.accept_lost_chunks = o.accept_lost_chunks;
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<ColdTier> cold, ColdTier::Open(co));
    s.lower_.AddCold(std::move(cold));
  }
  if (!o.remote.empty()) {
    KVTIER_ASSIGN_OR_RETURN(RemoteTierOptions ro, ParseRemoteSpec(o.remote));
    if (!o.remote_namespace.empty()) {
      ro.ns = o.remote_namespace;
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
    s.lower_.AddRemote(std::move(remote));
  }
  TransferEngine::Options eo;
  eo.threads = o.transfer_threads;
  eo.chunk_bytes = s.chunk_bytes_;
  eo.hot = hot;
  for (const auto& tier : s.lower_) eo.lower.push_back(tier.get());
  KVTIER_ASSIGN_OR_RETURN(s.engine_, TransferEngine::Create(eo));
  s.writer_ =
      std::make_unique<LowerWriter>(s.engine_.get(), &s.lower_, &s.sync_, &s.counters_, s.chunk_bytes_);
  s.landing_ = std::make_unique<Landing>(
      o, s.chunk_bytes_, *s.ring_,
      Landing::Parts{hot, s.warm_.get(), s.catalog_.get(), s.writer_.get(), &s.lower_, s.sequences_.get(),
                     &s.sync_, &s.counters_, s.hooks_.hold_landing});
  s.promoter_ = std::make_unique<Promoter>(
      o, s.hooks_, s.chunk_bytes_,
      Promoter::Parts{hot, s.hot_pool_.get(), s.warm_.get(), s.catalog_.get(), s.sequences_.get(),
                      s.landing_.get(), s.engine_.get(), &s.sync_, &s.counters_});
  if (s.lower_.cold()) {
    RecoveredStore rec;
    Status st = RecoverStore(o, s.lower_.cold(), hot, &rec);
    // Adopt whatever was rebuilt even on failure: the sequence table frees it.
    s.sequences_->Adopt(std::move(rec.sequences), rec.next_seq_id, rec.region_bytes);
    s.catalog_->Adopt(std::move(rec.chunk_by_id), rec.next_chunk_id);
    s.counters_.cold_chunks += rec.cold_chunks;
    s.counters_.cold_bytes += rec.cold_bytes;
    KVTIER_RETURN_IF_ERROR(st);
  }
  return store;
}

Result<SequenceId> TieredStore::CreateSequence() {
  visits_.Count();
  return ReturnOnBadAlloc(
      "CreateSequence: the sinks and local window of every layer", [&]() -> Result<SequenceId> {
        auto seq = std::make_unique<Sequence>();
        const int L = options_.geometry.layers;
        seq->layers.resize(L);
        for (auto& ls : seq->layers) {
          Status st = store_internal::AllocateLayerRegions(options_, token_bytes_, hot_.get(), &ls);
          if (!st.ok()) {
            for (auto& done : seq->layers) store_internal::FreeLayerRegions(hot_.get(), &done);
            return st;
          }
        }
        std::lock_guard<CountingMutex> l(sync_.mu);
        const SequenceId id = sequences_->Add(std::move(seq));
        if (lower_.cold()) {
          const std::string rec = EncodeSequenceRecord(SeqState::kOpen, std::vector<int64_t>(L, 0));
          Status st = lower_.cold()->PutSequence(id, rec);
          if (!st.ok()) {
            sequences_->Erase(id);
            return st;
          }
        }
        return id;
      });
}

std::vector<SequenceId> TieredStore::ListSequences() const {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  return sequences_->Ids();
}

Result<int64_t> TieredStore::SequenceLength(SequenceId seq, int layer) const {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
  return s->layers[layer].n_tokens;
}

Status TieredStore::CloseSequence(SequenceId seq) {
  visits_.Count();
  Sequence* s = nullptr;
  {
    std::unique_lock<CountingMutex> l(sync_.mu);
    KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, 0, true, &s));
    landing_->LandSequence(l, s);
    KVTIER_RETURN_IF_ERROR(Landing::TakeError(s));
    s->busy++;
  }
  Status st;
  if (!lower_.empty()) {
    // Every chunk must be acknowledged before the record says "closed".
    for (auto& ls : s->layers) {
      for (Chunk* c : ls.chunks) {
        std::unique_lock<CountingMutex> l(sync_.mu);
        if (c == nullptr) continue;  // dropped, or a hole left by a crash
        sync_.cv.wait(l, [&] { return !c->lower_writing; });
        if (c->lower_acked) continue;
        st = writer_->WriteDown(l, c, warm_->slot_data(c->warm_slot));
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
      st = ring_->CopyOut(hot_.get(), s->layers[l], &sinks, &local);
      if (st.ok()) st = lower_.cold()->PutBlob(seq, l, store_records::kSinksBlob, sinks.data(), sinks.size());
      if (st.ok()) st = lower_.cold()->PutBlob(seq, l, store_records::kLocalBlob, local.data(), local.size());
    }
    if (st.ok()) {
      const std::string rec = EncodeSequenceRecord(SeqState::kClosed, n_tokens);
      st = lower_.cold()->PutSequence(seq, rec);
    }
  }
  std::lock_guard<CountingMutex> l(sync_.mu);
  s->busy--;
  if (st.ok()) s->state = SeqState::kClosed;
  sync_.cv.notify_all();
  return st;
}

Status TieredStore::DropSequence(SequenceId seq) {
  visits_.Count();
  std::unique_lock<CountingMutex> l(sync_.mu);
  Sequence* s = sequences_->Find(seq);
  if (s == nullptr)
    return NotFound("sequence " + std::to_string(seq) + " does not exist (never created or dropped)");
  // Wait for appends, reads and transfers that touch this sequence to finish; chunks still
  // landing land first (their downloads read the regions freed below). A landing failure
  // changes nothing here: the sequence goes anyway.
  for (;;) {
    sync_.cv.wait(l, [&] { return s->busy == 0; });
    landing_->LandSequence(l, s);
    if (s->busy == 0) break;
  }
  sync_.cv.wait(l, [&] {
    if (s->busy > 0) return false;
    for (auto& ls : s->layers)
      if (!ls.landing.empty() || ls.landers > 0) return false;
    for (auto& ls : s->layers)
      for (Chunk* c : ls.chunks)
        if (c && c->transferring()) return false;
    return true;
  });
  // A warm slot of the sequence handed to a device reader is freed below: the reads first. A
  // failed wait drops nothing.
  bool exposed = false;
  for (auto& ls : s->layers)
    for (Chunk* c : ls.chunks) exposed = exposed || (c != nullptr && warm_->exposed(c->warm_slot));
  if (exposed) KVTIER_RETURN_IF_ERROR(warm_->FenceReaders());
  // Per lower tier, the chunks it holds; an attached sequence's chunks belong to its publisher.
  std::vector<std::vector<ChunkKey>> tier_keys(lower_.size());
  for (auto& ls : s->layers) {
    for (Chunk* c : ls.chunks) {
      if (c == nullptr) continue;
      for (size_t t = 0; t < lower_.size(); ++t)
        if ((c->tiers & lower_[t]->tier_bit()) &&
            !(lower_[t]->serves_published() && store_internal::SharedChunk(s, c->key)))
          tier_keys[t].push_back(c->key);
      warm_->Forget(c);
      hot_pool_->ForgetLocked(c);
      LowerTiers::ForgetLocked(c, chunk_bytes_, &counters_);
      catalog_->Forget(c);
    }
    ls.chunks.clear();
  }
  sequences_->Erase(seq);  // frees the layers' regions
  counters_.warm_chunks = warm_->used();
  counters_.hot_chunks = hot_->slots_used();
  l.unlock();
  return lower_.RemoveSequence(seq, tier_keys);
}

Status TieredStore::Flush(SequenceId seq) {
  visits_.Count();
  std::unique_lock<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, 0, false, &s));
  landing_->LandSequence(l, s);
  return Landing::TakeError(s);
}

Status TieredStore::WaitForDurable() {
  visits_.Count();
  Status landed;
  {
    // Chunks still landing have no write issued yet: land them, which issues it.
    std::unique_lock<CountingMutex> l(sync_.mu);
    landing_->LandEverything(l);
    for (SequenceId id : sequences_->Ids()) {
      Status st = Landing::TakeError(sequences_->Find(id));
      if (landed.ok()) landed = std::move(st);
    }
  }
  // Every write issued so far has finished or, where errors expire (a remote tier), one
  // failed: then the rest is not waited for (writes queued behind a dead node are refused
  // anyway), and the error says that not everything is durable.
  while (!engine_->WaitIdleFor(std::chrono::milliseconds(20))) {
    std::lock_guard<CountingMutex> l(sync_.mu);
    if (lower_.errors_expire() && !lower_.BackgroundErrorLocked().ok()) break;
  }
  std::lock_guard<CountingMutex> l(sync_.mu);
  if (!landed.ok()) return landed;
  // A failed write-through leaves its chunk unacknowledged in warm, where the
  // next demotion or CloseSequence writes it again (or, with both tiers and only Redis
  // failing, acknowledged by the cold tier alone); report the failure once.
  return lower_.TakeBackgroundErrorLocked();
}

Result<FetchHandle> TieredStore::FetchChunks(SequenceId seq, int layer,
                                             const std::vector<uint64_t>& chunk_indices, FetchFit fit) {
  visits_.Count();
  return promoter_->Fetch(seq, layer, chunk_indices, fit);
}

Result<WarmFetchHandle> TieredStore::FetchToWarm(SequenceId seq, int layer,
                                                 const std::vector<uint64_t>& chunk_indices) {
  visits_.Count();
  return promoter_->FetchToWarm(seq, layer, chunk_indices);
}

Result<uint64_t> TieredStore::ReserveHotSlots(SequenceId seq, int32_t slots) {
  visits_.Count();
  if (slots < 0)
    return InvalidArgument("ReserveHotSlots: slots must be >= 0 (got " + std::to_string(slots) + ")");
  std::lock_guard<CountingMutex> l(sync_.mu);
  if (sequences_->Find(seq) == nullptr)
    return NotFound("ReserveHotSlots: sequence " + std::to_string(seq) +
                    " does not exist (never created or dropped)");
  uint64_t after = 0;
  KVTIER_ASSIGN_OR_RETURN(uint64_t id, hot_pool_->ReserveLocked(seq, slots, &after));
  counters_.hot_reserved = after;
  return id;
}

void TieredStore::ReleaseHotSlots(uint64_t reservation) {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  uint64_t after = 0;
  if (hot_pool_->ReleaseLocked(reservation, &after)) counters_.hot_reserved = after;
}

void TieredStore::EvictHot() {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  hot_pool_->EvictUnpinnedLocked(hooks_.clock->Now());
}

StoreCounters TieredStore::counters() const {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  StoreCounters c = counters_;
  c.hot_chunks = hot_->slots_used();
  c.hot_bytes = c.hot_chunks * chunk_bytes_ + sequences_->region_bytes();
  c.chunks_landing = landing_->in_flight();
  c.warm_chunks = warm_->used() - c.chunks_landing;  // a chunk still landing is not warm yet
  c.warm_bytes = c.warm_chunks * chunk_bytes_;
  lower_.AddCounters(&c);
  return c;
}

uint64_t TieredStore::metadata_bytes() const {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  return catalog_->MetadataBytes();
}

}  // namespace kvtier
