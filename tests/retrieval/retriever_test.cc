#include "retrieval/retriever.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "integration/retriever_flags.h"
#include "integration/workload.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/dot.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

StoreOptions Options(const std::string& dir) {
  StoreOptions o;
  o.geometry = Geometry{3, 4, 2, 16, DType::kF32};
  o.n_sink = 4;
  o.n_local = 16;
  o.chunk_size = 4;
  o.repr_topk = 2;
  o.hot_bytes = 512 * o.chunk_bytes();
  o.warm_bytes = 16 * o.chunk_bytes();
  o.data_dir = dir;
  return o;
}

// Fills a store with `n` tokens of random K/V per layer and returns the K/V.
std::vector<std::vector<float>> Fill(TieredStore* s, SequenceId seq, int n, uint64_t seed,
                                     std::vector<std::vector<float>>* vs) {
  const Geometry& g = s->options().geometry;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::vector<float>> ks(g.layers);
  vs->assign(g.layers, {});
  for (int l = 0; l < g.layers; ++l) {
    ks[l].resize(static_cast<size_t>(n) * g.token_elems());
    (*vs)[l].resize(ks[l].size());
    for (auto& x : ks[l]) x = nd(rng);
    for (auto& x : (*vs)[l]) x = nd(rng);
    EXPECT_TRUE(s->Append(seq, l, ks[l].data(), (*vs)[l].data(), n, DType::kF32).ok());
  }
  return ks;
}

TEST(Retriever, BudgetCoveringEveryChunkEqualsFullAttention) {
  for (const char* alloc : {"topk", "entropy"})
    for (const char* probe : {"act", "mean"})
      for (const char* index : {"Exact", "Flat"}) {
        TempDir dir;
        auto store = TieredStore::Open(Options(dir.path()));
        ASSERT_TRUE(store.ok());
        TieredStore* s = store->get();
        const Geometry& g = s->options().geometry;
        SequenceId seq = *s->CreateSequence();
        const int n = 4 + 16 + 4 * 30 + 3;  // 30 chunks
        std::vector<std::vector<float>> vs;
        auto ks = Fill(s, seq, n, 7, &vs);
        RetrieverOptions ro;
        ro.probe = probe;
        ro.alloc = alloc;
        ro.index = index;
        // k = 4x the chunks: topk takes them all, and entropy's share of
        // L x k for every layer exceeds what the layer has.
        ro.budget_tokens = 4 * 30 * 4;
        auto r = Retriever::Create(s, ro);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        std::mt19937 rng(3);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim);
        for (auto& x : q) x = nd(rng);
        const int64_t pos = n - 1;
        (*r)->BeginStep();
        for (int l = 0; l < g.layers; ++l) {
          auto sel = (*r)->Select(seq, l, q.data(), 1, true);
          ASSERT_TRUE(sel.ok()) << sel.status().ToString();
          ASSERT_EQ(sel->chunks.size(), 30u) << alloc << " " << probe << " " << index << " layer " << l;
          auto h = s->FetchChunks(seq, l, sel->chunks);
          ASSERT_TRUE(h.ok() && h->Wait().ok());
          auto view = GetHotView(*s, seq, l);
          std::vector<kernels::KvSpan> parts{view->sinks};
          for (auto& sp : h->spans()) parts.push_back(sp);
          for (int i = 0; i < view->n_local_spans; ++i) parts.push_back(view->local[i]);
          std::vector<float> out(q.size()), full(q.size());
          kernels::AttentionParams p;
          p.q_heads = g.q_heads;
          p.kv_heads = g.kv_heads;
          p.head_dim = g.head_dim;
          p.dtype = DType::kF32;
          p.n_queries = 1;
          p.q = q.data();
          p.q_positions = &pos;
          p.parts = parts.data();
          p.n_parts = static_cast<int>(parts.size());
          p.out = out.data();
          ASSERT_EQ(kernels::Attention(p), kernels::KernelError::kOk);
          kernels::KvSpan all{ks[l].data(), vs[l].data(), n, 0, nullptr};
          p.parts = &all;
          p.n_parts = 1;
          p.out = full.data();
          ASSERT_EQ(kernels::Attention(p), kernels::KernelError::kOk);
          double num = 0, den = 0;
          for (size_t i = 0; i < out.size(); ++i) {
            num += (out[i] - full[i]) * (out[i] - full[i]);
            den += full[i] * full[i];
          }
          EXPECT_LT(std::sqrt(num / den), 1e-5) << alloc << " " << probe << " " << index;
        }
      }
}

// Exact scoring: a chunk scores the best representative per kv head, summed
// over heads; a mean over representatives would rank these two chunks the
// other way round.
// One layer of two 2-token chunks holding keys `k` ([4 tokens, kv_heads, head_dim]; values
// zero), then 4 zero tokens that stay in the local window: hand-computed scoring examples.
std::unique_ptr<TieredStore> TwoChunkStore(const Geometry& g, std::vector<float> k, SequenceId* seq) {
  StoreOptions o = Options("");
  o.geometry = g;
  o.n_sink = 0;
  o.n_local = 2;
  o.chunk_size = 2;
  o.repr_topk = 2;
  auto store = TieredStore::Open(o);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  if (!store.ok()) return nullptr;
  *seq = *(*store)->CreateSequence();
  k.resize(static_cast<size_t>(8) * g.token_elems(), 0.0f);
  std::vector<float> v(k.size(), 0.0f);
  EXPECT_TRUE((*store)->Append(*seq, 0, k.data(), v.data(), 8, DType::kF32).ok());
  EXPECT_EQ(*(*store)->ChunkCount(*seq, 0), 2u);
  return std::move(*store);
}

// The chunks one decode step with query q picks on layer 0 under `ro`.
std::vector<uint64_t> DecodeSelect(TieredStore* s, SequenceId seq, const RetrieverOptions& ro,
                                   const std::vector<float>& q) {
  auto r = Retriever::Create(s, ro);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return {};
  (*r)->BeginStep();
  auto sel = (*r)->Select(seq, 0, q.data(), 1, true);
  EXPECT_TRUE(sel.ok()) << sel.status().ToString();
  return sel.ok() ? sel->chunks : std::vector<uint64_t>{};
}

TEST(Retriever, GrantsBeyondTheHotPoolAreCountedAsClipped) {
  // k far above the pool: both allocators grant every one of the 30 chunks; the pool of 8
  // chunks takes the best 8 and the other 22 are reported, not silently dropped.
  for (const char* alloc : {"topk", "entropy"}) {
    TempDir dir;
    StoreOptions o = Options(dir.path());
    o.hot_bytes = 8 * o.chunk_bytes();
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    TieredStore* s = store->get();
    const Geometry& g = s->options().geometry;
    SequenceId seq = *s->CreateSequence();
    std::vector<std::vector<float>> vs;
    Fill(s, seq, 4 + 16 + 4 * 30 + 3, 7, &vs);  // 30 chunks
    RetrieverOptions ro;
    ro.alloc = alloc;
    ro.budget_tokens = 4 * 30 * 4;
    auto r = Retriever::Create(s, ro);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim, 0.5f);
    (*r)->BeginStep();
    for (int l = 0; l < g.layers; ++l) {
      auto sel = (*r)->Select(seq, l, q.data(), 1, true);
      ASSERT_TRUE(sel.ok()) << sel.status().ToString();
      EXPECT_EQ(sel->chunks.size(), 8u) << alloc << " layer " << l;
      EXPECT_EQ(sel->clipped, 22u) << alloc << " layer " << l;
    }
  }
}

