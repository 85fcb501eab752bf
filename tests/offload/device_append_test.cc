// Issue 13 on the store's side, on CPU:
//  * Device K/V for Append ("Append accepts device K/V so a GPU engine never round-trips
//    through host"): MemorySpace::kDevice copies with HotTier::CopyWithin, never through
//    Upload, and on the host tier gives the bytes and attention kHost gives; an unknown
//    MemorySpace is refused by name. On CUDA, CopyWithin is a device-to-device copy on the
//    tier's transfer stream (tests/offload/cuda_hot_tier_test.cc, skipped without a device).
//  * Overlapped D2H of chunks leaving the local window: sealing submits
//    HotTier::DownloadBatchAsync and the chunk lands later. A test tier whose downloads
//    write their destination only when waited (poisoned until then) shows that the store
//    gives the synchronous path's results bit for bit, never reads a landing chunk early,
//    bounds the chunks in flight, and loses only the chunk whose download failed.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"
#include "kvtier/kvtier.h"
#include "offload/hot_tier.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kDim = 16;

StoreOptions SmallStore() {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, DType::kF16};
  so.n_sink = 4;
  so.n_local = 8;
  so.chunk_size = 4;
  so.repr_topk = 2;
  so.hot_bytes = 64 * so.chunk_bytes();
  so.warm_bytes = 1024 * so.chunk_bytes();
  so.data_dir = "";
  return so;
}

// K/V (f16) and Q (f32) of `m` tokens from position p0 of one layer; a needle at
// positions [40, 44) that queries from 80 on look for, so retrieval has something to find.
struct Window {
  std::vector<uint16_t> k, v;
  std::vector<float> q;
  std::vector<int64_t> pos;
};
Window MakeWindow(int layer, int64_t p0, int m) {
  Window w;
  std::vector<float> kf, vf;
  for (int t = 0; t < m; ++t) {
    const int64_t p = p0 + t;
    std::mt19937 rng(static_cast<uint32_t>(p * 131 + layer * 7 + 1));
    std::normal_distribution<float> n(0.0f, 1.0f);
    const bool needle = p >= 40 && p < 44, seeking = p >= 80;
    for (int i = 0; i < kKvHeads * kDim; ++i) {
      kf.push_back(n(rng) + (needle ? 3.0f * std::sin(0.3f * static_cast<float>(i)) : 0.0f));
      vf.push_back(n(rng));
    }
    for (int i = 0; i < kQHeads * kDim; ++i)
      w.q.push_back(n(rng) +
                    (seeking ? 3.0f * std::sin(0.3f * static_cast<float>(i % (kKvHeads * kDim))) : 0.0f));
    w.pos.push_back(p);
  }
  w.k.resize(kf.size());
  w.v.resize(vf.size());
  FromFloat(DType::kF16, kf.data(), w.k.data(), kf.size());
  FromFloat(DType::kF16, vf.data(), w.v.data(), vf.size());
  return w;
}

// Prefill windows of 6 tokens to `prefill`, then decode steps to `total`, every layer
// appended in `space` and attended with retrieval; returns every Attend output.
Status Drive(Session* s, MemorySpace space, int64_t prefill, int64_t total, std::vector<float>* outs) {
  for (int64_t b = 0; b < total;) {
    const bool decode = b >= prefill;
    const int m = decode ? 1 : static_cast<int>(std::min<int64_t>(6, prefill - b));
    KVTIER_RETURN_IF_ERROR(s->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill));
    for (int l = 0; l < kLayers; ++l) {
      const Window w = MakeWindow(l, b, m);
      KVTIER_RETURN_IF_ERROR(s->Append(l, w.k.data(), w.v.data(), m, DType::kF16, space));
      std::vector<float> out(static_cast<size_t>(m) * kQHeads * kDim);
      KVTIER_RETURN_IF_ERROR(s->Attend(l, w.q.data(), w.pos.data(), m, out.data()));
      outs->insert(outs->end(), out.begin(), out.end());
    }
    b += m;
  }
  return Status::Ok();
}

SessionOptions SmallRetrieval() {
  SessionOptions o;
  o.retrieval.budget_tokens = 16;
  return o;
}

