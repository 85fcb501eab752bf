#include "offload/tiered_store.h"

#include "kernels/cpu/dot.h"

#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;

// Records in the cold tier. Integers are little-endian fixed width; every
// record starts with a magic and a version so a foreign or stale value is
// rejected with Corruption instead of being misread.
constexpr uint32_t kStoreMagic = 0x5354564b;  // "KVTS"
constexpr uint32_t kSeqMagic = 0x5153564b;    // "KVSQ"
constexpr uint32_t kMetaMagic = 0x4d43564b;   // "KVCM"
constexpr uint32_t kRecordVersion = 1;
constexpr SequenceId kStoreRecordSeq = 0;     // sequence ids start at 1
constexpr const char* kStoreBlob = "store";
constexpr const char* kSinksBlob = "sinks";
constexpr const char* kLocalBlob = "local";

enum class SeqState : uint8_t { kOpen = 0, kClosed = 1, kRecovered = 2 };

class Writer {
 public:
  template <typename T> void Put(T v) { buf_.append(reinterpret_cast<const char*>(&v), sizeof(T)); }
  void Bytes(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
  std::string& str() { return buf_; }
 private:
  std::string buf_;
};

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  template <typename T> bool Get(T* v) {
    if (s_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, s_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool Bytes(void* dst, size_t n) {
    if (s_.size() - pos_ < n) return false;
    std::memcpy(dst, s_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == s_.size(); }
 private:
  std::string_view s_;
  size_t pos_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------
// Internal state

struct TieredStore::Chunk {
  uint64_t id = 0;
  ChunkKey key;
  int64_t first_token = 0;
  std::vector<uint8_t> repr;  // [repr_topk, kv_heads, head_dim] in storage dtype
  uint8_t tiers = kTierNone;
  int32_t warm_slot = -1;
  int32_t hot_slot = -1;
  int warm_pins = 0;          // internal copies reading/writing the warm slot
  int hot_pins = 0;           // FetchHandles holding the hot slot
  Clock::time_point pin_deadline{};
  bool hot_loading = false;   // hot slot assigned, bytes not there yet
  bool cold_acked = false;
  bool cold_writing = false;
  float score = 0.0f;
};

struct TieredStore::LayerState {
  uint8_t* sink_k = nullptr;  // [n_sink, kv_heads, head_dim]
  uint8_t* sink_v = nullptr;
  uint8_t* ring_k = nullptr;  // [ring, kv_heads, head_dim], token p at (p - n_sink) % ring
  uint8_t* ring_v = nullptr;
  std::vector<float> ring_mass;  // [kv_heads, ring] attention mass while in the local window
  int64_t n_tokens = 0;
  int64_t sealed_end = 0;     // first position not yet in a chunk (>= n_sink once sinks are full)
  bool sinks_restored = true; // false for a recovered sequence without a sinks record
  std::vector<Chunk*> chunks; // by chunk index
};

struct TieredStore::Sequence {
  SequenceId id = 0;
  SeqState state = SeqState::kOpen;
  std::vector<LayerState> layers;
  int busy = 0;  // operations in progress that must finish before a drop
};

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
  KVTIER_RETURN_IF_ERROR(positive("transfer_threads", transfer_threads));
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
  {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return inflight_ == 0; });
  }
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
  KVTIER_ASSIGN_OR_RETURN(auto hot, HostHotTier::Create(options_.hot_bytes, chunk_bytes_));
  hot_ = std::move(hot);
  KVTIER_ASSIGN_OR_RETURN(warm_, SlotPool::Create("warm_bytes", options_.warm_bytes, chunk_bytes_, true));
  KVTIER_ASSIGN_OR_RETURN(hot_policy_, MakeDemotionPolicy(options_.hot_policy));
  KVTIER_ASSIGN_OR_RETURN(warm_policy_, MakeDemotionPolicy(options_.warm_policy));
  // Ask for no more workers than the process has (oneTBB warns otherwise); on
  // two cores that is one transfer worker, and callers' waits never block it.
  const int workers = std::max(1, std::min(options_.transfer_threads, tbb::info::default_concurrency() - 1));
  arena_ = std::make_unique<tbb::task_arena>(workers, 0);
  if (!options_.data_dir.empty()) {
    ColdTierOptions co;
    co.path = options_.data_dir;
    co.compression = options_.compression;
    co.sync_writes = options_.sync_writes;
    co.fault_injector = options_.cold_fault_injector;
    KVTIER_ASSIGN_OR_RETURN(cold_, ColdTier::Open(co));
    KVTIER_RETURN_IF_ERROR(Recover());
  }
  return Status::Ok();
}

namespace {
std::string EncodeStoreRecord(const StoreOptions& o) {
  Writer w;
  w.Put(kStoreMagic); w.Put(kRecordVersion);
  const Geometry& g = o.geometry;
  w.Put<int32_t>(g.layers); w.Put<int32_t>(g.q_heads); w.Put<int32_t>(g.kv_heads); w.Put<int32_t>(g.head_dim);
  w.Put<uint8_t>(static_cast<uint8_t>(g.dtype));
  w.Put<int32_t>(o.n_sink); w.Put<int32_t>(o.n_local); w.Put<int32_t>(o.chunk_size); w.Put<int32_t>(o.repr_topk);
  return std::move(w.str());
}

std::string DescribeLayout(const StoreOptions& o) {
  return "geometry " + o.geometry.ToString() + ", n_sink " + std::to_string(o.n_sink) + ", n_local " +
         std::to_string(o.n_local) + ", chunk_size " + std::to_string(o.chunk_size) + ", repr_topk " +
         std::to_string(o.repr_topk);
}
}  // namespace

Status TieredStore::Recover() {
  // The store record pins the layout: reopening with another geometry would misread every chunk.
  auto existing = cold_->GetBlob(kStoreRecordSeq, 0, kStoreBlob);
  const std::string mine = EncodeStoreRecord(options_);
  if (existing.ok()) {
    if (*existing != mine) {
      Reader r(*existing);
      uint32_t magic = 0, version = 0;
      StoreOptions theirs;
      int32_t v[8];
      uint8_t dt = 0;
      if (!r.Get(&magic) || magic != kStoreMagic || !r.Get(&version) || !r.Get(&v[0]) || !r.Get(&v[1]) ||
          !r.Get(&v[2]) || !r.Get(&v[3]) || !r.Get(&dt) || !r.Get(&v[4]) || !r.Get(&v[5]) || !r.Get(&v[6]) ||
          !r.Get(&v[7]))
        return Corruption("data_dir '" + options_.data_dir + "': store record is malformed");
      theirs.geometry = Geometry{v[0], v[1], v[2], v[3], static_cast<DType>(dt)};
      theirs.n_sink = v[4]; theirs.n_local = v[5]; theirs.chunk_size = v[6]; theirs.repr_topk = v[7];
      return InvalidArgument("data_dir '" + options_.data_dir + "' holds a store with " + DescribeLayout(theirs) +
                             ", but the options say " + DescribeLayout(options_));
    }
  } else if (existing.status().code() == StatusCode::kNotFound) {
    KVTIER_RETURN_IF_ERROR(cold_->PutBlob(kStoreRecordSeq, 0, kStoreBlob, mine.data(), mine.size()));
  } else {
    return existing.status();
  }

  const int L = options_.geometry.layers;
  std::vector<std::pair<SequenceId, std::string>> records;
  KVTIER_RETURN_IF_ERROR(cold_->ForEachSequence([&](SequenceId id, std::string_view rec) {
    records.emplace_back(id, std::string(rec));
    return Status::Ok();
  }));
  const size_t repr_bytes =
      static_cast<size_t>(options_.repr_topk) * options_.geometry.token_elems() * DTypeSize(options_.geometry.dtype);
  for (auto& [id, rec] : records) {
    if (id == kStoreRecordSeq) continue;
    Reader r(rec);
    uint32_t magic = 0, version = 0, layers = 0;
    uint8_t state = 0;
    if (!r.Get(&magic) || magic != kSeqMagic || !r.Get(&version) || !r.Get(&state) || !r.Get(&layers) ||
        layers != static_cast<uint32_t>(L))
      return Corruption("cold tier: sequence " + std::to_string(id) + " record is malformed");
    std::vector<int64_t> n_tokens(L);
    for (int l = 0; l < L; ++l)
      if (!r.Get(&n_tokens[l])) return Corruption("cold tier: sequence " + std::to_string(id) + " record is short");
    auto seq = std::make_unique<Sequence>();
    seq->id = id;
    seq->state = state == static_cast<uint8_t>(SeqState::kClosed) ? SeqState::kClosed : SeqState::kRecovered;
    seq->layers.resize(L);
    next_seq_id_ = std::max(next_seq_id_, id + 1);
    Status meta_status = cold_->ForEachChunkMeta(id, [&](const ChunkKey& key, std::string_view meta) -> Status {
      if (key.layer >= static_cast<uint32_t>(L))
        return Corruption("cold tier: chunk " + key.ToString() + " names a layer beyond the geometry");
      Reader mr(meta);
      uint32_t mm = 0, mv = 0;
      int64_t first = 0;
      uint32_t rb = 0;
      auto c = std::make_unique<Chunk>();
      if (!mr.Get(&mm) || mm != kMetaMagic || !mr.Get(&mv) || !mr.Get(&first) || !mr.Get(&rb) || rb != repr_bytes)
        return Corruption("cold tier: chunk " + key.ToString() + " meta record is malformed");
      c->repr.resize(rb);
      if (!mr.Bytes(c->repr.data(), rb) || !mr.Get(&c->score) || !mr.done())
        return Corruption("cold tier: chunk " + key.ToString() + " meta record is malformed");
      c->id = next_chunk_id_++;
      c->key = key;
      c->first_token = first;
      c->tiers = kTierCold;
      c->cold_acked = true;
      auto& chunks = seq->layers[key.layer].chunks;
      if (chunks.size() <= key.index) chunks.resize(key.index + 1, nullptr);
      chunk_by_id_[c->id] = c.get();
      chunks[key.index] = c.release();
      counters_.cold_chunks++;
      counters_.cold_bytes += chunk_bytes_;
      return Status::Ok();
    });
    // Register the sequence before checking the status, so its chunks are freed either way.
    Sequence* s = seq.get();
    sequences_[id] = std::move(seq);
    KVTIER_RETURN_IF_ERROR(meta_status);
    for (int l = 0; l < L; ++l) {
      LayerState& ls = s->layers[l];
      // A crash can leave a hole (chunk k+1 acknowledged before chunk k): keep the contiguous prefix.
      // A crash can leave holes (chunk k+1 acknowledged before chunk k); chunks
      // are addressed by index, so a hole reads back as NotFound, never as
      // someone else's tokens.
      // As at run time: sealed_end trails n_tokens while the sinks fill, then
      // sits at the end of the last chunk.
      if (s->state == SeqState::kClosed) {
        ls.n_tokens = n_tokens[l];
        // The sealed chunk count follows from n_tokens (Append seals the oldest chunk
        // when the ring is full and a token arrives), not from the chunks found:
        // trailing chunks may have been dropped by compression (DropChunks).
        const int64_t beyond = ls.n_tokens - options_.n_sink - (options_.n_local + options_.chunk_size);
        const int64_t sealed = beyond > 0 ? (beyond + options_.chunk_size - 1) / options_.chunk_size : 0;
        if (static_cast<int64_t>(ls.chunks.size()) > sealed)
          return Corruption("cold tier: sequence " + std::to_string(id) + " layer " + std::to_string(l) + " has " +
                            std::to_string(ls.chunks.size()) + " chunks but its " + std::to_string(ls.n_tokens) +
                            " tokens seal only " + std::to_string(sealed));
        ls.sealed_end = std::min<int64_t>(ls.n_tokens, options_.n_sink) + sealed * options_.chunk_size;
      } else {
        ls.sealed_end = ls.chunks.empty() ? 0 : options_.n_sink + static_cast<int64_t>(ls.chunks.size()) * options_.chunk_size;
        ls.n_tokens = ls.sealed_end;
      }
      ls.sinks_restored = false;
      if (s->state == SeqState::kClosed) {
        auto sinks = cold_->GetBlob(id, l, kSinksBlob);
        auto local = cold_->GetBlob(id, l, kLocalBlob);
        if (!sinks.ok()) return sinks.status();
        if (!local.ok()) return local.status();
        const int64_t n_sink_tokens = std::min<int64_t>(ls.n_tokens, options_.n_sink);
        const int64_t n_local_tokens = ls.n_tokens - std::max<int64_t>(ls.sealed_end, n_sink_tokens);
        if (sinks->size() != 2 * n_sink_tokens * token_bytes_ || n_local_tokens < 0 ||
            local->size() != 2 * static_cast<size_t>(n_local_tokens) * token_bytes_)
          return Corruption("cold tier: sequence " + std::to_string(id) + " layer " + std::to_string(l) +
                            " sinks/local records do not match its token count");
        // Rebuild the hot regions exactly as they were at close.
        const size_t ring = static_cast<size_t>(options_.n_local + options_.chunk_size);
        KVTIER_ASSIGN_OR_RETURN(ls.sink_k, hot_->AllocateRegion(std::max<size_t>(1, options_.n_sink * token_bytes_)));
        KVTIER_ASSIGN_OR_RETURN(ls.sink_v, hot_->AllocateRegion(std::max<size_t>(1, options_.n_sink * token_bytes_)));
        KVTIER_ASSIGN_OR_RETURN(ls.ring_k, hot_->AllocateRegion(ring * token_bytes_));
        KVTIER_ASSIGN_OR_RETURN(ls.ring_v, hot_->AllocateRegion(ring * token_bytes_));
        region_bytes_ += 2 * (options_.n_sink + ring) * token_bytes_;
        const size_t sb = n_sink_tokens * token_bytes_;
        KVTIER_RETURN_IF_ERROR(hot_->Upload(ls.sink_k, sinks->data(), sb));
        KVTIER_RETURN_IF_ERROR(hot_->Upload(ls.sink_v, sinks->data() + sb, sb));
        for (int64_t t = 0; t < n_local_tokens; ++t) {
          const int64_t p = ls.sealed_end + t;
          const size_t slot = static_cast<size_t>((p - options_.n_sink) % static_cast<int64_t>(ring));
          KVTIER_RETURN_IF_ERROR(hot_->Upload(ls.ring_k + slot * token_bytes_, local->data() + t * token_bytes_, token_bytes_));
          KVTIER_RETURN_IF_ERROR(hot_->Upload(ls.ring_v + slot * token_bytes_,
                                              local->data() + (n_local_tokens + t) * token_bytes_, token_bytes_));
        }
        ls.sinks_restored = true;
      }
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Sequences

namespace {
std::string EncodeSequenceRecord(SeqState state, const std::vector<int64_t>& n_tokens) {
  Writer w;
  w.Put(kSeqMagic); w.Put(kRecordVersion);
  w.Put(static_cast<uint8_t>(state));
  w.Put(static_cast<uint32_t>(n_tokens.size()));
  for (int64_t n : n_tokens) w.Put(n);
  return std::move(w.str());
}
}  // namespace

Result<SequenceId> TieredStore::CreateSequence() {
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

Status TieredStore::Append(SequenceId seq, int layer, const void* k, const void* v, int n, DType dtype) {
  Sequence* s = nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, true, &s));
    if (n <= 0) return InvalidArgument("Append: token count must be > 0 (got " + std::to_string(n) + ")");
    if (k == nullptr || v == nullptr) return InvalidArgument("Append: k and v must not be null");
    if (dtype != options_.geometry.dtype)
      return InvalidArgument(std::string("Append: dtype ") + DTypeName(dtype) + " does not match the store's " +
                             DTypeName(options_.geometry.dtype));
    s->busy++;
  }
  LayerState& ls = s->layers[layer];
  const auto* kb = static_cast<const uint8_t*>(k);
  const auto* vb = static_cast<const uint8_t*>(v);
  const int64_t ring = options_.n_local + options_.chunk_size;
  Status status;
  int done = 0;
  while (done < n) {
    if (ls.n_tokens < options_.n_sink) {
      const int take = static_cast<int>(std::min<int64_t>(n - done, options_.n_sink - ls.n_tokens));
      status = hot_->Upload(ls.sink_k + ls.n_tokens * token_bytes_, kb + done * token_bytes_, take * token_bytes_);
      if (status.ok())
        status = hot_->Upload(ls.sink_v + ls.n_tokens * token_bytes_, vb + done * token_bytes_, take * token_bytes_);
      if (!status.ok()) break;
      ls.n_tokens += take;
      ls.sealed_end = ls.n_tokens;
      done += take;
      continue;
    }
    if (ls.n_tokens - ls.sealed_end == ring) {
      status = SealOldestChunk(s, layer);
      if (!status.ok()) break;
    }
    // Copy up to the ring's free space, split at the wrap point.
    const int64_t free_tokens = ring - (ls.n_tokens - ls.sealed_end);
    const int64_t slot = (ls.n_tokens - options_.n_sink) % ring;
    const int take = static_cast<int>(std::min<int64_t>({n - done, free_tokens, ring - slot}));
    status = hot_->Upload(ls.ring_k + slot * token_bytes_, kb + done * token_bytes_, take * token_bytes_);
    if (status.ok()) status = hot_->Upload(ls.ring_v + slot * token_bytes_, vb + done * token_bytes_, take * token_bytes_);
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
    if (cold_ && warm_policy_->PickVictim(movable, &victim_id)) {
      // Not yet in cold: write it, and only then let it leave warm.
      KVTIER_RETURN_IF_ERROR(WriteWarmChunkToColdLocked(lock, chunk_by_id_.at(victim_id)));
      continue;
    }
    if (!cold_)
      return ResourceExhausted("warm tier is full (" + std::to_string(warm_->capacity()) +
                               " chunks) and there is no cold tier to demote to (data_dir is empty)");
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
  lock.unlock();
  Status st = WriteCold(c, payload);
  lock.lock();
  c->cold_writing = false;
  c->warm_pins--;
  cv_.notify_all();
  return st;
}

Status TieredStore::WriteCold(Chunk* c, const uint8_t* payload) {
  const std::string meta = EncodeMeta(*c);
  Status st = cold_->PutChunk(c->key, meta, payload, chunk_bytes_);
  std::function<void(const ChunkKey&)> listener;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!st.ok()) {
      st = Status(st.code(), "writing chunk " + c->key.ToString() + " to the cold tier: " + st.message());
      return st;
    }
    if (!c->cold_acked) {
      c->cold_acked = true;
      c->tiers |= kTierCold;
      counters_.cold_chunks++;
      counters_.cold_bytes += chunk_bytes_;
      counters_.cold_writes++;
      counters_.bytes_moved += chunk_bytes_;
    }
    listener = ack_listener_;
  }
  if (listener) listener(c->key);
  return Status::Ok();
}

std::string TieredStore::EncodeMeta(const Chunk& c) const {
  Writer w;
  w.Put(kMetaMagic); w.Put(kRecordVersion);
  w.Put(c.first_token);
  w.Put(static_cast<uint32_t>(c.repr.size()));
  w.Bytes(c.repr.data(), c.repr.size());
  w.Put(c.score);
  return std::move(w.str());
}

using kernels::Dot;

void TieredStore::ChooseRepresentatives(const LayerState& ls, int64_t first_token, uint8_t* repr) const {
  // InfLLM: per kv head, the chunk's tokens that received the most attention
  // while they were in the local window. Fallback when no statistics reached
  // this chunk for a head (all mass zero): the most typical keys, those with
  // the highest summed cosine to every key of the chunk (= cosine to the mean
  // of the unit keys), a medoid-like choice one outlier cannot drag towards
  // itself. The chosen keys are copied in the storage dtype, bit for bit.
  const Geometry& g = options_.geometry;
  const int cs = options_.chunk_size, D = g.head_dim, H = g.kv_heads, R = options_.repr_topk;
  const int64_t ring = options_.n_local + options_.chunk_size;
  const int64_t slot0 = (first_token - options_.n_sink) % ring;
  const uint8_t* chunk_keys = ls.ring_k + slot0 * token_bytes_;
  const size_t head_bytes = static_cast<size_t>(D) * DTypeSize(g.dtype);
  std::vector<float> keys;  // converted lazily: only the fallback needs fp32 keys
  std::vector<int> order(cs);
  std::vector<float> score(cs), mean(D), inv_norm(cs);
  for (int h = 0; h < H; ++h) {
    const float* mass = ls.ring_mass.data() + h * ring + slot0;
    float total = 0.0f;
    for (int t = 0; t < cs; ++t) total += mass[t];
    if (total > 0.0f) {
      for (int t = 0; t < cs; ++t) score[t] = mass[t];
    } else {
      if (keys.empty()) {
        keys.resize(static_cast<size_t>(cs) * H * D);
        ToFloat(g.dtype, chunk_keys, keys.data(), keys.size());
      }
      std::fill(mean.begin(), mean.end(), 0.0f);
      for (int t = 0; t < cs; ++t) {
        const float* kt = &keys[(static_cast<size_t>(t) * H + h) * D];
        const float nk = Dot(kt, kt, D);
        inv_norm[t] = nk > 0.0f ? 1.0f / std::sqrt(nk) : 0.0f;
        for (int d = 0; d < D; ++d) mean[d] += kt[d] * inv_norm[t];
      }
      for (int t = 0; t < cs; ++t)
        score[t] = Dot(&keys[(static_cast<size_t>(t) * H + h) * D], mean.data(), D) * inv_norm[t];
    }
    std::iota(order.begin(), order.end(), 0);
    // Highest score first; ties go to the earlier token (deterministic).
    std::partial_sort(order.begin(), order.begin() + R, order.end(),
                      [&](int a, int b) { return score[a] != score[b] ? score[a] > score[b] : a < b; });
    for (int r = 0; r < R; ++r)
      std::memcpy(repr + (static_cast<size_t>(r) * H + h) * head_bytes,
                  chunk_keys + (static_cast<size_t>(order[r]) * H + h) * head_bytes, head_bytes);
  }
}

Status TieredStore::SealOldestChunk(Sequence* s, int layer) {
  LayerState& ls = s->layers[layer];
  const int64_t ring = options_.n_local + options_.chunk_size;
  const int64_t first = ls.sealed_end;
  const int64_t slot0 = (first - options_.n_sink) % ring;  // multiple of chunk_size: chunks never wrap
  Chunk* c = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    KVTIER_RETURN_IF_ERROR(MakeWarmRoom(lock));
    const int32_t slot = warm_->Acquire();
    if (slot < 0) return Internal("warm tier reported room but had no free slot");
    c = new Chunk();
    c->id = next_chunk_id_++;
    c->key = ChunkKey{s->id, static_cast<uint32_t>(layer), ls.chunks.size()};
    c->first_token = first;
    c->warm_slot = slot;
    c->warm_pins = 1;  // being filled
    chunk_by_id_[c->id] = c;
    ls.chunks.push_back(c);
  }
  // Fill the warm slot outside the lock: [K chunk][V chunk].
  uint8_t* dst = warm_->slot_data(c->warm_slot);
  const size_t half = static_cast<size_t>(options_.chunk_size) * token_bytes_;
  Status st = hot_->Download(dst, ls.ring_k + slot0 * token_bytes_, half);
  if (st.ok()) st = hot_->Download(dst + half, ls.ring_v + slot0 * token_bytes_, half);
  c->repr.resize(static_cast<size_t>(options_.repr_topk) * token_bytes_);
  ChooseRepresentatives(ls, first, c->repr.data());
  // Reset the statistics of the ring positions the chunk leaves behind.
  for (int h = 0; h < options_.geometry.kv_heads; ++h)
    std::fill_n(ls.ring_mass.data() + h * ring + slot0, options_.chunk_size, 0.0f);

