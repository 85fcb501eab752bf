// TieredStore::WarmAddresses and the warm reader fence (offload/store_types.h): the addresses
// handed out are the chunks' bytes in warm, null where a chunk has no warm copy; a slot handed
// out (exposed) changes hands only after the fence was waited on, once per turnover, with the
// warm epoch moved, and a slot never handed out turns over with no wait; a failing fence stops
// the reuse and loses nothing; dropping chunks, the sequence or the store waits on it too; and a
// reader on another thread that follows the fence's protocol never reads a reused slot (run
// under ThreadSanitizer, Makefile's TSAN_TESTS).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "integration/pattern.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

constexpr uint64_t kSalt = 7;

// Eight warm slots; chunk i of a layer covers tokens [8 + 8i, 16 + 8i), and tokens
// [0, TokensFor(k)) are the fewest that seal k chunks: the ring holds n_local + chunk_size = 40
// tokens, and the token after a full ring seals its oldest chunk (so token TokensFor(k) - 1 is
// the one whose append seals chunk k - 1).
StoreOptions Options(const std::string& dir) {
  StoreOptions o;
  o.geometry = Geometry{2, 4, 2, 16, DType::kF16};
  o.n_sink = 8;
  o.n_local = 32;
  o.chunk_size = 8;
  o.repr_topk = 2;
  o.hot_bytes = 16 * o.chunk_bytes();
  o.warm_bytes = 8 * o.chunk_bytes();
  o.warm_policy = "lru";
  o.data_dir = dir;
  return o;
}
int64_t TokensFor(int chunks) { return 41 + 8 * static_cast<int64_t>(chunks); }
size_t TokenBytes(const StoreOptions& o) { return o.geometry.token_elems() * DTypeSize(o.geometry.dtype); }

// Counts its calls; fails them with `fail` set.
class CountingFence : public WarmReaderFence {
 public:
  Status WaitForReaders() override {
    calls++;
    if (fail) return Unavailable("the device reader's event failed");
    return Status::Ok();
  }
  std::atomic<int> calls{0};
  std::atomic<bool> fail{false};
};

struct Store {
  TempDir dir;
  std::unique_ptr<TieredStore> store;
  SequenceId seq = 0;
  int64_t appended = 0;

  explicit Store(int chunks) {
    auto s = TieredStore::Open(Options(dir.path()));
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    store = std::move(*s);
    seq = *store->CreateSequence();
    EXPECT_TRUE(AppendTo(TokensFor(chunks)).ok());
    EXPECT_TRUE(store->WaitForDurable().ok());
  }
  // Appends the pattern's tokens [appended, to) of layer 0, one at a time; stops at an error
  // (the failed token is not appended: a retry appends it).
  Status AppendTo(int64_t to) { return AppendPattern(store.get(), seq, 1, &appended, to); }
  static Status AppendPattern(TieredStore* s, SequenceId seq, uint64_t pid, int64_t* appended, int64_t to) {
    const size_t tb = TokenBytes(s->options());
    std::vector<uint8_t> k(tb), v(tb);
    for (; *appended < to; ++*appended) {
      FillPattern(kSalt, pid, 0, 0, *appended, 1, tb, k.data());
      FillPattern(kSalt, pid, 0, 1, *appended, 1, tb, v.data());
      KVTIER_RETURN_IF_ERROR(s->Append(seq, 0, k.data(), v.data(), 1, s->options().geometry.dtype));
    }
    return Status::Ok();
  }
  std::vector<WarmChunkAddress> Addresses(const std::vector<uint64_t>& indices, uint64_t* epoch) {
    std::vector<WarmChunkAddress> out(indices.size());
    const Status st = store->WarmAddresses(seq, 0, indices.data(), indices.size(), out.data(), epoch);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return out;
  }
  uint64_t fences() const { return store->counters().warm_reader_fences; }
};

std::vector<uint64_t> Indices(uint64_t from, uint64_t to) {
  std::vector<uint64_t> v;
  for (uint64_t i = from; i < to; ++i) v.push_back(i);
  return v;
}

// Whether `a` holds chunk `index` of the pattern `pid` (layer 0): K and V and its position.
bool HoldsChunk(const StoreOptions& o, uint64_t pid, uint64_t index, const WarmChunkAddress& a) {
  const size_t tb = TokenBytes(o);
  const size_t half = static_cast<size_t>(o.chunk_size) * tb;
  const int64_t first = o.n_sink + static_cast<int64_t>(index) * o.chunk_size;
  std::vector<uint8_t> k(half), v(half);
  FillPattern(kSalt, pid, 0, 0, first, o.chunk_size, tb, k.data());
  FillPattern(kSalt, pid, 0, 1, first, o.chunk_size, tb, v.data());
  return a.k != nullptr && a.v != nullptr && a.first_position == first &&
         std::memcmp(a.k, k.data(), half) == 0 && std::memcmp(a.v, v.data(), half) == 0;
}