TEST(DeviceAppend, OnTheHostTierKDeviceGivesTheBytesAndAttentionOfKHost) {
  // "host" keeps hot memory in host memory, so kDevice is host memory there: the same
  // store content, representatives and Attend outputs, bit for bit.
  auto a = TieredStore::Open(SmallStore());
  auto b = TieredStore::Open(SmallStore());
  ASSERT_TRUE(a.ok() && b.ok());
  auto sa = Session::Open(a->get(), SmallRetrieval());
  auto sb = Session::Open(b->get(), SmallRetrieval());
  ASSERT_TRUE(sa.ok() && sb.ok());
  std::vector<float> out_host, out_device;
  constexpr int64_t kTokens = 120;
  ASSERT_TRUE(Drive(sa->get(), MemorySpace::kHost, 96, kTokens, &out_host).ok());
  const Status st = Drive(sb->get(), MemorySpace::kDevice, 96, kTokens, &out_device);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(out_host.size(), out_device.size());
  EXPECT_EQ(0, std::memcmp(out_host.data(), out_device.data(), out_host.size() * sizeof(float)));
  const size_t tok = SmallStore().geometry.token_elems();
  for (int l = 0; l < kLayers; ++l) {
    std::vector<uint16_t> kh(kTokens * tok), vh(kh.size()), kd(kh.size(), 1), vd(kh.size(), 1);
    ASSERT_TRUE((*a)->ReadTokens((*sa)->sequence(), l, 0, kTokens, kh.data(), vh.data()).ok());
    ASSERT_TRUE((*b)->ReadTokens((*sb)->sequence(), l, 0, kTokens, kd.data(), vd.data()).ok());
    EXPECT_EQ(kh, kd) << "layer " << l;
    EXPECT_EQ(vh, vd) << "layer " << l;
    auto ca = (*a)->ListChunks((*sa)->sequence(), l);
    auto cb = (*b)->ListChunks((*sb)->sequence(), l);
    ASSERT_TRUE(ca.ok() && cb.ok());
    ASSERT_EQ(ca->size(), cb->size());
    ASSERT_GT(ca->size(), 20u);
    const size_t repr = static_cast<size_t>(SmallStore().repr_topk) * tok;
    for (size_t i = 0; i < ca->size(); ++i) {
      std::vector<float> ra(repr), rb(repr, -1.0f);
      ASSERT_TRUE((*a)->GetRepresentatives((*ca)[i].key, ra.data()).ok());
      ASSERT_TRUE((*b)->GetRepresentatives((*cb)[i].key, rb.data()).ok());
      EXPECT_EQ(0, std::memcmp(ra.data(), rb.data(), repr * sizeof(float)))
          << "layer " << l << " chunk " << i;
    }
  }
  EXPECT_GT((*sa)->counters().chunks_attended, 0u);
}

// Records which copy brought bytes into hot memory (Upload or CopyWithin) and where: the
// regions the store allocated (per layer: sink K, sink V, ring K, ring V, in that order).
class RecordingTier final : public ForwardingHotTier {
 public:
  using ForwardingHotTier::ForwardingHotTier;
  struct Copy {
    bool within = false;
    const uint8_t* dst = nullptr;
    size_t bytes = 0;
  };
  struct Region {
    const uint8_t* base = nullptr;
    size_t bytes = 0;
  };
  Result<uint8_t*> AllocateRegion(size_t bytes) override {
    KVTIER_ASSIGN_OR_RETURN(uint8_t * r, ForwardingHotTier::AllocateRegion(bytes));
    std::lock_guard<std::mutex> l(mu);
    regions.push_back(Region{r, bytes});
    return r;
  }
  Status Upload(uint8_t* dst, const void* src, size_t bytes) override {
    Record(false, dst, bytes);
    return ForwardingHotTier::Upload(dst, src, bytes);
  }
  Status UploadBatch(const UploadOp* ops, size_t n) override {
    for (size_t i = 0; i < n; ++i) Record(false, ops[i].dst, ops[i].bytes);
    return ForwardingHotTier::UploadBatch(ops, n);
  }
  Status CopyWithin(uint8_t* dst, const void* src, size_t bytes) override {
    Record(true, dst, bytes);
    return ForwardingHotTier::CopyWithin(dst, src, bytes);
  }
  void Record(bool within, const uint8_t* dst, size_t bytes) {
    std::lock_guard<std::mutex> l(mu);
    copies.push_back(Copy{within, dst, bytes});
  }
  std::mutex mu;
  std::vector<Copy> copies;
  std::vector<Region> regions;
};

TEST(DeviceAppend, KDeviceNeverGoesThroughUploadAtSinksRingOrTheWrapPoint) {
  for (MemorySpace space : {MemorySpace::kDevice, MemorySpace::kHost}) {
    SCOPED_TRACE(MemorySpaceName(space));
    RecordingTier* tier = nullptr;
    StoreOptions so = SmallStore();
    StoreHooks hooks;
    hooks.hot_tier_factory = [&tier](size_t pool, size_t slot) -> Result<std::unique_ptr<HotTier>> {
      KVTIER_ASSIGN_OR_RETURN(auto inner, MakeHotTier(Device::kCpu, pool, slot));
      auto t = std::make_unique<RecordingTier>(std::move(inner));
      tier = t.get();
      return std::unique_ptr<HotTier>(std::move(t));
    };
    auto store = TieredStore::Open(so, hooks);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto seq = (*store)->CreateSequence();
    ASSERT_TRUE(seq.ok());
    ASSERT_EQ(tier->regions.size(), 4u * kLayers);
    const RecordingTier::Region sink_k = tier->regions[0], ring_k = tier->regions[2];
    // Sinks (4 tokens), ring slots [0, 10), then 6 tokens: [10, 12) up to the wrap point, a
    // chunk sealed, [0, 4) from the ring's start (ring = n_local + chunk_size = 12 tokens).
    int64_t p = 0;
    for (int m : {4, 10, 6}) {
      const Window w = MakeWindow(0, p, m);
      const Status st = (*store)->Append(*seq, 0, w.k.data(), w.v.data(), m, DType::kF16, space);
      ASSERT_TRUE(st.ok()) << st.ToString();
      p += m;
    }
    const size_t tok = so.geometry.token_kv_bytes() / 2;
    bool sinks = false, up_to_wrap = false, from_ring_start = false;
    for (const RecordingTier::Copy& c : tier->copies) {
      EXPECT_EQ(c.within, space == MemorySpace::kDevice)
          << "a copy of " << c.bytes << " bytes took the wrong path";
      if (c.dst == sink_k.base && c.bytes == 4 * tok) sinks = true;
      if (c.dst == ring_k.base + 10 * tok && c.bytes == 2 * tok &&
          c.dst + c.bytes == ring_k.base + ring_k.bytes)
        up_to_wrap = true;
      if (c.dst == ring_k.base && c.bytes == 4 * tok && up_to_wrap) from_ring_start = true;
    }
    EXPECT_TRUE(sinks && up_to_wrap && from_ring_start) << sinks << up_to_wrap << from_ring_start;
    EXPECT_EQ(tier->copies.size(), 2u * 4u);  // K and V of: sinks, [0,10), [10,12), [0,4)
    // The bytes arrived either way (the sealed chunk reads back from warm, the rest from hot).
    const Window all = MakeWindow(0, 0, 20);
    std::vector<uint16_t> k(all.k.size()), v(all.v.size());
    ASSERT_TRUE((*store)->ReadTokens(*seq, 0, 0, 20, k.data(), v.data()).ok());
    EXPECT_EQ(k, all.k);
    EXPECT_EQ(v, all.v);
  }
}

