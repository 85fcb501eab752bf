#include "offload/tiered_store.h"

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <thread>

#include "integration/pattern.h"
#include "kernels/cpu/attention.h"
#include "offload/clock.h"
#include "offload/cold_tier.h"
#include "offload/hot_tier.h"
#include "offload/observe_queries.h"
#include "tests/test_util.h"
#include "tests/tiered_store_test_peer.h"
#if KVTIER_HAVE_CUDA
#include "kernels/cuda/kernels.h"
#endif
#include "offload/representatives.h"

namespace kvtier {
namespace {

constexpr uint64_t kSalt = 42;

StoreOptions SmallOptions(const std::string& dir) {
  StoreOptions o;
  o.geometry = Geometry{2, 4, 2, 16, DType::kF16};
  o.n_sink = 8;
  o.n_local = 32;
  o.chunk_size = 8;
  o.repr_topk = 2;
  o.hot_bytes = 16 * o.chunk_bytes();
  o.warm_bytes = 8 * o.chunk_bytes();
  o.data_dir = dir;
  return o;
}

size_t TokenBytes(const StoreOptions& o) { return o.geometry.token_elems() * DTypeSize(o.geometry.dtype); }

// Appends tokens [from, to) of the pattern in blocks of `block`.
void AppendPattern(TieredStore* s, SequenceId seq, int layer, uint64_t pid, int64_t from, int64_t to,
                   int block) {
  const size_t tb = TokenBytes(s->options());
  std::vector<uint8_t> k, v;
  for (int64_t p = from; p < to; p += block) {
    const int n = static_cast<int>(std::min<int64_t>(block, to - p));
    k.resize(n * tb);
    v.resize(n * tb);
    FillPattern(kSalt, pid, layer, 0, p, n, tb, k.data());
    FillPattern(kSalt, pid, layer, 1, p, n, tb, v.data());
    ASSERT_TRUE(s->Append(seq, layer, k.data(), v.data(), n, s->options().geometry.dtype).ok());
  }
}

void ExpectPattern(TieredStore* s, SequenceId seq, int layer, uint64_t pid, int64_t from, int64_t to) {
  const size_t tb = TokenBytes(s->options());
  const size_t n = static_cast<size_t>(to - from);
  std::vector<uint8_t> k(n * tb), v(n * tb), ek(n * tb), ev(n * tb);
  Status st = s->ReadTokens(seq, layer, from, to, k.data(), v.data());
  ASSERT_TRUE(st.ok()) << st.ToString();
  FillPattern(kSalt, pid, layer, 0, from, to - from, tb, ek.data());
  FillPattern(kSalt, pid, layer, 1, from, to - from, tb, ev.data());
  EXPECT_EQ(0, std::memcmp(k.data(), ek.data(), k.size())) << "K of [" << from << "," << to << ") differs";
  EXPECT_EQ(0, std::memcmp(v.data(), ev.data(), v.size())) << "V of [" << from << "," << to << ") differs";
}

TEST(StoreOptions, ValidateNamesTheField) {
  StoreOptions o = SmallOptions("");
  EXPECT_TRUE(o.Validate().ok());
  auto bad = [&](auto mutate, const char* field) {
    StoreOptions b = o;
    mutate(b);
    Status st = b.Validate();
    EXPECT_FALSE(st.ok()) << field;
    EXPECT_NE(st.message().find(field), std::string::npos) << st.ToString();
  };
  bad([](StoreOptions& b) { b.chunk_size = 0; }, "chunk_size");
  bad([](StoreOptions& b) { b.chunk_size = -4; }, "chunk_size");
  bad([](StoreOptions& b) { b.n_local = 0; }, "n_local");
  bad([](StoreOptions& b) { b.n_local = 33; }, "n_local");
  bad([](StoreOptions& b) { b.n_sink = -1; }, "n_sink");
  bad([](StoreOptions& b) { b.repr_topk = 9; }, "repr_topk");
  bad([](StoreOptions& b) { b.warm_bytes = 100; }, "warm_bytes");
  bad([](StoreOptions& b) { b.hot_bytes = 0; }, "hot_bytes");
  bad([](StoreOptions& b) { b.geometry.kv_heads = 3; }, "q_heads");
  bad([](StoreOptions& b) { b.geometry.head_dim = 0; }, "head_dim");
  bad([](StoreOptions& b) { b.warm_policy = "fifo"; }, "warm_policy");
  bad([](StoreOptions& b) { b.pin_timeout_ms = 0; }, "pin_timeout_ms");
  bad([](StoreOptions& b) { b.device = static_cast<Device>(7); }, "device");
  bad([](StoreOptions& b) { b.repr_choice = static_cast<ReprChoice>(7); }, "repr_choice");
}

TEST(TieredStore, BadHooksAreInvalidArgumentNamingTheHook) {
  StoreHooks hooks;
  hooks.clock = nullptr;
  auto s = TieredStore::Open(SmallOptions(""), hooks);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("clock"), std::string::npos) << s.status().ToString();
  // The options are still checked with hooks, the device alone excepted when the hot tier is the hook's.
  StoreOptions bad = SmallOptions("");
  bad.chunk_size = 0;
  EXPECT_EQ(TieredStore::Open(bad, StoreHooks{}).status().code(), StatusCode::kInvalidArgument);
}

TEST(TieredStore, DataDirThatIsAFileIsRejected) {
  TempDir dir;
  const std::string file = dir.path() + "/plain-file";
  std::ofstream(file) << "not a directory";
  auto s = TieredStore::Open(SmallOptions(file));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("is a file"), std::string::npos) << s.status().ToString();
}

TEST(TieredStore, AppendReadBackAcrossSinksChunksAndLocal) {
  TempDir dir;
  auto s = TieredStore::Open(SmallOptions(dir.path()));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  TieredStore* st = s->get();
  auto seq = st->CreateSequence();
  ASSERT_TRUE(seq.ok());
  // Odd block sizes cross every boundary: sinks, chunk edges, ring wrap.
  for (int l = 0; l < 2; ++l) AppendPattern(st, *seq, l, 7, 0, 301, l == 0 ? 5 : 13);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(*st->SequenceLength(*seq, l), 301);
    ExpectPattern(st, *seq, l, 7, 0, 301);
    ExpectPattern(st, *seq, l, 7, 3, 12);     // sinks into the first chunk
    ExpectPattern(st, *seq, l, 7, 250, 301);  // chunks into the local window
  }
  // Sealing: chunks form only once n_local + chunk_size tokens wait past the sinks.
  auto chunks = st->ListChunks(*seq, 0);
  ASSERT_TRUE(chunks.ok());
  const int64_t expect_chunks = (301 - 8 - 32) / 8;  // 32
  EXPECT_EQ(static_cast<int64_t>(chunks->size()), expect_chunks);
  for (size_t i = 0; i < chunks->size(); ++i) {
    EXPECT_EQ((*chunks)[i].key.index, i);
    EXPECT_EQ((*chunks)[i].first_token, 8 + static_cast<int64_t>(i) * 8);
  }
  auto view = GetHotView(*st, *seq, 0);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->sinks.n_tokens, 8);
  int local = 0;
  for (int i = 0; i < view->n_local_spans; ++i) local += view->local[i].n_tokens;
  EXPECT_GE(local, 32);
  EXPECT_LT(local, 40);
  EXPECT_EQ(view->local[0].first_position, 8 + expect_chunks * 8);
  // Tiny warm tier: most chunks went cold, and the store says so.
  StoreCounters c = st->counters();
  EXPECT_LE(c.warm_chunks, 8u);
  EXPECT_EQ(c.chunks_sealed, 64u);
  EXPECT_TRUE(st->WaitForDurable().ok());
  EXPECT_EQ(st->counters().cold_chunks, 64u);
}

TEST(TieredStore, SequencesAreIsolated) {
  TempDir dir;
  auto s = TieredStore::Open(SmallOptions(dir.path()));
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  auto a = st->CreateSequence(), b = st->CreateSequence();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  AppendPattern(st, *a, 0, 1, 0, 200, 17);
  AppendPattern(st, *b, 0, 2, 0, 120, 9);
  ExpectPattern(st, *a, 0, 1, 0, 200);
  ExpectPattern(st, *b, 0, 2, 0, 120);
  ASSERT_TRUE(st->DropSequence(*a).ok());
  ExpectPattern(st, *b, 0, 2, 0, 120);
  // Dropped: every operation says so.
  std::vector<uint8_t> k(TokenBytes(st->options())), v(k.size());
  Status app = st->Append(*a, 0, k.data(), v.data(), 1, DType::kF16);
  EXPECT_EQ(app.code(), StatusCode::kNotFound);
  EXPECT_NE(app.message().find("does not exist"), std::string::npos);
  EXPECT_EQ(st->ReadTokens(*a, 0, 0, 1, k.data(), v.data()).code(), StatusCode::kNotFound);
  EXPECT_EQ(st->DropSequence(*a).code(), StatusCode::kNotFound);
}