// Tokens [from, to) read back as the pattern (from whichever tier holds them).
void ExpectReadable(Store& s, int64_t from, int64_t to) {
  const size_t tb = TokenBytes(s.store->options());
  const size_t n = static_cast<size_t>(to - from);
  std::vector<uint8_t> k(n * tb), v(n * tb), ek(n * tb), ev(n * tb);
  const Status st = s.store->ReadTokens(s.seq, 0, from, to, k.data(), v.data());
  ASSERT_TRUE(st.ok()) << st.ToString();
  FillPattern(kSalt, 1, 0, 0, from, to - from, tb, ek.data());
  FillPattern(kSalt, 1, 0, 1, from, to - from, tb, ev.data());
  EXPECT_EQ(k, ek) << "K of [" << from << ", " << to << ")";
  EXPECT_EQ(v, ev) << "V of [" << from << ", " << to << ")";
}
void ExpectAllReadable(Store& s) { ExpectReadable(s, 0, s.appended); }

TEST(WarmAddresses, AreTheChunksBytesInWarmAndNullOnceOnlyColdHoldsThem) {
  Store s(8);
  uint64_t epoch = 99;
  std::vector<WarmChunkAddress> a = s.Addresses(Indices(0, 8), &epoch);
  EXPECT_EQ(epoch, 0u);
  for (uint64_t i = 0; i < 8; ++i) EXPECT_TRUE(HoldsChunk(s.store->options(), 1, i, a[i])) << "chunk " << i;
  // Four more chunks push the four least recently used (0..3) down to the cold tier only.
  ASSERT_TRUE(s.AppendTo(TokensFor(12)).ok());
  ASSERT_TRUE(s.store->WaitForDurable().ok());
  a = s.Addresses(Indices(0, 12), &epoch);
  const auto infos = *s.store->ListChunks(s.seq, 0);
  for (uint64_t i = 0; i < 12; ++i) {
    const bool in_warm = (infos[i].tiers & kTierWarm) != 0;
    EXPECT_EQ(in_warm, i >= 4) << "chunk " << i;
    if (in_warm) {
      EXPECT_TRUE(HoldsChunk(s.store->options(), 1, i, a[i])) << "chunk " << i;
    } else {
      EXPECT_EQ(a[i].k, nullptr) << "chunk " << i;
      EXPECT_EQ(a[i].v, nullptr) << "chunk " << i;
      EXPECT_EQ(a[i].first_position, 8 + 8 * static_cast<int64_t>(i));
    }
  }
}

TEST(WarmAddresses, RefusesUnknownChunksLayersSequencesAndNullOutputs) {
  Store s(2);
  WarmChunkAddress out[1];
  uint64_t epoch = 0;
  const uint64_t past[] = {2};
  Status st = s.store->WarmAddresses(s.seq, 0, past, 1, out, &epoch);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("does not exist (layer has 2 chunks)"), std::string::npos) << st.ToString();
  const uint64_t first[] = {0};
  st = s.store->WarmAddresses(s.seq, 7, first, 1, out, &epoch);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  st = s.store->WarmAddresses(s.seq + 100, 0, first, 1, out, &epoch);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(std::to_string(s.seq + 100)), std::string::npos) << st.ToString();
  EXPECT_EQ(s.store->WarmAddresses(s.seq, 0, first, 1, nullptr, &epoch).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.store->WarmAddresses(s.seq, 0, first, 1, out, nullptr).code(), StatusCode::kInvalidArgument);
  // A dropped chunk is a hole: no address, no error.
  ASSERT_TRUE(s.store->DropChunks(s.seq, 0, {0}).ok());
  ASSERT_TRUE(s.store->WarmAddresses(s.seq, 0, first, 1, out, &epoch).ok());
  EXPECT_EQ(out[0].k, nullptr);
}

TEST(WarmReaderFence, NotCalledWhenOnlyUnexposedSlotsTurnOver) {
  CountingFence fence;  // outlives the store, which may wait on it when it closes
  Store s(8);
  s.store->SetWarmReaderFence(&fence);
  uint64_t epoch = 0;
  const WarmChunkAddress a7 = s.Addresses({7}, &epoch)[0];  // the most recently used: stays
  ASSERT_TRUE(s.AppendTo(TokensFor(11)).ok());              // chunks 0..2 leave warm, unexposed
  ASSERT_TRUE(s.store->WaitForDurable().ok());
  EXPECT_EQ(fence.calls, 0);
  EXPECT_EQ(s.fences(), 0u);
  EXPECT_EQ(s.store->warm_epoch(), epoch);
  EXPECT_GE(s.store->counters().demotions, 3u);
  EXPECT_TRUE(HoldsChunk(s.store->options(), 1, 7, a7));  // the handed-out address still holds chunk 7
  s.store->SetWarmReaderFence(nullptr);
}