TEST(DeviceAppend, AnUnknownMemorySpaceIsInvalidArgumentAndAppendsNothing) {
  auto store = TieredStore::Open(SmallStore());
  ASSERT_TRUE(store.ok());
  auto session = Session::Open(store->get(), SmallRetrieval());
  ASSERT_TRUE(session.ok());
  const Window w = MakeWindow(0, 0, 3);
  const auto bad = static_cast<MemorySpace>(7);
  Status st = (*store)->Append((*session)->sequence(), 0, w.k.data(), w.v.data(), 3, DType::kF16, bad);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("memory space 7"), std::string::npos) << st.ToString();
  st = (*session)->Append(0, w.k.data(), w.v.data(), 3, DType::kF16, bad);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  auto n = (*store)->SequenceLength((*session)->sequence(), 0);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 0);
  EXPECT_STREQ(MemorySpaceName(bad), "unknown");
}

// ---- overlapped D2H of sealed chunks ----------------------------------------------------

// A "device" whose asynchronous downloads behave like copies on one CUDA stream waited late:
// each reads its source at its place in the stream (before any copy submitted after it:
// Upload, UploadBatch, Download, CopyWithin, FreeRegion, which like cudaFree synchronises),
// but writes its destination only when waited or polled done; until then the destination
// holds poison, so a store that read a landing chunk's warm copy early would see it.
class DeferredDownloadTier final : public ForwardingHotTier {
 public:
  using ForwardingHotTier::ForwardingHotTier;
  static constexpr uint8_t kPoison = 0xEE;

  /// TransferDone answers false this many times per ticket before the copy completes.
  int polls_before_done = 1 << 30;
  /// The n-th asynchronous download (1-based) fails when waited; 0: none fails.
  uint64_t fail_download = 0;

  Result<TransferTicket> DownloadBatchAsync(const DownloadOp* ops, size_t n) override {
    std::lock_guard<std::mutex> l(mu_);
    Pending p;
    p.number = ++issued_;
    for (size_t i = 0; i < n; ++i) {
      std::memset(ops[i].dst, kPoison, ops[i].bytes);
      p.ops.push_back(ops[i]);
    }
    const TransferTicket t = next_ticket_++;
    pending_[t] = std::move(p);
    max_in_flight_ = std::max(max_in_flight_, pending_.size());
    return t;
  }
  Result<bool> TransferDone(TransferTicket t) override {
    std::lock_guard<std::mutex> l(mu_);
    landing_threads_.insert(std::this_thread::get_id());
    auto it = pending_.find(t);
    if (it == pending_.end()) return InvalidArgument("unknown ticket");
    if (++it->second.polls <= polls_before_done) return false;
    CompleteLocked(&it->second);
    return true;
  }
  Status WaitTransfer(TransferTicket t) override {
    std::lock_guard<std::mutex> l(mu_);
    landing_threads_.insert(std::this_thread::get_id());
    auto it = pending_.find(t);
    if (it == pending_.end()) return InvalidArgument("unknown ticket");
    Pending p = std::move(it->second);
    pending_.erase(it);
    CompleteLocked(&p);
    if (p.failed) return IOError("injected failure of asynchronous download " + std::to_string(p.number));
    return Status::Ok();
  }
  Status Upload(uint8_t* dst, const void* src, size_t bytes) override {
    RunStream();
    return ForwardingHotTier::Upload(dst, src, bytes);
  }
  Status UploadBatch(const UploadOp* ops, size_t n) override {
    RunStream();
    return ForwardingHotTier::UploadBatch(ops, n);
  }
  Status Download(void* dst, const uint8_t* src, size_t bytes) override {
    RunStream();
    return ForwardingHotTier::Download(dst, src, bytes);
  }
  Status CopyWithin(uint8_t* dst, const void* src, size_t bytes) override {
    RunStream();
    return ForwardingHotTier::CopyWithin(dst, src, bytes);
  }
  void FreeRegion(uint8_t* region, size_t bytes) override {
    RunStream();
    ForwardingHotTier::FreeRegion(region, bytes);
  }