TEST(Retriever, ExactScoresTheBestRepresentativePerHead) {
  // chunk 0: keys (3,0) and (-3,0): one strong match, mean 0.
  // chunk 1: keys (1,0) and (1,0): mean (1,0), best 1.
  SequenceId seq = 0;
  auto store = TwoChunkStore(Geometry{1, 1, 1, 2, DType::kF32}, {3, 0, -3, 0, 1, 0, 1, 0}, &seq);
  ASSERT_NE(store, nullptr);
  RetrieverOptions ro;
  ro.probe = "mean";
  ro.alloc = "topk";
  ro.budget_tokens = 2;  // k = 1
  const std::vector<float> q{1, 0};
  EXPECT_EQ(DecodeSelect(store.get(), seq, ro, q), (std::vector<uint64_t>{0}));
  ro.index = "Flat";  // InfLLM's mean: chunk 1 wins
  EXPECT_EQ(DecodeSelect(store.get(), seq, ro, q), (std::vector<uint64_t>{1}));
}

TEST(Retriever, TiedChunksGoToTheSmallerIndexFirst) {
  // Both chunks hold (1,0) twice: every score ties, in both search stages and in a single
  // pass, and the smaller chunk index must win and come first. With q = (0,1) every dot is
  // +0 or -0, which compare equal and must tie too.
  SequenceId seq = 0;
  auto store = TwoChunkStore(Geometry{1, 1, 1, 2, DType::kF32}, {1, 0, 1, 0, 1, 0, 1, 0}, &seq);
  ASSERT_NE(store, nullptr);
  for (const char* alloc : {"topk", "entropy"})
    for (int rerank : {0, 1, 4})
      for (const std::vector<float>& q :
           {std::vector<float>{1, 0}, std::vector<float>{0, 1}, std::vector<float>{0, -1}}) {
        RetrieverOptions ro;
        ro.probe = "mean";
        ro.alloc = alloc;
        ro.index = "Exact:rerank=" + std::to_string(rerank) + ",rerank_min=0";
        ro.budget_tokens = 2;  // k = 1
        const std::string what = std::string(alloc) + " rerank " + std::to_string(rerank) + " q (" +
                                 std::to_string(q[0]) + "," + std::to_string(q[1]) + ")";
        if (std::string(alloc) == "topk") {
          EXPECT_EQ(DecodeSelect(store.get(), seq, ro, q), (std::vector<uint64_t>{0})) << what;
        }
        ro.budget_tokens = 4;  // k = 2
        EXPECT_EQ(DecodeSelect(store.get(), seq, ro, q), (std::vector<uint64_t>{0, 1})) << what;
      }
}

// The two-stage search (int8 first pass over every chunk, fp32 rescoring of the
// best candidates) must choose what the single fp32 pass chooses when the
// candidates are generous, and a planted chunk must survive a tight candidate
// set of its own size.
TEST(Retriever, TwoStageSearchMatchesTheFullPass) {
  for (const char* alloc : {"topk", "entropy"}) {
    TempDir dir;
    StoreOptions o = Options(dir.path());
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok());
    TieredStore* s = store->get();
    const Geometry& g = s->options().geometry;
    SequenceId seq = *s->CreateSequence();
    const int n = 4 + 16 + 4 * 200 + 3;  // 200 chunks
    std::vector<std::vector<float>> vs;
    auto ks = Fill(s, seq, n, 11, &vs);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim);
    for (auto& x : q) x = nd(rng);
    auto select = [&](int rerank_factor, int rerank_min) {
      RetrieverOptions ro;
      ro.probe = "mean";
      ro.alloc = alloc;
      ro.budget_tokens = 8 * 4;  // k = 8 chunks
      ro.index =
          "Exact:rerank=" + std::to_string(rerank_factor) + ",rerank_min=" + std::to_string(rerank_min);
      auto r = Retriever::Create(s, ro);
      EXPECT_TRUE(r.ok());
      std::vector<std::vector<uint64_t>> out;
      (*r)->BeginStep();
      for (int l = 0; l < g.layers; ++l) {
        auto sel = (*r)->Select(seq, l, q.data(), 1, true);
        EXPECT_TRUE(sel.ok()) << sel.status().ToString();
        out.push_back(sel->chunks);
      }
      return out;
    };
    const auto full = select(0, 0);
    EXPECT_EQ(select(4, 0), full) << alloc;     // 4x the take: the same chunks, same order
    EXPECT_EQ(select(1, 1000), full) << alloc;  // every chunk rescored
    for (const auto& layer : full) EXPECT_FALSE(layer.empty());
  }
}

TEST(Retriever, DroppedChunksAreNeverSelectedAgain) {
  for (const char* index : {"Exact", "Flat"}) {
    TempDir dir;
    auto store = TieredStore::Open(Options(dir.path()));
    ASSERT_TRUE(store.ok());
    TieredStore* s = store->get();
    const Geometry& g = s->options().geometry;
    SequenceId seq = *s->CreateSequence();
    std::vector<std::vector<float>> vs;
    Fill(s, seq, 4 + 16 + 4 * 30 + 3, 7, &vs);
    RetrieverOptions ro;
    ro.alloc = "topk";
    ro.index = index;
    ro.budget_tokens = 4 * 30 * 4;  // every chunk
    auto r = Retriever::Create(s, ro);
    ASSERT_TRUE(r.ok());
    std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim, 0.5f);
    (*r)->BeginStep();
    ASSERT_EQ((*r)->Select(seq, 0, q.data(), 1, true)->chunks.size(), 30u);
    const std::vector<uint64_t> gone{0, 7, 8, 29};
    ASSERT_TRUE(s->DropChunks(seq, 0, gone).ok());
    ASSERT_TRUE((*r)->Forget(seq, 0, gone).ok());
    (*r)->BeginStep();
    for (int l = 0; l < g.layers; ++l) {
      auto sel = (*r)->Select(seq, l, q.data(), 1, true);
      ASSERT_TRUE(sel.ok());
      EXPECT_EQ(sel->chunks.size(), l == 0 ? 26u : 30u) << index;
      if (l == 0) {
        for (uint64_t c : gone)
          EXPECT_EQ(std::count(sel->chunks.begin(), sel->chunks.end(), c), 0) << index << " chunk " << c;
      }
      auto h = s->FetchChunks(seq, l, sel->chunks);  // every chosen chunk still exists
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      ASSERT_TRUE(h->Wait().ok());
    }
    // The compacted index scores as one built afresh from the store (the int8 stage alone
    // deciding: exact_index_test checks the rows bit for bit).
    ro.budget_tokens = 5 * 4;
    ro.index = std::string(index) == "Exact" ? "Exact:rerank=1,rerank_min=0" : index;
    auto compacted = Retriever::Create(s, ro);
    ASSERT_TRUE(compacted.ok());
    (*compacted)->BeginStep();
    ASSERT_TRUE((*compacted)->Select(seq, 0, q.data(), 1, true).ok());  // indexes all 30 chunks
    ASSERT_TRUE(s->DropChunks(seq, 1, gone).ok());
    ASSERT_TRUE((*compacted)->Forget(seq, 0, gone).ok());
    ASSERT_TRUE((*compacted)->Forget(seq, 1, gone).ok());
    auto fresh = Retriever::Create(s, ro);
    ASSERT_TRUE(fresh.ok());
    (*compacted)->BeginStep();
    (*fresh)->BeginStep();
    for (int l = 0; l < g.layers; ++l) {
      auto a = (*compacted)->Select(seq, l, q.data(), 1, true);
      auto b = (*fresh)->Select(seq, l, q.data(), 1, true);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->chunks, b->chunks) << index << " layer " << l;
    }
  }
}