TEST(TieredStore, BadInputGetsClearErrorsAndLosesNothing) {
  TempDir dir;
  auto s = TieredStore::Open(SmallOptions(dir.path()));
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  auto seq = st->CreateSequence();
  AppendPattern(st, *seq, 0, 3, 0, 100, 10);
  std::vector<uint8_t> k(64 * TokenBytes(st->options())), v(k.size());
  auto expect = [](Status got, StatusCode code, const char* needle) {
    EXPECT_EQ(got.code(), code) << got.ToString();
    EXPECT_NE(got.message().find(needle), std::string::npos) << got.ToString();
  };
  expect(st->Append(*seq, 0, k.data(), v.data(), 4, DType::kBF16), StatusCode::kInvalidArgument, "dtype");
  expect(st->Append(*seq, 0, k.data(), v.data(), 0, DType::kF16), StatusCode::kInvalidArgument,
         "token count");
  expect(st->Append(*seq, 0, k.data(), v.data(), -3, DType::kF16), StatusCode::kInvalidArgument,
         "token count");
  expect(st->Append(*seq, 0, nullptr, v.data(), 4, DType::kF16), StatusCode::kInvalidArgument, "null");
  expect(st->Append(*seq, 2, k.data(), v.data(), 4, DType::kF16), StatusCode::kInvalidArgument, "layer 2");
  expect(st->Append(*seq, -1, k.data(), v.data(), 4, DType::kF16), StatusCode::kInvalidArgument, "layer -1");
  expect(st->Append(999, 0, k.data(), v.data(), 4, DType::kF16), StatusCode::kNotFound, "sequence 999");
  expect(st->ReadTokens(*seq, 0, 50, 101, k.data(), v.data()), StatusCode::kInvalidArgument, "outside");
  expect(st->ReadTokens(*seq, 0, 10, 5, k.data(), v.data()), StatusCode::kInvalidArgument, "outside");
  auto f = st->FetchChunks(*seq, 0, {999});
  ASSERT_FALSE(f.ok());
  expect(f.status(), StatusCode::kInvalidArgument, "does not exist");
  std::vector<float> mass(2 * 4, 1.0f);
  expect(st->AddLocalAttention(*seq, 0, 0, 4, mass.data()), StatusCode::kInvalidArgument, "local window");
  // Nothing already stored was disturbed.
  ExpectPattern(st, *seq, 0, 3, 0, 100);
  // Closed sequences are read-only.
  ASSERT_TRUE(st->CloseSequence(*seq).ok());
  expect(st->Append(*seq, 0, k.data(), v.data(), 4, DType::kF16), StatusCode::kFailedPrecondition, "closed");
  ExpectPattern(st, *seq, 0, 3, 0, 100);
}

TEST(TieredStore, WarmFullWithoutColdTierIsResourceExhausted) {
  StoreOptions o = SmallOptions("");
  o.warm_bytes = 2 * o.chunk_bytes();
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok());
  auto seq = (*s)->CreateSequence();
  const size_t tb = TokenBytes(o);
  std::vector<uint8_t> k(tb), v(tb);
  Status last;
  int appended = 0;
  for (int p = 0; p < 200 && last.ok(); ++p) {
    FillPattern(kSalt, 5, 0, 0, p, 1, tb, k.data());
    FillPattern(kSalt, 5, 0, 1, p, 1, tb, v.data());
    last = (*s)->Append(*seq, 0, k.data(), v.data(), 1, DType::kF16);
    if (last.ok()) ++appended;
  }
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted) << last.ToString();
  EXPECT_NE(last.message().find("no cold tier"), std::string::npos);
  // Everything acknowledged before the error is intact.
  ExpectPattern(s->get(), *seq, 0, 5, 0, appended);
}

// "A chunk leaves a tier only after the lower tier acknowledged it": with the
// disk failing, a full warm tier refuses new chunks instead of dropping old
// ones, everything appended so far stays readable, and once the disk is back
// appends continue where they stopped.
class ColdFailure : public ::testing::TestWithParam<bool> {};

TEST_P(ColdFailure, FullWarmTierKeepsEveryChunkWhileTheDiskFails) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  o.write_through = GetParam();
  o.warm_bytes = 4 * o.chunk_bytes();
  auto failing = std::make_shared<std::atomic<bool>>(false);
  StoreHooks hooks;
  hooks.cold_fault_injector = [failing](std::string_view op, const ChunkKey& k) {
    return failing->load() && op == "put" ? IOError("injected: disk full writing " + k.ToString())
                                          : Status::Ok();
  };
  auto s = TieredStore::Open(o, hooks);
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  auto seq = st->CreateSequence();
  AppendPattern(st, *seq, 0, 21, 0, 120, 8);  // some chunks safely in cold
  ASSERT_TRUE(st->WaitForDurable().ok());
  failing->store(true);
  const size_t tb = TokenBytes(o);
  std::vector<uint8_t> k(tb), v(tb);
  int64_t n = 120;
  Status last;
  for (; n < 2000; ++n) {
    FillPattern(kSalt, 21, 0, 0, n, 1, tb, k.data());
    FillPattern(kSalt, 21, 0, 1, n, 1, tb, v.data());
    last = st->Append(*seq, 0, k.data(), v.data(), 1, DType::kF16);
    if (!last.ok()) break;
  }
  ASSERT_FALSE(last.ok()) << "a full warm tier over a failing disk must refuse, not drop";
  EXPECT_EQ(last.code(), StatusCode::kIOError) << last.ToString();
  EXPECT_NE(last.message().find("injected"), std::string::npos) << last.ToString();
  ExpectPattern(st, *seq, 0, 21, 0, n);  // nothing acknowledged was lost
  (void)st->WaitForDurable();            // reports (and clears) the failed write-through
  // The disk recovers: the refused token can be appended again and the rest follows.
  failing->store(false);
  AppendPattern(st, *seq, 0, 21, n, n + 300, 7);
  ASSERT_TRUE(st->CloseSequence(*seq).ok());
  ExpectPattern(st, *seq, 0, 21, 0, n + 300);
}
INSTANTIATE_TEST_SUITE_P(WriteThrough, ColdFailure, ::testing::Bool());

TEST(TieredStore, CorruptColdChunkIsReportedNotServed) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  o.warm_bytes = 2 * o.chunk_bytes();
  SequenceId seq = 0;
  {
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok());
    seq = *(*s)->CreateSequence();
    AppendPattern(s->get(), seq, 0, 31, 0, 200, 9);
    ASSERT_TRUE((*s)->CloseSequence(seq).ok());
  }
  // Flip one byte of chunk 2's stored payload behind the store's back.
  {
    rocksdb::DB* db = nullptr;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    for (const char* name : {cold_tier_format::kSequenceColumn, cold_tier_format::kMetaColumn,
                             cold_tier_format::kPayloadColumn, cold_tier_format::kBlobColumn})
      cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::Status os = rocksdb::DB::Open(rocksdb::DBOptions(), dir.path(), cfs, &handles, &db);
    ASSERT_TRUE(os.ok()) << os.ToString();
    const std::string key = cold_tier_format::ChunkKeyBytes(ChunkKey{seq, 0, 2});
    std::string value;
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), handles[2], key, &value).ok());
    value[value.size() / 2] ^= 0x5a;
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), handles[2], key, value).ok());
    for (auto* h : handles) db->DestroyColumnFamilyHandle(h);
    delete db;
  }
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const size_t tb = TokenBytes(o);
  std::vector<uint8_t> k(8 * tb), v(8 * tb);
  Status bad = (*s)->ReadTokens(seq, 0, 8 + 2 * 8, 8 + 3 * 8, k.data(), v.data());
  EXPECT_EQ(bad.code(), StatusCode::kCorruption) << bad.ToString();
  EXPECT_NE(bad.message().find("chunk=2"), std::string::npos) << bad.ToString();
  auto h = (*s)->FetchChunks(seq, 0, {2});
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->Wait().code(), StatusCode::kCorruption);
  // Its neighbours are fine.
  ExpectPattern(s->get(), seq, 0, 31, 0, 8 + 2 * 8);
  ExpectPattern(s->get(), seq, 0, 31, 8 + 3 * 8, 200);
}

// Four hot slots over 30 sealed chunks of layer 0 (pattern 9), with the warm tier holding 8:
// most chunks are in the cold tier only. Null (after a failed expectation) when setup fails.
// The TierBits of chunk `index` of (seq, layer), 0 when it is not listed.
uint8_t TiersOf(TieredStore* st, SequenceId seq, int layer, uint64_t index) {
  const auto list = st->ListChunks(seq, layer);  // named: a range-for over *temporary would dangle
  EXPECT_TRUE(list.ok());
  if (!list.ok()) return 0;
  for (const ChunkInfo& c : *list)
    if (c.key.index == index) return c.tiers;
  return 0;
}

// The chunks of (seq, layer) with a warm copy and those without one. Which chunks keep a warm
// copy depends on the order in which the lower tier acknowledged their write-throughs (the
// warm policy's victim is among acknowledged chunks), so tests ask instead of assuming.
void SplitByWarmCopy(TieredStore* st, SequenceId seq, int layer, std::vector<uint64_t>* warm,
                     std::vector<uint64_t>* not_warm) {
  const auto list = st->ListChunks(seq, layer);
  ASSERT_TRUE(list.ok()) << list.status().ToString();
  for (const ChunkInfo& c : *list) ((c.tiers & kTierWarm) ? warm : not_warm)->push_back(c.key.index);
}