  size_t in_flight() {
    std::lock_guard<std::mutex> l(mu_);
    return pending_.size();
  }
  size_t max_in_flight() {
    std::lock_guard<std::mutex> l(mu_);
    return max_in_flight_;
  }
  uint64_t issued() {
    std::lock_guard<std::mutex> l(mu_);
    return issued_;
  }
  /// Whether `thread` ever polled or waited for a download: the work of landing a chunk.
  bool landed_on(std::thread::id thread) {
    std::lock_guard<std::mutex> l(mu_);
    return landing_threads_.count(thread) > 0;
  }

 private:
  struct Pending {
    uint64_t number = 0;
    std::vector<DownloadOp> ops;
    std::vector<std::vector<uint8_t>> read;  // the source bytes, once the stream reached it
    int polls = 0;
    bool completed = false, failed = false;
  };
  void ReadSourceLocked(Pending* p) {
    if (!p->read.empty() || p->ops.empty()) return;
    for (const DownloadOp& op : p->ops) p->read.emplace_back(op.src, op.src + op.bytes);
  }
  void CompleteLocked(Pending* p) {
    if (p->completed) return;
    p->completed = true;
    ReadSourceLocked(p);
    if (p->number == fail_download) {
      p->failed = true;  // the destination keeps its poison
      return;
    }
    for (size_t i = 0; i < p->ops.size(); ++i) std::memcpy(p->ops[i].dst, p->read[i].data(), p->ops[i].bytes);
  }
  void RunStream() {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [t, p] : pending_) ReadSourceLocked(&p);
  }

  std::mutex mu_;
  std::map<TransferTicket, Pending> pending_;
  TransferTicket next_ticket_ = 1;
  uint64_t issued_ = 0;
  std::set<std::thread::id> landing_threads_;
  size_t max_in_flight_ = 0;
};

// A store's options with the hooks it is opened with (TieredStore::Open(so, so.hooks)).
struct OptionsAndHooks : StoreOptions {
  StoreHooks hooks;
};

OptionsAndHooks DeferredStore(const std::string& dir, DeferredDownloadTier** tier, int polls_before_done,
                              uint64_t fail_download = 0) {
  OptionsAndHooks so;
  static_cast<StoreOptions&>(so) = SmallStore();
  so.data_dir = dir;
  so.hooks.hot_tier_factory = [tier, polls_before_done, fail_download](
                                  size_t pool, size_t slot) -> Result<std::unique_ptr<HotTier>> {
    KVTIER_ASSIGN_OR_RETURN(auto inner, MakeHotTier(Device::kCpu, pool, slot));
    auto t = std::make_unique<DeferredDownloadTier>(std::move(inner));
    t->polls_before_done = polls_before_done;
    t->fail_download = fail_download;
    *tier = t.get();
    return std::unique_ptr<HotTier>(std::move(t));
  };
  return so;
}

// Every step appends all layers first (windows of 12 tokens = 3 chunks of 4 during prefill),
// then attends them: chunks sealed by a layer's Append are still landing when other layers
// append, and land when retrieval lists the layer's chunks.
Status DriveAppendingFirst(Session* s, int64_t prefill, int64_t total, std::vector<float>* outs,
                           DeferredDownloadTier* tier, size_t* seen_in_flight) {
  for (int64_t b = 0; b < total;) {
    const bool decode = b >= prefill;
    const int m = decode ? 1 : static_cast<int>(std::min<int64_t>(12, prefill - b));
    KVTIER_RETURN_IF_ERROR(s->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill));
    std::vector<Window> w;
    for (int l = 0; l < kLayers; ++l) {
      w.push_back(MakeWindow(l, b, m));
      KVTIER_RETURN_IF_ERROR(s->Append(l, w[l].k.data(), w[l].v.data(), m, DType::kF16));
    }
    if (tier != nullptr) *seen_in_flight = std::max(*seen_in_flight, tier->in_flight());
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> out(static_cast<size_t>(m) * kQHeads * kDim);
      KVTIER_RETURN_IF_ERROR(s->Attend(l, w[l].q.data(), w[l].pos.data(), m, out.data()));
      outs->insert(outs->end(), out.begin(), out.end());
    }
    b += m;
  }
  return Status::Ok();
}

