// The layer step's door (TieredStore::BeginLayerStep, offload/store/layer_step.cc): what a
// decode layer step costs in store visits and lock entries, and what the door returns.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/dtype.h"
#include "kvtier/kvtier.h"
#include "offload/tiered_store.h"
#include "tests/tiered_store_test_peer.h"

namespace kvtier {
namespace {

constexpr int kLayers = 3, kQHeads = 4, kKvHeads = 2, kDim = 16;

StoreOptions SmallStore() {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, DType::kF16};
  so.n_sink = 4;
  so.n_local = 8;
  so.chunk_size = 4;
  so.repr_topk = 2;
  so.hot_bytes = 64 * so.chunk_bytes();
  so.warm_bytes = 1024 * so.chunk_bytes();
  so.data_dir = "";  // no lower tier: no write-through takes the lock on a transfer thread
  return so;
}

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
    for (int i = 0; i < kKvHeads * kDim; ++i) {
      kf.push_back(n(rng) + (p >= 40 && p < 44 ? 3.0f * std::sin(0.3f * static_cast<float>(i)) : 0.0f));
      vf.push_back(n(rng));
    }
    for (int i = 0; i < kQHeads * kDim; ++i)
      w.q.push_back(n(rng) + 3.0f * std::sin(0.3f * static_cast<float>(i % (kKvHeads * kDim))));
    w.pos.push_back(p);
  }
  w.k.resize(kf.size());
  w.v.resize(vf.size());
  FromFloat(DType::kF16, kf.data(), w.k.data(), kf.size());
  FromFloat(DType::kF16, vf.data(), w.v.data(), vf.size());
  return w;
}

// The rule: a decode layer step (Session::Attend, retrieval on) makes at most 2 store visits
// (BeginLayerStep, FetchChunks) and 3 lock entries (those two, and the fetch handle's
// release) when every chunk it fetches is hot already: the steady state. A step that fetches
// a chunk not yet hot takes the lock again to copy it in (RunFetch) and to wait for it; a
// prefill window also observes statistics; neither is counted here. Appends (and the
// sealing they do) are the step's other calls, outside Attend.
TEST(LayerStep, ADecodeLayerStepMakesAtMostTwoVisitsAndThreeLockEntries) {
  auto opened = TieredStore::Open(SmallStore());
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TieredStore* store = opened->get();
  SessionOptions so;
  so.retrieval.budget_tokens = 16;
  auto session = Session::Open(store, so);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  Session* s = session->get();
  constexpr int64_t kPrefill = 96, kTokens = 160;
  int steady = 0, with_chunks = 0;
  uint64_t max_visits = 0, max_locks = 0;
  for (int64_t b = 0; b < kTokens;) {
    const bool decode = b >= kPrefill;
    const int m = decode ? 1 : 8;
    ASSERT_TRUE(s->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill).ok());
    for (int l = 0; l < kLayers; ++l) {
      const Window w = MakeWindow(l, b, m);
      ASSERT_TRUE(s->Append(l, w.k.data(), w.v.data(), m, DType::kF16).ok());
      std::vector<float> out(static_cast<size_t>(m) * kQHeads * kDim);
      const uint64_t misses = store->counters().misses;
      const uint64_t v0 = TieredStoreTestPeer::Visits(*store);
      const uint64_t l0 = TieredStoreTestPeer::LockEntries(*store);
      AttendStats stats;
      ASSERT_TRUE(s->Attend(l, w.q.data(), w.pos.data(), m, out.data(), &stats).ok());
      const uint64_t visits = TieredStoreTestPeer::Visits(*store) - v0;
      const uint64_t locks = TieredStoreTestPeer::LockEntries(*store) - l0;
      if (!decode || store->counters().misses != misses) continue;
      steady++;
      with_chunks += stats.chunks > 0;
      max_visits = std::max(max_visits, visits);
      max_locks = std::max(max_locks, locks);
      EXPECT_LE(visits, 2u) << "position " << b << " layer " << l;
      EXPECT_LE(locks, 3u) << "position " << b << " layer " << l;
    }
    b += m;
  }
  // Most decode layer steps are steady, and they did fetch chunks (a fetch of none would
  // prove nothing about the fetch and its release).
  EXPECT_GT(steady, (kTokens - kPrefill) * kLayers / 2);
  EXPECT_GT(with_chunks, steady / 2);
  EXPECT_EQ(max_visits, 2u);
  EXPECT_EQ(max_locks, 3u);
}

TEST(LayerStep, TheDoorLandsTheLayerAndHandsOverItsChangesFromTheCursor) {
  auto opened = TieredStore::Open(SmallStore());
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TieredStore* store = opened->get();
  auto seq = store->CreateSequence();
  ASSERT_TRUE(seq.ok());
  // 4 sinks, 7 chunks sealed, 9 tokens in the local window.
  const Window w = MakeWindow(0, 0, 41);
  ASSERT_TRUE(store->Append(*seq, 0, w.k.data(), w.v.data(), 41, DType::kF16).ok());
  LayerStepView step;
  ChunkUpdate updates;
  ChunkCursor cursor;
  ASSERT_TRUE(store->BeginLayerStep(*seq, 0, &cursor, &updates, &step).ok());
  EXPECT_TRUE(step.background.ok());
  EXPECT_EQ(step.hot.n_tokens, 41);
  EXPECT_EQ(step.hot.sinks.n_tokens, 4);
  int local = 0;
  for (int i = 0; i < step.hot.n_local_spans; ++i) local += step.hot.local[i].n_tokens;
  EXPECT_EQ(local, 9);
  EXPECT_EQ(updates.added, (std::vector<uint64_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(updates.repr.size(), 7u * 2 * kKvHeads * kDim);
  EXPECT_EQ(updates.next.chunks, 7u);
  EXPECT_TRUE(updates.complete);
  // The same as the change feed gives, and a later call from the next cursor brings only
  // what changed since: a drop here.
  ChunkUpdate feed;
  ASSERT_TRUE(store->ChunkUpdatesSince(*seq, 0, cursor, &feed).ok());
  EXPECT_EQ(feed.added, updates.added);
  EXPECT_EQ(feed.repr, updates.repr);
  ASSERT_TRUE(store->DropChunks(*seq, 0, {2}).ok());
  cursor = updates.next;
  ASSERT_TRUE(store->BeginLayerStep(*seq, 0, &cursor, &updates, &step, 1).ok());
  EXPECT_TRUE(updates.added.empty());
  EXPECT_EQ(updates.dropped, (std::vector<uint64_t>{2}));
  EXPECT_EQ(updates.since.chunks, 7u);
  // Without a cursor: the hot view alone. Bad calls name what was wrong.
  ASSERT_TRUE(store->BeginLayerStep(*seq, 0, nullptr, nullptr, &step).ok());
  EXPECT_EQ(store->BeginLayerStep(*seq, 0, &cursor, nullptr, &step).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->BeginLayerStep(*seq, kLayers, nullptr, nullptr, &step).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store->BeginLayerStep(*seq + 1, 0, nullptr, nullptr, &step).code(), StatusCode::kNotFound);
  ChunkCursor past{100, 0};
  EXPECT_EQ(store->BeginLayerStep(*seq, 0, &past, &updates, &step).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