std::unique_ptr<TieredStore> FourHotSlotsOverThirtyChunks(const std::string& dir, StoreOptions* o,
                                                          SequenceId* seq) {
  *o = SmallOptions(dir);
  o->hot_bytes = 4 * o->chunk_bytes();
  auto s = TieredStore::Open(*o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  auto created = (*s)->CreateSequence();
  EXPECT_TRUE(created.ok());
  if (!created.ok()) return nullptr;
  *seq = *created;
  AppendPattern(s->get(), *seq, 0, 9, 0, 8 + 40 + 8 * 30, 31);
  EXPECT_TRUE((*s)->WaitForDurable().ok());
  return std::move(*s);
}

// A chunk read back from cold keeps a warm copy even when the warm tier is full: the warm
// policy's victim among chunks the cold tier already holds gives up its warm slot (free: cold
// has it). The next fetch of the same chunk, after the hot copy is gone, costs no cold read.
TEST(TieredStore, ColdReadsKeepAWarmCopyWhenWarmIsFull) {
  TempDir dir;
  StoreOptions o;
  SequenceId seq = 0;
  auto store = FourHotSlotsOverThirtyChunks(dir.path(), &o, &seq);
  ASSERT_NE(store, nullptr);
  TieredStore* st = store.get();
  auto tiers_of = [&](uint64_t idx) { return TiersOf(st, seq, 0, idx); };
  std::vector<uint64_t> warm, cold_only;
  SplitByWarmCopy(st, seq, 0, &warm, &cold_only);
  ASSERT_FALSE(cold_only.empty());
  const uint64_t cold = cold_only[0];
  const uint64_t warm_before = st->counters().warm_chunks;
  {
    auto h = st->FetchChunks(seq, 0, {cold});
    ASSERT_TRUE(h.ok() && h->Wait().ok());
  }
  EXPECT_NE(tiers_of(cold) & kTierWarm, 0) << "the cold read left a warm copy";
  EXPECT_EQ(st->counters().warm_chunks, warm_before) << "by dropping another warm copy, not by growing";
  st->EvictHot();
  const StoreCounters c1 = st->counters();
  {
    auto h = st->FetchChunks(seq, 0, {cold});
    ASSERT_TRUE(h.ok() && h->Wait().ok());
  }
  EXPECT_EQ(st->counters().cold_reads, c1.cold_reads) << "served from warm";
  // Every chunk is still readable, the ones that lost their warm copy from cold.
  ExpectPattern(st, seq, 0, 9, 0, 8 + 40 + 8 * 30);
}

TEST(TieredStore, FetchPromotesPinsAndCountsHits) {
  TempDir dir;
  StoreOptions o;
  SequenceId seq = 0;
  auto store = FourHotSlotsOverThirtyChunks(dir.path(), &o, &seq);
  ASSERT_NE(store, nullptr);
  TieredStore* st = store.get();
  const size_t tb = TokenBytes(o);
  auto check_spans = [&](const FetchHandle& h, const std::vector<uint64_t>& idx) {
    ASSERT_EQ(h.spans().size(), idx.size());
    std::vector<uint8_t> e(8 * tb);
    for (size_t i = 0; i < idx.size(); ++i) {
      const auto& sp = h.spans()[i];
      EXPECT_EQ(sp.first_position, 8 + static_cast<int64_t>(idx[i]) * 8);
      FillPattern(kSalt, 9, 0, 0, sp.first_position, 8, tb, e.data());
      EXPECT_EQ(0, std::memcmp(e.data(), sp.k, e.size())) << "chunk " << idx[i];
      FillPattern(kSalt, 9, 0, 1, sp.first_position, 8, tb, e.data());
      EXPECT_EQ(0, std::memcmp(e.data(), sp.v, e.size())) << "chunk " << idx[i];
    }
  };
  ASSERT_EQ(*st->ChunkCount(seq, 0), 30u);
  std::vector<uint64_t> warm, cold_only;
  SplitByWarmCopy(st, seq, 0, &warm, &cold_only);
  ASSERT_GE(cold_only.size(), 2u);
  ASSERT_GE(warm.size(), 3u);
  const StoreCounters c0 = st->counters();
  // Two chunks only the cold tier holds and the newest chunk with a warm copy (each cold read
  // keeps a warm copy by dropping the warm LRU victim, never the newest); none of 10 and 11.
  std::vector<uint64_t> idx;
  for (uint64_t i : cold_only)
    if (idx.size() < 2 && i != 10 && i != 11) idx.push_back(i);
  ASSERT_EQ(idx.size(), 2u);
  ASSERT_GT(warm.back(), 11u);
  idx.insert(idx.begin() + 1, warm.back());
  auto h = st->FetchChunks(seq, 0, idx);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_TRUE(h->Wait().ok());
  check_spans(*h, idx);
  const StoreCounters c1 = st->counters();
  EXPECT_EQ(c1.misses - c0.misses, 3u);
  EXPECT_EQ(c1.cold_reads - c0.cold_reads, 2u);
  // All four hot slots: three pinned by h, so a fetch of two more must fail cleanly.
  auto h2 = st->FetchChunks(seq, 0, {10, 11});
  ASSERT_FALSE(h2.ok());
  EXPECT_EQ(h2.status().code(), StatusCode::kResourceExhausted);
  // Same chunks again: hits, nothing moves.
  auto h3 = st->FetchChunks(seq, 0, idx);
  ASSERT_TRUE(h3.ok() && h3->Wait().ok());
  EXPECT_EQ(st->counters().hits - c1.hits, 3u);
  EXPECT_EQ(st->counters().bytes_moved, c1.bytes_moved);
  // A chunk asked for twice needs one slot: with one slot free, {10, 10} fits, {10, 10, 11, 11}
  // does not, and both spans of the chunk read its bytes.
  auto twice_over = st->FetchChunks(seq, 0, {10, 10, 11, 11});
  ASSERT_FALSE(twice_over.ok());
  EXPECT_EQ(twice_over.status().code(), StatusCode::kResourceExhausted);
  {
    auto twice = st->FetchChunks(seq, 0, {10, 10});
    ASSERT_TRUE(twice.ok()) << twice.status().ToString();
    ASSERT_TRUE(twice->Wait().ok());
    check_spans(*twice, {10, 10});
  }
  h->Release();
  h3->Release();
  // Released: the slots can be reused, and evicted chunks come back intact.
  for (uint64_t a = 0; a < 30; a += 2) {
    auto hh = st->FetchChunks(seq, 0, {a, a + 1});
    ASSERT_TRUE(hh.ok()) << hh.status().ToString();
    Status w = hh->Wait();
    ASSERT_TRUE(w.ok()) << w.ToString();
    check_spans(*hh, {a, a + 1});
  }
}

// A fetch whose loads all have warm copies on a host hot tier is a few memcpys: it runs on
// the caller's thread (done when FetchChunks returns) and wakes no transfer worker; one that
// reads a lower tier goes to the transfer engine, to overlap with the caller.
TEST(TieredStore, WarmOnlyFetchesRunOnTheCallersThread) {
  TempDir dir;
  StoreOptions o;
  SequenceId seq = 0;
  auto store = FourHotSlotsOverThirtyChunks(dir.path(), &o, &seq);
  ASSERT_NE(store, nullptr);
  TieredStore* st = store.get();
  st->EvictHot();
  std::vector<uint64_t> warm, cold_only;
  SplitByWarmCopy(st, seq, 0, &warm, &cold_only);
  ASSERT_GE(warm.size(), 2u);
  ASSERT_FALSE(cold_only.empty());
  const uint64_t tasks = TieredStoreTestPeer::TransferTasks(*st);
  const StoreCounters c0 = st->counters();
  {
    auto h = st->FetchChunks(seq, 0, {warm[0], warm[1]});
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_TRUE(h->Ready()) << "loaded before FetchChunks returned";
    ASSERT_TRUE(h->Wait().ok());
    EXPECT_EQ(TieredStoreTestPeer::TransferTasks(*st), tasks) << "no transfer task";
    EXPECT_EQ(st->counters().misses - c0.misses, 2u);
    EXPECT_EQ(st->counters().cold_reads, c0.cold_reads);
  }
  {
    auto h = st->FetchChunks(seq, 0, {cold_only[0]});
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    ASSERT_TRUE(h->Wait().ok());
    EXPECT_EQ(TieredStoreTestPeer::TransferTasks(*st), tasks + 1) << "the cold read went to the engine";
    EXPECT_EQ(st->counters().cold_reads - c0.cold_reads, 1u);
  }
  ExpectPattern(st, seq, 0, 9, 0, 8 + 40 + 8 * 30);
}

// The caller may keep fetches of several layers in flight and attend one layer while the
// next layer's chunks load (the pipelining a model's forward pass allows): issued before
// any Wait, each handle delivers its own chunks intact, cold ones included, and a hit on
// a chunk another fetch is still loading waits for that load.
TEST(TieredStore, FetchesOfTwoLayersInFlightAtOnce) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  auto seq = st->CreateSequence();
  for (int layer = 0; layer < 2; ++layer) AppendPattern(st, *seq, layer, 9, 0, 8 + 40 + 8 * 20, 31);
  ASSERT_TRUE(st->WaitForDurable().ok());
  const size_t tb = TokenBytes(o);
  const std::vector<uint64_t> idx{0, 3, 19, 7};  // mostly cold: warm holds 8 chunks of 40
  const StoreCounters c0 = st->counters();
  auto h0 = st->FetchChunks(*seq, 0, idx);
  auto h1 = st->FetchChunks(*seq, 1, idx);
  auto h1_again = st->FetchChunks(*seq, 1, {3, 7});  // hits on chunks h1 may still be loading
  ASSERT_TRUE(h0.ok() && h1.ok() && h1_again.ok());
  std::vector<uint8_t> e(8 * tb);
  auto check = [&](const FetchHandle& h, int layer, const std::vector<uint64_t>& want) {
    ASSERT_EQ(h.spans().size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const auto& sp = h.spans()[i];
      ASSERT_EQ(sp.first_position, 8 + static_cast<int64_t>(want[i]) * 8);
      FillPattern(kSalt, 9, layer, 0, sp.first_position, 8, tb, e.data());
      EXPECT_EQ(0, std::memcmp(e.data(), sp.k, e.size())) << "layer " << layer << " chunk " << want[i];
      FillPattern(kSalt, 9, layer, 1, sp.first_position, 8, tb, e.data());
      EXPECT_EQ(0, std::memcmp(e.data(), sp.v, e.size())) << "layer " << layer << " chunk " << want[i];
    }
  };
  ASSERT_TRUE(h0->Wait().ok());
  check(*h0, 0, idx);  // layer 0 is read while layer 1's loads may still run
  ASSERT_TRUE(h1_again->Wait().ok());
  check(*h1_again, 1, {3, 7});
  ASSERT_TRUE(h1->Wait().ok());
  check(*h1, 1, idx);
  EXPECT_EQ(st->counters().misses - c0.misses, 8u);
  EXPECT_EQ(st->counters().hits - c0.hits, 2u);
  EXPECT_GE(st->counters().cold_reads - c0.cold_reads, 4u);
}

// Leases run on StoreHooks::clock: a ManualClock moves time by exactly what the test
// says, so nothing sleeps and a busy machine cannot make the lease run out early or late.
// Two slots, pins of 50 ms, 6 chunks of layer 0 sealed.
std::unique_ptr<TieredStore> TwoHotSlotsWithManualLeases(const std::string& dir,
                                                         std::shared_ptr<ManualClock> clock,
                                                         SequenceId* seq) {
  StoreOptions o = SmallOptions(dir);
  o.hot_bytes = 2 * o.chunk_bytes();
  o.pin_timeout_ms = 50;
  StoreHooks hooks;
  hooks.clock = clock;
  auto s = TieredStore::Open(o, hooks);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  auto created = (*s)->CreateSequence();
  EXPECT_TRUE(created.ok());
  if (!created.ok()) return nullptr;
  *seq = *created;
  AppendPattern(s->get(), *seq, 0, 4, 0, 8 + 32 + 8 * 6, 8);
  return std::move(*s);
}