// Everything a reader can see of one layer: its tokens, chunk list and representatives.
struct LayerContent {
  std::vector<uint16_t> k, v;
  std::vector<uint64_t> chunk_indices;
  std::vector<float> repr;
};
LayerContent ReadLayer(TieredStore* store, SequenceId seq, int layer, int64_t tokens) {
  LayerContent c;
  const size_t tok = store->options().geometry.token_elems();
  c.k.assign(tokens * tok, 1);
  c.v.assign(tokens * tok, 1);
  const Status st = store->ReadTokens(seq, layer, 0, tokens, c.k.data(), c.v.data());
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto chunks = store->ListChunks(seq, layer);
  EXPECT_TRUE(chunks.ok()) << chunks.status().ToString();
  if (!chunks.ok()) return c;
  for (const ChunkInfo& ci : *chunks) {
    c.chunk_indices.push_back(ci.key.index);
    std::vector<float> r(static_cast<size_t>(store->options().repr_topk) * tok);
    EXPECT_TRUE(store->GetRepresentatives(ci.key, r.data()).ok());
    c.repr.insert(c.repr.end(), r.begin(), r.end());
  }
  return c;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(AsyncSeal, DeferredDownloadsGiveTheSynchronousResultsBitForBit) {
  // polls_before_done 1: a chunk lands at the second poll (the next seal or Append of its
  // layer); huge: only readers and the in-flight bound land chunks.
  for (int polls : {1, 1 << 30}) {
    SCOPED_TRACE("polls_before_done " + std::to_string(polls));
    TempDir dir_sync, dir_async;
    DeferredDownloadTier* tier = nullptr;
    StoreOptions sync_opts = SmallStore();
    sync_opts.data_dir = dir_sync.path();
    OptionsAndHooks async_opts = DeferredStore(dir_async.path(), &tier, polls);
    async_opts.max_landing_chunks = 3;
    constexpr int64_t kPrefill = 144, kTokens = 160;
    SequenceId seq_sync = 0, seq_async = 0;
    std::vector<LayerContent> before;
    {
      auto a = TieredStore::Open(sync_opts);
      auto b = TieredStore::Open(async_opts, async_opts.hooks);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
      auto sa = Session::Open(a->get(), SmallRetrieval());
      auto sb = Session::Open(b->get(), SmallRetrieval());
      ASSERT_TRUE(sa.ok() && sb.ok());
      seq_sync = (*sa)->sequence();
      seq_async = (*sb)->sequence();
      std::vector<float> out_sync, out_async;
      size_t seen = 0;
      ASSERT_TRUE(DriveAppendingFirst(sa->get(), kPrefill, kTokens, &out_sync, nullptr, &seen).ok());
      const Status st = DriveAppendingFirst(sb->get(), kPrefill, kTokens, &out_async, tier, &seen);
      ASSERT_TRUE(st.ok()) << st.ToString();
      // The downloads really were in flight across Appends, and never more than the bound
      // (3 per layer) plus the one just submitted.
      EXPECT_GE(seen, 2u);
      EXPECT_LE(tier->max_in_flight(), static_cast<size_t>(kLayers * 3 + 1));
      EXPECT_TRUE(SameBits(out_sync, out_async)) << "Attend outputs differ";
      EXPECT_GT((*sb)->counters().chunks_attended, 0u);
      // A chunk still landing is not seen by readers, and no reader lands it: append one more
      // window without attending, so that chunks are in flight; readers see the landed ones
      // only, and the driver's Flush lands the rest.
      for (int l = 0; l < kLayers; ++l) {
        const Window w = MakeWindow(l, kTokens, 12);
        ASSERT_TRUE((*a)->Append(seq_sync, l, w.k.data(), w.v.data(), 12, DType::kF16).ok());
        ASSERT_TRUE((*b)->Append(seq_async, l, w.k.data(), w.v.data(), 12, DType::kF16).ok());
      }
      const size_t in_flight = tier->in_flight();
      EXPECT_GT(in_flight, 0u);
      EXPECT_EQ((*b)->counters().chunks_landing, in_flight);
      uint64_t seen_sync = 0, seen_async = 0;
      for (int l = 0; l < kLayers; ++l) {
        seen_sync += *(*a)->ChunkCount(seq_sync, l);
        seen_async += *(*b)->ChunkCount(seq_async, l);
        EXPECT_EQ((*b)->ListChunks(seq_async, l)->size(), *(*b)->ChunkCount(seq_async, l));
      }
      EXPECT_EQ(seen_async + in_flight, seen_sync);
      EXPECT_EQ(tier->in_flight(), in_flight);  // the readers landed nothing
      ASSERT_TRUE((*b)->Flush(seq_async).ok());
      EXPECT_EQ(tier->in_flight(), 0u);
      EXPECT_EQ((*b)->counters().chunks_landing, 0u);
      for (int l = 0; l < kLayers; ++l) {
        SCOPED_TRACE("layer " + std::to_string(l));
        const LayerContent cs = ReadLayer(a->get(), seq_sync, l, kTokens + 12);
        const LayerContent ca = ReadLayer(b->get(), seq_async, l, kTokens + 12);
        EXPECT_EQ(cs.k, ca.k);
        EXPECT_EQ(cs.v, ca.v);
        EXPECT_EQ(cs.chunk_indices, ca.chunk_indices);
        EXPECT_TRUE(SameBits(cs.repr, ca.repr)) << "representatives differ";
        before.push_back(cs);
        // Fetched chunks carry the same bytes (fetched from both, so the counters stay equal).
        auto fs = (*a)->FetchChunks(seq_sync, l, {0, 7, 20});
        ASSERT_TRUE(fs.ok() && fs->Wait().ok());
        fs->Release();
        auto fh = (*b)->FetchChunks(seq_async, l, {0, 7, 20});
        ASSERT_TRUE(fh.ok() && fh->Wait().ok());
        const size_t tok = async_opts.geometry.token_elems();
        std::vector<uint16_t> chunk(async_opts.chunk_size * tok);
        for (const kernels::KvSpan& sp : fh->spans()) {
          ASSERT_TRUE(tier->Download(chunk.data(), static_cast<const uint8_t*>(sp.k), chunk.size() * 2).ok());
          EXPECT_EQ(0, std::memcmp(chunk.data(), cs.k.data() + sp.first_position * tok, chunk.size() * 2));
        }
      }
      EXPECT_EQ(tier->in_flight(), 0u);
      ASSERT_TRUE((*a)->WaitForDurable().ok());
      ASSERT_TRUE((*b)->WaitForDurable().ok());
      const StoreCounters ks = (*a)->counters(), ka = (*b)->counters();
      EXPECT_EQ(ks.chunks_sealed, ka.chunks_sealed);
      EXPECT_EQ(ks.warm_chunks, ka.warm_chunks);
      EXPECT_EQ(ks.cold_chunks, ka.cold_chunks);
      EXPECT_EQ(ks.bytes_moved, ka.bytes_moved);
      EXPECT_EQ(ka.chunks_sealed, tier->issued());
      // One more sealing round left in flight, then closed: Close lands it first.
      for (int l = 0; l < kLayers; ++l) {
        const Window w = MakeWindow(l, kTokens + 12, 8);
        ASSERT_TRUE((*a)->Append(seq_sync, l, w.k.data(), w.v.data(), 8, DType::kF16).ok());
        ASSERT_TRUE((*b)->Append(seq_async, l, w.k.data(), w.v.data(), 8, DType::kF16).ok());
      }
      ASSERT_TRUE((*a)->CloseSequence(seq_sync).ok());
      ASSERT_TRUE((*b)->CloseSequence(seq_async).ok());
      EXPECT_EQ(tier->in_flight(), 0u);
      EXPECT_EQ((*a)->counters().chunks_sealed, (*b)->counters().chunks_sealed);
    }
    // Reopened from the cold tier: the same content.
    auto a = TieredStore::Open(sync_opts);
    auto b = TieredStore::Open(async_opts, async_opts.hooks);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE("reopened, layer " + std::to_string(l));
      const LayerContent cs = ReadLayer(a->get(), seq_sync, l, kTokens + 20);
      const LayerContent ca = ReadLayer(b->get(), seq_async, l, kTokens + 20);
      EXPECT_EQ(cs.k, ca.k);
      EXPECT_EQ(cs.v, ca.v);
      EXPECT_EQ(cs.chunk_indices, ca.chunk_indices);
      EXPECT_TRUE(SameBits(cs.repr, ca.repr));
      EXPECT_EQ(std::vector<uint16_t>(cs.k.begin(), cs.k.begin() + before[l].k.size()), before[l].k);
    }
  }
}

