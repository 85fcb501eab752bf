// Promoter and FetchHandle (offload/store/promoter.h), tested through a TieredStore: building
// them alone takes most of the store (HotPool, WarmTier, ChunkCatalog, SequenceTable, Landing,
// the transfer engine). Each test is aimed at the promoter's contract: a fetch of chunks that
// are all hot already is complete at issue and waiting on it takes no lock; a fetch takes all
// its hot slots or none; a failed lower-tier read gives back the hot slots of its fetch.
// tests/offload/tiered_store_test.cc covers what a fetch loads and counts (hits, misses, cold
// reads, spans' bytes), warm-only fetches on the caller's thread, leases and refetches; it
// checks that a fetch past the free slots fails, not that the failed fetch took nothing.
// The warm-only fetch (TieredStore::FetchToWarm): chunks come back from the cold tier into warm
// and nowhere else (no hot slot, no hot-tier count moves), a device reader then finds their warm
// copies (WarmAddresses), a chunk warm has no room for is ResourceExhausted naming it and stays
// cold, a failed read names its chunk and gives its warm slot back.
#include "offload/store/promoter.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "offload/store_hooks.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"
#include "tests/tiered_store_test_peer.h"

namespace kvtier {
namespace {

// Four hot slots, four warm ones, a cold tier whose reads of `failing_index` (layer 0) fail.
struct Fixture {
  TempDir dir;
  StoreOptions options;
  std::unique_ptr<TieredStore> store;
  SequenceId seq = 0;
  std::atomic<int64_t> failing_index{-1};