TEST(TieredStore, ExpiredPinStopsProtecting) {
  TempDir dir;
  auto clock = std::make_shared<ManualClock>();
  SequenceId seq = 0;
  auto store = TwoHotSlotsWithManualLeases(dir.path(), clock, &seq);
  ASSERT_NE(store, nullptr);
  TieredStore* st = store.get();
  auto h = st->FetchChunks(seq, 0, {0, 1});
  ASSERT_TRUE(h.ok() && h->Wait().ok());
  // Pinned and within the lease: no slot for another chunk, up to its last nanosecond.
  EXPECT_EQ(st->FetchChunks(seq, 0, {2}).status().code(), StatusCode::kResourceExhausted);
  clock->Advance(std::chrono::milliseconds(50) - std::chrono::nanoseconds(1));
  EXPECT_EQ(st->FetchChunks(seq, 0, {2}).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(st->counters().lease_expired, 0u);
  // Lease over: the forgotten pin no longer blocks the tier.
  clock->Advance(std::chrono::nanoseconds(1));
  auto h2 = st->FetchChunks(seq, 0, {2});
  ASSERT_TRUE(h2.ok()) << h2.status().ToString();
  ASSERT_TRUE(h2->Wait().ok());
  EXPECT_EQ(st->counters().lease_expired, 1u);
}

// A second fetch of a pinned chunk extends its lease (the later deadline wins); the
// other chunk of the first fetch keeps the old one.
TEST(TieredStore, RefetchExtendsTheLease) {
  TempDir dir;
  auto clock = std::make_shared<ManualClock>();
  SequenceId seq = 0;
  auto store = TwoHotSlotsWithManualLeases(dir.path(), clock, &seq);
  ASSERT_NE(store, nullptr);
  TieredStore* st = store.get();
  auto h = st->FetchChunks(seq, 0, {0, 1});
  ASSERT_TRUE(h.ok() && h->Wait().ok());
  clock->Advance(std::chrono::milliseconds(40));
  auto again = st->FetchChunks(seq, 0, {0});  // a hit: chunk 0 now pinned until t=90
  ASSERT_TRUE(again.ok() && again->Wait().ok());
  clock->Advance(std::chrono::milliseconds(20));  // t=60: chunk 1's lease is over, chunk 0's is not
  auto h2 = st->FetchChunks(seq, 0, {2});
  ASSERT_TRUE(h2.ok()) << h2.status().ToString();
  ASSERT_TRUE(h2->Wait().ok());
  auto chunks = st->ListChunks(seq, 0);
  ASSERT_TRUE(chunks.ok());
  EXPECT_NE((*chunks)[0].tiers & kTierHot, 0) << "chunk 0's extended lease protected it";
  EXPECT_EQ((*chunks)[1].tiers & kTierHot, 0) << "chunk 1's slot went to chunk 2";
  // Both slots pinned (0 until t=90, 2 until t=110): nothing more fits.
  EXPECT_EQ(st->FetchChunks(seq, 0, {3}).status().code(), StatusCode::kResourceExhausted);
  clock->Advance(std::chrono::milliseconds(30));  // t=90: chunk 0's extended lease is over
  auto h3 = st->FetchChunks(seq, 0, {3});
  ASSERT_TRUE(h3.ok()) << h3.status().ToString();
  ASSERT_TRUE(h3->Wait().ok());
}

// ChunkUpdatesSince hands a retrieval index what landed (with the representatives
// GetRepresentatives gives) and what was dropped since its cursor, holes left out.
TEST(TieredStore, ChunkUpdatesSinceHandsOverLandedAndDroppedChunks) {
  StoreOptions o = SmallOptions("");
  o.warm_bytes = 64 * o.chunk_bytes();
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  const SequenceId seq = *st->CreateSequence();
  AppendPattern(st, seq, 0, 1, 0, 8 + 40 + 8 * 6, 5);  // sinks, a full ring (n_local + chunk), 6 sealed
  const size_t repr_elems = static_cast<size_t>(o.repr_topk) * o.geometry.token_elems();
  ChunkUpdate u;
  ASSERT_TRUE(st->ChunkUpdatesSince(seq, 0, ChunkCursor{}, &u).ok());
  EXPECT_EQ(u.added, (std::vector<uint64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(u.dropped.empty());
  EXPECT_EQ(u.next.chunks, 6u);
  EXPECT_EQ(u.next.drops, 0u);
  ASSERT_EQ(u.repr.size(), 6 * repr_elems);
  std::vector<float> r(repr_elems);
  for (uint64_t c = 0; c < 6; ++c) {
    ASSERT_TRUE(st->GetRepresentatives(ChunkKey{seq, 0, c}, r.data()).ok());
    EXPECT_EQ(0, std::memcmp(r.data(), u.repr.data() + c * repr_elems, repr_elems * sizeof(float)))
        << "chunk " << c;
  }
  // Nothing new: empty. Then two drops and two more chunks, one of them dropped at once.
  const ChunkCursor first = u.next;
  ASSERT_TRUE(st->ChunkUpdatesSince(seq, 0, first, &u).ok());
  EXPECT_TRUE(u.added.empty() && u.dropped.empty() && u.repr.empty());
  ASSERT_TRUE(st->DropChunks(seq, 0, {1, 4}).ok());
  AppendPattern(st, seq, 0, 1, 8 + 40 + 8 * 6, 8 + 40 + 8 * 8, 5);
  ASSERT_TRUE(st->DropChunks(seq, 0, {7}).ok());
  ASSERT_TRUE(st->ChunkUpdatesSince(seq, 0, first, &u).ok());
  EXPECT_EQ(u.added, (std::vector<uint64_t>{6}));
  EXPECT_EQ(u.dropped, (std::vector<uint64_t>{1, 4, 7}));
  EXPECT_EQ(u.next.chunks, 8u);
  EXPECT_EQ(u.next.drops, 3u);
  // From the start (a new index over the sequence): only live chunks, every drop.
  ASSERT_TRUE(st->ChunkUpdatesSince(seq, 0, ChunkCursor{}, &u).ok());
  EXPECT_EQ(u.added, (std::vector<uint64_t>{0, 2, 3, 5, 6}));
  EXPECT_EQ(u.dropped, (std::vector<uint64_t>{1, 4, 7}));
  EXPECT_TRUE(u.complete);
  EXPECT_EQ(u.pending, 0u);
  // In batches of two: holes skipped, every drop with the first batch, the cursor after the
  // last chunk handed over, and the same chunks and representatives in the end.
  std::vector<uint64_t> added;
  std::vector<float> repr;
  ChunkCursor at{};
  int calls = 0;
  do {
    ASSERT_TRUE(st->ChunkUpdatesSince(seq, 0, at, &u, 2).ok());
    EXPECT_LE(u.added.size(), 2u);
    EXPECT_EQ(u.pending, 8u - u.next.chunks) << "call " << calls;
    EXPECT_EQ(u.dropped, calls == 0 ? (std::vector<uint64_t>{1, 4, 7}) : std::vector<uint64_t>{});
    added.insert(added.end(), u.added.begin(), u.added.end());
    repr.insert(repr.end(), u.repr.begin(), u.repr.end());
    at = u.next;
    ++calls;
  } while (!u.complete && calls < 10);
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(added, (std::vector<uint64_t>{0, 2, 3, 5, 6}));
  EXPECT_EQ(at.chunks, 8u);
  EXPECT_EQ(at.drops, 3u);
  ASSERT_TRUE(st->ChunkUpdatesSince(seq, 0, ChunkCursor{}, &u).ok());
  EXPECT_EQ(repr, u.repr);
  EXPECT_EQ(st->ChunkUpdatesSince(seq, 0, ChunkCursor{}, &u, 0).code(), StatusCode::kInvalidArgument);
  // Bad calls are named.
  Status past = st->ChunkUpdatesSince(seq, 0, ChunkCursor{9, 0}, &u);
  EXPECT_EQ(past.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past.message().find("cursor"), std::string::npos) << past.ToString();
  EXPECT_EQ(st->ChunkUpdatesSince(seq, 0, ChunkCursor{}, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st->ChunkUpdatesSince(seq + 100, 0, ChunkCursor{}, &u).code(), StatusCode::kNotFound);
  EXPECT_EQ(st->ChunkUpdatesSince(seq, 5, ChunkCursor{}, &u).code(), StatusCode::kInvalidArgument);
}

// Two stores fed the same tokens: `paged` over a cold tier with a warm tier of 4 chunks (most
// chunks leave warm, and their representatives leave memory with them), `resident` without a
// cold tier and with room for every chunk in warm (every chunk keeps its representatives).
struct PagedAndResident {
  TempDir dir;
  StoreOptions paged_o, resident_o;
  StoreHooks paged_hooks;
  std::unique_ptr<TieredStore> paged, resident;
  SequenceId paged_seq = 0, resident_seq = 0;
  static constexpr int64_t kTokens = 8 + 40 + 8 * 30;  // sinks, a full ring, 30 sealed chunks a layer

  // Representative keys of every chunk of one layer, fp32, as GetRepresentatives gives them.
  static std::vector<float> AllRepr(TieredStore* st, SequenceId seq, int layer, uint64_t n) {
    const size_t e = static_cast<size_t>(st->options().repr_topk) * st->options().geometry.token_elems();
    std::vector<float> all(n * e);
    for (uint64_t c = 0; c < n; ++c) {
      Status got = st->GetRepresentatives(ChunkKey{seq, static_cast<uint32_t>(layer), c}, all.data() + c * e);
      EXPECT_TRUE(got.ok()) << "chunk " << c << ": " << got.ToString();
    }
    return all;
  }
};

std::unique_ptr<PagedAndResident> MakePagedAndResident(
    std::function<Status(std::string_view, const ChunkKey&)> injector = nullptr) {
  auto p = std::make_unique<PagedAndResident>();
  p->paged_o = SmallOptions(p->dir.path());
  p->paged_o.warm_bytes = 4 * p->paged_o.chunk_bytes();
  p->paged_hooks.cold_fault_injector = std::move(injector);
  p->resident_o = SmallOptions("");
  p->resident_o.warm_bytes = 128 * p->resident_o.chunk_bytes();
  auto a = TieredStore::Open(p->paged_o, p->paged_hooks);
  auto b = TieredStore::Open(p->resident_o);
  EXPECT_TRUE(a.ok() && b.ok());
  if (!a.ok() || !b.ok()) return nullptr;
  p->paged = std::move(*a);
  p->resident = std::move(*b);
  p->paged_seq = *p->paged->CreateSequence();
  p->resident_seq = *p->resident->CreateSequence();
  for (int l = 0; l < 2; ++l) {
    AppendPattern(p->paged.get(), p->paged_seq, l, 61, 0, PagedAndResident::kTokens, 13);
    AppendPattern(p->resident.get(), p->resident_seq, l, 61, 0, PagedAndResident::kTokens, 13);
  }
  EXPECT_TRUE(p->paged->WaitForDurable().ok());
  return p;
}

// Chunks that left the warm tier, acknowledged by the cold tier, no longer hold their
// representatives in memory: metadata_bytes falls by exactly their bytes, and every reader
// gets the same representatives bit for bit, read back from the cold tier's meta records.
TEST(TieredStore, RepresentativesLeaveMemoryWithTheWarmCopyAndComeBackBitForBit) {
  auto p = MakePagedAndResident();
  ASSERT_NE(p, nullptr);
  const StoreOptions& o = p->paged_o;
  const size_t repr_bytes = static_cast<size_t>(o.repr_topk) * TokenBytes(o);
  uint64_t left_warm = 0;
  for (int l = 0; l < 2; ++l) {
    auto list = p->paged->ListChunks(p->paged_seq, l);
    ASSERT_TRUE(list.ok());
    ASSERT_EQ(list->size(), 30u);
    for (const ChunkInfo& c : *list) left_warm += (c.tiers & kTierWarm) == 0;
  }
  ASSERT_GE(left_warm, 50u) << "a warm tier of 4 chunks keeps at most 4 of 60";
  EXPECT_EQ(p->resident->metadata_bytes() - p->paged->metadata_bytes(), left_warm * repr_bytes)
      << "the representatives of every chunk that left warm left memory";
  const size_t e = static_cast<size_t>(o.repr_topk) * o.geometry.token_elems();
  for (int l = 0; l < 2; ++l) {
    // GetRepresentatives, chunk by chunk.
    const std::vector<float> want = PagedAndResident::AllRepr(p->resident.get(), p->resident_seq, l, 30);
    const std::vector<float> got = PagedAndResident::AllRepr(p->paged.get(), p->paged_seq, l, 30);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << "layer " << l;
    // An index built now (cursor 0), and one that synced up to chunk 10 before.
    for (const ChunkCursor since : {ChunkCursor{}, ChunkCursor{10, 0}}) {
      ChunkUpdate u, r;
      Status su = p->paged->ChunkUpdatesSince(p->paged_seq, l, since, &u);
      ASSERT_TRUE(su.ok()) << su.ToString();
      ASSERT_TRUE(p->resident->ChunkUpdatesSince(p->resident_seq, l, since, &r).ok());
      EXPECT_EQ(u.added, r.added);
      EXPECT_EQ(u.next.chunks, r.next.chunks);
      ASSERT_EQ(u.repr.size(), r.repr.size());
      EXPECT_EQ(0, std::memcmp(u.repr.data(), r.repr.data(), u.repr.size() * sizeof(float)))
          << "layer " << l << " from chunk " << since.chunks;
      EXPECT_EQ(0, std::memcmp(u.repr.data(), want.data() + since.chunks * e, u.repr.size() * sizeof(float)));
    }
  }
  // A released chunk read back into warm by a fetch keeps its representatives out of memory
  // (and the chunk whose warm slot it took releases its own).
  {
    auto h = p->paged->FetchChunks(p->paged_seq, 0, {0});
    ASSERT_TRUE(h.ok() && h->Wait().ok());
  }
  uint64_t not_warm = 0;
  for (int l = 0; l < 2; ++l) {
    auto list = p->paged->ListChunks(p->paged_seq, l);
    ASSERT_TRUE(list.ok());
    for (const ChunkInfo& c : *list) {
      not_warm += (c.tiers & kTierWarm) == 0;
      if (l == 0 && c.key.index == 0) ASSERT_NE(c.tiers & kTierWarm, 0) << "chunk 0 was read into warm";
    }
  }
  EXPECT_EQ(p->resident->metadata_bytes() - p->paged->metadata_bytes(), (not_warm + 1) * repr_bytes);
  // Dropping a released chunk: the rest still reads back, and the drop is handed over.
  ASSERT_TRUE(p->paged->DropChunks(p->paged_seq, 0, {2}).ok());
  ChunkUpdate u;
  ASSERT_TRUE(p->paged->ChunkUpdatesSince(p->paged_seq, 0, ChunkCursor{}, &u).ok());
  EXPECT_EQ(u.added.size(), 29u);
  EXPECT_EQ(u.dropped, (std::vector<uint64_t>{2}));
  EXPECT_EQ(std::find(u.added.begin(), u.added.end(), 2u), u.added.end());
}

// A released representative that cannot be read back is a named error, not a crash and not
// wrong bytes; chunks still in warm are served from memory meanwhile, and once the cold tier
// answers again the same calls succeed.
TEST(TieredStore, RepresentativesThatCannotBeReadBackAreANamedError) {
  auto failing = std::make_shared<std::atomic<bool>>(false);
  auto p = MakePagedAndResident([failing](std::string_view op, const ChunkKey& k) {
    return failing->load() && op == "meta" ? IOError("injected: meta of " + k.ToString() + " unreadable")
                                           : Status::Ok();
  });
  ASSERT_NE(p, nullptr);
  const size_t e = static_cast<size_t>(p->paged_o.repr_topk) * p->paged_o.geometry.token_elems();
  std::vector<float> r(e);
  failing->store(true);
  Status st = p->paged->GetRepresentatives(ChunkKey{p->paged_seq, 1, 0}, r.data());
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_NE(st.message().find("representatives of chunk " + ChunkKey{p->paged_seq, 1, 0}.ToString()),
            std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("injected"), std::string::npos) << st.ToString();
  ChunkUpdate u;
  st = p->paged->ChunkUpdatesSince(p->paged_seq, 1, ChunkCursor{}, &u);
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_NE(st.message().find("representatives of chunk"), std::string::npos) << st.ToString();
  auto list = p->paged->ListChunks(p->paged_seq, 1);
  ASSERT_TRUE(list.ok());
  for (const ChunkInfo& c : *list)
    if (c.tiers & kTierWarm) {
      Status warm = p->paged->GetRepresentatives(c.key, r.data());
      EXPECT_TRUE(warm.ok()) << c.key.ToString() << " is in warm: " << warm.ToString();
    }
  failing->store(false);
  st = p->paged->ChunkUpdatesSince(p->paged_seq, 1, ChunkCursor{}, &u);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(u.added.size(), 30u);
  EXPECT_EQ(PagedAndResident::AllRepr(p->paged.get(), p->paged_seq, 1, 30),
            PagedAndResident::AllRepr(p->resident.get(), p->resident_seq, 1, 30));
}

// A reopened store keeps the representatives of its (cold only) chunks in the cold tier:
// metadata_bytes counts none, and readers get them back bit for bit.
TEST(TieredStore, ReopenLeavesRepresentativesInTheColdTier) {
  auto p = MakePagedAndResident();
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(p->paged->CloseSequence(p->paged_seq).ok());
  const uint64_t before = p->paged->metadata_bytes();
  p->paged.reset();
  auto reopened = TieredStore::Open(p->paged_o, p->paged_hooks);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  TieredStore* st = reopened->get();
  const size_t repr_bytes = static_cast<size_t>(p->paged_o.repr_topk) * TokenBytes(p->paged_o);
  EXPECT_EQ(p->resident->metadata_bytes() - st->metadata_bytes(), 60 * repr_bytes)
      << "no chunk of the reopened store holds its representatives in memory";
  EXPECT_LT(st->metadata_bytes(), before);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(PagedAndResident::AllRepr(st, p->paged_seq, l, 30),
              PagedAndResident::AllRepr(p->resident.get(), p->resident_seq, l, 30));
    ChunkUpdate u, r;
    ASSERT_TRUE(st->ChunkUpdatesSince(p->paged_seq, l, ChunkCursor{}, &u).ok());
    ASSERT_TRUE(p->resident->ChunkUpdatesSince(p->resident_seq, l, ChunkCursor{}, &r).ok());
    EXPECT_EQ(u.added, r.added);
    EXPECT_EQ(u.repr, r.repr);
    ExpectPattern(st, p->paged_seq, l, 61, 0, PagedAndResident::kTokens);
  }
}

// DropChunks refuses a chunk a live handle pins, and only while the lease lasts.
TEST(TieredStore, DropChunksRespectsTheLeaseOnly) {
  TempDir dir;
  auto clock = std::make_shared<ManualClock>();
  SequenceId seq = 0;
  auto store = TwoHotSlotsWithManualLeases(dir.path(), clock, &seq);
  ASSERT_NE(store, nullptr);
  TieredStore* st = store.get();
  auto h = st->FetchChunks(seq, 0, {1});
  ASSERT_TRUE(h.ok() && h->Wait().ok());
  clock->Advance(std::chrono::milliseconds(49));
  EXPECT_EQ(st->DropChunks(seq, 0, {1}).code(), StatusCode::kFailedPrecondition);
  clock->Advance(std::chrono::milliseconds(1));
  Status dropped = st->DropChunks(seq, 0, {1});
  EXPECT_TRUE(dropped.ok()) << dropped.ToString();
  h->Release();  // the handle outlived its chunk: releasing it is still fine
}

TEST(TieredStore, RepresentativesFollowAttentionMassOrFallBackToTypicalKeys) {
  StoreOptions o = SmallOptions("");
  o.geometry = Geometry{1, 2, 1, 4, DType::kF32};
  o.n_sink = 0;
  o.n_local = 4;
  o.chunk_size = 4;
  o.repr_topk = 1;
  o.warm_bytes = 64 * o.chunk_bytes();
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  auto seq = st->CreateSequence();
  // Tokens 0..3: keys e0, e1, e2, e3 scaled; token 2 gets the most attention.
  std::vector<float> k(4 * 4, 0.0f), v(4 * 4, 1.0f);
  for (int t = 0; t < 4; ++t) k[t * 4 + t] = 1.0f + t;
  ASSERT_TRUE(st->Append(*seq, 0, k.data(), v.data(), 4, DType::kF32).ok());
  std::vector<float> mass{0.1f, 0.2f, 0.9f, 0.3f};
  ASSERT_TRUE(st->AddLocalAttention(*seq, 0, 0, 4, mass.data()).ok());
  // Tokens 4..7: no statistics; keys 3x the same direction and one outlier.
  std::vector<float> k2(16, 0.0f);
  for (int t = 0; t < 3; ++t) k2[t * 4 + 0] = 1.0f + 0.1f * t;
  k2[3 * 4 + 1] = 5.0f;
  ASSERT_TRUE(st->Append(*seq, 0, k2.data(), v.data(), 4, DType::kF32).ok());
  // Push both chunks out of the local window.
  std::vector<float> k3(8 * 4, 0.5f), v3(8 * 4, 0.5f);
  ASSERT_TRUE(st->Append(*seq, 0, k3.data(), v3.data(), 8, DType::kF32).ok());
  std::vector<float> repr(4);
  ASSERT_TRUE(st->GetRepresentatives(ChunkKey{*seq, 0, 0}, repr.data()).ok());
  EXPECT_EQ(repr, (std::vector<float>{0, 0, 3, 0}));  // the most attended token
  ASSERT_TRUE(st->GetRepresentatives(ChunkKey{*seq, 0, 1}, repr.data()).ok());
  EXPECT_EQ(repr[1], 0.0f) << "fallback must pick a typical key, not the outlier";
  EXPECT_GT(repr[0], 0.9f);
}

// The store honours repr_choice: with cluster and one representative a sealed chunk's
// representative is its mean key, whatever its statistics.
TEST(TieredStore, ClusterRepresentativeIsTheChunksMeanKey) {
  StoreOptions o = SmallOptions("");
  o.geometry = Geometry{1, 2, 1, 4, DType::kF32};
  o.n_sink = 0;
  o.n_local = 4;
  o.chunk_size = 4;
  o.repr_topk = 1;
  o.repr_choice = ReprChoice::kCluster;
  o.warm_bytes = 64 * o.chunk_bytes();
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  auto seq = st->CreateSequence();
  std::vector<float> k(4 * 4, 0.0f), v(8 * 4, 1.0f);
  for (int t = 0; t < 4; ++t) k[t * 4 + t] = 1.0f + t;
  ASSERT_TRUE(st->Append(*seq, 0, k.data(), v.data(), 4, DType::kF32).ok());
  std::vector<float> mass{0.1f, 0.2f, 0.9f, 0.3f};
  ASSERT_TRUE(st->AddLocalAttention(*seq, 0, 0, 4, mass.data()).ok());
  std::vector<float> k2(8 * 4, 0.5f);
  ASSERT_TRUE(st->Append(*seq, 0, k2.data(), v.data(), 8, DType::kF32).ok());
  std::vector<float> repr(4);
  ASSERT_TRUE(st->GetRepresentatives(ChunkKey{*seq, 0, 0}, repr.data()).ok());
  EXPECT_EQ(repr, (std::vector<float>{0.25f, 0.5f, 0.75f, 1.0f}));
  StoreOptions bad = o;
  bad.repr_choice = static_cast<ReprChoice>(7);
  EXPECT_EQ(TieredStore::Open(bad).status().code(), StatusCode::kInvalidArgument);
}

// ChooseRepresentatives on its own, InfLLM's choice: per kv head the most attended tokens,
// highest first.
TEST(TieredStoreRepresentatives, MostAttendedTokensPerHead) {
  RepresentativeInput in;
  in.geometry = Geometry{1, 2, 2, 2, DType::kF32};
  in.chunk_size = 4;
  in.repr_topk = 2;
  in.choice = ReprChoice::kMass;
  // keys[t][h] = (10 t + h, -t): every key distinct and recognisable.
  std::vector<float> keys(4 * 2 * 2);
  for (int t = 0; t < 4; ++t)
    for (int h = 0; h < 2; ++h) {
      keys[(t * 2 + h) * 2 + 0] = 10.0f * t + h;
      keys[(t * 2 + h) * 2 + 1] = -1.0f * t;
    }
  in.keys = reinterpret_cast<const uint8_t*>(keys.data());
  // Head 0 attends tokens 2 then 0; head 1 tokens 1 then 3. Stride 6: rows longer than the chunk.
  std::vector<float> mass{0.3f, 0.1f, 0.5f, 0.0f, 9.f, 9.f,  //
                          0.0f, 0.7f, 0.1f, 0.2f, 9.f, 9.f};
  in.mass = mass.data();
  in.mass_stride = 6;
  std::vector<float> out(2 * 2 * 2, -1.0f);
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
  // out[r][h] = keys[chosen token][h].
  EXPECT_EQ(out, (std::vector<float>{20, -2, 11, -1,   // r=0: head 0 token 2, head 1 token 1
                                     0, 0, 31, -3}));  // r=1: head 0 token 0, head 1 token 3
  // Ties go to the earlier token.
  std::fill(mass.begin(), mass.end(), 1.0f);
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
  EXPECT_EQ(out, (std::vector<float>{0, 0, 1, 0, 10, -1, 11, -1}));
}

// The diverse choice: the most attended token first, then the token with the highest
// mass / top mass - (highest cosine with a token taken), computed here by hand. Five tokens
// share a topic direction and collect most of the mass; one needle key points elsewhere.
TEST(TieredStoreRepresentatives, DiverseTakesTheKeyTheMostAttendedOnesDoNotCover) {
  RepresentativeInput in;
  in.geometry = Geometry{1, 1, 1, 2, DType::kF32};
  in.chunk_size = 6;
  in.repr_topk = 2;
  // Tokens 0-4 along (1, 0.1 t), token 5 (the needle) along (0, 1).
  std::vector<float> keys;
  for (int t = 0; t < 5; ++t) keys.insert(keys.end(), {1.0f, 0.1f * t});
  keys.insert(keys.end(), {0.0f, 1.0f});
  in.keys = reinterpret_cast<const uint8_t*>(keys.data());
  const std::vector<float> mass{0.9f, 1.0f, 0.8f, 0.7f, 0.6f, 0.3f};
  in.mass = mass.data();
  in.mass_stride = 6;
  auto cosine = [&](int a, int b) {
    const float* x = &keys[2 * a];
    const float* y = &keys[2 * b];
    return (x[0] * y[0] + x[1] * y[1]) / std::sqrt((x[0] * x[0] + x[1] * x[1]) * (y[0] * y[0] + y[1] * y[1]));
  };
  // By hand: token 1 first (mass 1.0); token 5 scores 0.3 - cos(5, 1), token 0 0.9 - cos(0, 1).
  ASSERT_GT(0.3f - cosine(5, 1), 0.9f - cosine(0, 1));
  std::vector<float> out(2 * 2, -1.0f);
  in.choice = ReprChoice::kDiverse;
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
  EXPECT_EQ(out, (std::vector<float>{1.0f, 0.1f, 0.0f, 1.0f})) << "token 1, then the needle";
  // InfLLM's choice takes the two most attended, both along the topic.
  in.choice = ReprChoice::kMass;
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
  EXPECT_EQ(out, (std::vector<float>{1.0f, 0.1f, 1.0f, 0.0f})) << "tokens 1 and 0";
  // With one representative both take the most attended token.
  in.repr_topk = 1;
  for (ReprChoice c : {ReprChoice::kMass, ReprChoice::kDiverse}) {
    in.choice = c;
    ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[1], 0.1f);
  }
  ReprChoice parsed = ReprChoice::kMass;
  EXPECT_TRUE(ParseReprChoice("diverse", &parsed));
  EXPECT_EQ(parsed, ReprChoice::kDiverse);
  EXPECT_FALSE(ParseReprChoice("typical", &parsed));
  EXPECT_STREQ(ReprChoiceName(ReprChoice::kMass), "mass");
}

// The cluster choice: the diverse seeds (token 1, then the needle), every other key with the
// seed it has the highest cosine with, and each representative its group's mean, by hand.
TEST(TieredStoreRepresentatives, ClusterStoresTheMeanKeyOfEachSeedsGroup) {
  RepresentativeInput in;
  in.geometry = Geometry{1, 1, 1, 2, DType::kF32};
  in.chunk_size = 7;
  in.repr_topk = 2;
  // Tokens 0-4 along (1, 0.1 t); tokens 5 and 6 (the needle) along (0, 1) and (0.1, 1).
  std::vector<float> keys;
  for (int t = 0; t < 5; ++t) keys.insert(keys.end(), {1.0f, 0.1f * t});
  keys.insert(keys.end(), {0.0f, 1.0f, 0.1f, 1.0f});
  in.keys = reinterpret_cast<const uint8_t*>(keys.data());
  const std::vector<float> mass{0.9f, 1.0f, 0.8f, 0.7f, 0.6f, 0.3f, 0.1f};
  in.mass = mass.data();
  in.mass_stride = 7;
  std::vector<float> out(2 * 2, -1.0f);
  in.choice = ReprChoice::kDiverse;
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
  ASSERT_EQ(out, (std::vector<float>{1.0f, 0.1f, 0.0f, 1.0f})) << "the seeds: token 1, then token 5";
  in.choice = ReprChoice::kCluster;
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
  // Tokens 0-4 join token 1 (mean (1, 0.2)); token 6 joins token 5 (mean (0.05, 1)).
  float topic_y = 0.0f;
  for (int t = 0; t < 5; ++t) topic_y += keys[2 * t + 1];
  EXPECT_EQ(out, (std::vector<float>{1.0f, topic_y / 5.0f, (keys[10] + keys[12]) / 2.0f, 1.0f}));
  // One representative: the chunk's mean key.
  in.repr_topk = 1;
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
  float sx = 0, sy = 0;
  for (int t = 0; t < 7; ++t) sx += keys[2 * t], sy += keys[2 * t + 1];
  EXPECT_EQ(out[0], sx / 7.0f);
  EXPECT_EQ(out[1], sy / 7.0f);
  // Every key a representative: each is its own group, the keys themselves in the diverse order.
  in.repr_topk = 7;
  std::vector<float> all(7 * 2), diverse(7 * 2);
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(all.data())).ok());
  in.choice = ReprChoice::kDiverse;
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(diverse.data())).ok());
  EXPECT_EQ(all, diverse);
  std::vector<float> sorted_all = all, sorted_keys = keys;
  std::sort(sorted_all.begin(), sorted_all.end());
  std::sort(sorted_keys.begin(), sorted_keys.end());
  EXPECT_EQ(sorted_all, sorted_keys);
  // A mean in a 16-bit dtype is the fp32 mean rounded to it.
  in.geometry = Geometry{1, 1, 1, 2, DType::kF16};
  in.choice = ReprChoice::kCluster;
  in.repr_topk = 1;
  std::vector<uint16_t> keys16(keys.size()), out16(2);
  FromFloat(DType::kF16, keys.data(), keys16.data(), keys.size());
  in.keys = reinterpret_cast<const uint8_t*>(keys16.data());
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out16.data())).ok());
  float mean16[2] = {0, 0};
  for (int t = 0; t < 7; ++t)
    for (int d = 0; d < 2; ++d) mean16[d] += F16ToFloat(keys16[2 * t + d]);
  for (float& m : mean16) m /= 7.0f;
  uint16_t want[2];
  FromFloat(DType::kF16, mean16, want, 2);
  EXPECT_EQ(out16[0], want[0]);
  EXPECT_EQ(out16[1], want[1]);
  ReprChoice parsed = ReprChoice::kMass;
  EXPECT_TRUE(ParseReprChoice("cluster", &parsed));
  EXPECT_EQ(parsed, ReprChoice::kCluster);
  EXPECT_STREQ(ReprChoiceName(ReprChoice::kCluster), "cluster");
}

