// Landing (offload/store/landing.h), tested alone: built over the parts it moves chunks between
// (a host HotTier behind a tier whose downloads complete only when the test says so, a
// WarmTier, a ChunkCatalog, a SequenceTable, no lower tier), with one sequence appended
// through a LayerRing whose seals go to Landing::Seal. What it checks: a sealed chunk is
// invisible to readers until it lands, in_flight counts the chunks between seal and landing,
// and a failed download becomes a hole whose error TakeError returns once.
// tests/offload/tiered_store_test.cc covers landing on a host tier through the store (chunks
// are visible as soon as Append returns); the deferred completion here needs a device-like tier.
#include "offload/store/landing.h"

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "offload/store/chunk_catalog.h"
#include "offload/store/layer_regions.h"
#include "offload/store/layer_ring.h"
#include "offload/store/lower_writer.h"
#include "offload/store/sequence_table.h"
#include "offload/store/warm_tier.h"

namespace kvtier {
namespace {

using store_internal::Sequence;

// A host tier whose asynchronous downloads copy at submit but report done only once
// Complete() names them, as a device tier's would; Fail() makes a download's wait fail.
class DeferredHotTier : public ForwardingHotTier {
 public:
  using ForwardingHotTier::ForwardingHotTier;
  Result<TransferTicket> DownloadBatchAsync(const DownloadOp* ops, size_t n) override {
    for (size_t i = 0; i < n; ++i)
      KVTIER_RETURN_IF_ERROR(inner().Download(ops[i].dst, ops[i].src, ops[i].bytes));
    return next_++;
  }
  Result<bool> TransferDone(TransferTicket t) override {
    return t == kCompletedTransfer || done_.count(t) > 0;
  }
  Status WaitTransfer(TransferTicket t) override {
    waits_++;
    if (failing_.count(t) > 0)
      return IOError("injected: the download of ticket " + std::to_string(t) + " failed");
    return Status::Ok();
  }
  void Complete(TransferTicket t) { done_.insert(t); }
  void Fail(TransferTicket t) { failing_.insert(t); }
  int waits() const { return waits_; }

 private:
  TransferTicket next_ = 1;
  std::set<TransferTicket> done_, failing_;
  int waits_ = 0;
};

StoreOptions Small() {
  StoreOptions o;
  o.geometry = Geometry{1, 2, 1, 4, DType::kF16};
  o.n_sink = 2;
  o.n_local = 4;
  o.chunk_size = 2;
  o.repr_topk = 1;
  o.warm_bytes = 4 * o.chunk_bytes();
  return o;
}

struct Fixture {
  StoreOptions options = Small();
  size_t tok = options.geometry.token_elems() * 2;
  DeferredHotTier* hot = nullptr;
  std::unique_ptr<HotTier> hot_owner;
  StoreSync sync;
  StoreCounters counters;
  LowerTiers lower;  // none: nothing is written down
  ChunkCatalog catalog{options, tok};
  std::unique_ptr<WarmTier> warm;
  LowerWriter writer{nullptr, &lower, &sync, &counters, options.chunk_bytes()};
  LayerRing ring{options, tok};
  std::unique_ptr<SequenceTable> sequences;
  std::unique_ptr<Landing> landing;
  Sequence* s = nullptr;