TEST(Retriever, EntropyBudgetNeverExceedsTheStepBudget) {
  TempDir dir;
  auto store = TieredStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  TieredStore* s = store->get();
  SequenceId seq = *s->CreateSequence();
  std::vector<std::vector<float>> vs;
  Fill(s, seq, 4 + 16 + 4 * 40, 11, &vs);
  RetrieverOptions ro;
  ro.alloc = "entropy";
  ro.budget_tokens = 5 * 4;  // k = 5 per layer, 15 per step
  auto r = Retriever::Create(s, ro);
  ASSERT_TRUE(r.ok());
  const Geometry& g = s->options().geometry;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(8) * g.q_heads * g.head_dim);
  for (int step = 0; step < 20; ++step) {
    for (auto& x : q) x = nd(rng) * (1 + step % 3);
    (*r)->BeginStep();
    size_t total = 0;
    for (int l = 0; l < g.layers; ++l) {
      auto sel = (*r)->Select(seq, l, q.data(), 8, false);
      ASSERT_TRUE(sel.ok()) << sel.status().ToString();
      EXPECT_GE(sel->chunks.size(), 1u);
      EXPECT_GT(sel->entropy, 0.0);
      total += sel->chunks.size();
    }
    EXPECT_LE(total, 15u);
  }
}

// reuse_cosine: a layer takes its last search's choice again while its probe stays within the
// cosine and no chunk landed or left; otherwise it searches, and a search's choice is always
// what a retriever without reuse chooses for the same probe.
TEST(Retriever, ReusesTheLastSearchOnlyWhileTheProbeStaysAndNothingLands) {
  // The host path, and the backend path (the "cpu" twins of the device selection).
  for (const bool on_backend : {false, true})
    for (const char* alloc : {"entropy:rank=logit", "topk"}) {
      SCOPED_TRACE(std::string(alloc) + (on_backend ? ", backend" : ", host"));
      TempDir dir;
      auto store = TieredStore::Open(Options(dir.path()));
      ASSERT_TRUE(store.ok());
      TieredStore* s = store->get();
      const Geometry& g = s->options().geometry;
      SequenceId seq = *s->CreateSequence();
      std::vector<std::vector<float>> vs;
      Fill(s, seq, 4 + 16 + 4 * 60 + 3, 13, &vs);
      RetrieverOptions ro;
      ro.probe = "mean";
      ro.alloc = alloc;
      ro.budget_tokens = 6 * 4;  // k = 6 chunks
      RetrieverOptions reusing = ro;
      reusing.reuse_cosine = 0.9;
      auto backend = [&]() -> std::unique_ptr<RetrievalBackend> {
        if (!on_backend) return nullptr;
        auto b = MakeRetrievalBackend("cpu");
        EXPECT_TRUE(b.ok()) << b.status().ToString();
        return b.ok() ? std::move(b).value() : nullptr;
      };
      auto r = Retriever::Create(s, reusing, backend());
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_EQ((*r)->backend() != nullptr, on_backend);
      EXPECT_NE((*r)->Describe().find(" reuse=0.9"), std::string::npos) << (*r)->Describe();
      // The reference: a retriever that searches at every step, fed the same steps.
      auto ref = Retriever::Create(s, ro, backend());
      ASSERT_TRUE(ref.ok());
      std::mt19937 rng(17);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      const size_t qn = static_cast<size_t>(g.q_heads) * g.head_dim;
      std::vector<float> q0(qn), far(qn), near(qn);
      for (auto& x : q0) x = nd(rng);
      for (auto& x : far) x = nd(rng);  // an independent probe: cosine about 0
      for (size_t i = 0; i < qn; ++i) near[i] = q0[i] + 0.05f * nd(rng);  // cosine about 0.999
      // One step over every layer; returns each layer's choice and whether it was reused.
      auto step = [&](Retriever* rt, const std::vector<float>& q) {
        std::vector<std::pair<std::vector<uint64_t>, bool>> out;
        rt->BeginStep();
        for (int l = 0; l < g.layers; ++l) {
          auto sel = rt->Select(seq, l, q.data(), 1, true);
          EXPECT_TRUE(sel.ok()) << sel.status().ToString();
          if (!sel.ok()) return out;
          EXPECT_FALSE(sel->chunks.empty());
          out.emplace_back(sel->chunks, sel->reused);
        }
        return out;
      };
      auto choices = [](const std::vector<std::pair<std::vector<uint64_t>, bool>>& v) {
        std::vector<std::vector<uint64_t>> c;
        for (const auto& [chunks, reused] : v) c.push_back(chunks);
        return c;
      };
      const auto first = step(r->get(), q0);
      const auto first_ref = step(ref->get(), q0);
      EXPECT_EQ(choices(first), choices(first_ref)) << alloc;
      for (const auto& [chunks, reused] : first) EXPECT_FALSE(reused) << alloc << ": nothing to reuse yet";
      // The same probe: every layer reuses the q0 search (its shortlist rescored for q0), with the
      // grant its entropy gets now (the running means of Eq. 12 moved): what a search for q0
      // itself chooses.
      const auto again = step(r->get(), q0);
      const auto again_ref = step(ref->get(), q0);
      for (const auto& [chunks, reused] : again) EXPECT_TRUE(reused) << alloc;
      EXPECT_EQ(choices(again), choices(again_ref)) << alloc;
      // The probe barely moved: every layer reuses, rescoring the shortlist for the new probe. With
      // topk (no entropy to differ) that is what a search for it chooses: its best are among the
      // q0 search's best three times the grant. The entropy reference is fed q0 again, so that
      // both allocators keep seeing the same entropies.
      const bool topk = std::string(alloc) == "topk";
      const auto moved_a_little = step(r->get(), near);
      const auto moved_a_little_ref = step(ref->get(), topk ? near : q0);
      for (int l = 0; l < g.layers; ++l) {
        EXPECT_TRUE(moved_a_little[l].second) << alloc << " layer " << l;
        EXPECT_EQ(moved_a_little[l].first.size(), moved_a_little_ref[l].first.size())
            << alloc << " layer " << l;
        if (topk) EXPECT_EQ(moved_a_little[l].first, moved_a_little_ref[l].first) << "layer " << l;
      }
      // Once more (the third reuse rescores the shortlist gathered by the second): the same.
      std::vector<float> nearer(qn);
      for (size_t i = 0; i < qn; ++i) nearer[i] = q0[i] + 0.03f * nd(rng);
      const auto moved_again = step(r->get(), nearer);
      const auto moved_again_ref = step(ref->get(), topk ? nearer : q0);
      for (int l = 0; l < g.layers; ++l) {
        EXPECT_TRUE(moved_again[l].second) << alloc << " layer " << l;
        if (topk) EXPECT_EQ(moved_again[l].first, moved_again_ref[l].first) << "layer " << l;
      }
      // The probe moved: every layer searches, and chooses what the reference chooses.
      const auto moved = step(r->get(), far);
      const auto moved_ref = step(ref->get(), far);
      for (const auto& [chunks, reused] : moved) EXPECT_FALSE(reused) << alloc;
      EXPECT_EQ(choices(moved), choices(moved_ref)) << alloc;
      EXPECT_EQ((*r)->reused_selections(), 3u * g.layers) << alloc;
      EXPECT_EQ((*r)->selections(), 5u * g.layers) << alloc;
      // A chunk lands in every layer (4 more tokens push one out of the local window): the same
      // probe searches again, over the new chunk too.
      std::vector<float> k4(4 * g.token_elems());
      for (auto& x : k4) x = nd(rng);
      for (int l = 0; l < g.layers; ++l)
        ASSERT_TRUE(s->Append(seq, l, k4.data(), k4.data(), 4, DType::kF32).ok());
      const auto landed = step(r->get(), far);
      const auto landed_ref = step(ref->get(), far);
      for (const auto& [chunks, reused] : landed) EXPECT_FALSE(reused) << alloc << ": a chunk landed";
      EXPECT_EQ(choices(landed), choices(landed_ref)) << alloc;
      // A dropped chunk ends the reuse of layer 0 only.
      ASSERT_TRUE(s->DropChunks(seq, 0, {landed[0].first.front()}).ok());
      const auto dropped = step(r->get(), far);
      EXPECT_FALSE(dropped[0].second) << alloc;
      EXPECT_EQ(std::count(dropped[0].first.begin(), dropped[0].first.end(), landed[0].first.front()), 0);
      for (int l = 1; l < g.layers; ++l) EXPECT_TRUE(dropped[l].second) << alloc << " layer " << l;
    }
}