  Fixture() {
    options.geometry = Geometry{1, 2, 1, 8, DType::kF16};
    options.n_sink = 2;
    options.n_local = 4;
    options.chunk_size = 2;
    options.repr_topk = 1;
    options.hot_bytes = 4 * options.chunk_bytes();
    options.warm_bytes = 4 * options.chunk_bytes();
    options.data_dir = dir.path();
    StoreHooks hooks;
    hooks.cold_fault_injector = [this](std::string_view op, const ChunkKey& key) {
      if (op == "get" && static_cast<int64_t>(key.index) == failing_index.load())
        return IOError("injected: cold read of chunk " + key.ToString() + " failed");
      return Status::Ok();
    };
    auto s = TieredStore::Open(options, hooks);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    store = std::move(*s);
    seq = *store->CreateSequence();
    // 2 sinks, 12 chunks, 6 local tokens.
    const int n = 2 + 12 * 2 + 6;
    const size_t tb = options.geometry.token_elems() * 2;
    std::vector<uint8_t> kv(n * tb);
    for (int p = 0; p < n; ++p) std::fill_n(kv.data() + p * tb, tb, static_cast<uint8_t>(p));
    EXPECT_TRUE(store->Append(seq, 0, kv.data(), kv.data(), n, DType::kF16).ok());
    EXPECT_TRUE(store->WaitForDurable().ok());
  }
  // Chunk indices with and without a warm copy.
  void Split(std::vector<uint64_t>* warm, std::vector<uint64_t>* cold_only) {
    auto list = store->ListChunks(seq, 0);
    ASSERT_TRUE(list.ok()) << list.status().ToString();
    for (const ChunkInfo& c : *list) ((c.tiers & kTierWarm) ? warm : cold_only)->push_back(c.key.index);
  }
  uint8_t TiersOf(uint64_t index) {
    auto list = store->ListChunks(seq, 0);
    for (const ChunkInfo& c : *list)
      if (c.key.index == index) return c.tiers;
    return 0;
  }
  int32_t HotSlotsUsed() { return store->hot_tier()->slots_used(); }
};

TEST(Promoter, AFetchOfHotChunksIsCompleteAtIssueAndItsWaitTakesNoLock) {
  Fixture f;
  std::vector<uint64_t> warm, cold_only;
  f.Split(&warm, &cold_only);
  ASSERT_GE(cold_only.size(), 2u);
  const std::vector<uint64_t> idx = {cold_only[0], cold_only[1]};
  {
    auto first = f.store->FetchChunks(f.seq, 0, idx);  // loads them (cold reads on the engine)
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    ASSERT_TRUE(first->Wait().ok());
  }
  const StoreCounters c0 = f.store->counters();
  auto h = f.store->FetchChunks(f.seq, 0, idx);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(f.store->counters().hits - c0.hits, 2u);
  EXPECT_TRUE(h->Ready());  // done when FetchChunks returned (Ready itself locks)
  const uint64_t entries = TieredStoreTestPeer::LockEntries(*f.store);
  ASSERT_TRUE(h->Wait().ok());
  ASSERT_TRUE(h->Wait().ok());
  EXPECT_EQ(TieredStoreTestPeer::LockEntries(*f.store), entries)
      << "Wait on a fetch complete at issue locked";
  ASSERT_EQ(h->spans().size(), 2u);
  EXPECT_EQ(static_cast<const uint8_t*>(h->spans()[0].k)[0], 2 + 2 * cold_only[0]);
  EXPECT_EQ(static_cast<const uint8_t*>(h->spans()[1].v)[0], 2 + 2 * cold_only[1]);
}

TEST(Promoter, AFetchTakesAllItsHotSlotsOrNone) {
  Fixture f;
  f.store->EvictHot();
  auto held = f.store->FetchChunks(f.seq, 0, {0, 1, 2});  // three of the four slots, pinned
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  ASSERT_TRUE(held->Wait().ok());
  EXPECT_EQ(f.HotSlotsUsed(), 3);
  // Two more do not fit beside this thread's own pins: refused, and nothing taken.
  auto over = f.store->FetchChunks(f.seq, 0, {5, 6});
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().ToString();
  EXPECT_EQ(f.HotSlotsUsed(), 3);
  EXPECT_EQ(f.TiersOf(5) & kTierHot, 0);
  EXPECT_EQ(f.TiersOf(6) & kTierHot, 0);
  // The free slot is still free: a fetch of one chunk gets it.
  auto one = f.store->FetchChunks(f.seq, 0, {6});
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  ASSERT_TRUE(one->Wait().ok());
  EXPECT_NE(f.TiersOf(6) & kTierHot, 0);
  EXPECT_EQ(f.HotSlotsUsed(), 4);
}

TEST(Promoter, AFailedLowerTierReadGivesBackTheFetchsHotSlots) {
  Fixture f;
  f.store->EvictHot();
  std::vector<uint64_t> warm, cold_only;
  f.Split(&warm, &cold_only);
  ASSERT_FALSE(warm.empty());
  ASSERT_FALSE(cold_only.empty());
  f.failing_index = static_cast<int64_t>(cold_only[0]);
  {
    auto h = f.store->FetchChunks(f.seq, 0, {warm[0], cold_only[0]});
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    const Status st = h->Wait();
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("injected: cold read of chunk"), std::string::npos) << st.ToString();
  }
  EXPECT_EQ(f.HotSlotsUsed(), 0) << "a failed fetch left chunks in hot slots";
  EXPECT_EQ(f.TiersOf(warm[0]) & kTierHot, 0);
  EXPECT_EQ(f.TiersOf(cold_only[0]) & kTierHot, 0);
  // All four slots are there for the next fetch, and the chunk reads once the tier recovers.
  f.failing_index = -1;
  auto all = f.store->FetchChunks(f.seq, 0, {warm[0], cold_only[0], 10, 11});
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_TRUE(all->Wait().ok());
  EXPECT_EQ(static_cast<const uint8_t*>(all->spans()[1].k)[0], 2 + 2 * cold_only[0]);
}

// The store's hot tier, warm tier and cold-read counts around a warm-only fetch.
struct TierCounts {
  int32_t hot_slots = 0;
  uint64_t hits = 0, misses = 0, warm_loads = 0, cold_reads = 0, warm_chunks = 0;
};
TierCounts Counts(Fixture& f) {
  const StoreCounters c = f.store->counters();
  return TierCounts{f.HotSlotsUsed(), c.hits, c.misses, c.warm_loads, c.cold_reads, c.warm_chunks};
}

TEST(Promoter, AWarmOnlyFetchBringsColdChunksToWarmAndNoFurther) {
  Fixture f;
  f.store->EvictHot();
  std::vector<uint64_t> warm, cold_only;
  f.Split(&warm, &cold_only);
  ASSERT_GE(cold_only.size(), 2u);
  const TierCounts before = Counts(f);
  auto h = f.store->FetchToWarm(f.seq, 0, {cold_only[0], cold_only[1]});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->reads(), 2u);
  ASSERT_TRUE(h->Wait().ok()) << h->Wait().ToString();
  EXPECT_TRUE(h->Ready());
  EXPECT_TRUE(h->status().ok());
  const TierCounts after = Counts(f);
  // In warm, read from the cold tier, and not in the hot tier: no slot, no hit, no miss, no upload.
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(f.TiersOf(cold_only[i]) & kTierWarm, 0) << "chunk " << cold_only[i];
    EXPECT_EQ(f.TiersOf(cold_only[i]) & kTierHot, 0) << "chunk " << cold_only[i];
  }
  EXPECT_EQ(after.hot_slots, 0);
  EXPECT_EQ(after.hits, before.hits);
  EXPECT_EQ(after.misses, before.misses);
  EXPECT_EQ(after.warm_loads, before.warm_loads);
  EXPECT_EQ(after.cold_reads, before.cold_reads + 2);
  EXPECT_EQ(after.warm_chunks, before.warm_chunks) << "warm was full: two acknowledged copies made room";
  // A device reader finds their warm copies now: the chunks' own bytes (token p holds byte p).
  WarmChunkAddress addr[2];
  uint64_t epoch = 0;
  ASSERT_TRUE(f.store->WarmAddresses(f.seq, 0, cold_only.data(), 2, addr, &epoch).ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_NE(addr[i].k, nullptr) << "chunk " << cold_only[i] << " has no warm source";
    EXPECT_EQ(static_cast<const uint8_t*>(addr[i].k)[0], 2 + 2 * cold_only[i]);
    EXPECT_EQ(static_cast<const uint8_t*>(addr[i].v)[0], 2 + 2 * cold_only[i]);
  }
  // Asked again: already warm, nothing read, done at issue.
  auto again = f.store->FetchToWarm(f.seq, 0, {cold_only[0]});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->reads(), 0u);
  EXPECT_TRUE(again->Ready());
  EXPECT_EQ(f.store->counters().cold_reads, after.cold_reads);
  // A chunk that does not exist: refused by name, nothing read.
  auto bad = f.store->FetchToWarm(f.seq, 0, {cold_only[0], 99});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("chunk"), std::string::npos) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("99"), std::string::npos) << bad.status().ToString();
  EXPECT_EQ(f.store->FetchToWarm(f.seq, 3, {0}).status().code(), StatusCode::kInvalidArgument);
}