TEST(WarmReaderFence, CalledOnceBeforeExposedSlotsAreReusedAndTheEpochMovesThen) {
  CountingFence fence;  // outlives the store, which may wait on it when it closes
  Store s(8);
  s.store->SetWarmReaderFence(&fence);
  uint64_t epoch = 0;
  s.Addresses(Indices(0, 8), &epoch);  // every slot exposed; chunk 0 the least recently used
  ASSERT_TRUE(s.AppendTo(TokensFor(9) - 1).ok());
  EXPECT_EQ(fence.calls, 0);  // no room needed yet: 8 chunks in 8 slots
  ASSERT_TRUE(s.AppendTo(TokensFor(9)).ok());
  EXPECT_EQ(fence.calls, 1);
  EXPECT_EQ(s.fences(), 1u);
  EXPECT_EQ(s.store->warm_epoch(), epoch + 1);
  // The wait covered every read so far: the next victims (1, 2, exposed before it) need none.
  ASSERT_TRUE(s.AppendTo(TokensFor(11)).ok());
  ASSERT_TRUE(s.store->WaitForDurable().ok());
  EXPECT_EQ(fence.calls, 1);
  EXPECT_EQ(s.store->warm_epoch(), epoch + 1);
  uint64_t now = 0;
  const std::vector<WarmChunkAddress> a = s.Addresses(Indices(0, 11), &now);
  EXPECT_EQ(now, epoch + 1);
  for (uint64_t i = 0; i < 3; ++i) EXPECT_EQ(a[i].k, nullptr) << "chunk " << i;
  for (uint64_t i = 3; i < 11; ++i) EXPECT_TRUE(HoldsChunk(s.store->options(), 1, i, a[i])) << "chunk " << i;
  ExpectAllReadable(s);
  s.store->SetWarmReaderFence(nullptr);
}

TEST(WarmReaderFence, AFailingFenceStopsTheReuseWithItsErrorAndLosesNothing) {
  CountingFence fence;  // outlives the store, which may wait on it when it closes
  Store s(8);
  fence.fail = true;
  s.store->SetWarmReaderFence(&fence);
  uint64_t epoch = 0;
  s.Addresses(Indices(0, 8), &epoch);
  const Status st = s.AppendTo(TokensFor(9));
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("the device reader's event failed"), std::string::npos) << st.ToString();
  EXPECT_EQ(fence.calls, 1);
  EXPECT_EQ(s.appended, TokensFor(9) - 1);  // the token that needed the room is not appended
  // Chunk 0 kept its warm copy, at the same address, and every token reads back.
  uint64_t now = 0;
  EXPECT_TRUE(HoldsChunk(s.store->options(), 1, 0, s.Addresses({0}, &now)[0]));
  ExpectAllReadable(s);
  // Once the fence works, the same append goes through, waiting on it again.
  fence.fail = false;
  ASSERT_TRUE(s.AppendTo(TokensFor(9)).ok());
  EXPECT_EQ(fence.calls, 2);
  EXPECT_EQ(s.fences(), 2u);
  ExpectAllReadable(s);
  s.store->SetWarmReaderFence(nullptr);
}

TEST(WarmReaderFence, DroppingExposedChunksWaitsAndAFailureDropsNothing) {
  CountingFence fence;  // outlives the store, which may wait on it when it closes
  Store s(4);
  s.store->SetWarmReaderFence(&fence);
  uint64_t epoch = 0;
  ASSERT_TRUE(s.store->DropChunks(s.seq, 0, {3}).ok());  // never exposed
  EXPECT_EQ(fence.calls, 0);
  s.Addresses({1}, &epoch);
  fence.fail = true;
  const Status st = s.store->DropChunks(s.seq, 0, {0, 1});
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_EQ(fence.calls, 1);
  EXPECT_EQ(s.store->ListChunks(s.seq, 0)->size(), 3u);  // 0, 1, 2: nothing dropped
  ExpectReadable(s, 0, 32);                              // sinks and chunks 0..2 (3 is a hole)
  fence.fail = false;
  ASSERT_TRUE(s.store->DropChunks(s.seq, 0, {0, 1}).ok());
  EXPECT_EQ(fence.calls, 2);
  EXPECT_EQ(s.store->warm_epoch(), epoch + 2);  // moved by both waits, the failed one included
  s.store->SetWarmReaderFence(nullptr);
}