// screen_period R: a decode step screens a rotating 1/R of the chunks and rescores the shortlist,
// the chunks that landed and what of the slice could enter the grant. While the probe stays, it
// chooses what a full screen chooses; when the probe moves, it chooses it again within R steps
// (every chunk screened once); a chunk that lands is scored at once; a dropped chunk, a
// prefill window or the first decode step screen every chunk.
TEST(Retriever, ScreenPeriodFindsWhatAFullScreenFindsWithinThePeriod) {
  // rerank=0: the screen is the fp32 pass, so the kept cosines, Eq. 11 and the grants are the
  // reference's exactly; rerank=1 screens in int8 and rescores by the error bound.
  for (const char* index : {"Exact:heads=max,rerank=0", "Exact:heads=max"}) {
    SCOPED_TRACE(index);
    TempDir dir;
    auto store = TieredStore::Open(Options(dir.path()));
    ASSERT_TRUE(store.ok());
    TieredStore* s = store->get();
    const Geometry& g = s->options().geometry;
    SequenceId seq = *s->CreateSequence();
    std::vector<std::vector<float>> vs;
    Fill(s, seq, 4 + 16 + 4 * 120 + 3, 19, &vs);  // 120 chunks a layer
    RetrieverOptions ro;
    ro.probe = "mean";
    ro.alloc = "entropy:rank=logit";
    ro.index = index;
    ro.budget_tokens = 6 * 4;  // k = 6 chunks
    RetrieverOptions sliced_options = ro;
    constexpr int kPeriod = 4;
    sliced_options.screen_period = kPeriod;
    auto r = Retriever::Create(s, sliced_options);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_NE((*r)->Describe().find(" screen=4"), std::string::npos) << (*r)->Describe();
    auto ref = Retriever::Create(s, ro);
    ASSERT_TRUE(ref.ok());
    std::mt19937 rng(23);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const size_t qn = static_cast<size_t>(g.q_heads) * g.head_dim;
    std::vector<float> q0(qn), far(qn);
    for (auto& x : q0) x = nd(rng);
    for (auto& x : far) x = nd(rng);
    std::vector<double> entropies[2];  // the last step's Eq. 11 per layer: [0] r, [1] ref
    auto step = [&](Retriever* rt, const std::vector<float>& q, bool decode = true) {
      std::vector<std::vector<uint64_t>> out;
      std::vector<double>& theta = entropies[rt == ref->get() ? 1 : 0];
      theta.clear();
      rt->BeginStep();
      for (int l = 0; l < g.layers; ++l) {
        auto sel = rt->Select(seq, l, q.data(), 1, decode);
        EXPECT_TRUE(sel.ok()) << sel.status().ToString();
        if (!sel.ok()) return out;
        EXPECT_FALSE(sel->chunks.empty());
        out.push_back(sel->chunks);
        theta.push_back(sel->entropy);
      }
      return out;
    };
    // The grants may differ from the reference's: Eq. 11 takes the kept cosines, int8-screened
    // ones (rerank=1), or some still of the last probe while the slices come round, and Eq. 12's
    // running means keep what they saw. So: the same order, the shorter choice the longer's top
    // (with rerank=0 and a probe that never moved, the same grants too).
    bool same_grants = std::string(index).find("rerank=0") != std::string::npos;
    auto same_choice = [&](const std::vector<std::vector<uint64_t>>& a,
                           const std::vector<std::vector<uint64_t>>& b, const char* what) {
      ASSERT_EQ(a.size(), b.size());
      for (size_t l = 0; l < a.size(); ++l) {
        if (same_grants) {
          EXPECT_EQ(a[l], b[l]) << what << " layer " << l;
        } else {
          const size_t m = std::min(a[l].size(), b[l].size());
          EXPECT_TRUE(std::equal(a[l].begin(), a[l].begin() + m, b[l].begin())) << what << " layer " << l;
        }
      }
    };
    // A prefill window and the first decode step screen every chunk.
    same_choice(step(r->get(), q0, false), step(ref->get(), q0, false), "prefill");
    same_choice(step(r->get(), q0), step(ref->get(), q0), "first decode step");
    EXPECT_EQ((*r)->sliced_selections(), 0u);
    // The probe stays: slices, and the full screen's choice.
    for (int i = 0; i < 3; ++i) {
      same_choice(step(r->get(), q0), step(ref->get(), q0), "same probe");
      // Eq. 11 kept as running sums is the full screen's (rerank=0: the same cosines).
      for (int l = 0; l < g.layers && same_grants; ++l)
        EXPECT_NEAR(entropies[0][l], entropies[1][l], 1e-6 * entropies[1][l]) << "layer " << l;
    }
    EXPECT_EQ((*r)->sliced_selections(), 3u * g.layers);
    // The probe moves for good: within R steps every chunk has been screened for it, and the
    // choice is the full screen's from then on.
    for (int i = 0; i < kPeriod - 1; ++i) {
      step(r->get(), far);
      step(ref->get(), far);
    }
    same_grants = false;
    for (int i = 0; i < 3; ++i) same_choice(step(r->get(), far), step(ref->get(), far), "after R steps");
    EXPECT_EQ((*r)->sliced_selections(), (3u + kPeriod - 1 + 3) * g.layers);
    // Chunks land whose keys point along the probe (28 tokens: the local window of 16 pushes the
    // first of them out, chunks 125 and 126 whole): the next step scores them, and takes one first.
    constexpr int kMore = 28;
    std::vector<float> k_more(kMore * g.token_elems()), v_more(k_more.size());
    for (auto& x : v_more) x = nd(rng);
    for (int t = 0; t < kMore; ++t)
      for (int h = 0; h < g.kv_heads; ++h)
        for (int d = 0; d < g.head_dim; ++d)  // kv head h serves q heads 2h and 2h + 1
          k_more[static_cast<size_t>(t) * g.token_elems() + h * g.head_dim + d] =
              8.0f * (far[(2 * h) * g.head_dim + d] + far[(2 * h + 1) * g.head_dim + d]);
    for (int l = 0; l < g.layers; ++l)
      ASSERT_TRUE(s->Append(seq, l, k_more.data(), v_more.data(), kMore, DType::kF32).ok());
    const auto landed = step(r->get(), far);
    same_choice(landed, step(ref->get(), far), "chunks landed");
    for (int l = 0; l < g.layers; ++l) {
      ASSERT_FALSE(landed[l].empty());
      EXPECT_GE(landed[l].front(), 120u) << "layer " << l << ": a chunk that landed comes first";
    }
    EXPECT_EQ((*r)->sliced_selections(), (3u + kPeriod - 1 + 3 + 1) * g.layers);
    const uint64_t landed_chunk = landed[0].front();
    // A dropped chunk: that layer screens every chunk again; the others keep slicing.
    ASSERT_TRUE(s->DropChunks(seq, 0, {landed_chunk}).ok());
    const auto dropped = step(r->get(), far);
    same_choice(dropped, step(ref->get(), far), "a chunk dropped");
    EXPECT_EQ(std::count(dropped[0].begin(), dropped[0].end(), landed_chunk), 0);
    EXPECT_EQ((*r)->sliced_selections(), (3u + kPeriod - 1 + 3 + 1) * g.layers + g.layers - 1);
  }
}