// A reader fence that always fails: the store may not give an exposed warm slot away.
class FailingFence : public WarmReaderFence {
 public:
  Status WaitForReaders() override { return Unavailable("injected: the device readers did not finish"); }
};

TEST(Promoter, AWarmOnlyFetchWithNoRoomIsResourceExhaustedAndTheChunkStaysCold) {
  Fixture f;
  FailingFence fence;
  f.store->SetWarmReaderFence(&fence);
  std::vector<uint64_t> warm, cold_only;
  f.Split(&warm, &cold_only);
  ASSERT_EQ(warm.size(), 4u);
  ASSERT_FALSE(cold_only.empty());
  // Every warm slot handed to a device reader that never finishes: no victim may leave.
  std::vector<WarmChunkAddress> addr(warm.size());
  uint64_t epoch = 0;
  ASSERT_TRUE(f.store->WarmAddresses(f.seq, 0, warm.data(), warm.size(), addr.data(), &epoch).ok());
  auto h = f.store->FetchToWarm(f.seq, 0, {cold_only[0]});
  ASSERT_TRUE(h.ok())
      << h.status().ToString();  // the caller does not wait: the refusal comes with the handle
  const Status st = h->Wait();
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_NE(st.message().find("chunk " + ChunkKey{f.seq, 0, cold_only[0]}.ToString()), std::string::npos)
      << st.ToString();
  EXPECT_EQ(h->status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(f.TiersOf(cold_only[0]) & kTierWarm, 0);
  for (uint64_t w : warm) EXPECT_NE(f.TiersOf(w) & kTierWarm, 0) << "chunk " << w << " left warm";
  // Asked again once the readers are done (no fence): it comes back.
  f.store->SetWarmReaderFence(nullptr);
  auto retry = f.store->FetchToWarm(f.seq, 0, {cold_only[0]});
  ASSERT_TRUE(retry.ok()) << retry.status().ToString();
  EXPECT_EQ(retry->reads(), 1u) << "the refused chunk was not asked again";
  EXPECT_TRUE(retry->Wait().ok());
  EXPECT_NE(f.TiersOf(cold_only[0]) & kTierWarm, 0);
}

TEST(Promoter, AWarmOnlyFetchsFailedReadNamesTheChunkAndGivesItsWarmSlotBack) {
  Fixture f;
  std::vector<uint64_t> warm, cold_only;
  f.Split(&warm, &cold_only);
  ASSERT_GE(cold_only.size(), 2u);
  f.failing_index = static_cast<int64_t>(cold_only[0]);
  auto h = f.store->FetchToWarm(f.seq, 0, {cold_only[0], cold_only[1]});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const Status st = h->Wait();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("bringing chunk " + ChunkKey{f.seq, 0, cold_only[0]}.ToString()),
            std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("injected: cold read of chunk"), std::string::npos) << st.ToString();
  EXPECT_EQ(f.TiersOf(cold_only[0]) & kTierWarm, 0);
  EXPECT_NE(f.TiersOf(cold_only[1]) & kTierWarm, 0) << "the other chunk's read succeeded";
  EXPECT_LE(f.store->counters().warm_chunks, 4u);
  // The tier recovers: the chunk reads, into a slot the failed read gave back or a victim's.
  f.failing_index = -1;
  auto retry = f.store->FetchToWarm(f.seq, 0, {cold_only[0]});
  ASSERT_TRUE(retry.ok()) << retry.status().ToString();
  ASSERT_TRUE(retry->Wait().ok());
  EXPECT_NE(f.TiersOf(cold_only[0]) & kTierWarm, 0);
}

}  // namespace
}  // namespace kvtier
