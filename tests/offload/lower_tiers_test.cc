// LowerTiers (offload/store/lower_tiers.h): the tiers below warm as one object, tested alone over
// in-memory tiers: fall-through reads, representatives from meta records, removals, counters,
// acknowledgements and the sticky background error with its window.
#include "offload/store/lower_tiers.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "offload/store_records.h"

namespace kvtier {
namespace {

// A lower tier in memory: chunks and metas by key, a name in every error.
class MemoryTier : public LowerTier {
 public:
  MemoryTier(std::string name, uint8_t bit, bool metas, std::chrono::milliseconds window)
      : name_(std::move(name)), bit_(bit), metas_(metas), window_(window) {}
  std::string_view name() const override { return name_; }
  uint8_t tier_bit() const override { return bit_; }
  bool serves_published() const override { return false; }
  bool parallel_reads() const override { return false; }
  std::chrono::milliseconds error_window() const override { return window_; }
  Status PutChunk(const ChunkKey& key, std::string_view meta, const void* payload, size_t bytes) override {
    metas[key.ToString()] = std::string(meta);
    chunks[key.ToString()] = std::string(static_cast<const char*>(payload), bytes);
    return Status::Ok();
  }
  Status GetChunk(const LowerChunkRef& ref, void* dst, size_t bytes) override {
    auto it = chunks.find(ref.key.ToString());
    if (it == chunks.end()) return NotFound(name_ + ": no chunk " + ref.key.ToString());
    std::memcpy(dst, it->second.data(), std::min(bytes, it->second.size()));
    return Status::Ok();
  }
  bool reads_chunk_meta() const override { return metas_; }
  void GetChunkMetas(std::vector<MetaGet>* gets) override {
    for (MetaGet& g : *gets) {
      auto it = metas.find(g.ref.key.ToString());
      g.status = it == metas.end() ? NotFound(name_ + ": no meta " + g.ref.key.ToString()) : Status::Ok();
      if (it != metas.end()) g.meta = it->second;
    }
  }
  Status RemoveChunks(const std::vector<ChunkKey>& keys) override {
    for (const ChunkKey& k : keys) removed.push_back(k.ToString());
    return Status::Ok();
  }
  Status RemoveSequence(SequenceId seq, const std::vector<ChunkKey>& keys) override {
    removed_seqs.push_back(seq);
    return RemoveChunks(keys);
  }
  void CountLoad(StoreCounters* c) const override { c->cold_loads++; }
  void AddCounters(StoreCounters* c) const override { c->remote_puts += 1; }
  uint64_t memory_bytes() const override { return 100; }

  std::map<std::string, std::string> chunks, metas;
  std::vector<std::string> removed;
  std::vector<SequenceId> removed_seqs;