TEST(WarmReaderFence, DroppingTheSequenceOrClosingTheStoreWaitsForExposedSlots) {
  CountingFence fence;
  {
    Store s(3);
    s.store->SetWarmReaderFence(&fence);
    const SequenceId other = *s.store->CreateSequence();
    ASSERT_TRUE(s.store->DropSequence(other).ok());  // holds no chunk
    EXPECT_EQ(fence.calls, 0);
    uint64_t epoch = 0;
    s.Addresses({2}, &epoch);
    fence.fail = true;
    EXPECT_EQ(s.store->DropSequence(s.seq).code(), StatusCode::kUnavailable);
    EXPECT_EQ(fence.calls, 1);
    ExpectAllReadable(s);  // still there
    fence.fail = false;
    ASSERT_TRUE(s.store->DropSequence(s.seq).ok());
    EXPECT_EQ(fence.calls, 2);
  }
  EXPECT_EQ(fence.calls, 2);  // closed with nothing exposed: no wait
  {
    Store s(3);
    s.store->SetWarmReaderFence(&fence);
    uint64_t epoch = 0;
    s.Addresses({0, 1, 2}, &epoch);
  }
  EXPECT_EQ(fence.calls, 3);  // closed with exposed slots: one wait
}

// A reader on another thread, as a device reader would be: it asks for sequence A's addresses,
// and "reads" them (copies the bytes and checks them) in one critical section of its own lock
// that checks the epoch first; the fence takes the same lock. Meanwhile sequence B's driver
// appends on a third thread, turning warm over (A's exposed slots among them). Every read that
// passed the epoch check holds A's chunk, and ThreadSanitizer sees no race between the
// reader's copies and the store's writes into reused slots.
TEST(WarmReaderFence, AReaderOnAnotherThreadNeverReadsAReusedSlot) {
  struct LockFence : WarmReaderFence {
    std::mutex reads;
    std::atomic<int> calls{0};
    Status WaitForReaders() override {
      calls++;
      std::lock_guard<std::mutex> l(reads);  // the reads in flight end with the section
      return Status::Ok();
    }
  } fence;  // outlives the store
  Store a(4);
  a.store->SetWarmReaderFence(&fence);
  const SequenceId b = *a.store->CreateSequence();
  const StoreOptions& o = a.store->options();
  const size_t half = static_cast<size_t>(o.chunk_size) * TokenBytes(o);
  uint64_t epoch = 0;
  std::vector<WarmChunkAddress> addresses = a.Addresses(Indices(0, 4), &epoch);  // exposed before B runs
  int checked = 0, bad = 0;
  for (uint64_t i = 0; i < addresses.size(); ++i) (HoldsChunk(o, 1, i, addresses[i]) ? checked : bad)++;
  ASSERT_EQ(checked, 4);
  std::atomic<bool> writing{true}, reading{false};
  Status written;
  std::thread writer([&] {
    while (!reading) std::this_thread::yield();  // the reader's loop runs before warm turns over
    int64_t appended = 0;
    written = Store::AppendPattern(a.store.get(), b, 2, &appended, TokensFor(24));
    writing = false;
  });
  std::vector<uint8_t> k(half), v(half);
  do {
    bool current = false;
    {
      std::lock_guard<std::mutex> l(fence.reads);
      current = a.store->warm_epoch() == epoch;
      if (current) {
        for (uint64_t i = 0; i < addresses.size(); ++i) {
          if (addresses[i].k == nullptr) continue;
          std::memcpy(k.data(), addresses[i].k, half);
          std::memcpy(v.data(), addresses[i].v, half);
          WarmChunkAddress copy{k.data(), v.data(), addresses[i].first_position};
          (HoldsChunk(o, 1, i, copy) ? checked : bad)++;
        }
      }
    }
    reading = true;
    if (!current)  // stale: ask again (outside the reader's lock)
      addresses = a.Addresses(Indices(0, 4), &epoch);
  } while (writing);
  writer.join();
  ASSERT_TRUE(written.ok()) << written.ToString();
  EXPECT_EQ(bad, 0);
  EXPECT_GT(checked, 4);      // reads on the reader's side of the race, not only the first ones
  EXPECT_GE(fence.calls, 1);  // A's exposed chunks were the oldest: they turned over
  EXPECT_EQ(static_cast<uint64_t>(fence.calls), a.fences());
  EXPECT_GT(a.store->warm_epoch(), 0u);
  ExpectAllReadable(a);
  a.store->SetWarmReaderFence(nullptr);
}

}  // namespace
}  // namespace kvtier