// A head that reads on (a copy head) moves its target a token a step; when it crosses a chunk
// boundary, the next chunk is what the new probe favours, yet the last probe had no reason to
// put it in the shortlist, and the slice may be far from it. The neighbours of the last step's
// choice are candidates, so the sliced step takes it at once, as a full screen does.
TEST(Retriever, ScreenPeriodFollowsAReadIntoTheNextChunk) {
  TempDir dir;
  auto store = TieredStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  TieredStore* s = store->get();
  const Geometry& g = s->options().geometry;
  const StoreOptions& so = s->options();
  SequenceId seq = *s->CreateSequence();
  // 120 sealed chunks of random keys, but chunk 100's keys point along u and chunk 101's along
  // w (per kv head, w orthogonal to u): the probe u favours chunk 100 and scores 101 at 0.
  constexpr int kChunks = 120, kFirst = 100;
  const int n = so.n_sink + so.n_local + so.chunk_size * kChunks + 3;
  std::mt19937 rng(29);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t hd = static_cast<size_t>(g.head_dim);
  std::vector<float> u(g.kv_heads * hd), w(u.size());
  for (int h = 0; h < g.kv_heads; ++h) {
    float* uh = u.data() + h * hd;
    float* wh = w.data() + h * hd;
    for (size_t d = 0; d < hd; ++d) uh[d] = nd(rng), wh[d] = nd(rng);
    auto normalize = [&](float* x) {
      float n2 = 0;
      for (size_t d = 0; d < hd; ++d) n2 += x[d] * x[d];
      for (size_t d = 0; d < hd; ++d) x[d] /= std::sqrt(n2);
    };
    normalize(uh);
    float dot = 0;
    for (size_t d = 0; d < hd; ++d) dot += uh[d] * wh[d];
    for (size_t d = 0; d < hd; ++d) wh[d] -= dot * uh[d];
    normalize(wh);
  }
  for (int l = 0; l < g.layers; ++l) {
    std::vector<float> k(static_cast<size_t>(n) * g.token_elems()), v(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    for (int c = kFirst; c <= kFirst + 1; ++c)
      for (int t = 0; t < so.chunk_size; ++t) {
        const size_t tok = static_cast<size_t>(so.n_sink + c * so.chunk_size + t);
        for (size_t e = 0; e < u.size(); ++e) k[tok * g.token_elems() + e] = 20.0f * (c == kFirst ? u : w)[e];
      }
    ASSERT_TRUE(s->Append(seq, l, k.data(), v.data(), n, DType::kF32).ok());
  }
  ASSERT_EQ(*s->ChunkCount(seq, 0), static_cast<uint64_t>(kChunks));
  RetrieverOptions ro;
  ro.probe = "mean";
  ro.alloc = "entropy:rank=logit";
  ro.index = "Exact:heads=max";
  ro.budget_tokens = 6 * so.chunk_size;
  RetrieverOptions sliced_options = ro;
  sliced_options.screen_period = 4;  // the next slice: rows [0, 32), far from chunk 101
  auto r = Retriever::Create(s, sliced_options);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto ref = Retriever::Create(s, ro);
  ASSERT_TRUE(ref.ok());
  // Queries: both q heads of kv head h along its direction.
  auto query = [&](const std::vector<float>& dir) {
    std::vector<float> q(static_cast<size_t>(g.q_heads) * hd);
    const int group = g.q_heads / g.kv_heads;
    for (int qh = 0; qh < g.q_heads; ++qh)
      for (size_t d = 0; d < hd; ++d) q[qh * hd + d] = 3.0f * dir[(qh / group) * hd + d];
    return q;
  };
  auto first_choice = [&](Retriever* rt, const std::vector<float>& q, bool decode) {
    std::vector<uint64_t> firsts;
    rt->BeginStep();
    for (int l = 0; l < g.layers; ++l) {
      auto sel = rt->Select(seq, l, q.data(), 1, decode);
      EXPECT_TRUE(sel.ok()) << sel.status().ToString();
      if (!sel.ok() || sel->chunks.empty()) return std::vector<uint64_t>{};
      firsts.push_back(sel->chunks[0]);
    }
    return firsts;
  };
  const std::vector<uint64_t> at_u(g.layers, kFirst), at_w(g.layers, kFirst + 1);
  const std::vector<float> qu = query(u), qw = query(w);
  EXPECT_EQ(first_choice(r->get(), qu, false), at_u);  // a prefill window
  EXPECT_EQ(first_choice(ref->get(), qu, false), at_u);
  EXPECT_EQ(first_choice(r->get(), qu, true), at_u);  // the first decode step screens all
  EXPECT_EQ(first_choice(ref->get(), qu, true), at_u);
  EXPECT_EQ((*r)->sliced_selections(), 0u);
  // The read moves on into chunk 101: a full screen takes it first, and so does the slice.
  EXPECT_EQ(first_choice(ref->get(), qw, true), at_w);
  EXPECT_EQ(first_choice(r->get(), qw, true), at_w);
  EXPECT_EQ((*r)->sliced_selections(), static_cast<uint64_t>(g.layers));
}

// reuse_cosine and screen_period together: a chunk landing ends reuse, the next step slices, and
// that sliced step is a search the step after it reuses (it does not wait for a full screen).
TEST(Retriever, ReuseResumesAfterASlicedStep) {
  TempDir dir;
  auto store = TieredStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  TieredStore* s = store->get();
  const Geometry& g = s->options().geometry;
  SequenceId seq = *s->CreateSequence();
  std::vector<std::vector<float>> vs;
  Fill(s, seq, 4 + 16 + 4 * 120 + 3, 31, &vs);  // 120 chunks a layer, 3 tokens past the last
  RetrieverOptions ro;
  ro.probe = "mean";
  ro.alloc = "entropy:rank=logit";
  ro.index = "Exact:heads=max";
  ro.budget_tokens = 6 * 4;  // k = 6 chunks
  RetrieverOptions both = ro;
  both.reuse_cosine = 0.9;
  both.screen_period = 4;
  auto r = Retriever::Create(s, both);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto ref = Retriever::Create(s, ro);
  ASSERT_TRUE(ref.ok());
  std::mt19937 rng(37);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim);
  for (auto& x : q) x = nd(rng);
  auto step = [&](Retriever* rt) {
    std::vector<std::vector<uint64_t>> out;
    rt->BeginStep();
    for (int l = 0; l < g.layers; ++l) {
      auto sel = rt->Select(seq, l, q.data(), 1, true);
      EXPECT_TRUE(sel.ok()) << sel.status().ToString();
      if (!sel.ok()) return out;
      out.push_back(sel->chunks);
    }
    return out;
  };
  // The same probe throughout: each choice is the reference's (the shorter one the longer's top:
  // the grants come from Eq. 11 over kept or screened cosines).
  auto same_choice = [&](const char* what) {
    const auto a = step(r->get()), b = step(ref->get());
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t l = 0; l < a.size(); ++l) {
      ASSERT_FALSE(a[l].empty()) << what;
      const size_t m = std::min(a[l].size(), b[l].size());
      EXPECT_TRUE(std::equal(a[l].begin(), a[l].begin() + m, b[l].begin())) << what << " layer " << l;
    }
  };
  const uint64_t L = static_cast<uint64_t>(g.layers);
  same_choice("first decode step");  // a full screen
  same_choice("reused");
  EXPECT_EQ((*r)->reused_selections(), L);
  EXPECT_EQ((*r)->sliced_selections(), 0u);
  // A chunk lands in every layer: no reuse; the step slices (and scores the new chunk).
  std::vector<float> k4(4 * g.token_elems());
  for (auto& x : k4) x = nd(rng);
  for (int l = 0; l < g.layers; ++l)
    ASSERT_TRUE(s->Append(seq, l, k4.data(), k4.data(), 4, DType::kF32).ok());
  same_choice("a chunk landed");
  EXPECT_EQ((*r)->reused_selections(), L);
  EXPECT_EQ((*r)->sliced_selections(), L);
  // The probe stayed: the next step reuses the sliced step's search.
  same_choice("reused after the slice");
  EXPECT_EQ((*r)->reused_selections(), 2 * L);
  EXPECT_EQ((*r)->sliced_selections(), L);
  EXPECT_EQ((*r)->selections(), 4 * L);
}