  std::unique_lock<std::mutex> lock(mu_);
  if (!st.ok()) {
    ls.chunks.pop_back();
    chunk_by_id_.erase(c->id);
    warm_->Release(c->warm_slot);
    delete c;
    return st;
  }
  c->tiers = kTierWarm;
  warm_policy_->OnInsert(c->id);
  counters_.warm_chunks = warm_->used();
  counters_.chunks_sealed++;
  counters_.bytes_moved += chunk_bytes_;
  ls.sealed_end += options_.chunk_size;
  if (options_.write_through && cold_) {
    c->cold_writing = true;  // keeps the warm pin until the write is done
    lock.unlock();
    SubmitColdWrite(c);
  } else {
    c->warm_pins = 0;
  }
  return Status::Ok();
}

void TieredStore::Enqueue(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    inflight_++;
  }
  arena_->enqueue([this, fn = std::move(fn)] {
    fn();
    std::lock_guard<std::mutex> l(mu_);
    inflight_--;
    cv_.notify_all();
  });
}

void TieredStore::SubmitColdWrite(Chunk* c) {
  Enqueue([this, c] {
    Status st = WriteCold(c, warm_->slot_data(c->warm_slot));
    std::lock_guard<std::mutex> l(mu_);
    c->cold_writing = false;
    c->warm_pins--;
    if (!st.ok() && background_error_.ok()) background_error_ = st;
  });
}