// Without statistics: the typical keys, not the outlier; the choice copies the stored
// bits (bf16 here) untouched.
TEST(TieredStoreRepresentatives, FallbackPicksTypicalKeysBitForBit) {
  RepresentativeInput in;
  in.geometry = Geometry{1, 1, 1, 4, DType::kBF16};
  in.chunk_size = 4;
  in.repr_topk = 1;
  // Three keys around e0 (token 0 on it, tokens 1 and 2 tilted either way), one large
  // outlier along e2: the mean of the unit keys lies closest to token 0.
  const std::vector<float> f{1.0f, 0, 0, 0, 1.0f, 0.25f, 0, 0, 1.0f, -0.25f, 0, 0, 0, 0, 8.0f, 0};
  std::vector<uint16_t> keys(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &f[i], 4);
    keys[i] = static_cast<uint16_t>(u >> 16);
  }
  in.keys = reinterpret_cast<const uint8_t*>(keys.data());
  std::vector<uint16_t> out(4, 0xffff);
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out.data())).ok());
  EXPECT_EQ(out, (std::vector<uint16_t>(keys.begin(), keys.begin() + 4)))
      << "token 0 lies on the mean direction";
  // All-zero mass is "no statistics" as well.
  std::vector<float> zero(4, 0.0f);
  in.mass = zero.data();
  in.mass_stride = 4;
  std::vector<uint16_t> out2(4, 0xffff);
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(out2.data())).ok());
  EXPECT_EQ(out2, out);
}