// Layers are served in order within a step; returns layer 1's choice.
std::vector<uint64_t> SelectLayer1(Retriever* r, SequenceId seq, const std::vector<float>& q) {
  r->BeginStep();
  std::vector<uint64_t> out;
  for (int l = 0; l < 3; ++l) {
    auto sel = r->Select(seq, l, q.data(), 1, true);
    EXPECT_TRUE(sel.ok()) << sel.status().ToString();
    if (sel.ok() && l == 1) out = sel->chunks;
  }
  return out;
}

TEST(Retriever, LayersOutOfOrderAreRejected) {
  TempDir dir;
  auto store = TieredStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  SequenceId seq = *(*store)->CreateSequence();
  std::vector<std::vector<float>> vs;
  Fill(store->get(), seq, 4 + 16 + 4 * 10, 17, &vs);
  auto r = Retriever::Create(store->get(), RetrieverOptions());
  ASSERT_TRUE(r.ok());
  std::vector<float> q(static_cast<size_t>(4) * 16, 0.5f);
  (*r)->BeginStep();
  auto sel = (*r)->Select(seq, 1, q.data(), 1, true);
  EXPECT_EQ(sel.status().code(), StatusCode::kFailedPrecondition) << sel.status().ToString();
}

TEST(Retriever, IndexIsRebuiltAfterReopen) {
  TempDir dir;
  const StoreOptions o = Options(dir.path());
  std::vector<float> q(static_cast<size_t>(o.geometry.q_heads) * o.geometry.head_dim, 0.3f);
  q[5] = 2.0f;
  std::vector<uint64_t> before;
  SequenceId seq = 0;
  RetrieverOptions ro;
  ro.alloc = "topk";
  ro.budget_tokens = 6 * 4;
  for (const char* index : {"Exact", "Flat"}) {
    ro.index = index;
    {
      auto store = TieredStore::Open(o);
      ASSERT_TRUE(store.ok());
      seq = *(*store)->CreateSequence();
      std::vector<std::vector<float>> vs;
      Fill(store->get(), seq, 4 + 16 + 4 * 25, 13, &vs);
      auto r = Retriever::Create(store->get(), ro);
      ASSERT_TRUE(r.ok());
      before = SelectLayer1(r->get(), seq, q);
      ASSERT_EQ(before.size(), 6u);
      ASSERT_TRUE((*store)->CloseSequence(seq).ok());
    }
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto r = Retriever::Create(store->get(), ro);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(SelectLayer1(r->get(), seq, q), before) << index;
    ASSERT_TRUE((*store)->DropSequence(seq).ok());
  }
}

TEST(Retriever, CappedIndexIsRebuiltAfterReopenAsItWasBuilt) {
  // StoreOptions::index_bytes caps every index a Retriever builds (index_bytes / layers each).
  // Built step by step while the sequence grows, or in one Sync after a reopen, the capped
  // index ends alike: the same chunks compressed and evicted, the same bytes, the same choice.
  TempDir dir;
  StoreOptions o = Options(dir.path());
  o.index_bytes = 1 << 20;  // ~930 full chunks a layer, ~3,360 as int8 codes
  std::vector<float> q(static_cast<size_t>(o.geometry.q_heads) * o.geometry.head_dim, 0.3f);
  q[5] = 2.0f;
  RetrieverOptions ro;
  ro.alloc = "topk";
  ro.budget_tokens = 6 * 4;
  SequenceId seq = 0;
  std::vector<uint64_t> before;
  uint64_t compressed = 0, evicted = 0, bytes = 0;
  {
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    seq = *(*store)->CreateSequence();
    auto r = Retriever::Create(store->get(), ro);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::vector<std::vector<float>> vs;
    for (int step = 0; step < 20; ++step) {  // 20 x 800 tokens = ~4,000 chunks a layer
      Fill(store->get(), seq, 800, 100 + step, &vs);
      SelectLayer1(r->get(), seq, q);
      ASSERT_LE((*r)->memory_bytes(), o.index_bytes) << "step " << step;
    }
    before = SelectLayer1(r->get(), seq, q);
    compressed = (*r)->compressed_chunks();
    evicted = (*r)->evicted_chunks();
    bytes = (*r)->memory_bytes();
    EXPECT_GT(evicted, 0u);
    EXPECT_GT(compressed, 0u);
    ASSERT_TRUE((*store)->CloseSequence(seq).ok());
  }
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto r = Retriever::Create(store->get(), ro);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(SelectLayer1(r->get(), seq, q), before);
  EXPECT_EQ((*r)->compressed_chunks(), compressed);
  EXPECT_EQ((*r)->evicted_chunks(), evicted);
  EXPECT_EQ((*r)->memory_bytes(), bytes);
  // A FAISS kind cannot be capped: the Retriever says so instead of growing unbounded.
  ro.index = "Flat";
  auto flat = Retriever::Create(store->get(), ro);
  ASSERT_FALSE(flat.ok());
  EXPECT_NE(flat.status().message().find("index_bytes"), std::string::npos) << flat.status().ToString();
}

