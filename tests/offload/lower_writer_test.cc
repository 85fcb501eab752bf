// LowerWriter (offload/store/lower_writer.h), tested alone over a transfer engine and two
// in-memory lower tiers (the first acknowledging as the cold tier, the second as the remote
// one): what a write sends (the meta record encoded from the chunk and the snapshotted score),
// the acknowledgements on the chunk and in the counters, a later tier's refusal, WriteDown's
// pin while the lock is dropped, and a failed background write becoming the sticky error.
#include "offload/store/lower_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "offload/store_records.h"
#include "offload/transfer_engine.h"

namespace kvtier {
namespace {

using store_internal::Chunk;

// A lower tier in memory; `fail` makes every PutChunk fail; `on_put` runs inside PutChunk.
class MemoryTier : public LowerTier {
 public:
  MemoryTier(std::string name, uint8_t bit) : name_(std::move(name)), bit_(bit) {}
  std::string_view name() const override { return name_; }
  uint8_t tier_bit() const override { return bit_; }
  bool serves_published() const override { return false; }
  bool parallel_reads() const override { return false; }
  std::chrono::milliseconds error_window() const override { return std::chrono::milliseconds::max(); }
  Status PutChunk(const ChunkKey& key, std::string_view meta, const void* payload, size_t bytes) override {
    if (on_put) on_put();
    std::lock_guard<std::mutex> l(mu);
    if (fail) return IOError(name_ + ": refused " + key.ToString());
    metas[key.ToString()] = std::string(meta);
    chunks[key.ToString()] = std::string(static_cast<const char*>(payload), bytes);
    return Status::Ok();
  }
  Status GetChunk(const LowerChunkRef& ref, void*, size_t) override {
    return NotFound(name_ + ": no chunk " + ref.key.ToString());
  }
  bool reads_chunk_meta() const override { return false; }
  void GetChunkMetas(std::vector<MetaGet>*) override {}
  Status RemoveChunks(const std::vector<ChunkKey>&) override { return Status::Ok(); }
  Status RemoveSequence(SequenceId, const std::vector<ChunkKey>&) override { return Status::Ok(); }
  void CountLoad(StoreCounters*) const override {}
  void AddCounters(StoreCounters*) const override {}
  uint64_t memory_bytes() const override { return 0; }

  std::mutex mu;
  bool fail = false;
  std::function<void()> on_put;
  std::map<std::string, std::string> chunks, metas;

 private:
  std::string name_;
  uint8_t bit_;
};

constexpr size_t kChunkBytes = 64;
constexpr size_t kReprBytes = 8;

struct Fixture {
  std::unique_ptr<HotTier> hot = *MakeHotTier(Device::kCpu, 4 * kChunkBytes, kChunkBytes);
  LowerTiers lower;
  MemoryTier* cold = nullptr;
  MemoryTier* remote = nullptr;
  StoreSync sync;
  StoreCounters counters;
  std::unique_ptr<TransferEngine> engine;
  std::unique_ptr<LowerWriter> writer;
  Chunk chunk;
  std::vector<uint8_t> payload = std::vector<uint8_t>(kChunkBytes, 7);