TEST(TieredStoreRepresentatives, BadInputIsNamed) {
  std::vector<float> keys(16, 1.0f), out(16);
  RepresentativeInput in;
  in.geometry = Geometry{1, 1, 1, 4, DType::kF32};
  in.chunk_size = 4;
  in.repr_topk = 5;
  in.keys = reinterpret_cast<const uint8_t*>(keys.data());
  auto* o = reinterpret_cast<uint8_t*>(out.data());
  Status st = ChooseRepresentatives(in, o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("repr_topk"), std::string::npos) << st.ToString();
  in.repr_topk = 1;
  in.keys = nullptr;
  EXPECT_NE(ChooseRepresentatives(in, o).message().find("null"), std::string::npos);
  in.keys = reinterpret_cast<const uint8_t*>(keys.data());
  in.mass = keys.data();
  in.mass_stride = 2;
  EXPECT_NE(ChooseRepresentatives(in, o).message().find("mass_stride"), std::string::npos);
}

// A hot tier that counts what the store asks of it (forwarding to the host tier).
class CountingHotTier final : public HotTier {
 public:
  explicit CountingHotTier(std::unique_ptr<HotTier> inner) : inner_(std::move(inner)) {}
  Device device() const override { return inner_->device(); }
  int32_t slot_capacity() const override { return inner_->slot_capacity(); }
  int32_t slots_used() const override { return inner_->slots_used(); }
  size_t slot_bytes() const override { return inner_->slot_bytes(); }
  int32_t AcquireSlot() override {
    acquired++;
    return inner_->AcquireSlot();
  }
  void ReleaseSlot(int32_t slot) override { inner_->ReleaseSlot(slot); }
  uint8_t* slot_data(int32_t slot) override { return inner_->slot_data(slot); }
  Result<uint8_t*> AllocateRegion(size_t bytes) override {
    regions++;
    return inner_->AllocateRegion(bytes);
  }
  void FreeRegion(uint8_t* region, size_t bytes) override { inner_->FreeRegion(region, bytes); }
  Status Upload(uint8_t* dst, const void* src, size_t bytes) override {
    uploads++;
    upload_bytes += bytes;
    return inner_->Upload(dst, src, bytes);
  }
  Status Download(void* dst, const uint8_t* src, size_t bytes) override {
    return inner_->Download(dst, src, bytes);
  }