// head_merge: chunk 0's keys match head 0 strongly and oppose head 1; chunk 1 matches
// both heads mildly. Summed over heads chunk 1 wins (10 - 5 < 3 + 3); when the most
// interested head decides, chunk 0 wins (10 > 3).
TEST(Retriever, HeadMergeMaxLetsTheMostInterestedHeadDecide) {
  // token = [head0 (x, y), head1 (x, y)]
  SequenceId seq = 0;
  auto store = TwoChunkStore(Geometry{1, 2, 2, 2, DType::kF32},
                             {10, 0, -5, 0, 10, 0, -5, 0,  // chunk 0
                              3, 0, 3, 0, 3, 0, 3, 0},     // chunk 1
                             &seq);
  ASSERT_NE(store, nullptr);
  const std::vector<float> q{1, 0, 1, 0};  // one token, two q heads (one per kv head)
  for (int rerank : {0, 4}) {
    for (const char* merge : {"sum", "max"}) {
      RetrieverOptions ro;
      ro.probe = "mean";
      ro.alloc = "topk";
      ro.budget_tokens = 2;  // k = 1
      ro.index = std::string("Exact:heads=") + merge + ",rerank=" + std::to_string(rerank);
      EXPECT_EQ(DecodeSelect(store.get(), seq, ro, q),
                (std::vector<uint64_t>{std::string(merge) == "max" ? 0u : 1u}))
          << merge << " rerank " << rerank;
    }
  }
}

// rank_by under the entropy allocator: chunk 0's key is long but 60 degrees off the probe
// (cosine 0.5, logit 5), chunk 1's is short and close (cosine 0.9, logit 0.9). With room
// for one chunk, Algorithm 1's cosine order takes chunk 1, the logit order chunk 0.
TEST(Retriever, RankByLogitKeepsKeyNorms) {
  // For both index kinds: rank is the allocator's, whatever the index.
  const float c = 0.9f, sn = std::sqrt(1.0f - 0.81f);
  SequenceId seq = 0;
  auto store =
      TwoChunkStore(Geometry{1, 1, 1, 2, DType::kF32}, {5, 8.6602540f, 5, 8.6602540f, c, sn, c, sn}, &seq);
  ASSERT_NE(store, nullptr);
  for (const char* index : {"Exact", "Exact:rerank=0", "Flat"})
    for (const char* rank : {"cosine", "logit"}) {
      RetrieverOptions ro;
      ro.probe = "mean";
      ro.alloc = std::string("entropy:rank=") + rank;
      ro.index = index;
      ro.budget_tokens = 2;  // L x k = 1 chunk for the only layer
      EXPECT_EQ(DecodeSelect(store.get(), seq, ro, {1, 0}),
                (std::vector<uint64_t>{std::string(rank) == "logit" ? 0u : 1u}))
          << index << " " << rank;
    }
}

TEST(Retriever, BadOptionsAreRejected) {
  struct Case {
    std::function<void(RetrieverOptions*)> set;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](RetrieverOptions* o) { o->probe = "bogus"; }, "probe"},
      {[](RetrieverOptions* o) { o->alloc = "entropy:min=x"; }, "alloc"},
      {[](RetrieverOptions* o) { o->alloc = "entropy:rank=norm"; }, "'rank'"},
      {[](RetrieverOptions* o) { o->alloc = "topk:rank=cosine"; }, "topk takes the index's top k by logit"},
      {[](RetrieverOptions* o) { o->index = "Bogus"; }, "Bogus"},
      {[](RetrieverOptions* o) { o->index = "Exact:rerank=-1"; }, "'rerank'"},
      {[](RetrieverOptions* o) { o->index = "Exact:heads=avg"; }, "'heads'"},
      // One concatenated vector per chunk: the sum over heads is built in.
      {[](RetrieverOptions* o) { o->index = "Flat:heads=max"; }, "needs the Exact index"},
      {[](RetrieverOptions* o) { o->index = "Flat:rerank=4"; }, "Exact index only"},
      {[](RetrieverOptions* o) { o->budget_tokens = -1; }, "budget_tokens"},
  };
  for (const Case& c : cases) {
    RetrieverOptions ro;
    c.set(&ro);
    const Status st = ro.Validate();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(st.message().find(c.expect), std::string::npos)
        << st.message() << " (wanted " << c.expect << ")";
  }
  EXPECT_FALSE(Retriever::Create(nullptr, RetrieverOptions()).ok());
  // Checked again against the store's real shape: PQ64 splits the 1024 dimensions Validate
  // builds at, not kv_heads x head_dim = 32.
  TempDir dir;
  auto store = TieredStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  RetrieverOptions ro;
  ro.index = "PQ64";
  EXPECT_TRUE(ro.Validate().ok()) << ro.Validate().ToString();
  auto r = Retriever::Create(store->get(), ro);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("index: "), std::string::npos) << r.status().message();
  ro.index = "PQ4";
  EXPECT_TRUE(Retriever::Create(store->get(), ro).ok());
}

// ---- spec strings ---------------------------------------------------------------------------

TEST(RetrieverOptions, ToStringSpellsEveryPartOutAndParsesBack) {
  EXPECT_EQ(RetrieverOptions().ToString(),
            "probe=act:eps=1e-06 alloc=entropy:min=1,rank=logit index=Exact:heads=max,rerank=1,rerank_min=0 "
            "budget=2048");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"",
       "probe=act:eps=1e-06 alloc=entropy:min=1,rank=logit index=Exact:heads=max,rerank=1,rerank_min=0 "
       "budget=2048"},
      {"index=Flat alloc=topk", "probe=act:eps=1e-06 alloc=topk index=Flat budget=2048"},
      {"  budget=512   probe=mean index=HNSW32:ef=32 ",
       "probe=mean alloc=entropy:min=1,rank=logit index=HNSW32:ef=32 budget=512"},
      {"index=IVF64,Flat:nprobe=4 alloc=entropy:rank=logit",
       "probe=act:eps=1e-06 alloc=entropy:min=1,rank=logit index=IVF64,Flat:nprobe=4,train_min=0 "
       "budget=2048"},
      {"index=Exact:rerank=0,heads=max alloc=entropy:rank=logit,min=2 probe=question:base=mean,weight=0.25",
       "probe=question:base=mean,weight=0.25 alloc=entropy:min=2,rank=logit "
       "index=Exact:heads=max,rerank=0,rerank_min=0 budget=2048"},
      {"reuse=0.80 alloc=topk",
       "probe=act:eps=1e-06 alloc=topk index=Exact:heads=max,rerank=1,rerank_min=0 "
       "budget=2048 reuse=0.8"},
      {"reuse=0",
       "probe=act:eps=1e-06 alloc=entropy:min=1,rank=logit index=Exact:heads=max,rerank=1,"
       "rerank_min=0 budget=2048"},
      {"screen=8 reuse=0.8",
       "probe=act:eps=1e-06 alloc=entropy:min=1,rank=logit index=Exact:heads=max,rerank=1,"
       "rerank_min=0 budget=2048 reuse=0.8 screen=8"},
      {"screen=1",
       "probe=act:eps=1e-06 alloc=entropy:min=1,rank=logit index=Exact:heads=max,rerank=1,"
       "rerank_min=0 budget=2048"},
      // The index's own "screen" key (its first stage) beside the retriever's (the rolling screen).
      {"index=Exact:heads=max,screen=int4 screen=8",
       "probe=act:eps=1e-06 alloc=entropy:min=1,rank=logit index=Exact:heads=max,rerank=1,"
       "rerank_min=0,screen=int4 budget=2048 screen=8"},
  };
  for (const auto& [spec, canonical] : cases) {
    auto o = RetrieverOptions::Parse(spec);
    ASSERT_TRUE(o.ok()) << spec << ": " << o.status().ToString();
    EXPECT_EQ(o->ToString(), canonical) << spec;
    auto again = RetrieverOptions::Parse(o->ToString());
    ASSERT_TRUE(again.ok()) << o->ToString() << ": " << again.status().ToString();
    EXPECT_EQ(again->ToString(), canonical);
  }
  // The fields as set, not canonicalised, until ToString.
  auto o = RetrieverOptions::Parse("index=IVF64,Flat budget=64");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->index, "IVF64,Flat");
  EXPECT_EQ(o->budget_tokens, 64);
  EXPECT_EQ(o->probe, "act");
}