Status TieredStore::WaitForDurable() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return inflight_ == 0; });
  // A failed write-through leaves its chunk unacknowledged in warm, where the
  // next demotion or CloseSequence writes it again; report the failure once.
  Status st = background_error_;
  background_error_ = Status::Ok();
  return st;
}

void TieredStore::SetColdAckListener(std::function<void(const ChunkKey&)> listener) {
  std::lock_guard<std::mutex> l(mu_);
  ack_listener_ = std::move(listener);
}

// ---------------------------------------------------------------------------
// Statistics for representative keys

Status TieredStore::ObserveQueries(SequenceId seq, int layer, const float* q, const int64_t* positions, int m) {
  if (m <= 0) return InvalidArgument("ObserveQueries: query count must be > 0 (got " + std::to_string(m) + ")");
  if (q == nullptr || positions == nullptr) return InvalidArgument("ObserveQueries: q and positions must not be null");
  KVTIER_ASSIGN_OR_RETURN(HotView view, GetHotView(seq, layer));
  const Geometry& g = options_.geometry;
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
  std::lock_guard<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  std::vector<ChunkInfo> out;
  for (const Chunk* c : s->layers[layer].chunks) {
    if (c == nullptr) continue;
    out.push_back(ChunkInfo{c->key, c->first_token, options_.chunk_size, c->tiers, c->score});
  }
  return out;
}

