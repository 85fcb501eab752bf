#include "retrieval/retriever.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

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
std::vector<std::vector<float>> Fill(TieredStore* s, SequenceId seq, int n, uint64_t seed, std::vector<std::vector<float>>* vs) {
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
        ro.index.factory = index;
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
          auto view = s->GetHotView(seq, l);
          std::vector<kernels::KvSpan> parts{view->sinks};
          for (auto& sp : h->spans()) parts.push_back(sp);
          for (int i = 0; i < view->n_local_spans; ++i) parts.push_back(view->local[i]);
          std::vector<float> out(q.size()), full(q.size());
          kernels::AttentionParams p;
          p.q_heads = g.q_heads; p.kv_heads = g.kv_heads; p.head_dim = g.head_dim; p.dtype = DType::kF32;
          p.n_queries = 1; p.q = q.data(); p.q_positions = &pos;
          p.parts = parts.data(); p.n_parts = static_cast<int>(parts.size()); p.out = out.data();
          ASSERT_EQ(kernels::Attention(p), kernels::KernelError::kOk);
          kernels::KvSpan all{ks[l].data(), vs[l].data(), n, 0, nullptr};
          p.parts = &all; p.n_parts = 1; p.out = full.data();
          ASSERT_EQ(kernels::Attention(p), kernels::KernelError::kOk);
          double num = 0, den = 0;
          for (size_t i = 0; i < out.size(); ++i) { num += (out[i] - full[i]) * (out[i] - full[i]); den += full[i] * full[i]; }
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
  o.n_sink = 0; o.n_local = 2; o.chunk_size = 2; o.repr_topk = 2;
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
  ro.index.factory = "Flat";  // InfLLM's mean: chunk 1 wins
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
      for (const std::vector<float>& q : {std::vector<float>{1, 0}, std::vector<float>{0, 1}, std::vector<float>{0, -1}}) {
        RetrieverOptions ro;
        ro.probe = "mean";
        ro.alloc = alloc;
        ro.rerank_factor = rerank;
        ro.rerank_min = 0;
        ro.budget_tokens = 2;  // k = 1
        const std::string what = std::string(alloc) + " rerank " + std::to_string(rerank) + " q (" +
                                  std::to_string(q[0]) + "," + std::to_string(q[1]) + ")";
        if (std::string(alloc) == "topk") EXPECT_EQ(DecodeSelect(store.get(), seq, ro, q), (std::vector<uint64_t>{0})) << what;
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
      ro.rerank_factor = rerank_factor;
      ro.rerank_min = rerank_min;
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
    ro.index.factory = index;
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
        for (uint64_t c : gone) EXPECT_EQ(std::count(sel->chunks.begin(), sel->chunks.end(), c), 0) << index << " chunk " << c;
      }
      auto h = s->FetchChunks(seq, l, sel->chunks);  // every chosen chunk still exists
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      ASSERT_TRUE(h->Wait().ok());
    }
    // The compacted index scores as one built afresh from the store: with no slack in the
    // candidate set, the int8 first stage alone decides, so its rows must be intact.
    ro.budget_tokens = 5 * 4;
    ro.rerank_factor = 1;
    ro.rerank_min = 0;
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

TEST(Retriever, DotKeyOfAStoredKeyEqualsDotOfItsFloats) {
  // The rescoring stage reads representatives in the store's dtype; its scores must be the
  // ones an fp32 copy would give, bit for bit, at every length (lanes and tail).
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32})
    for (int n : {1, 7, 8, 9, 63, 64, 65, 128, 200}) {
      for (int rep = 0; rep < 50; ++rep) {
        std::vector<float> k(n), p(n), back(n);
        for (auto& x : k) x = nd(rng);
        for (auto& x : p) x = nd(rng);
        std::vector<uint8_t> stored(n * DTypeSize(t));
        FromFloat(t, k.data(), stored.data(), n);
        ToFloat(t, stored.data(), back.data(), n);
        ASSERT_EQ(kernels::DotKey(t, stored.data(), p.data(), n), kernels::Dot(back.data(), p.data(), n))
            << DTypeName(t) << " n " << n;
        double ref = 0.0;
        for (int i = 0; i < n; ++i) ref += static_cast<double>(back[i]) * p[i];
        EXPECT_NEAR(kernels::Dot(back.data(), p.data(), n), ref, 1e-4 * (1.0 + std::sqrt(static_cast<double>(n))));
      }
    }
}