TEST(RetrieverOptions, BadSpecsAreRejectedNamingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bogus=1", "unknown key 'bogus'"},
      {"probe", "malformed item 'probe'"},
      {"probe=", "malformed item 'probe='"},
      {"=act", "malformed item '=act'"},
      {"probe=act probe=mean", "duplicate key 'probe'"},
      {"budget=x", "'budget'"},
      {"budget=-1", "budget_tokens"},
      {"index=Flat:heads=max", "needs the Exact index"},
      {"index=Exact:rerank_min=-3", "'rerank_min'"},
      {"alloc=entropy:rank=up", "'rank'"},
      {"probe=act:eps=x", "probe"},
      {"reuse=x", "'reuse'"},
      {"reuse=0.5x", "'reuse'"},
      {"reuse=1.5", "option 'reuse_cosine': 1.5 is outside [0, 1]"},
      {"reuse=-0.1", "option 'reuse_cosine': -0.1 is outside [0, 1]"},
      {"screen=0", "option 'screen_period': 0 is outside [1, "},
      {"screen=x", "'screen'"},
      {"screen=4 alloc=topk", "needs an allocator that reads every chunk's score"},
      {"screen=4 index=Flat", "needs the Exact index kind"},
  };
  for (const auto& [spec, needle] : cases) {
    auto o = RetrieverOptions::Parse(spec);
    ASSERT_FALSE(o.ok()) << spec;
    EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(o.status().message().find(needle), std::string::npos)
        << spec << " -> " << o.status().message() << " (wanted " << needle << ")";
  }
}

TEST(Retriever, DescribeIsTheCanonicalSpecAndParsesBack) {
  TempDir dir;
  auto store = TieredStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  for (const char* spec :
       {"", "index=Flat alloc=topk probe=mean budget=64",
        "index=Exact:heads=max,rerank=0 alloc=entropy:rank=logit", "index=HNSW32 budget=128"}) {
    auto o = RetrieverOptions::Parse(spec);
    ASSERT_TRUE(o.ok()) << spec;
    auto r = Retriever::Create(store->get(), *o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ((*r)->Describe(), o->ToString()) << spec;
    auto back = RetrieverOptions::Parse((*r)->Describe());
    ASSERT_TRUE(back.ok()) << (*r)->Describe();
    EXPECT_EQ(back->ToString(), (*r)->Describe());
  }
}

TEST(RetrieverSpecFlags, ShorthandsEditTheSpecsInAnyOrder) {
  RetrieverOptions o;
  RetrieverSpecFlags rf(&o);
  ASSERT_TRUE(rf.SetIndexKey("heads", "max").ok());
  EXPECT_EQ(o.index, "Exact:heads=max");
  ASSERT_TRUE(rf.SetIndex("Exact:rerank=0").ok());  // a later --index keeps the shorthand
  EXPECT_EQ(o.index, "Exact:rerank=0,heads=max");
  ASSERT_TRUE(rf.SetIndexKey("rerank", "2").ok());  // the shorthand wins over the spec's own key
  EXPECT_EQ(o.index, "Exact:rerank=2,heads=max");
  ASSERT_TRUE(rf.SetAllocKey("rank", "logit").ok());
  ASSERT_TRUE(rf.SetAlloc("entropy:min=2").ok());
  EXPECT_EQ(o.alloc, "entropy:min=2,rank=logit");
  EXPECT_TRUE(o.Validate().ok()) << o.Validate().ToString();
  // A shorthand the kind refuses is Validate's error, naming it.
  ASSERT_TRUE(rf.SetIndex("Flat").ok());
  EXPECT_EQ(o.index, "Flat:heads=max,rerank=2");
  EXPECT_NE(o.Validate().message().find("Exact"), std::string::npos) << o.Validate().message();
  // A malformed spec is refused at once.
  EXPECT_FALSE(rf.SetIndex("Exact:").ok());
}

TEST(RetrieverSpecFlags, ToolDefaultsFillOnlyUnsetKeysTheKindHas) {
  RetrieverOptions o;
  RetrieverSpecFlags rf(&o);
  ASSERT_TRUE(rf.DefaultIndexKey("heads", "max").ok());
  ASSERT_TRUE(rf.DefaultAllocKey("rank", "logit").ok());
  EXPECT_EQ(o.index, "Exact:heads=max");
  EXPECT_EQ(o.alloc, "entropy:rank=logit");
  ASSERT_TRUE(rf.SetIndex("Exact").ok());  // --index Exact keeps the tool's heads=max
  EXPECT_EQ(o.index, "Exact:heads=max");
  ASSERT_TRUE(rf.SetIndex("Exact:heads=sum").ok());  // the spec's own key wins
  EXPECT_EQ(o.index, "Exact:heads=sum");
  ASSERT_TRUE(rf.SetIndex("Flat").ok());  // FAISS has no heads=max: the default does not apply
  EXPECT_EQ(o.index, "Flat");
  ASSERT_TRUE(rf.SetAlloc("topk").ok());  // topk ranks by logit anyway
  EXPECT_TRUE(o.Validate().ok()) << o.Validate().ToString();
  ASSERT_TRUE(rf.SetIndexKey("heads", "sum").ok());  // an explicit shorthand wins over the default
  ASSERT_TRUE(rf.SetIndex("Exact").ok());
  EXPECT_EQ(o.index, "Exact:heads=sum");
}

TEST(RetrieverSpecFlags, SetSpecKeyAndSpecKey) {
  EXPECT_EQ(*SetSpecKey("IVF1024,Flat", "nprobe", "4"), "IVF1024,Flat:nprobe=4");
  EXPECT_EQ(*SetSpecKey("Exact:heads=max,rerank=2", "heads", "sum"), "Exact:heads=sum,rerank=2");
  EXPECT_FALSE(SetSpecKey("", "heads", "sum").ok());
  EXPECT_EQ(SpecKey("Exact:heads=max,rerank=2", "rerank"), "2");
  EXPECT_EQ(SpecKey("Exact", "rerank"), "");
  EXPECT_EQ(SpecKey("Exact:", "rerank"), "");
}

}  // namespace
}  // namespace kvtier