  // Atomic: uploads of fetches run on transfer threads.
  std::atomic<int64_t> uploads{0}, upload_bytes{0}, acquired{0}, regions{0};

 private:
  std::unique_ptr<HotTier> inner_;
};

TEST(TieredStoreHotTier, AnEngineCanInjectItsOwnHotTier) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  o.device = static_cast<Device>(7);  // the factory wins: the device is not looked at
  CountingHotTier* tier = nullptr;
  StoreHooks hooks;
  hooks.hot_tier_factory = [&tier](size_t pool_bytes, size_t slot_bytes) -> Result<std::unique_ptr<HotTier>> {
    KVTIER_ASSIGN_OR_RETURN(auto host, MakeHotTier(Device::kCpu, pool_bytes, slot_bytes));
    auto counting = std::make_unique<CountingHotTier>(std::move(host));
    tier = counting.get();
    return std::unique_ptr<HotTier>(std::move(counting));
  };
  auto s = TieredStore::Open(o, hooks);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_NE(tier, nullptr);
  TieredStore* st = s->get();
  auto seq = st->CreateSequence();
  ASSERT_TRUE(seq.ok());
  EXPECT_EQ(tier->regions.load(), 2 * 4) << "sinks and ring, K and V, of both layers";
  AppendPattern(st, *seq, 0, 9, 0, 8 + 40 + 8 * 10, 16);
  const int64_t after_append = tier->uploads.load();
  EXPECT_GT(after_append, 0) << "appends write sinks and ring through the tier";
  ASSERT_TRUE(st->WaitForDurable().ok());
  auto h = st->FetchChunks(*seq, 0, {0, 4, 9});
  ASSERT_TRUE(h.ok() && h->Wait().ok());
  EXPECT_EQ(tier->uploads.load() - after_append, 3) << "one upload per chunk loaded";
  EXPECT_EQ(tier->acquired.load(), 3);
  // The spans point into the injected tier's slots and hold the right bytes.
  const size_t tb = TokenBytes(o);
  std::vector<uint8_t> e(8 * tb);
  FillPattern(kSalt, 9, 0, 0, 8 + 4 * 8, 8, tb, e.data());
  EXPECT_EQ(0, std::memcmp(e.data(), h->spans()[1].k, e.size()));
  h->Release();
  ExpectPattern(st, *seq, 0, 9, 0, 8 + 40 + 8 * 10);
}

TEST(TieredStoreHotTier, DevicesAndTheirErrors) {
  const size_t slot = 4096;
  auto host = MakeHotTier(Device::kCpu, 4 * slot, slot);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  EXPECT_EQ((*host)->device(), Device::kCpu);
  EXPECT_EQ((*host)->slot_capacity(), 4);
  EXPECT_EQ((*host)->slot_bytes(), slot);
  EXPECT_STREQ(DeviceName(Device::kCpu), "cpu");
  EXPECT_STREQ(DeviceName(Device::kCuda), "cuda");
  EXPECT_EQ(*ParseDevice("cuda"), Device::kCuda);
  EXPECT_EQ(ParseDevice("host").status().message(), "unknown device 'host' (cpu|cuda)");
  // Without a CUDA build or a device, the GPU tier is a clear Unavailable, from MakeHotTier
  // and from Open (tests/offload/cuda_hot_tier_test.cc covers the store with a device).
#if KVTIER_HAVE_CUDA
  const bool device = kernels::cuda::DeviceCount() > 0;
#else
  const bool device = false;
#endif
  StoreOptions o = SmallOptions("");
  if (!device) {
    auto cuda = MakeHotTier(Device::kCuda, 4 * slot, slot);
    ASSERT_FALSE(cuda.ok());
    EXPECT_EQ(cuda.status().code(), StatusCode::kUnavailable) << cuda.status().ToString();
    EXPECT_NE(cuda.status().message().find("no CUDA"), std::string::npos) << cuda.status().ToString();
    o.device = Device::kCuda;
    auto s = TieredStore::Open(o);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(s.status().message().find("device"), std::string::npos) << s.status().ToString();
  }
  EXPECT_EQ(MakeHotTier(static_cast<Device>(7), 4 * slot, slot).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeHotTier(Device::kCpu, slot / 2, slot).status().code(), StatusCode::kInvalidArgument);
}

TEST(TieredStoreHotTier, AnInjectedTierWithTheWrongSlotsIsRefused) {
  StoreOptions o = SmallOptions("");
  StoreHooks hooks;
  hooks.hot_tier_factory = [](size_t pool_bytes, size_t slot_bytes) {
    return MakeHotTier(Device::kCpu, pool_bytes, slot_bytes / 2);
  };
  auto s = TieredStore::Open(o, hooks);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("slot"), std::string::npos) << s.status().ToString();
  hooks.hot_tier_factory = [](size_t, size_t) -> Result<std::unique_ptr<HotTier>> {
    return Unavailable("no device");
  };
  EXPECT_EQ(TieredStore::Open(o, hooks).status().code(), StatusCode::kUnavailable);
}