  Fixture() {
    auto a = std::make_unique<MemoryTier>("cold", kTierCold);
    auto b = std::make_unique<MemoryTier>("remote", kTierRemote);
    cold = a.get();
    remote = b.get();
    lower.Add(std::move(a));
    lower.Add(std::move(b));
    TransferEngine::Options eo;
    eo.threads = 1;
    eo.chunk_bytes = kChunkBytes;
    eo.hot = hot.get();
    for (const auto& t : lower) eo.lower.push_back(t.get());
    engine = *TransferEngine::Create(eo);
    writer = std::make_unique<LowerWriter>(engine.get(), &lower, &sync, &counters, kChunkBytes);
    chunk.id = 1;
    chunk.key = ChunkKey{4, 0, 2};
    chunk.first_token = 10;
    chunk.repr = std::vector<uint8_t>(kReprBytes, 3);
  }
};

TEST(LowerWriter, AWriteSendsTheMetaAndAcknowledgesOnceEveryTierTookIt) {
  Fixture f;
  ASSERT_TRUE(f.writer->Write(&f.chunk, f.payload.data(), 0.75f).ok());
  EXPECT_TRUE(f.chunk.lower_acked);
  EXPECT_EQ(f.chunk.tiers, kTierCold | kTierRemote);
  EXPECT_EQ(f.counters.cold_chunks, 1u);
  EXPECT_EQ(f.counters.cold_writes, 1u);
  EXPECT_EQ(f.counters.cold_bytes, kChunkBytes);
  const std::string k = f.chunk.key.ToString();
  EXPECT_EQ(f.remote->chunks[k], std::string(kChunkBytes, 7));
  auto meta = store_records::DecodeChunkMeta(f.cold->metas[k], f.chunk.key, kReprBytes);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  EXPECT_EQ(meta->first_token, 10);
  EXPECT_EQ(meta->repr, f.chunk.repr);
  EXPECT_EQ(meta->score, 0.75f);  // the caller's snapshot, not the record's score
}

TEST(LowerWriter, ALaterTiersRefusalIsReturnedButWhatTheFirstTookIsAcknowledged) {
  Fixture f;
  f.remote->fail = true;
  const Status st = f.writer->Write(&f.chunk, f.payload.data(), 0.0f);
  EXPECT_EQ(st.code(), StatusCode::kIOError);
  EXPECT_NE(st.message().find("remote: refused"), std::string::npos) << st.ToString();
  EXPECT_TRUE(f.chunk.lower_acked);
  EXPECT_EQ(f.chunk.tiers, kTierCold);
  EXPECT_EQ(f.counters.cold_chunks, 1u);
}

TEST(LowerWriter, AWriteNoTierTookAcknowledgesNothing) {
  Fixture f;
  f.cold->fail = true;
  EXPECT_FALSE(f.writer->Write(&f.chunk, f.payload.data(), 0.0f).ok());
  EXPECT_FALSE(f.chunk.lower_acked);
  EXPECT_EQ(f.chunk.tiers, kTierNone);
  EXPECT_EQ(f.counters.cold_writes, 0u);
  EXPECT_TRUE(f.remote->chunks.empty());  // not tried past the first failure
}

TEST(LowerWriter, WriteDownPinsTheChunkWithTheLockDropped) {
  Fixture f;
  bool lock_free = false;
  int pins = 0;
  bool writing = false;
  f.cold->on_put = [&] {
    lock_free = f.sync.mu.try_lock();
    if (lock_free) f.sync.mu.unlock();
    pins = f.chunk.warm_pins;
    writing = f.chunk.lower_writing;
  };
  f.chunk.score = 0.5f;
  std::unique_lock<CountingMutex> lock(f.sync.mu);
  ASSERT_TRUE(f.writer->WriteDown(lock, &f.chunk, f.payload.data()).ok());
  EXPECT_TRUE(lock.owns_lock());
  EXPECT_TRUE(lock_free) << "the coordinator's lock was held during the write";
  EXPECT_EQ(pins, 1);
  EXPECT_TRUE(writing);
  EXPECT_EQ(f.chunk.warm_pins, 0);
  EXPECT_FALSE(f.chunk.lower_writing);
  EXPECT_TRUE(f.chunk.lower_acked);
  lock.unlock();
  auto meta = store_records::DecodeChunkMeta(f.cold->metas[f.chunk.key.ToString()], f.chunk.key, kReprBytes);
  ASSERT_TRUE(meta.ok());
  EXPECT_EQ(meta->score, 0.5f);  // snapshotted under the lock
}

TEST(LowerWriter, ASubmittedWriteClearsItsPinAndAFailureBecomesTheStickyError) {
  Fixture f;
  Chunk failing = f.chunk;
  failing.id = 2;
  failing.key = ChunkKey{4, 0, 3};
  for (Chunk* c : {&f.chunk, &failing}) {
    c->lower_writing = true;
    c->warm_pins = 1;
  }
  f.writer->Submit(&f.chunk, f.payload.data(), 0.0f);
  f.engine->WaitIdle();
  {
    std::lock_guard<CountingMutex> l(f.sync.mu);
    EXPECT_TRUE(f.chunk.lower_acked);
    EXPECT_FALSE(f.chunk.lower_writing);
    EXPECT_EQ(f.chunk.warm_pins, 0);
    EXPECT_TRUE(f.lower.BackgroundErrorLocked().ok());
  }
  f.cold->fail = true;
  f.writer->Submit(&failing, f.payload.data(), 0.0f);
  f.engine->WaitIdle();
  std::lock_guard<CountingMutex> l(f.sync.mu);
  EXPECT_FALSE(failing.lower_acked);
  EXPECT_FALSE(failing.lower_writing);
  EXPECT_EQ(failing.warm_pins, 0);
  const Status sticky = f.lower.BackgroundErrorLocked();
  EXPECT_EQ(sticky.code(), StatusCode::kIOError);
  EXPECT_NE(sticky.message().find("cold: refused " + failing.key.ToString()), std::string::npos)
      << sticky.ToString();
}

}  // namespace
}  // namespace kvtier
