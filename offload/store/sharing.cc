// TieredStore, part "sharing": sequences shared between stores through the remote tier.
// PublishSequence copies a closed sequence's chunks up, then writes its layer records and
// the manifest (last, so a reader never sees half of it); AttachPublished rebuilds a
// published sequence here, its chunks left in the remote tier under the publisher's keys.
//
// Locking: the coordinator's mutex (sync_.mu) guards what this file reads of the parts. Both hold
// Sequence::busy (publish) or build the sequence out of sight (attach) while they talk to Redis without
// sync_.mu.

#include <cstring>

#include "offload/store/layer_regions.h"
#include "offload/store_records.h"
#include "offload/store_state.h"
#include "offload/tiered_store.h"
#include "store/coding.h"

namespace kvtier {

using store_records::EncodeChunkMeta;
using store_records::SeqState;
using ReprRead = LowerTiers::ReprRead;

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
  visits_.Count();
  if (!lower_.remote())
    return FailedPrecondition("PublishSequence: the store has no remote tier (StoreOptions::remote)");
  Sequence* s = nullptr;
  {
    std::lock_guard<CountingMutex> l(sync_.mu);
    KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, 0, false, &s));
    if (s->state != SeqState::kClosed)
      return FailedPrecondition("PublishSequence: sequence " + std::to_string(seq) +
                                " is not closed; close it first (readers must see a complete sequence)");
    if (s->attached)
      return FailedPrecondition(
          "PublishSequence: sequence " + std::to_string(seq) +
          " is attached from another store's publication; publish from the store that wrote it");
    s->busy++;
  }
  {
    // A closed sequence has nothing landing (CloseSequence landed it); kept for the invariant.
    std::unique_lock<CountingMutex> l(sync_.mu);
    landing_->LandSequence(l, s);
    Status landed = Landing::TakeError(s);
    if (!landed.ok()) {
      s->busy--;
      sync_.cv.notify_all();
      return landed;
    }
  }
  Status st;
  const size_t repr_bytes = options_.repr_bytes();
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
        std::lock_guard<CountingMutex> lk(sync_.mu);
        if (c->tiers & kTierRemote) continue;
        score = c->score;
      }
      st = lower_.ReadChunk(s, c->key, buf.data(), chunk_bytes_);
      if (!st.ok()) {
        // Not in the lower tiers: the warm copy (write_through off) is the only one.
        std::unique_lock<CountingMutex> lk(sync_.mu);
        if (c->warm_slot < 0) break;
        std::memcpy(buf.data(), warm_->slot_data(c->warm_slot), chunk_bytes_);
        st = Status::Ok();
      }
      // Representatives released from memory come back from the cold tier's meta record.
      std::vector<uint8_t> repr;
      {
        std::lock_guard<CountingMutex> lk(sync_.mu);
        repr = c->repr;
      }
      if (repr.empty()) {
        repr.resize(repr_bytes);
        std::vector<ReprRead> reads{ReprRead{c->key, repr.data(), Status::Ok()}};
        st = lower_.ReadReprs(s, repr_bytes, &reads);
      }
      if (!st.ok()) break;
      const std::string meta = EncodeChunkMeta(c->first_token, repr.data(), repr.size(), score);
      st = lower_.remote()->PutChunk(c->key, meta, buf.data(), chunk_bytes_);
      if (!st.ok()) break;
      std::lock_guard<CountingMutex> lk(sync_.mu);
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
    // Every chunk's meta: a snapshot under the lock, then the representatives released from
    // memory read back (one batch, without the lock), then the records.
    struct Snap {
      int64_t first_token = 0;
      float score = 0.0f;
      bool present = false;
    };
    std::vector<Snap> snaps;
    std::vector<uint8_t> reprs;
    std::vector<ReprRead> paged;
    {
      std::lock_guard<CountingMutex> lk(sync_.mu);
      snaps.resize(ls.chunks.size());
      reprs.resize(ls.chunks.size() * repr_bytes);
      for (size_t i = 0; i < ls.chunks.size(); ++i) {
        const Chunk* c = ls.chunks[i];
        if (c == nullptr) continue;
        snaps[i] = Snap{c->first_token, c->score, true};
        uint8_t* dst = reprs.data() + i * repr_bytes;
        if (c->repr.empty())
          paged.push_back(ReprRead{c->key, dst, Status::Ok()});
        else
          std::memcpy(dst, c->repr.data(), repr_bytes);
      }
    }
    if (!paged.empty()) st = lower_.ReadReprs(s, repr_bytes, &paged);
    if (!st.ok()) break;
    PutFixed64(&rec, snaps.size());
    for (size_t i = 0; i < snaps.size(); ++i) {
      PutFixed8(&rec, snaps[i].present ? 1 : 0);
      if (snaps[i].present)
        PutLengthPrefixed(&rec, EncodeChunkMeta(snaps[i].first_token, reprs.data() + i * repr_bytes,
                                                repr_bytes, snaps[i].score));
    }
    std::string sinks, local;
    if (st.ok()) st = ring_->CopyOut(hot_.get(), ls, &sinks, &local);
    PutLengthPrefixed(&rec, sinks);
    PutLengthPrefixed(&rec, local);
    parts.push_back(std::move(rec));
  }
  if (st.ok()) {
    std::string manifest;
    PutFixed32(&manifest, kPubManifestMagic);
    PutFixed32(&manifest, kPubVersion);
    PutLengthPrefixed(&manifest, store_records::EncodeStoreRecord(store_records::StoreLayout{
                                     options_.geometry, options_.n_sink, options_.n_local,
                                     options_.chunk_size, options_.repr_topk, options_.repr_heads}));
    PutLengthPrefixed(&manifest, lower_.remote()->ns());
    PutFixed64(&manifest, seq);
    PutFixed32(&manifest, static_cast<uint32_t>(options_.geometry.layers));
    st = lower_.remote()->PutPublication(name, parts, manifest);
  }
  std::lock_guard<CountingMutex> l(sync_.mu);
  s->busy--;
  sync_.cv.notify_all();
  return st;
}

