// Device K/V for Append (issue 13: "Append accepts device K/V so a GPU engine never
// round-trips through host"): MemorySpace::kDevice copies with HotTier::CopyWithin, never
// through Upload, and on the host tier gives the bytes and attention kHost gives; an unknown
// MemorySpace is refused by name. On CUDA, CopyWithin is a device-to-device copy on the
// tier's transfer stream (tests/cuda_hot_tier_test.cc, skipped without a device).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "kvtier/kvtier.h"
#include "offload/hot_tier.h"

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
      w.q.push_back(n(rng) + (seeking ? 3.0f * std::sin(0.3f * static_cast<float>(i % (kKvHeads * kDim))) : 0.0f));
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
      EXPECT_EQ(0, std::memcmp(ra.data(), rb.data(), repr * sizeof(float))) << "layer " << l << " chunk " << i;
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
    KVTIER_ASSIGN_OR_RETURN(uint8_t* r, ForwardingHotTier::AllocateRegion(bytes));
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
    so.hot_tier_factory = [&tier](size_t pool, size_t slot) -> Result<std::unique_ptr<HotTier>> {
      KVTIER_ASSIGN_OR_RETURN(auto inner, MakeHotTier("host", pool, slot));
      auto t = std::make_unique<RecordingTier>(std::move(inner));
      tier = t.get();
      return std::unique_ptr<HotTier>(std::move(t));
    };
    auto store = TieredStore::Open(so);
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
      EXPECT_EQ(c.within, space == MemorySpace::kDevice) << "a copy of " << c.bytes << " bytes took the wrong path";
      if (c.dst == sink_k.base && c.bytes == 4 * tok) sinks = true;
      if (c.dst == ring_k.base + 10 * tok && c.bytes == 2 * tok && c.dst + c.bytes == ring_k.base + ring_k.bytes)
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

}  // namespace
}  // namespace kvtier