// Scores set while chunks sit in warm reach the cold tier with the chunks (written at
// close, without write-through) and come back on reopen.
TEST(TieredStore, ScoresSurviveReopen) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  o.write_through = false;
  o.warm_bytes = 64 * o.chunk_bytes();
  SequenceId seq = 0;
  {
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok());
    seq = *(*s)->CreateSequence();
    AppendPattern(s->get(), seq, 0, 3, 0, 8 + 40 + 8 * 5, 8);
    ASSERT_EQ(*(*s)->ChunkCount(seq, 0), 5u);
    ASSERT_TRUE((*s)->SetChunkScores(seq, 0, {{0, 0.5f}, {3, -2.25f}}).ok());
    ASSERT_TRUE((*s)->CloseSequence(seq).ok());
  }
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto chunks = (*s)->ListChunks(seq, 0);
  ASSERT_TRUE(chunks.ok());
  ASSERT_EQ(chunks->size(), 5u);
  EXPECT_EQ((*chunks)[0].score, 0.5f);
  EXPECT_EQ((*chunks)[1].score, 0.0f);
  EXPECT_EQ((*chunks)[3].score, -2.25f);
}

TEST(TieredStore, ObserveQueriesAccumulatesLocalAttention) {
  StoreOptions o = SmallOptions("");
  o.geometry = Geometry{1, 2, 1, 4, DType::kF32};
  o.n_sink = 0;
  o.n_local = 4;
  o.chunk_size = 4;
  o.repr_topk = 1;
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  auto seq = st->CreateSequence();
  std::vector<float> k(16, 0.0f), v(16, 1.0f);
  for (int t = 0; t < 4; ++t) k[t * 4 + t] = 1.0f;
  ASSERT_TRUE(st->Append(*seq, 0, k.data(), v.data(), 4, DType::kF32).ok());
  // A query pointing at token 1's key, at position 3 (sees tokens 0..3).
  std::vector<float> q{0, 8, 0, 0, 0, 8, 0, 0};  // two q heads, one kv head
  int64_t pos = 3;
  ASSERT_TRUE(ObserveQueries(*st, *seq, 0, q.data(), &pos, 1).ok());
  std::vector<float> k3(8 * 4, 0.0f), v3(8 * 4, 0.0f);
  ASSERT_TRUE(st->Append(*seq, 0, k3.data(), v3.data(), 8, DType::kF32).ok());
  std::vector<float> repr(4);
  ASSERT_TRUE(st->GetRepresentatives(ChunkKey{*seq, 0, 0}, repr.data()).ok());
  EXPECT_EQ(repr, (std::vector<float>{0, 1, 0, 0}));
}

TEST(TieredStore, ReopenRecoversClosedSequencesBitForBit) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  o.write_through = false;  // chunks reach cold by demotion or at close
  SequenceId a = 0, b = 0;
  {
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok());
    a = *(*s)->CreateSequence();
    b = *(*s)->CreateSequence();
    for (int l = 0; l < 2; ++l) {
      AppendPattern(s->get(), a, l, 11, 0, 333, 7);
      AppendPattern(s->get(), b, l, 12, 0, 20, 7);  // still inside sinks + local
    }
    ASSERT_TRUE((*s)->CloseSequence(a).ok());
    ASSERT_TRUE((*s)->CloseSequence(b).ok());
  }
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->ListSequences(), (std::vector<SequenceId>{a, b}));
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(*(*s)->SequenceLength(a, l), 333);
    ExpectPattern(s->get(), a, l, 11, 0, 333);
    ExpectPattern(s->get(), b, l, 12, 0, 20);
  }
  // Representatives came back too, and attention can run on the recovered view.
  auto view = GetHotView(**s, a, 0);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->n_tokens, 333);
  auto h = (*s)->FetchChunks(a, 0, {0, 3});
  ASSERT_TRUE(h.ok() && h->Wait().ok());
  // A new sequence gets a fresh id.
  auto c = (*s)->CreateSequence();
  ASSERT_TRUE(c.ok());
  EXPECT_GT(*c, b);
}

TEST(TieredStore, DropChunksRemovesThemFromEveryTierForGood) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  SequenceId seq = 0;
  {
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok());
    TieredStore* st = s->get();
    seq = *st->CreateSequence();
    AppendPattern(st, seq, 0, 5, 0, 8 + 32 + 8 * 20, 13);  // 19 chunks sealed: warm holds 8, the rest cold
    AppendPattern(st, seq, 1, 6, 0, 8 + 32 + 8 * 20, 13);
    ASSERT_TRUE(st->WaitForDurable().ok());
    // A live pin refuses the drop, and nothing is dropped.
    auto h = st->FetchChunks(seq, 0, {3});
    ASSERT_TRUE(h.ok() && h->Wait().ok());
    Status pinned = st->DropChunks(seq, 0, {2, 3});
    EXPECT_EQ(pinned.code(), StatusCode::kFailedPrecondition) << pinned.ToString();
    EXPECT_NE(pinned.message().find("pinned"), std::string::npos);
    ExpectPattern(st, seq, 0, 5, 8 + 2 * 8, 8 + 4 * 8);
    h->Release();
    EXPECT_EQ(st->DropChunks(seq, 0, {19}).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(st->DropChunks(seq, 2, {0}).code(), StatusCode::kInvalidArgument);
    const StoreCounters c0 = st->counters();
    Status dropped = st->DropChunks(seq, 0, {2, 3, 18});  // 2, 3 cold; 18 warm
    ASSERT_TRUE(dropped.ok()) << dropped.ToString();
    ASSERT_TRUE(st->DropChunks(seq, 0, {3}).ok());  // again: ignored
    EXPECT_EQ(st->counters().dropped_chunks - c0.dropped_chunks, 3u);
    EXPECT_EQ(st->counters().cold_chunks, c0.cold_chunks - 3);  // write-through: all three were on disk
    EXPECT_EQ(*st->ChunkCount(seq, 0), 19u);                    // indices stay: the dropped ones are holes
    auto refused = st->FetchChunks(seq, 0, {1, 2});
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    std::vector<uint8_t> k(8 * TokenBytes(o)), v(k.size());
    Status gone = st->ReadTokens(seq, 0, 8 + 2 * 8, 8 + 3 * 8, k.data(), v.data());
    EXPECT_EQ(gone.code(), StatusCode::kNotFound);
    EXPECT_NE(gone.message().find("dropped"), std::string::npos);
    // Neighbours and the other layer are untouched.
    ExpectPattern(st, seq, 0, 5, 0, 8 + 2 * 8);
    ExpectPattern(st, seq, 0, 5, 8 + 4 * 8, 8 + 18 * 8);
    ExpectPattern(st, seq, 0, 5, 8 + 19 * 8, 8 + 32 + 8 * 20);
    ExpectPattern(st, seq, 1, 6, 0, 8 + 32 + 8 * 20);
    ASSERT_TRUE(st->CloseSequence(seq).ok());
  }
  // Reopened: the dropped chunks stay dropped; the rest is intact.
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::vector<uint8_t> k(8 * TokenBytes(o)), v(k.size());
  EXPECT_EQ((*s)->ReadTokens(seq, 0, 8 + 3 * 8, 8 + 4 * 8, k.data(), v.data()).code(), StatusCode::kNotFound);
  EXPECT_EQ((*s)->ReadTokens(seq, 0, 8 + 18 * 8, 8 + 19 * 8, k.data(), v.data()).code(),
            StatusCode::kNotFound);
  ExpectPattern(s->get(), seq, 0, 5, 8 + 4 * 8, 8 + 18 * 8);
  ExpectPattern(s->get(), seq, 1, 6, 0, 8 + 32 + 8 * 20);
}

TEST(TieredStore, ReopenWithAnotherGeometryIsRejected) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  {
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok());
  }
  o.geometry.head_dim = 32;
  auto s = TieredStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("geometry"), std::string::npos) << s.status().ToString();
}

TEST(TieredStore, ConcurrentSequencesWithTinyTiers) {
  TempDir dir;
  StoreOptions o = SmallOptions(dir.path());
  o.warm_bytes = 4 * o.chunk_bytes();
  o.hot_bytes = 8 * o.chunk_bytes();
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok());
  TieredStore* st = s->get();
  std::vector<SequenceId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(*st->CreateSequence());
  std::vector<std::thread> th;
  const size_t tb = TokenBytes(o);
  const size_t half = static_cast<size_t>(o.chunk_size) * tb;
  for (int i = 0; i < 4; ++i)
    th.emplace_back([&, i] {
      for (int l = 0; l < 2; ++l) AppendPattern(st, ids[i], l, 100 + i, 0, 500, 3 + i * 5);
      // Four fetches of one chunk each fit the eight hot slots: every one must succeed and
      // bring its own sequence's bytes, whatever the others are doing.
      auto h = st->FetchChunks(ids[i], 0, {1});
      ASSERT_TRUE(h.ok()) << "sequence " << i << ": " << h.status().ToString();
      Status w = h->Wait();
      ASSERT_TRUE(w.ok()) << "sequence " << i << ": " << w.ToString();
      ASSERT_EQ(h->spans().size(), 1u);
      const kernels::KvSpan& span = h->spans()[0];
      EXPECT_EQ(span.first_position, o.n_sink + o.chunk_size);
      std::vector<uint8_t> ek(half), ev(half);
      FillPattern(kSalt, 100 + i, 0, 0, span.first_position, o.chunk_size, tb, ek.data());
      FillPattern(kSalt, 100 + i, 0, 1, span.first_position, o.chunk_size, tb, ev.data());
      EXPECT_EQ(0, std::memcmp(span.k, ek.data(), half)) << "K of the chunk fetched for sequence " << i;
      EXPECT_EQ(0, std::memcmp(span.v, ev.data(), half)) << "V of the chunk fetched for sequence " << i;
    });
  for (auto& t : th) t.join();
  for (int i = 0; i < 4; ++i)
    for (int l = 0; l < 2; ++l) ExpectPattern(st, ids[i], l, 100 + i, 0, 500);
}

}  // namespace
}  // namespace kvtier