TEST(AsyncSeal, AtMostMaxLandingChunksStayInFlightAndStatisticsReportThem) {
  TempDir dir;
  DeferredDownloadTier* tier = nullptr;
  OptionsAndHooks so = DeferredStore(dir.path(), &tier, 1 << 30);
  so.max_landing_chunks = 2;
  auto store = TieredStore::Open(so, so.hooks);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto seq = (*store)->CreateSequence();
  ASSERT_TRUE(seq.ok());
  // 4 sinks + 60 tokens: the ring (12) fills and 12 chunks are sealed in one call.
  const Window w = MakeWindow(0, 0, 64);
  ASSERT_TRUE((*store)->Append(*seq, 0, w.k.data(), w.v.data(), 64, DType::kF16).ok());
  EXPECT_EQ(tier->issued(), 12u);
  EXPECT_EQ(tier->in_flight(), 2u);
  EXPECT_EQ(tier->max_in_flight(), 3u);  // the bound, plus the one just submitted
  // Statistics count the landed chunks and report the others; they land nothing.
  StoreCounters c = (*store)->counters();
  EXPECT_EQ(tier->in_flight(), 2u);
  EXPECT_EQ(c.chunks_sealed, 10u);
  EXPECT_EQ(c.chunks_landing, 2u);
  EXPECT_EQ(c.warm_chunks, 10u);
  ASSERT_TRUE((*store)->Flush(*seq).ok());
  c = (*store)->counters();
  EXPECT_EQ(tier->in_flight(), 0u);
  EXPECT_EQ(c.chunks_sealed, 12u);
  EXPECT_EQ(c.chunks_landing, 0u);
  EXPECT_EQ(c.warm_chunks, 12u);
  so.max_landing_chunks = 0;
  EXPECT_EQ(so.Validate().code(), StatusCode::kInvalidArgument);
  // Left in flight at DropSequence: landed, then dropped (nothing reads a freed ring).
  ASSERT_TRUE((*store)->Append(*seq, 0, w.k.data(), w.v.data(), 8, DType::kF16).ok());
  EXPECT_GT(tier->in_flight(), 0u);
  ASSERT_TRUE((*store)->DropSequence(*seq).ok());
  EXPECT_EQ(tier->in_flight(), 0u);
  EXPECT_EQ((*store)->counters().warm_chunks, 0u);
}

