// The bytes a layer step reads, by part (AttendStats::first_stage_bytes, rescoring_bytes,
// attention_bytes; the fetch's from the store's loads), against a hand computation on a small
// geometry: 2 layers, 2 kv heads, head_dim 64, fp16, chunks of 32 tokens, 4 representatives.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/dtype.h"
#include "kvtier/kvtier.h"
#include "offload/tiered_store.h"

namespace kvtier {
namespace {

constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kDim = 64, kChunk = 32, kRepr = 4;
constexpr int kSinks = 32, kLocal = 64;
// By hand, per chunk and layer: the int8 screen reads 2 heads x 4 representatives x (64 codes +
// a code scale and a cosine scale of 4 bytes each); the rescoring 2 x 4 x (64 fp16 elements +
// an inverse norm of 4 bytes); a token's K and V are 2 x 2 heads x 64 x 2 bytes.
constexpr uint64_t kScreenPerChunk = 2 * 4 * (64 + 8);       // 576
constexpr uint64_t kRescorePerChunk = 2 * 4 * (64 * 2 + 4);  // 1056
constexpr uint64_t kKvPerToken = 2 * 2 * 64 * 2;             // 512
constexpr uint64_t kChunkBytes = kChunk * kKvPerToken;       // 16384

StoreOptions SmallStore() {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, DType::kF16};
  so.n_sink = kSinks;
  so.n_local = kLocal;
  so.chunk_size = kChunk;
  so.repr_topk = kRepr;
  so.hot_bytes = 64 * so.chunk_bytes();
  so.warm_bytes = 256 * so.chunk_bytes();
  so.data_dir = "";
  return so;
}

// Appends `m` tokens at `p0` to every layer and attends them (a prefill window or, m = 1, a
// decode step); returns the last layer step's stats per layer.
// With `same_query` every step's queries are one fixed draw (a probe that stays put).
std::vector<AttendStats> Step(Session* s, int64_t p0, int m, bool decode, bool same_query = false) {
  std::vector<AttendStats> stats(kLayers);
  EXPECT_TRUE(s->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill).ok());
  std::vector<int64_t> pos(static_cast<size_t>(m));
  for (int t = 0; t < m; ++t) pos[static_cast<size_t>(t)] = p0 + t;
  for (int l = 0; l < kLayers; ++l) {
    std::mt19937 rng(static_cast<uint32_t>(p0 * 31 + l));
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> k(static_cast<size_t>(m) * kKvHeads * kDim), v(k.size()),
        q(static_cast<size_t>(m) * kQHeads * kDim), out(q.size());
    for (float& x : k) x = n(rng);
    for (float& x : v) x = n(rng);
    std::mt19937 q_rng(static_cast<uint32_t>(l + 7));
    for (float& x : q) x = same_query ? n(q_rng) : n(rng);
    std::vector<uint16_t> kh(k.size()), vh(v.size());
    FromFloat(DType::kF16, k.data(), kh.data(), k.size());
    FromFloat(DType::kF16, v.data(), vh.data(), v.size());
    EXPECT_TRUE(s->Append(l, kh.data(), vh.data(), m, DType::kF16).ok());
    const Status st = s->Attend(l, q.data(), pos.data(), m, out.data(), &stats[static_cast<size_t>(l)]);
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  return stats;
}

uint64_t Loads(const StoreCounters& c) { return c.warm_loads + c.cold_loads + c.remote_loads; }

// rerank_min above the chunk count makes the rescoring take every chunk: the number of chunks
// screened and rescored are both the layer's chunk count, the number attended the grant.
TEST(StepBytes, EachPartMatchesAHandComputation) {
  auto store = TieredStore::Open(SmallStore());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore* ts = store->get();
  SessionOptions so;
  so.retrieval.budget_tokens = 4 * kChunk;  // 4 chunks a layer
  so.retrieval.alloc = "topk";
  so.retrieval.index = "Exact:heads=max,rerank=1,rerank_min=100000";
  auto session = Session::Open(ts, so);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  Session* s = session->get();
  constexpr int64_t kPrefill = 1024;
  for (int64_t b = 0; b < kPrefill; b += 128) Step(s, b, 128, false);
  const SessionCounters c0 = s->counters();
  ts->EvictHot();  // every chunk the decode step attends is fetched: promoted into a hot slot
  const StoreCounters before = ts->counters();
  const std::vector<AttendStats> stats = Step(s, kPrefill, 1, true);
  const StoreCounters after = ts->counters();
  const SessionCounters c1 = s->counters();
  const int64_t held = kPrefill + 1;  // tokens each layer holds
  uint64_t first = 0, rescore = 0, attention = 0, attended_chunks = 0;
  for (int l = 0; l < kLayers; ++l) {
    auto chunks = ts->ChunkCount(s->sequence(), l);
    ASSERT_TRUE(chunks.ok());
    const uint64_t n = *chunks;  // screened and rescored
    // Sinks + sealed chunks + local window hold every token: (1025 - 32 - 64) / 32 chunks at most.
    ASSERT_GE(n, 25u);
    ASSERT_LE(n, 29u);
    const AttendStats& st = stats[static_cast<size_t>(l)];
    ASSERT_EQ(st.chunks, 4u);
    EXPECT_EQ(st.first_stage_bytes, n * kScreenPerChunk) << "layer " << l << ", " << n << " chunks";
    EXPECT_EQ(st.rescoring_bytes, n * kRescorePerChunk) << "layer " << l;
    // Attended: every token but those of the chunks not retrieved.
    const uint64_t tokens = static_cast<uint64_t>(held) - (n - st.chunks) * kChunk;
    EXPECT_EQ(st.attention_bytes, tokens * kKvPerToken) << "layer " << l;
    first += st.first_stage_bytes;
    rescore += st.rescoring_bytes;
    attention += st.attention_bytes;
    attended_chunks += st.chunks;
  }
  // The fetch (what `kvtier run` counts): the chunks promoted into hot slots times a chunk's K/V.
  EXPECT_EQ((Loads(after) - Loads(before)) * SmallStore().chunk_bytes(), attended_chunks * kChunkBytes);
  // The session's totals are the layer steps' sums.
  EXPECT_EQ(c1.first_stage_bytes - c0.first_stage_bytes, first);
  EXPECT_EQ(c1.rescoring_bytes - c0.rescoring_bytes, rescore);
  EXPECT_EQ(c1.attention_bytes - c0.attention_bytes, attention);
}

// With the default search the rescoring takes what the screen's bound cannot rule out: at least
// the grant, at most every chunk, a whole number of chunks.
TEST(StepBytes, TheDefaultSearchRescoresBetweenTheGrantAndEveryChunk) {
  auto store = TieredStore::Open(SmallStore());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore* ts = store->get();
  SessionOptions so;
  so.retrieval.budget_tokens = 4 * kChunk;
  auto session = Session::Open(ts, so);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  Session* s = session->get();
  for (int64_t b = 0; b < 1024; b += 128) Step(s, b, 128, false);
  const std::vector<AttendStats> stats = Step(s, 1024, 1, true);
  for (int l = 0; l < kLayers; ++l) {
    const uint64_t n = *ts->ChunkCount(s->sequence(), l);
    const AttendStats& st = stats[static_cast<size_t>(l)];
    EXPECT_EQ(st.first_stage_bytes, n * kScreenPerChunk);
    EXPECT_EQ(st.rescoring_bytes % kRescorePerChunk, 0u);
    EXPECT_GE(st.rescoring_bytes, st.chunks * kRescorePerChunk);
    EXPECT_LE(st.rescoring_bytes, n * kRescorePerChunk);
  }
}

// A sliced step (screen_period 4) screens ceil(n / 4) rows, in whole blocks of 8, from row 0
// after the full screen of the first decode step; a reused step screens nothing and rescores
// the shortlist (its second reuse gathers the shortlist once, then scores the copy).
TEST(StepBytes, ASliceAndAReuseReadWhatTheyScore) {
  for (const bool reuse : {false, true}) {
    SCOPED_TRACE(reuse ? "reuse" : "slice");
    auto store = TieredStore::Open(SmallStore());
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    TieredStore* ts = store->get();
    SessionOptions so;
    so.retrieval.budget_tokens = 4 * kChunk;
    if (reuse) {
      so.retrieval.reuse_cosine = 0.5;
      so.retrieval.alloc = "topk";  // a grant of 4 chunks every step: a shortlist of 12
    } else {
      so.retrieval.screen_period = 4;
    }
    auto session = Session::Open(ts, so);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    Session* s = session->get();
    for (int64_t b = 0; b < 1024; b += 128) Step(s, b, 128, false, true);
    // Decode steps 1024..1027: no chunk seals (the ring holds 64 tokens and seals 32 at a time
    // once it overflows; 1024 - 32 = 992 tokens are 31 chunks, so the next seal is at 1024 + 32).
    std::vector<std::vector<AttendStats>> steps;
    std::vector<uint64_t> n(kLayers);
    for (int64_t p = 1024; p < 1027; ++p) steps.push_back(Step(s, p, 1, true, true));
    for (int l = 0; l < kLayers; ++l) n[static_cast<size_t>(l)] = *ts->ChunkCount(s->sequence(), l);
    for (int l = 0; l < kLayers; ++l) {
      const uint64_t chunks = n[static_cast<size_t>(l)];
      const AttendStats& first = steps[0][static_cast<size_t>(l)];
      EXPECT_FALSE(first.sliced || first.reused);
      EXPECT_EQ(first.first_stage_bytes, chunks * kScreenPerChunk);
      const AttendStats& second = steps[1][static_cast<size_t>(l)];
      const AttendStats& third = steps[2][static_cast<size_t>(l)];
      if (!reuse) {
        ASSERT_TRUE(second.sliced) << "layer " << l;
        const uint64_t slice = std::min<uint64_t>(chunks, ((chunks + 3) / 4 + 7) / 8 * 8);
        EXPECT_EQ(second.first_stage_bytes, slice * kScreenPerChunk) << "layer " << l << ", " << chunks;
        EXPECT_GT(second.rescoring_bytes, 0u);
        EXPECT_EQ(second.rescoring_bytes % kRescorePerChunk, 0u);
      } else {
        ASSERT_TRUE(second.reused && third.reused) << "layer " << l;
        EXPECT_EQ(second.first_stage_bytes, 0u);
        EXPECT_EQ(third.first_stage_bytes, 0u);
        // The shortlist: three times the grant of 4 chunks, scored where it lies (second), then
        // copied and the copy scored (third): twice its bytes.
        EXPECT_EQ(second.rescoring_bytes, 12 * kRescorePerChunk) << "layer " << l;
        EXPECT_EQ(third.rescoring_bytes, 2 * 12 * kRescorePerChunk) << "layer " << l;
      }
    }
  }
}

// Without retrieval the step reads only the K/V it attends (sinks and local window).
TEST(StepBytes, WithoutRetrievalOnlyTheAttentionReads) {
  auto store = TieredStore::Open(SmallStore());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  SessionOptions so;
  so.retrieval.budget_tokens = 0;
  auto session = Session::Open(store->get(), so);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  Session* s = session->get();
  for (int64_t b = 0; b < 512; b += 128) Step(s, b, 128, false);
  const std::vector<AttendStats> stats = Step(s, 512, 1, true);
  for (int l = 0; l < kLayers; ++l) {
    const uint64_t n = *store->get()->ChunkCount(s->sequence(), l);
    const AttendStats& st = stats[static_cast<size_t>(l)];
    EXPECT_EQ(st.first_stage_bytes, 0u);
    EXPECT_EQ(st.rescoring_bytes, 0u);
    EXPECT_EQ(st.attention_bytes, (513 - n * kChunk) * kKvPerToken);
  }
}

}  // namespace
}  // namespace kvtier