Result<uint64_t> TieredStore::ChunkCount(SequenceId seq, int layer) const {
  std::lock_guard<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  return static_cast<uint64_t>(s->layers[layer].chunks.size());
}

Status TieredStore::GetRepresentatives(const ChunkKey& key, float* out) const {
  std::lock_guard<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(key.seq, static_cast<int>(key.layer), false, &s));
  const auto& chunks = s->layers[key.layer].chunks;
  if (key.index >= chunks.size() || chunks[key.index] == nullptr) return NotFound("chunk " + key.ToString() + " does not exist");
  const Chunk* c = chunks[key.index];
  ToFloat(options_.geometry.dtype, c->repr.data(), out, c->repr.size() / DTypeSize(options_.geometry.dtype));
  return Status::Ok();
}

Status TieredStore::ReadTokens(SequenceId seq, int layer, int64_t begin, int64_t end, void* k_out, void* v_out) {
  Sequence* s = nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
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
      const uint64_t idx = static_cast<uint64_t>((p - options_.n_sink) / options_.chunk_size);
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
                        " is missing (dropped by compression, or lost before it was acknowledged)");
          break;
        }
        if (c->warm_slot >= 0) { c->warm_pins++; src = warm_->slot_data(c->warm_slot); }
        else if (c->hot_slot >= 0 && !c->hot_loading) { c->hot_pins++; from_hot = true; src = hot_->slot_data(c->hot_slot); }
      }
      if (src == nullptr) {
        staging.resize(chunk_bytes_);
        st = cold_ ? cold_->GetChunk(c->key, staging.data(), chunk_bytes_)
                   : Internal("chunk " + c->key.ToString() + " is in no tier");
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

bool TieredStore::PinnedLocked(const Chunk* c) const {
  if (c->hot_pins == 0) return false;
  return Clock::now() < c->pin_deadline;
}

int32_t TieredStore::AcquireHotSlotLocked() {
  int32_t slot = hot_->AcquireSlot();
  if (slot >= 0) return slot;
  uint64_t victim = 0;
  auto can_leave = [&](uint64_t id) {
    const Chunk* c = chunk_by_id_.at(id);
    return !c->hot_loading && !PinnedLocked(c);
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

Result<FetchHandle> TieredStore::FetchChunks(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices) {
  auto st = std::make_shared<FetchHandle::State>();
  st->store = this;
  bool any_load = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    Sequence* s = nullptr;
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
    LayerState& ls = s->layers[layer];
    if (static_cast<int64_t>(chunk_indices.size()) > hot_->slot_capacity())
      return ResourceExhausted("fetch of " + std::to_string(chunk_indices.size()) + " chunks exceeds the hot tier's " +
                               std::to_string(hot_->slot_capacity()) + " slots (hot_bytes)");
    for (uint64_t idx : chunk_indices)
      if (idx >= ls.chunks.size() || ls.chunks[idx] == nullptr)
        return InvalidArgument("fetch: chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                               " does not exist (layer has " + std::to_string(ls.chunks.size()) + " chunks)");
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.pin_timeout_ms);
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
        const int32_t slot = AcquireHotSlotLocked();
        if (slot < 0) {
          undo();
          return ResourceExhausted("hot tier: all " + std::to_string(hot_->slot_capacity()) +
                                   " slots are pinned; release fetch handles or raise hot_bytes");
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
  if (any_load) Enqueue([this, st] {
    if (!st->claimed.exchange(true)) RunFetch(st);
  });
  else st->claimed = true;
  FetchHandle h;
  h.state_ = st;
  return h;
}

void TieredStore::RunFetch(const std::shared_ptr<FetchHandle::State>& st) {
  // Three phases, so the store lock is taken twice per fetch, not twice per chunk:
  // (1) under the lock, pin each load's warm copy, or reserve the warm slot a chunk coming
  // back from cold will keep its copy in (retrieval tends to come back to the same chunks);
  // (2) without it, read cold chunks into those slots and upload to the hot slots; (3) under
  // the lock, unpin, attach the warm copies that arrived, and mark the loads done.
  struct Load {
    Chunk* c = nullptr;
    const uint8_t* warm = nullptr;  // pinned warm copy, or null: read it from cold
    int32_t read_slot = -1;         // warm slot reserved for the cold read (-1: none was free)
    std::vector<uint8_t> staging;   // the cold read's bytes when no warm slot was free
    Status status;
  };
  std::vector<Load> loads;
  size_t cold_loads = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < st->chunk_ids.size(); ++i) {
      if (!st->needs_load[i]) continue;
      Load ld;
      ld.c = chunk_by_id_.at(st->chunk_ids[i]);
      if (ld.c->warm_slot >= 0) {
        ld.c->warm_pins++;
        ld.warm = warm_->slot_data(ld.c->warm_slot);
        warm_policy_->OnAccess(ld.c->id);
      } else {
        ld.read_slot = AcquireWarmSlotForReadLocked();
        ++cold_loads;
      }
      loads.push_back(std::move(ld));
    }
  }
  auto run = [&](Load& ld) {
    const uint8_t* src = ld.warm;
    if (src == nullptr) {
      if (!cold_) {
        ld.status = Internal("chunk " + ld.c->key.ToString() + " is in no tier");
        return;
      }
      uint8_t* buf = ld.read_slot >= 0 ? warm_->slot_data(ld.read_slot) : nullptr;
      if (buf == nullptr) {
        ld.staging.resize(chunk_bytes_);
        buf = ld.staging.data();
      }
      ld.status = cold_->GetChunk(ld.c->key, buf, chunk_bytes_);
      if (!ld.status.ok()) return;
      src = buf;
    }
    ld.status = hot_->Upload(hot_->slot_data(ld.c->hot_slot), src, chunk_bytes_);
  };
  // A warm copy is one 16 KiB memcpy, cheaper than a fork-join; cold reads are worth spreading.
  if (cold_loads >= 2) {
    tbb::parallel_for(size_t{0}, loads.size(), [&](size_t j) { run(loads[j]); });
  } else {
    for (Load& ld : loads) run(ld);
  }

  std::lock_guard<std::mutex> l(mu_);
  Status first_error;
  for (Load& ld : loads) {
    Chunk* c = ld.c;
    if (ld.warm != nullptr) {
      c->warm_pins--;
    } else {
      counters_.cold_reads++;
      if (ld.read_slot >= 0) {
        if (ld.status.ok() && c->warm_slot < 0) {
          c->warm_slot = ld.read_slot;
          c->tiers |= kTierWarm;
          warm_policy_->OnInsert(c->id);
          counters_.promotions++;
          counters_.bytes_moved += chunk_bytes_;
        } else {
          warm_->Release(ld.read_slot);
        }
      }
    }
    if (ld.status.ok()) {
      counters_.promotions++;
      counters_.bytes_moved += chunk_bytes_;
    } else if (first_error.ok()) {
      first_error = ld.status;
    }
  }
  for (const Load& ld : loads) {
    ld.c->hot_loading = false;
    if (first_error.ok()) ld.c->tiers |= kTierHot;
  }
  if (!first_error.ok()) {
    // Failed loads must not stay in hot slots holding garbage.
    for (const Load& ld : loads) {
      hot_->ReleaseSlot(ld.c->hot_slot);
      hot_policy_->OnRemove(ld.c->id);
      ld.c->hot_slot = -1;
      ld.c->tiers &= ~kTierHot;
    }
  }
  counters_.warm_chunks = warm_->used();
  st->status = first_error;
  st->done = true;
  cv_.notify_all();
}

void TieredStore::EvictHot() {
  std::lock_guard<std::mutex> l(mu_);
  uint64_t victim = 0;
  while (hot_policy_->PickVictim(
      [&](uint64_t id) {
        const Chunk* c = chunk_by_id_.at(id);
        return !c->hot_loading && !PinnedLocked(c);
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
    std::lock_guard<std::mutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, 0, true, &s));
    s->busy++;
  }
  Status st;
  if (cold_) {
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
    std::vector<int64_t> n_tokens;
    for (int l = 0; l < options_.geometry.layers && st.ok(); ++l) {
      LayerState& ls = s->layers[l];
      n_tokens.push_back(ls.n_tokens);
      const int64_t n_sink_tokens = std::min<int64_t>(ls.n_tokens, options_.n_sink);
      std::string sinks(2 * n_sink_tokens * token_bytes_, '\0');
      st = hot_->Download(sinks.data(), ls.sink_k, n_sink_tokens * token_bytes_);
      if (st.ok()) st = hot_->Download(sinks.data() + n_sink_tokens * token_bytes_, ls.sink_v, n_sink_tokens * token_bytes_);
      const int64_t n_local = ls.n_tokens - std::max<int64_t>(ls.sealed_end, n_sink_tokens);
      std::string local(2 * n_local * token_bytes_, '\0');
      if (st.ok() && n_local > 0) {
        std::vector<uint8_t> k(n_local * token_bytes_), v(n_local * token_bytes_);
        st = ReadTokens(seq, l, ls.n_tokens - n_local, ls.n_tokens, k.data(), v.data());
        std::memcpy(local.data(), k.data(), k.size());
        std::memcpy(local.data() + k.size(), v.data(), v.size());
      }
      if (st.ok()) st = cold_->PutBlob(seq, l, kSinksBlob, sinks.data(), sinks.size());
      if (st.ok()) st = cold_->PutBlob(seq, l, kLocalBlob, local.data(), local.size());
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

void TieredStore::FreeChunkLocked(Chunk* c) {
  if (c->warm_slot >= 0) { warm_->Release(c->warm_slot); warm_policy_->OnRemove(c->id); }
  if (c->hot_slot >= 0) { hot_->ReleaseSlot(c->hot_slot); hot_policy_->OnRemove(c->id); }
  if (c->cold_acked && counters_.cold_chunks > 0) { counters_.cold_chunks--; counters_.cold_bytes -= chunk_bytes_; }
  chunk_by_id_.erase(c->id);
  delete c;
}

Status TieredStore::DropSequence(SequenceId seq) {
  std::unique_lock<std::mutex> l(mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return NotFound("sequence " + std::to_string(seq) + " does not exist (never created or dropped)");
  Sequence* s = it->second.get();
  // Wait for appends, reads and transfers that touch this sequence to finish.
  cv_.wait(l, [&] {
    if (s->busy > 0) return false;
    for (auto& ls : s->layers)
      for (Chunk* c : ls.chunks)
        if (c && (c->warm_pins > 0 || c->cold_writing || c->hot_loading)) return false;
    return true;
  });
  for (auto& ls : s->layers) {
    for (Chunk* c : ls.chunks)
      if (c) FreeChunkLocked(c);
    ls.chunks.clear();
    const size_t ring = static_cast<size_t>(options_.n_local + options_.chunk_size);
    hot_->FreeRegion(ls.sink_k, 0); hot_->FreeRegion(ls.sink_v, 0);
    hot_->FreeRegion(ls.ring_k, 0); hot_->FreeRegion(ls.ring_v, 0);
    region_bytes_ -= 2 * (options_.n_sink + ring) * token_bytes_;
  }
  sequences_.erase(it);
  counters_.warm_chunks = warm_->used();
  counters_.hot_chunks = hot_->slots_used();
  if (cold_) {
    l.unlock();
    KVTIER_RETURN_IF_ERROR(cold_->DeleteSequence(seq));
  }
  return Status::Ok();
}

Status TieredStore::SetChunkScores(SequenceId seq, int layer, const std::vector<std::pair<uint64_t, float>>& scores) {
  std::lock_guard<std::mutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
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
  std::vector<ChunkKey> cold_keys;
  {
    std::unique_lock<std::mutex> l(mu_);
    Sequence* s = nullptr;
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
    LayerState& ls = s->layers[layer];
    for (uint64_t idx : chunk_indices)
      if (idx >= ls.chunks.size())
        return InvalidArgument("DropChunks: chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                               " does not exist (layer has " + std::to_string(ls.chunks.size()) + " chunks)");
    const auto now = Clock::now();
    for (uint64_t idx : chunk_indices) {
      const Chunk* c = ls.chunks[idx];
      if (c && c->hot_pins > 0 && c->pin_deadline > now)
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
      if (c->cold_acked || c->cold_writing) cold_keys.push_back(c->key);
      FreeChunkLocked(c);
      ls.chunks[idx] = nullptr;
      counters_.dropped_chunks++;
    }
    counters_.warm_chunks = warm_->used();
    counters_.hot_chunks = hot_->slots_used();
  }
  // The chunk is gone from memory; removing its cold copy is what makes the drop
  // survive a reopen.
  if (cold_)
    for (const ChunkKey& k : cold_keys) KVTIER_RETURN_IF_ERROR(cold_->DeleteChunk(k));
  return Status::Ok();
}

StoreCounters TieredStore::counters() const {
  std::lock_guard<std::mutex> l(mu_);
  StoreCounters c = counters_;
  c.hot_chunks = hot_->slots_used();
  c.hot_bytes = c.hot_chunks * chunk_bytes_ + region_bytes_;
  c.warm_chunks = warm_->used();
  c.warm_bytes = c.warm_chunks * chunk_bytes_;
  return c;
}

uint64_t TieredStore::metadata_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  const size_t per_chunk = sizeof(Chunk) + static_cast<size_t>(options_.repr_topk) * token_bytes_ + 64;
  return chunk_by_id_.size() * per_chunk;
}

}  // namespace kvtier