TEST(AsyncSeal, AFailedDownloadIsReportedOnceAndLosesOnlyItsChunk) {
  TempDir dir;
  DeferredDownloadTier* tier = nullptr;
  const OptionsAndHooks so = DeferredStore(dir.path(), &tier, 1 << 30, /*fail_download=*/3);
  const size_t tok = so.geometry.token_elems();
  constexpr int64_t kTokens = 40;  // 4 sinks, 6 chunks sealed of 4 tokens, 12 in the ring
  const Window w = MakeWindow(0, 0, kTokens);
  SequenceId seq = 0;
  {
    auto store = TieredStore::Open(so, so.hooks);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto created = (*store)->CreateSequence();
    ASSERT_TRUE(created.ok());
    seq = *created;
    ASSERT_TRUE((*store)->Append(seq, 0, w.k.data(), w.v.data(), kTokens, DType::kF16).ok());
    EXPECT_EQ(tier->in_flight(), 6u);
    // A reader sees none of them and lands nothing.
    auto listed = (*store)->ListChunks(seq, 0);
    ASSERT_TRUE(listed.ok()) << listed.status().ToString();
    EXPECT_TRUE(listed->empty());
    EXPECT_EQ(tier->in_flight(), 6u);
    // The first driver call that lands layer 0 reports the failure, naming the chunk; the
    // next does not.
    const Status flushed = (*store)->Flush(seq);
    EXPECT_EQ(flushed.code(), StatusCode::kIOError) << flushed.ToString();
    EXPECT_NE(flushed.message().find("injected failure"), std::string::npos);
    EXPECT_NE(flushed.message().find(ChunkKey{seq, 0, 2}.ToString()), std::string::npos)
        << flushed.ToString();
    ASSERT_TRUE((*store)->Flush(seq).ok());
    listed = (*store)->ListChunks(seq, 0);
    ASSERT_TRUE(listed.ok()) << listed.status().ToString();
    std::vector<uint64_t> indices;
    for (const ChunkInfo& c : *listed) indices.push_back(c.key.index);
    EXPECT_EQ(indices, (std::vector<uint64_t>{0, 1, 3, 4, 5}));
    ASSERT_TRUE((*store)->WaitForDurable().ok());
    const StoreCounters c = (*store)->counters();
    EXPECT_EQ(c.chunks_sealed, 5u);
    EXPECT_EQ(c.warm_chunks, 5u);
    EXPECT_EQ(c.cold_chunks, 5u);
    // The lost chunk's tokens are missing; every other token reads back.
    std::vector<uint16_t> k(4 * tok), v(4 * tok);
    const Status lost = (*store)->ReadTokens(seq, 0, 4 + 2 * 4, 4 + 3 * 4, k.data(), v.data());
    EXPECT_EQ(lost.code(), StatusCode::kNotFound) << lost.ToString();
    for (int64_t p : {0, 4, 8, 16, 20, 24, 28, 32, 36}) {
      ASSERT_TRUE((*store)->ReadTokens(seq, 0, p, p + 4, k.data(), v.data()).ok()) << p;
      EXPECT_EQ(0, std::memcmp(k.data(), w.k.data() + p * tok, k.size() * 2)) << p;
      EXPECT_EQ(0, std::memcmp(v.data(), w.v.data() + p * tok, v.size() * 2)) << p;
    }
    ASSERT_TRUE((*store)->CloseSequence(seq).ok());
  }
  // Every acknowledged chunk comes back after a reopen.
  auto store = TieredStore::Open(so, so.hooks);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto listed = (*store)->ListChunks(seq, 0);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(listed->size(), 5u);
  std::vector<uint16_t> k(4 * tok), v(4 * tok);
  for (int64_t p : {4, 8, 16, 20, 24}) {
    ASSERT_TRUE((*store)->ReadTokens(seq, 0, p, p + 4, k.data(), v.data()).ok()) << p;
    EXPECT_EQ(0, std::memcmp(k.data(), w.k.data() + p * tok, k.size() * 2)) << p;
  }
}

TEST(AsyncSeal, AFailedDownloadIsReportedByAppendBeforeItAppends) {
  DeferredDownloadTier* tier = nullptr;
  // polls_before_done 1: the poll right after sealing says "not yet", the next Append's says done.
  OptionsAndHooks so = DeferredStore("", &tier, /*polls_before_done=*/1, /*fail_download=*/1);
  so.data_dir = "";
  auto store = TieredStore::Open(so, so.hooks);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto seq = (*store)->CreateSequence();
  ASSERT_TRUE(seq.ok());
  const Window w = MakeWindow(0, 0, 20);
  ASSERT_TRUE((*store)->Append(*seq, 0, w.k.data(), w.v.data(), 17, DType::kF16).ok());  // seals chunk 0
  EXPECT_EQ(tier->in_flight(), 1u);
  const Status st = (*store)->Append(*seq, 0, w.k.data() + 17 * 32, w.v.data() + 17 * 32, 3, DType::kF16);
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  auto n = (*store)->SequenceLength(*seq, 0);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 17);  // nothing of the failed call was appended
  ASSERT_TRUE((*store)->Append(*seq, 0, w.k.data() + 17 * 32, w.v.data() + 17 * 32, 3, DType::kF16).ok());
  auto count = (*store)->ChunkCount(*seq, 0);
  ASSERT_TRUE(count.ok());
  EXPECT_EQ(*count, 1u);
  auto listed = (*store)->ListChunks(*seq, 0);
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());  // chunk 0 is a hole
}