 private:
  std::string name_;
  uint8_t bit_;
  bool metas_;
  std::chrono::milliseconds window_;
};

constexpr auto kForever = std::chrono::milliseconds::max();

struct Two {
  LowerTiers tiers;
  MemoryTier* first = nullptr;
  MemoryTier* second = nullptr;
  store_internal::Sequence seq;
};
std::unique_ptr<Two> MakeTwo(std::chrono::milliseconds second_window = kForever) {
  auto t = std::make_unique<Two>();
  auto a = std::make_unique<MemoryTier>("first", kTierCold, true, kForever);
  auto b = std::make_unique<MemoryTier>("second", kTierRemote, false, second_window);
  t->first = a.get();
  t->second = b.get();
  t->tiers.Add(std::move(a));
  t->tiers.Add(std::move(b));
  t->seq.id = 3;
  t->seq.layers.resize(1);
  return t;
}

TEST(LowerTiers, ReadsFallThroughTheTiersInOrderAndNameEveryFailure) {
  auto t = MakeTwo();
  const ChunkKey k{3, 0, 5};
  const std::string bytes = "payload!";
  ASSERT_TRUE(t->second->PutChunk(k, "m", bytes.data(), bytes.size()).ok());
  std::string got(bytes.size(), '\0');
  ASSERT_TRUE(t->tiers.ReadChunk(&t->seq, k, got.data(), got.size()).ok());
  EXPECT_EQ(got, bytes);  // the first tier lost it, the second served it
  const Status missing = t->tiers.ReadChunk(&t->seq, ChunkKey{3, 0, 6}, got.data(), got.size());
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("first: no chunk"), std::string::npos) << missing.ToString();
  EXPECT_NE(missing.message().find("second: no chunk"), std::string::npos) << missing.ToString();
}

TEST(LowerTiers, RepresentativesComeFromTheTiersThatReadMetasAlone) {
  auto t = MakeTwo();
  const std::vector<uint8_t> repr = {1, 2, 3, 4, 5, 6, 7, 8};
  const ChunkKey held{3, 0, 1}, only_second{3, 0, 2};
  const std::string meta = store_records::EncodeChunkMeta(40, repr.data(), repr.size(), 0.5f);
  ASSERT_TRUE(t->first->PutChunk(held, meta, "x", 1).ok());
  ASSERT_TRUE(t->second->PutChunk(only_second, meta, "x", 1).ok());  // the second reads no metas
  std::vector<uint8_t> a(repr.size()), b(repr.size());
  std::vector<LowerTiers::ReprRead> reads{{held, a.data(), Status::Ok()},
                                          {only_second, b.data(), Status::Ok()}};
  const Status st = t->tiers.ReadReprs(&t->seq, repr.size(), &reads);
  EXPECT_TRUE(reads[0].status.ok()) << reads[0].status.ToString();
  EXPECT_EQ(a, repr);
  EXPECT_FALSE(reads[1].status.ok());
  EXPECT_EQ(st.code(), reads[1].status.code());
  EXPECT_NE(st.message().find("representatives of chunk " + only_second.ToString()), std::string::npos)
      << st.ToString();
  EXPECT_EQ(t->tiers.meta_tiers(), kTierCold);
}

TEST(LowerTiers, RemovalsCountersAndMemoryGoToEveryTier) {
  auto t = MakeTwo();
  const ChunkKey a{3, 0, 1}, b{3, 0, 2};
  ASSERT_TRUE(t->tiers.RemoveChunks({{a}, {a, b}}).ok());
  EXPECT_EQ(t->first->removed, (std::vector<std::string>{a.ToString()}));
  EXPECT_EQ(t->second->removed, (std::vector<std::string>{a.ToString(), b.ToString()}));
  ASSERT_TRUE(t->tiers.RemoveSequence(3, {{}, {b}}).ok());
  EXPECT_EQ(t->first->removed_seqs, (std::vector<SequenceId>{3}));
  EXPECT_EQ(t->second->removed_seqs, (std::vector<SequenceId>{3}));
  StoreCounters c;
  t->tiers.AddCounters(&c);
  EXPECT_EQ(c.remote_puts, 2u);
  EXPECT_EQ(t->tiers.memory_bytes(), 200u);
  EXPECT_EQ(t->tiers.size(), 2u);
  EXPECT_EQ(t->tiers.cold(), nullptr);  // tiers added with Add are no views of RocksDB or Redis
}

TEST(LowerTiers, AChunkIsAcknowledgedOnceAndTheListenerIsHandedBack) {
  auto t = MakeTwo();
  std::vector<std::string> heard;
  t->tiers.SetAckListenerLocked([&heard](const ChunkKey& k) { heard.push_back(k.ToString()); });
  store_internal::Chunk c;
  c.key = ChunkKey{3, 0, 9};
  c.tiers = kTierWarm;
  StoreCounters counters;
  LowerTiers::AckListener listener = t->tiers.AckLocked(&c, kTierCold | kTierRemote, 64, &counters);
  ASSERT_TRUE(listener);
  listener(c.key);
  EXPECT_TRUE(c.lower_acked);
  EXPECT_EQ(c.tiers, kTierWarm | kTierCold | kTierRemote);
  EXPECT_EQ(counters.cold_chunks, 1u);
  EXPECT_EQ(counters.cold_bytes, 64u);
  EXPECT_EQ(counters.cold_writes, 1u);
  t->tiers.AckLocked(&c, kTierCold, 64, &counters);  // again: counted once
  EXPECT_EQ(counters.cold_chunks, 1u);
  EXPECT_EQ(counters.cold_writes, 1u);
  EXPECT_EQ(heard, (std::vector<std::string>{c.key.ToString()}));
  // Acknowledged by the remote tier alone: no cold chunk.
  store_internal::Chunk r;
  t->tiers.AckLocked(&r, kTierRemote, 64, &counters);
  EXPECT_EQ(counters.cold_chunks, 1u);
  EXPECT_EQ(counters.cold_writes, 2u);
}

TEST(LowerTiers, TheFirstFailedWriteIsStickyUntilTakenWithoutAWindow) {
  auto t = MakeTwo();
  EXPECT_FALSE(t->tiers.errors_expire());
  EXPECT_TRUE(t->tiers.BackgroundErrorLocked().ok());
  t->tiers.RecordWriteFailureLocked(IOError("disk full"));
  t->tiers.RecordWriteFailureLocked(IOError("second failure"));  // the first is held
  EXPECT_EQ(t->tiers.BackgroundErrorLocked().message(), "disk full");
  EXPECT_EQ(t->tiers.BackgroundErrorLocked().message(), "disk full");  // reading does not clear
  EXPECT_EQ(t->tiers.TakeBackgroundErrorLocked().message(), "disk full");
  EXPECT_TRUE(t->tiers.BackgroundErrorLocked().ok());
  EXPECT_TRUE(t->tiers.TakeBackgroundErrorLocked().ok());
}

TEST(LowerTiers, WithAWindowTheErrorStepsAsideAndALaterOneReplacesIt) {
  auto t = MakeTwo(std::chrono::milliseconds(30));  // the shortest window of the tiers counts
  EXPECT_TRUE(t->tiers.errors_expire());
  t->tiers.RecordWriteFailureLocked(Unavailable("redis down"));
  EXPECT_EQ(t->tiers.BackgroundErrorLocked().code(), StatusCode::kUnavailable);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_TRUE(t->tiers.BackgroundErrorLocked().ok()) << "past the window it is no longer in the way";
  t->tiers.RecordWriteFailureLocked(IOError("later"));
  EXPECT_EQ(t->tiers.BackgroundErrorLocked().message(), "later");
  EXPECT_EQ(t->tiers.TakeBackgroundErrorLocked().message(), "later");
}

}  // namespace
}  // namespace kvtier