  Fixture() {
    auto d = std::make_unique<DeferredHotTier>(
        *MakeHotTier(Device::kCpu, 4 * options.chunk_bytes(), options.chunk_bytes()));
    hot = d.get();
    hot_owner = std::move(d);
    warm = *WarmTier::Create(options, options.chunk_bytes(), &catalog, &lower, &counters);
    sequences = std::make_unique<SequenceTable>(options, tok, hot);
    Landing::Parts parts;
    parts.hot = hot;
    parts.warm = warm.get();
    parts.catalog = &catalog;
    parts.writer = &writer;
    parts.lower = &lower;
    parts.sequences = sequences.get();
    parts.sync = &sync;
    parts.counters = &counters;
    landing = std::make_unique<Landing>(options, options.chunk_bytes(), ring, parts);
    auto seq = std::make_unique<Sequence>();
    seq->layers.resize(1);
    EXPECT_TRUE(store_internal::AllocateLayerRegions(options, tok, hot, &seq->layers[0]).ok());
    s = sequences->Find(sequences->Add(std::move(seq)));
  }
  // Appends n tokens (K bytes = V bytes = position) sealing through Landing::Seal.
  Status Append(int n) {
    std::vector<uint8_t> kv(n * tok);
    for (int t = 0; t < n; ++t) std::fill_n(kv.data() + t * tok, tok, static_cast<uint8_t>(next_ + t));
    next_ += n;
    return ring.Append(
        s->layers[0], kv.data(), kv.data(), n,
        [this](uint8_t* dst, const uint8_t* src, size_t b) { return hot->Upload(dst, src, b); },
        [this] { return landing->Seal(s, 0); });
  }
  size_t Listed() {
    std::lock_guard<CountingMutex> l(sync.mu);
    return catalog.List(s->layers[0]).size();
  }
  int64_t next_ = 0;
};

TEST(Landing, ASealedChunkIsInvisibleUntilItsDownloadLands) {
  Fixture f;
  ASSERT_TRUE(f.Append(8).ok());  // sinks and a full ring: nothing sealed yet
  EXPECT_EQ(f.landing->in_flight(), 0u);
  ASSERT_TRUE(f.Append(3).ok());  // two seals: chunks 0 and 1 (tickets 1 and 2)
  auto& ls = f.s->layers[0];
  ASSERT_EQ(ls.chunks.size(), 2u);
  EXPECT_TRUE(ls.chunks[0]->landing);
  EXPECT_EQ(f.landing->in_flight(), 2u);
  EXPECT_EQ(ls.landing.size(), 2u);
  EXPECT_EQ(f.Listed(), 0u);
  EXPECT_EQ(ChunkCatalog::LandedEnd(ls), 0u);
  EXPECT_EQ(f.counters.chunks_sealed, 0u);
  EXPECT_EQ(ls.chunks[0]->tiers & kTierWarm, 0);  // holds its slot, not in warm yet
  EXPECT_EQ(f.warm->used(), 2);
  std::unique_lock<CountingMutex> lock(f.sync.mu);
  // Landing only what completed lands nothing and never waits.
  f.landing->LandLayer(lock, f.s, 0, 0, true);
  EXPECT_EQ(f.landing->in_flight(), 2u);
  EXPECT_EQ(f.hot->waits(), 0);
  f.hot->Complete(1);
  f.landing->LandLayer(lock, f.s, 0, 0, true);
  EXPECT_EQ(f.landing->in_flight(), 1u);
  EXPECT_FALSE(ls.chunks[0]->landing);
  EXPECT_TRUE(ls.chunks[1]->landing);
  EXPECT_EQ(ChunkCatalog::LandedEnd(ls), 1u);
  EXPECT_EQ(ls.chunks[0]->tiers & kTierWarm, kTierWarm);
  EXPECT_EQ(ls.chunks[0]->warm_pins, 0);
  EXPECT_EQ(f.counters.chunks_sealed, 1u);
  // The warm copy holds the chunk's tokens 2 and 3, K then V.
  const uint8_t* w = f.warm->slot_data(ls.chunks[0]->warm_slot);
  EXPECT_EQ(w[0], 2);
  EXPECT_EQ(w[f.tok], 3);
  EXPECT_EQ(w[2 * f.tok], 2);
  lock.unlock();
  EXPECT_EQ(f.Listed(), 1u);
  lock.lock();
  f.landing->LandLayer(lock, f.s, 0);  // waits for the rest
  EXPECT_EQ(f.landing->in_flight(), 0u);
  EXPECT_EQ(ChunkCatalog::LandedEnd(ls), 2u);
  EXPECT_TRUE(Landing::TakeError(ls).ok());
}

TEST(Landing, AFailedDownloadBecomesAHoleAndItsErrorIsReportedOnce) {
  Fixture f;
  ASSERT_TRUE(f.Append(8).ok());
  f.hot->Fail(1);
  ASSERT_TRUE(f.Append(3).ok());  // chunks 0 (failing) and 1
  auto& ls = f.s->layers[0];
  const ChunkKey lost = ls.chunks[0]->key;
  std::unique_lock<CountingMutex> lock(f.sync.mu);
  f.landing->LandLayer(lock, f.s, 0);
  EXPECT_EQ(f.landing->in_flight(), 0u);
  EXPECT_EQ(ls.chunks[0], nullptr);  // a hole
  ASSERT_NE(ls.chunks[1], nullptr);
  EXPECT_FALSE(ls.chunks[1]->landing);
  EXPECT_EQ(f.warm->used(), 1);  // the lost chunk's slot went back
  EXPECT_EQ(f.counters.chunks_sealed, 1u);
  EXPECT_EQ(ChunkCatalog::LandedEnd(ls), 2u);
  lock.unlock();
  EXPECT_EQ(f.Listed(), 1u);
  const Status st = Landing::TakeError(f.s);
  EXPECT_EQ(st.code(), StatusCode::kIOError);
  EXPECT_NE(st.message().find("sealing chunk " + lost.ToString() + " failed"), std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("ticket 1 failed"), std::string::npos) << st.ToString();
  EXPECT_TRUE(Landing::TakeError(f.s).ok());  // reported once
}

TEST(Landing, SealWaitsForWarmRoomByLandingWhatIsInFlight) {
  Fixture f;
  ASSERT_TRUE(f.Append(8).ok());
  ASSERT_TRUE(f.Append(8).ok());  // four seals: warm is full of landing chunks
  EXPECT_EQ(f.landing->in_flight(), 4u);
  EXPECT_EQ(f.warm->used(), 4);
  // The fifth seal finds no room and no lower tier: it lands the four in flight (their slots
  // become warm chunks), and with none of them acknowledged warm is still full.
  const Status st = f.Append(2);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(f.landing->in_flight(), 0u);
  EXPECT_EQ(f.counters.chunks_sealed, 4u);
}

}  // namespace
}  // namespace kvtier