TEST(Retriever, QuantizedBlockDotMatchesFloatDot) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  constexpr int B = kernels::kI8Block;
  for (int d : {1, 2, 15, 16, 64, 129, 4096}) {
    std::vector<float> x(static_cast<size_t>(B) * d), p(d);
    for (auto& v : x) v = nd(rng);
    for (auto& v : p) v = nd(rng);
    // Eight rows quantised, then stored in the paired transposed layout.
    std::vector<int8_t> block(kernels::I8BlockBytes(d), 0), codes(d);
    std::vector<float> scale(B), x_l1(B, 0.0f);
    float p_l1 = 0.0f;
    for (float v : p) p_l1 += std::fabs(v);
    for (int j = 0; j < B; ++j) {
      scale[j] = kernels::QuantizeI8(x.data() + static_cast<size_t>(j) * d, d, codes.data());
      float max_abs = 0.0f;
      for (int e = 0; e < d; ++e) {
        block[kernels::I8Offset(e, j)] = codes[e];
        const float xe = x[static_cast<size_t>(j) * d + e];
        max_abs = std::max(max_abs, std::fabs(xe));
        x_l1[j] += std::fabs(xe);
        EXPECT_LE(std::fabs(codes[e] * scale[j] - xe), 0.5f * scale[j] + 1e-6f);
      }
      EXPECT_FLOAT_EQ(scale[j], max_abs / 127.0f);
    }
    std::vector<int16_t> p16((d + 1) / 2 * 2, 7);
    const float ps = kernels::QuantizeProbeI16(p.data(), d, p16.data());
    if (d % 2) EXPECT_EQ(p16.back(), 0) << "the pad must be 0";
    int32_t out[B], ref[B];
    kernels::DotI8Blocks(block.data(), 1, p16.data(), d, out);
    kernels::DotI8BlocksScalar(block.data(), 1, p16.data(), d, ref);
    for (int j = 0; j < B; ++j) {
      EXPECT_EQ(out[j], ref[j]) << "vector path vs scalar twin, d " << d << " lane " << j;
      const float exact = kernels::Dot(x.data() + static_cast<size_t>(j) * d, p.data(), d);
      // Errors: codes within half a row step of x, probe codes within half a probe step of p.
      const float bound = 0.5f * scale[j] * p_l1 + 0.5f * ps * (x_l1[j] + 0.5f * scale[j] * d) + 1e-3f;
      EXPECT_NEAR(static_cast<float>(out[j]) * ps * scale[j], exact, bound) << "d " << d << " lane " << j;
    }
  }
  // Extreme codes and probe at the largest head_dim cannot overflow the int32 sums.
  {
    const int d = 4096;
    std::vector<int8_t> block(kernels::I8BlockBytes(d), 127);
    std::vector<float> p(d, -1.0f);
    std::vector<int16_t> p16(d);
    kernels::QuantizeProbeI16(p.data(), d, p16.data());
    int32_t out[B], ref[B];
    kernels::DotI8Blocks(block.data(), 1, p16.data(), d, out);
    kernels::DotI8BlocksScalar(block.data(), 1, p16.data(), d, ref);
    for (int j = 0; j < B; ++j) {
      EXPECT_EQ(out[j], ref[j]);
      EXPECT_EQ(out[j], static_cast<int64_t>(127) * p16[0] * d) << "no overflow";
    }
  }
  // Many blocks in one call, at every head width the vector paths treat differently
  // (odd pair counts, the AVX-512 probe table's limit of 512 and beyond), bit for bit.
  for (int d : {2, 6, 62, 64, 66, 128, 510, 512, 514, 1000}) {
    const size_t n_blocks = 37;
    std::vector<int8_t> blocks(n_blocks * kernels::I8BlockBytes(d));
    for (auto& c : blocks) c = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    std::vector<float> p(d);
    for (auto& v : p) v = nd(rng);
    std::vector<int16_t> p16((d + 1) / 2 * 2);
    kernels::QuantizeProbeI16(p.data(), d, p16.data());
    std::vector<int32_t> out(n_blocks * B), ref(n_blocks * B);
    kernels::DotI8Blocks(blocks.data(), n_blocks, p16.data(), d, out.data());
    kernels::DotI8BlocksScalar(blocks.data(), n_blocks, p16.data(), d, ref.data());
    EXPECT_EQ(out, ref) << "vector path vs scalar twin over " << n_blocks << " blocks, d " << d;
  }
  std::vector<float> zero(8, 0.0f);
  std::vector<int8_t> codes(8, 5);
  EXPECT_EQ(kernels::QuantizeI8(zero.data(), 8, codes.data()), 0.0f);
  for (int8_t c : codes) EXPECT_EQ(c, 0);
  std::vector<int16_t> pz(8, 5);
  EXPECT_EQ(kernels::QuantizeProbeI16(zero.data(), 8, pz.data()), 0.0f);
  for (int16_t c : pz) EXPECT_EQ(c, 0);
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
    ro.index.factory = index;
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