Result<SequenceId> TieredStore::AttachPublished(std::string_view name) {
  visits_.Count();
  if (!lower_.remote())
    return FailedPrecondition("AttachPublished: the store has no remote tier (StoreOptions::remote)");
  KVTIER_ASSIGN_OR_RETURN(std::string manifest, lower_.remote()->GetManifest(name));
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
  KVTIER_ASSIGN_OR_RETURN(store_records::StoreLayout theirs,
                          store_records::DecodeStoreRecord(layout_rec, what));
  const store_records::StoreLayout mine{options_.geometry,   options_.n_sink,    options_.n_local,
                                        options_.chunk_size, options_.repr_topk, options_.repr_heads};
  if (theirs.ToString() != mine.ToString() || layers != static_cast<uint32_t>(options_.geometry.layers))
    return InvalidArgument(what + " was written with " + theirs.ToString() + "; this store has " +
                           mine.ToString());

  const int L = options_.geometry.layers;
  const size_t repr_bytes = options_.repr_bytes();
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
        store_internal::FreeLayerRegions(store->hot_.get(), &ls);
        for (Chunk* c : ls.chunks) delete c;
      }
    }
  } cleanup{this, seq.get()};
  for (int l = 0; l < L; ++l) {
    KVTIER_ASSIGN_OR_RETURN(std::string part,
                            lower_.remote()->GetPublicationPart(name, static_cast<uint32_t>(l)));
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
      KVTIER_ASSIGN_OR_RETURN(store_records::ChunkMeta m,
                              store_records::DecodeChunkMeta(meta, remote_key, repr_bytes));
      auto* c = new Chunk();
      ls.chunks.push_back(c);
      c->key = ChunkKey{0, static_cast<uint32_t>(l), i};  // seq set once the id is known
      c->first_token = m.first_token;
      c->repr = std::move(m.repr);
      c->score = m.score;
      c->tiers = kTierRemote;
      c->lower_acked = true;  // a lower tier (the remote one) holds it: warm copies may leave
    }
    std::string sinks, local;
    KVTIER_RETURN_IF_ERROR(rr.ReadLengthPrefixed(&sinks, "sinks"));
    KVTIER_RETURN_IF_ERROR(rr.ReadLengthPrefixed(&local, "local"));
    KVTIER_RETURN_IF_ERROR(rr.ExpectEnd());
    if (sinks.size() != 2 * n_sink_tokens * token_bytes_ || local.size() != 2 * n_local * token_bytes_)
      return Corruption(what + " layer " + std::to_string(l) + ": sinks/local do not match its token count");
    KVTIER_RETURN_IF_ERROR(store_internal::AllocateLayerRegions(options_, token_bytes_, hot_.get(), &ls));
    KVTIER_RETURN_IF_ERROR(
        store_internal::RestoreLayerRegions(options_, token_bytes_, hot_.get(), sinks, local, &ls));
  }
  std::lock_guard<CountingMutex> l(sync_.mu);
  cleanup.armed = false;
  Sequence* attached = seq.get();
  const SequenceId id = sequences_->Add(std::move(seq));
  // The chunks keep their representatives in memory: the remote tier does not read metas alone
  // (see metadata_bytes).
  for (auto& ls : attached->layers)
    for (Chunk* c : ls.chunks) {
      if (c == nullptr) continue;
      c->key.seq = id;
      catalog_->Register(c);
    }
  return id;
}

}  // namespace kvtier