TEST(AsyncSeal, StatisticsOnAnotherThreadLandNothingWhileSequencesComeAndGo) {
  // counters() on its own thread, while this one appends and drops (a drop lands what is in
  // flight): the reader sees consistent numbers and never runs a landing.
  DeferredDownloadTier* tier = nullptr;
  const OptionsAndHooks so = DeferredStore("", &tier, 1 << 30);
  auto store = TieredStore::Open(so, so.hooks);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0};
  std::thread::id reader_id;
  std::thread reader([&] {
    while (!stop.load()) {
      const StoreCounters c = (*store)->counters();
      EXPECT_LE(c.warm_chunks, c.chunks_sealed);
      EXPECT_LE(c.chunks_landing, static_cast<uint64_t>(kLayers) * 6);
      reads.fetch_add(1);
    }
  });
  reader_id = reader.get_id();
  constexpr int kRounds = 30;
  for (int round = 0; round < kRounds; ++round) {
    auto seq = (*store)->CreateSequence();
    ASSERT_TRUE(seq.ok());
    for (int l = 0; l < kLayers; ++l) {
      const Window w = MakeWindow(l, 0, 40);  // 4 sinks, 6 chunks sealed, 12 in the ring
      ASSERT_TRUE((*store)->Append(*seq, l, w.k.data(), w.v.data(), 40, DType::kF16).ok());
    }
    ASSERT_TRUE((*store)->DropSequence(*seq).ok());
  }
  stop.store(true);
  reader.join();
  EXPECT_GT(reads.load(), 0u);
  EXPECT_FALSE(tier->landed_on(reader_id));
  EXPECT_TRUE(tier->landed_on(std::this_thread::get_id()));
  EXPECT_EQ(tier->in_flight(), 0u);
  const StoreCounters c = (*store)->counters();
  EXPECT_EQ(c.chunks_sealed, static_cast<uint64_t>(kRounds) * kLayers * 6);
  EXPECT_EQ(c.warm_chunks, 0u);
}

TEST(AsyncSeal, AReaderOnAnotherThreadNeverLandsASequenceItDoesNotDrive) {
  // Downloads complete only when waited: every chunk sealed stays landing until its
  // sequence's driver (this thread) lands it. A reader on another thread calls every reader
  // of the store and must neither see those chunks nor run their landing.
  TempDir dir;
  DeferredDownloadTier* tier = nullptr;
  OptionsAndHooks so = DeferredStore(dir.path(), &tier, 1 << 30);
  so.max_landing_chunks = 8;
  auto opened = TieredStore::Open(so, so.hooks);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TieredStore* store = opened->get();
  auto seq = store->CreateSequence();
  ASSERT_TRUE(seq.ok());
  // 4 sinks, 6 chunks sealed (4 tokens each), 12 in the ring, in every layer.
  for (int l = 0; l < kLayers; ++l) {
    const Window w = MakeWindow(l, 0, 40);
    ASSERT_TRUE(store->Append(*seq, l, w.k.data(), w.v.data(), 40, DType::kF16).ok());
  }
  const size_t in_flight = tier->in_flight();
  ASSERT_EQ(in_flight, static_cast<size_t>(kLayers) * 6);
  const uint64_t landing = store->counters().chunks_landing;
  EXPECT_EQ(landing, in_flight);
  std::thread::id reader_id;
  std::thread reader([&] {
    const size_t tok = so.geometry.token_elems();
    for (int l = 0; l < kLayers; ++l) {
      auto count = store->ChunkCount(*seq, l);
      ASSERT_TRUE(count.ok());
      EXPECT_EQ(*count, 0u);  // all six still landing
      auto listed = store->ListChunks(*seq, l);
      ASSERT_TRUE(listed.ok());
      EXPECT_TRUE(listed->empty());
      std::vector<float> repr(static_cast<size_t>(so.repr_topk) * tok);
      EXPECT_EQ(store->GetRepresentatives(ChunkKey{*seq, static_cast<uint32_t>(l), 0}, repr.data()).code(),
                StatusCode::kNotFound);
      ChunkUpdate update;
      ASSERT_TRUE(store->ChunkUpdatesSince(*seq, l, ChunkCursor{}, &update).ok());
      EXPECT_TRUE(update.added.empty());
      EXPECT_EQ(update.next.chunks, 0u);
      std::vector<uint16_t> k(40 * tok), v(40 * tok);
      EXPECT_EQ(store->ReadTokens(*seq, l, 0, 40, k.data(), v.data()).code(),
                StatusCode::kFailedPrecondition);
      EXPECT_TRUE(store->ReadTokens(*seq, l, 28, 40, k.data(), v.data()).ok());  // the local window
      EXPECT_EQ(*store->SequenceLength(*seq, l), 40);
    }
    const StoreCounters c = store->counters();
    EXPECT_EQ(c.chunks_landing, in_flight);
    EXPECT_EQ(c.chunks_sealed, 0u);
    EXPECT_GT(store->metadata_bytes(), 0u);
  });
  reader_id = reader.get_id();
  reader.join();
  EXPECT_FALSE(tier->landed_on(reader_id)) << "a reader ran a landing of a sequence it does not drive";
  EXPECT_EQ(tier->in_flight(), in_flight);
  EXPECT_EQ(store->counters().chunks_landing, landing);
  // The driver lands them, on its own thread; then readers see every chunk.
  ASSERT_TRUE(store->Flush(*seq).ok());
  EXPECT_TRUE(tier->landed_on(std::this_thread::get_id()));
  EXPECT_EQ(tier->in_flight(), 0u);
  EXPECT_EQ(store->counters().chunks_landing, 0u);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(*store->ChunkCount(*seq, l), 6u);
}

}  // namespace
}  // namespace kvtier