// head_merge: chunk 0's keys match head 0 strongly and oppose head 1; chunk 1 matches
// both heads mildly. Summed over heads chunk 1 wins (10 - 5 < 3 + 3); when the most
// interested head decides, chunk 0 wins (10 > 3).
TEST(Retriever, HeadMergeMaxLetsTheMostInterestedHeadDecide) {
  // token = [head0 (x, y), head1 (x, y)]
  SequenceId seq = 0;
  auto store = TwoChunkStore(Geometry{1, 2, 2, 2, DType::kF32},
                             {10, 0, -5, 0,  10, 0, -5, 0,   // chunk 0
                              3, 0, 3, 0,    3, 0, 3, 0},    // chunk 1
                             &seq);
  ASSERT_NE(store, nullptr);
  const std::vector<float> q{1, 0, 1, 0};  // one token, two q heads (one per kv head)
  for (int rerank : {0, 4}) {
    for (const char* merge : {"sum", "max"}) {
      RetrieverOptions ro;
      ro.probe = "mean";
      ro.alloc = "topk";
      ro.budget_tokens = 2;  // k = 1
      ro.rerank_factor = rerank;
      ro.head_merge = merge;
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
  const float c = 0.9f, sn = std::sqrt(1.0f - 0.81f);
  SequenceId seq = 0;
  auto store = TwoChunkStore(Geometry{1, 1, 1, 2, DType::kF32}, {5, 8.6602540f, 5, 8.6602540f, c, sn, c, sn}, &seq);
  ASSERT_NE(store, nullptr);
  for (const char* rank : {"cosine", "logit"}) {
    RetrieverOptions ro;
    ro.probe = "mean";
    ro.alloc = "entropy";
    ro.budget_tokens = 2;  // L x k = 1 chunk for the only layer
    ro.rank_by = rank;
    EXPECT_EQ(DecodeSelect(store.get(), seq, ro, {1, 0}),
              (std::vector<uint64_t>{std::string(rank) == "logit" ? 0u : 1u}))
        << rank;
  }
}

TEST(Retriever, BadOptionsAreRejected) {
  RetrieverOptions ro;
  ro.probe = "bogus";
  EXPECT_NE(ro.Validate().message().find("probe"), std::string::npos);
  ro = RetrieverOptions();
  ro.alloc = "entropy:min=x";
  EXPECT_NE(ro.Validate().message().find("alloc"), std::string::npos);
  ro = RetrieverOptions();
  ro.index.factory = "Bogus";
  EXPECT_FALSE(ro.Validate().ok());
  ro = RetrieverOptions();
  ro.rerank_factor = -1;
  EXPECT_NE(ro.Validate().message().find("rerank"), std::string::npos);
  ro = RetrieverOptions();
  ro.head_merge = "avg";
  EXPECT_NE(ro.Validate().message().find("head_merge"), std::string::npos);
  ro = RetrieverOptions();
  ro.head_merge = "max";
  ro.index.factory = "Flat";  // one concatenated vector per chunk: the sum over heads is built in
  EXPECT_NE(ro.Validate().message().find("Exact"), std::string::npos);
  ro = RetrieverOptions();
  ro.rank_by = "norm";
  EXPECT_NE(ro.Validate().message().find("rank_by"), std::string::npos);
  ro = RetrieverOptions();
  ro.budget_tokens = -1;
  EXPECT_NE(ro.Validate().message().find("budget_tokens"), std::string::npos);
  EXPECT_FALSE(Retriever::Create(nullptr, RetrieverOptions()).ok());
}

}  // namespace
}  // namespace kvtier
