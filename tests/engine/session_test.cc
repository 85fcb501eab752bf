// The engine API (include/kvtier/session.h): Session's Attend equals the hand-written
// sequence it replaces, sessions keep their own retrieval state, many sessions on many
// threads over one store give each one's single-threaded results bit for bit, bad calls
// get named errors, and Compress keeps the budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "engine/session_internal.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/rope.h"
#include "kernels/dtype.h"
#include "kvtier/kvtier.h"
#include "offload/tiered_store.h"
#include "retrieval/chunk_index.h"
#include "retrieval/retriever.h"
#include "tests/test_util.h"
#include "tests/tiered_store_test_peer.h"

namespace kvtier {
namespace {

constexpr int kLayers = 3, kQHeads = 4, kKvHeads = 2, kDim = 32;

StoreOptions SmallStore(const std::string& data_dir = "") {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, DType::kF16};
  so.n_sink = 8;
  so.n_local = 32;
  so.chunk_size = 8;
  so.repr_topk = 2;
  so.hot_bytes = 256 * so.chunk_bytes();
  so.warm_bytes = 2048 * so.chunk_bytes();
  so.data_dir = data_dir;
  return so;
}

// Deterministic K/V/Q for (sequence seed, layer, position): a topic direction per
// sequence plus noise, and a needle the late queries look for, so retrieval has
// something to find.
struct Token {
  std::vector<uint16_t> k, v;  // f16
  std::vector<float> q;
};
Token MakeToken(uint32_t seed, int layer, int64_t pos) {
  std::mt19937 rng(seed * 1000003u + static_cast<uint32_t>(layer) * 7919u + static_cast<uint32_t>(pos));
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> k(kKvHeads * kDim), v(k.size());
  Token t;
  t.q.resize(kQHeads * kDim);
  const bool needle = pos >= 100 && pos < 108;
  for (int i = 0; i < kKvHeads * kDim; ++i) {
    k[i] = n(rng) + (needle ? 3.0f * std::sin(0.3f * static_cast<float>(i + seed)) : 0.0f);
    v[i] = n(rng);
  }
  const bool seeking = pos >= 200;
  for (int i = 0; i < kQHeads * kDim; ++i)
    t.q[i] =
        n(rng) + (seeking ? 3.0f * std::sin(0.3f * static_cast<float>(i % (kKvHeads * kDim) + seed)) : 0.0f);
  t.k.resize(k.size());
  t.v.resize(v.size());
  FromFloat(DType::kF16, k.data(), t.k.data(), k.size());
  FromFloat(DType::kF16, v.data(), t.v.data(), v.size());
  return t;
}

// One step at position b: a prefill window of up to 16 tokens while b < prefill, else one
// decode token; appends every layer's Attend output to outs. Returns the tokens it ran.
Result<int> StepOnce(Session* s, uint32_t seed, int64_t b, int64_t prefill, std::vector<float>* outs) {
  const bool decode = b >= prefill;
  const int m = decode ? 1 : static_cast<int>(std::min<int64_t>(16, prefill - b));
  KVTIER_RETURN_IF_ERROR(s->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill));
  std::vector<int64_t> pos(m);
  for (int t = 0; t < m; ++t) pos[t] = b + t;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<uint16_t> k, v;
    std::vector<float> q;
    for (int t = 0; t < m; ++t) {
      Token tok = MakeToken(seed, l, b + t);
      k.insert(k.end(), tok.k.begin(), tok.k.end());
      v.insert(v.end(), tok.v.begin(), tok.v.end());
      q.insert(q.end(), tok.q.begin(), tok.q.end());
    }
    KVTIER_RETURN_IF_ERROR(s->Append(l, k.data(), v.data(), m, DType::kF16));
    std::vector<float> out(static_cast<size_t>(m) * kQHeads * kDim);
    KVTIER_RETURN_IF_ERROR(s->Attend(l, q.data(), pos.data(), m, out.data()));
    outs->insert(outs->end(), out.begin(), out.end());
  }
  return m;
}

// Prefill windows of 16 tokens up to `prefill`, then decode steps to `total`; returns every
// Attend output, concatenated.
Status DriveSession(Session* s, uint32_t seed, int64_t prefill, int64_t total, std::vector<float>* outs) {
  for (int64_t b = 0; b < total;) {
    KVTIER_ASSIGN_OR_RETURN(int m, StepOnce(s, seed, b, prefill, outs));
    b += m;
  }
  return Status::Ok();
}

SessionOptions Retrieval(int budget_tokens) {
  SessionOptions o;
  o.retrieval.budget_tokens = budget_tokens;
  return o;
}

TEST(Session, AttendEqualsTheHandWrittenSequence) {
  // The sequence engines wrote by hand (Select, FetchChunks, Wait, GetHotView, spans,
  // Attention, Release) over a second sequence with the same data, next to Session::Attend.
  auto store = TieredStore::Open(SmallStore());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto s = Session::Open(store->get(), Retrieval(32));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto seq2 = (*store)->CreateSequence();
  ASSERT_TRUE(seq2.ok());
  auto r = Retriever::Create(store->get(), Retrieval(32).retrieval);
  ASSERT_TRUE(r.ok());
  const Geometry g = SmallStore().geometry;
  const size_t q_elems = static_cast<size_t>(kQHeads) * kDim;
  int compared = 0, with_chunks = 0;
  for (int64_t p = 0; p < 260; ++p) {
    ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
    (*r)->BeginStep();
    for (int l = 0; l < kLayers; ++l) {
      Token t = MakeToken(5, l, p);
      ASSERT_TRUE((*s)->Append(l, t.k.data(), t.v.data(), 1, DType::kF16).ok());
      ASSERT_TRUE((*store)->Append(*seq2, l, t.k.data(), t.v.data(), 1, DType::kF16).ok());
      std::vector<float> a(q_elems), b(q_elems);
      AttendStats st;
      ASSERT_TRUE((*s)->Attend(l, t.q.data(), &p, 1, a.data(), &st).ok());
      auto sel = (*r)->Select(*seq2, l, t.q.data(), 1, /*decode=*/true);
      ASSERT_TRUE(sel.ok());
      auto h = (*store)->FetchChunks(*seq2, l, sel->chunks);
      ASSERT_TRUE(h.ok() && h->Wait().ok());
      auto view = GetHotView(**store, *seq2, l);
      ASSERT_TRUE(view.ok());
      std::vector<kernels::KvSpan> parts{view->sinks};
      for (const auto& sp : h->spans()) parts.push_back(sp);
      for (int i = 0; i < view->n_local_spans; ++i) parts.push_back(view->local[i]);
      kernels::AttentionParams ap;
      ap.q_heads = g.q_heads;
      ap.kv_heads = g.kv_heads;
      ap.head_dim = g.head_dim;
      ap.dtype = g.dtype;
      ap.scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
      ap.n_queries = 1;
      ap.q = t.q.data();
      ap.q_positions = &p;
      ap.parts = parts.data();
      ap.n_parts = static_cast<int>(parts.size());
      ap.out = b.data();
      ASSERT_EQ(kernels::Attention(ap), kernels::KernelError::kOk);
      h->Release();
      ASSERT_EQ(st.chunks, sel->chunks.size());
      EXPECT_EQ((*s)->last_chunks()[l], sel->chunks) << "position " << p << " layer " << l;
      ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << "position " << p << " layer " << l;
      ++compared;
      with_chunks += st.chunks > 0 ? 1 : 0;
    }
  }
  EXPECT_EQ(compared, 260 * kLayers);
  EXPECT_GT(with_chunks, 100);  // retrieval really ran
  const SessionCounters c = (*s)->counters();
  EXPECT_EQ(c.steps, 260u);
  EXPECT_EQ(c.attends, 260u * kLayers);
  EXPECT_EQ(c.tokens_appended, 260u * kLayers);
  EXPECT_GT(c.chunks_attended, 0u);
}

TEST(Session, GrantsTheHotPoolCannotHoldAreReportedAsClipped) {
  // The entropy cut-off (Eq. 12) splits the step's L x k chunks by each layer's entropy, so a
  // layer can be granted more than k: layers 1 and 2 hold one repeated key and layer 0 random
  // keys, so their entropies differ. A pool of exactly k chunks passes Validate; the session
  // attends the best chunks the pool holds and reports the rest, while a session over a large
  // pool attends the whole grant.
  const int k = 8;
  StoreOptions small_opt = SmallStore(), big_opt = SmallStore();
  small_opt.hot_bytes = static_cast<uint64_t>(k) * small_opt.chunk_bytes();
  auto small_store = TieredStore::Open(small_opt);
  auto big_store = TieredStore::Open(big_opt);
  ASSERT_TRUE(small_store.ok() && big_store.ok());
  auto small = Session::Open(small_store->get(), Retrieval(k * small_opt.chunk_size));
  auto big = Session::Open(big_store->get(), Retrieval(k * small_opt.chunk_size));
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  std::vector<uint16_t> repeated(kKvHeads * kDim);
  for (size_t i = 0; i < repeated.size(); ++i) {
    const float x = std::sin(0.7f * static_cast<float>(i));
    FromFloat(DType::kF16, &x, &repeated[i], 1);
  }
  uint64_t clipped = 0;
  for (int64_t p = 0; p < 400; ++p) {
    ASSERT_TRUE((*small)->BeginStep(StepKind::kDecode).ok());
    ASSERT_TRUE((*big)->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      Token t = MakeToken(9, l, p);
      const uint16_t* key = l == 0 ? t.k.data() : repeated.data();
      std::vector<float> out(static_cast<size_t>(kQHeads) * kDim);
      AttendStats a, b;
      ASSERT_TRUE((*small)->Append(l, key, t.v.data(), 1, DType::kF16).ok());
      ASSERT_TRUE((*small)->Attend(l, t.q.data(), &p, 1, out.data(), &a).ok());
      ASSERT_TRUE((*big)->Append(l, key, t.v.data(), 1, DType::kF16).ok());
      ASSERT_TRUE((*big)->Attend(l, t.q.data(), &p, 1, out.data(), &b).ok());
      ASSERT_LE(a.chunks, static_cast<size_t>(k)) << "position " << p << " layer " << l;
      ASSERT_EQ(a.chunks + a.chunks_clipped, b.chunks) << "position " << p << " layer " << l;
      ASSERT_EQ(b.chunks_clipped, 0u);
      const std::vector<uint64_t>& chosen = (*small)->last_chunks()[l];
      const std::vector<uint64_t>& granted = (*big)->last_chunks()[l];
      ASSERT_TRUE(std::equal(chosen.begin(), chosen.end(), granted.begin()))  // the best first
          << "position " << p << " layer " << l;
      clipped += a.chunks_clipped;
    }
  }
  EXPECT_GT(clipped, 0u);
  EXPECT_EQ((*small)->counters().chunks_clipped, clipped);
  EXPECT_EQ((*big)->counters().chunks_clipped, 0u);
}

// With reuse_cosine and screen_period, each Attend says how its layer's chunks were chosen, and
// the session counts both kinds; without them, every selection searches every chunk.
TEST(Session, ReportsReusedAndSlicedSelections) {
  auto store = TieredStore::Open(SmallStore());
  ASSERT_TRUE(store.ok());
  SessionOptions fast = Retrieval(32);
  fast.retrieval.reuse_cosine = 0.9;
  fast.retrieval.screen_period = 4;
  auto a = Session::Open(store->get(), fast);
  auto b = Session::Open(store->get(), Retrieval(32));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  uint64_t reused = 0, sliced = 0;
  for (int64_t p = 0; p < 400; ++p) {
    const bool decode = p >= 200;
    for (Session* s : {a->get(), b->get()}) {
      ASSERT_TRUE(s->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill).ok());
      for (int l = 0; l < kLayers; ++l) {
        Token t = MakeToken(5, l, p);
        // Decode steps ask the same query: the probe stays, so a step reuses unless a chunk
        // landed since the last search (every 8 tokens), and then it screens a slice.
        const std::vector<float> q = decode ? MakeToken(5, l, 200).q : t.q;
        std::vector<float> out(static_cast<size_t>(kQHeads) * kDim);
        AttendStats st;
        ASSERT_TRUE(s->Append(l, t.k.data(), t.v.data(), 1, DType::kF16).ok());
        ASSERT_TRUE(s->Attend(l, q.data(), &p, 1, out.data(), &st).ok());
        ASSERT_FALSE(st.reused && st.sliced) << "position " << p << " layer " << l;
        if (s == b->get()) {
          ASSERT_FALSE(st.reused || st.sliced) << "position " << p << " layer " << l;
          continue;
        }
        if (!decode) ASSERT_FALSE(st.sliced) << "a prefill window screens every chunk, position " << p;
        reused += st.reused ? 1 : 0;
        sliced += st.sliced ? 1 : 0;
      }
    }
  }
  EXPECT_GT(reused, 0u);
  EXPECT_GT(sliced, 0u);
  EXPECT_EQ((*a)->counters().selections_reused, reused);
  EXPECT_EQ((*a)->counters().selections_sliced, sliced);
  EXPECT_EQ((*b)->counters().selections_reused, 0u);
  EXPECT_EQ((*b)->counters().selections_sliced, 0u);
}

TEST(Session, FullBudgetEqualsAttentionOverEveryChunk) {
  // retrieve = false attends every live chunk; a retrieval budget covering every chunk must
  // give the same outputs (the same keys, merged by log-sum-exp in another order: close).
  auto store = TieredStore::Open(SmallStore());
  ASSERT_TRUE(store.ok());
  SessionOptions full;
  full.retrieve = false;
  auto a = Session::Open(store->get(), full);
  // The whole hot pool (256 chunks of 8 tokens): more than every chunk of the sequence.
  auto b = Session::Open(store->get(), Retrieval(256 * 8));
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<float> oa, ob;
  ASSERT_TRUE(DriveSession(a->get(), 3, 128, 240, &oa).ok());
  ASSERT_TRUE(DriveSession(b->get(), 3, 128, 240, &ob).ok());
  ASSERT_EQ(oa.size(), ob.size());
  double err = 0, ref = 0;
  for (size_t i = 0; i < oa.size(); ++i) {
    err += (oa[i] - ob[i]) * (oa[i] - ob[i]);
    ref += oa[i] * oa[i];
  }
  EXPECT_LT(std::sqrt(err / ref), 1e-5);
  EXPECT_EQ((*a)->counters().chunks_attended, (*b)->counters().chunks_attended);
}

TEST(Session, SessionsKeepTheirOwnRetrievalState) {
  // Two sequences interleaved step by step through one store: each gives what it gives
  // alone. A retriever shared by both would mix their probe statistics (Eq. 8).
  std::vector<float> alone_a, alone_b, mixed_a, mixed_b;
  {
    auto store = TieredStore::Open(SmallStore());
    auto a = Session::Open(store->get(), Retrieval(32));
    ASSERT_TRUE(a.ok());
    ASSERT_TRUE(DriveSession(a->get(), 11, 160, 260, &alone_a).ok());
    auto b = Session::Open(store->get(), Retrieval(32));
    ASSERT_TRUE(DriveSession(b->get(), 12, 160, 260, &alone_b).ok());
  }
  auto store = TieredStore::Open(SmallStore());
  auto a = Session::Open(store->get(), Retrieval(32));
  auto b = Session::Open(store->get(), Retrieval(32));
  ASSERT_TRUE(a.ok() && b.ok());
  // Step-level interleaving.
  struct Driver {
    Session* s;
    uint32_t seed;
    int64_t b = 0;
    std::vector<float> outs;
    Status Step() {
      KVTIER_ASSIGN_OR_RETURN(int m, StepOnce(s, seed, b, 160, &outs));
      b += m;
      return Status::Ok();
    }
  };
  Driver da{a->get(), 11}, db{b->get(), 12};
  while (da.b < 260 || db.b < 260) {
    if (da.b < 260) ASSERT_TRUE(da.Step().ok());
    if (db.b < 260) ASSERT_TRUE(db.Step().ok());
  }
  ASSERT_EQ(da.outs.size(), alone_a.size());
  ASSERT_EQ(db.outs.size(), alone_b.size());
  EXPECT_EQ(std::memcmp(da.outs.data(), alone_a.data(), alone_a.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(db.outs.data(), alone_b.data(), alone_b.size() * sizeof(float)), 0);
}

TEST(Session, EightSessionsOnFourThreadsMatchTheirSingleThreadedRuns) {
  // One store with a disk tier and a warm tier too small for everything, so chunks move
  // between tiers while the sessions run. Each session's outputs must equal, bit for bit,
  // what it gives when it runs alone on a fresh store.
  constexpr int kSessions = 8, kThreads = 4;
  constexpr int64_t kPrefill = 320, kTotal = 400;
  TempDir dir;
  std::vector<std::vector<float>> alone(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    auto so = SmallStore(dir.path() + "/alone" + std::to_string(i));
    auto store = TieredStore::Open(so);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto s = Session::Open(store->get(), Retrieval(32));
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(DriveSession(s->get(), 100 + i, kPrefill, kTotal, &alone[i]).ok());
  }
  StoreOptions so = SmallStore(dir.path() + "/shared");
  so.warm_bytes = 96 * so.chunk_bytes();  // 8 sessions x 3 layers x ~45 chunks do not fit
  auto store = TieredStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  std::vector<std::unique_ptr<Session>> sessions;
  for (int i = 0; i < kSessions; ++i) {
    auto s = Session::Open(store->get(), Retrieval(32));
    ASSERT_TRUE(s.ok());
    sessions.push_back(std::move(*s));
  }
  std::vector<std::vector<float>> shared(kSessions);
  std::vector<Status> status(kSessions);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = t; i < kSessions; i += kThreads)
        status[i] = DriveSession(sessions[i].get(), 100 + i, kPrefill, kTotal, &shared[i]);
    });
  for (auto& th : threads) th.join();
  const StoreCounters c = (*store)->counters();
  EXPECT_GT(c.cold_reads, 0u) << "the warm tier should have been too small";
  for (int i = 0; i < kSessions; ++i) {
    ASSERT_TRUE(status[i].ok()) << "session " << i << ": " << status[i].ToString();
    ASSERT_EQ(shared[i].size(), alone[i].size());
    EXPECT_EQ(std::memcmp(shared[i].data(), alone[i].data(), alone[i].size() * sizeof(float)), 0)
        << "session " << i << " differs from its single-threaded run";
    EXPECT_GT(sessions[i]->counters().chunks_attended, 0u);
  }
}

TEST(Session, InfLLMPositionsRotateAtAttentionTime) {
  // With every chunk attended, kInfLLM over keys stored before RoPE equals attention over
  // keys rotated by hand where InfLLM puts them (chunks and separated sinks at L0).
  auto store = TieredStore::Open(SmallStore());
  SessionOptions o;
  o.retrieve = false;
  o.positions = PositionMode::kInfLLM;
  auto s = Session::Open(store->get(), o);
  ASSERT_TRUE(s.ok());
  const Geometry g = SmallStore().geometry;
  const std::vector<double> inv = kernels::RopeInvFreq(kDim, 10000.0);
  std::vector<float> all_k, all_v;
  for (int64_t p = 0; p < 120; ++p) {
    ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
    Token t = MakeToken(9, 0, p);
    std::vector<float> kf(t.k.size()), vf(t.v.size());
    ToFloat(DType::kF16, t.k.data(), kf.data(), kf.size());
    ToFloat(DType::kF16, t.v.data(), vf.data(), vf.size());
    all_k.insert(all_k.end(), kf.begin(), kf.end());
    all_v.insert(all_v.end(), vf.begin(), vf.end());
    for (int l = 0; l < kLayers; ++l)
      ASSERT_TRUE((*s)->Append(l, t.k.data(), t.v.data(), 1, DType::kF16).ok());
    std::vector<float> out(static_cast<size_t>(kQHeads) * kDim);
    ASSERT_TRUE((*s)->Attend(0, t.q.data(), &p, 1, out.data()).ok());
    if (p != 119) continue;
    // Reference: L0 = first position of the local window.
    auto view = GetHotView(**store, (*s)->sequence(), 0);
    ASSERT_TRUE(view.ok());
    const int64_t l0 = view->local[0].first_position;
    ASSERT_GT(l0, 8) << "chunks must separate the sinks from the local window";
    std::vector<float> k = all_k;
    std::vector<int64_t> rp(120);
    for (int64_t i = 0; i < 120; ++i) rp[i] = i >= l0 ? i : l0;
    kernels::Rope(k.data(), 120, kKvHeads, kDim, rp.data(), inv.data());
    std::vector<float> q = t.q;
    kernels::Rope(q.data(), 1, kQHeads, kDim, &p, inv.data());
    kernels::KvSpan all{k.data(), all_v.data(), 120, 0, nullptr};
    kernels::AttentionParams ap;
    ap.q_heads = g.q_heads;
    ap.kv_heads = g.kv_heads;
    ap.head_dim = g.head_dim;
    ap.dtype = DType::kF32;
    ap.n_queries = 1;
    ap.q = q.data();
    ap.q_positions = &p;
    ap.parts = &all;
    ap.n_parts = 1;
    std::vector<float> ref(out.size());
    ap.out = ref.data();
    ASSERT_EQ(kernels::Attention(ap), kernels::KernelError::kOk);
    double err = 0, den = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      err += (out[i] - ref[i]) * (out[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    EXPECT_LT(std::sqrt(err / den), 1e-5);
  }
}

// With InfLLM positions the representative-key statistics are the attention the model pays
// to its local window: queries and keys rotated at their true positions. The same keys stored
// already rotated (absolute positions), with the queries rotated by hand, are that reference:
// both stores must choose the same tokens as every chunk's representatives. (By attention
// alone, ReprChoice::kMass: the diverse choice also compares the stored keys with each other,
// and rotating keys at their own positions changes those angles.)
TEST(Session, InfLLMStatisticsAttendWhereTheModelAttends) {
  StoreOptions so = SmallStore();
  so.repr_choice = ReprChoice::kMass;
  so.geometry.dtype = DType::kF32;  // the same key bits in both stores, rotated or not
  so.n_sink = 0;                    // InfLLM puts separated sinks at L0: none here, so both agree
  auto raw_store = TieredStore::Open(so);
  auto rot_store = TieredStore::Open(so);
  ASSERT_TRUE(raw_store.ok() && rot_store.ok());
  SessionOptions infllm = Retrieval(64);
  infllm.positions = PositionMode::kInfLLM;
  auto a = Session::Open(raw_store->get(), infllm);
  auto b = Session::Open(rot_store->get(), Retrieval(64));
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<double> inv = kernels::RopeInvFreq(kDim, 10000.0);
  constexpr int kTokens = 160, kWindow = 16;
  // Raw keys per layer, [token, kv_heads, head_dim], to find which token a representative is.
  std::vector<std::vector<float>> raw_keys(kLayers), rot_keys(kLayers);
  for (int64_t b0 = 0; b0 < kTokens; b0 += kWindow) {
    ASSERT_TRUE((*a)->BeginStep(StepKind::kPrefill).ok());
    ASSERT_TRUE((*b)->BeginStep(StepKind::kPrefill).ok());
    std::vector<int64_t> pos(kWindow);
    for (int t = 0; t < kWindow; ++t) pos[t] = b0 + t;
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> k, v, q;
      for (int t = 0; t < kWindow; ++t) {
        Token tok = MakeToken(21, l, b0 + t);
        std::vector<float> kf(tok.k.size()), vf(tok.v.size());
        ToFloat(DType::kF16, tok.k.data(), kf.data(), kf.size());
        ToFloat(DType::kF16, tok.v.data(), vf.data(), vf.size());
        k.insert(k.end(), kf.begin(), kf.end());
        v.insert(v.end(), vf.begin(), vf.end());
        q.insert(q.end(), tok.q.begin(), tok.q.end());
      }
      std::vector<float> k_rot = k, q_rot = q;
      kernels::Rope(k_rot.data(), kWindow, kKvHeads, kDim, pos.data(), inv.data());
      kernels::Rope(q_rot.data(), kWindow, kQHeads, kDim, pos.data(), inv.data());
      raw_keys[l].insert(raw_keys[l].end(), k.begin(), k.end());
      rot_keys[l].insert(rot_keys[l].end(), k_rot.begin(), k_rot.end());
      std::vector<float> out(static_cast<size_t>(kWindow) * kQHeads * kDim);
      ASSERT_TRUE((*a)->Append(l, k.data(), v.data(), kWindow, DType::kF32).ok());
      ASSERT_TRUE((*a)->Attend(l, q.data(), pos.data(), kWindow, out.data()).ok());
      ASSERT_TRUE((*b)->Append(l, k_rot.data(), v.data(), kWindow, DType::kF32).ok());
      ASSERT_TRUE((*b)->Attend(l, q_rot.data(), pos.data(), kWindow, out.data()).ok());
    }
  }
  // The token of chunk c whose key (head h) equals `key` exactly; -1 if none.
  auto token_of = [&](const std::vector<float>& keys, uint64_t c, int h, const float* key) -> int64_t {
    for (int64_t t = static_cast<int64_t>(c) * so.chunk_size; t < static_cast<int64_t>(c + 1) * so.chunk_size;
         ++t)
      if (std::memcmp(keys.data() + (t * kKvHeads + h) * kDim, key, kDim * sizeof(float)) == 0) return t;
    return -1;
  };
  int compared = 0;
  for (int l = 0; l < kLayers; ++l) {
    auto na = (*raw_store)->ChunkCount((*a)->sequence(), l);
    auto nb = (*rot_store)->ChunkCount((*b)->sequence(), l);
    ASSERT_TRUE(na.ok() && nb.ok());
    ASSERT_EQ(*na, *nb);
    ASSERT_GE(*na, 10u) << "the windows must seal chunks";
    std::vector<float> ra(static_cast<size_t>(so.repr_topk) * kKvHeads * kDim), rb(ra.size());
    for (uint64_t c = 0; c < *na; ++c) {
      ASSERT_TRUE((*raw_store)
                      ->GetRepresentatives(ChunkKey{(*a)->sequence(), static_cast<uint32_t>(l), c}, ra.data())
                      .ok());
      ASSERT_TRUE((*rot_store)
                      ->GetRepresentatives(ChunkKey{(*b)->sequence(), static_cast<uint32_t>(l), c}, rb.data())
                      .ok());
      for (int h = 0; h < kKvHeads; ++h) {
        std::vector<int64_t> ta, tb;
        for (int r = 0; r < so.repr_topk; ++r) {
          ta.push_back(
              token_of(raw_keys[l], c, h, ra.data() + (static_cast<size_t>(r) * kKvHeads + h) * kDim));
          tb.push_back(
              token_of(rot_keys[l], c, h, rb.data() + (static_cast<size_t>(r) * kKvHeads + h) * kDim));
        }
        std::sort(ta.begin(), ta.end());
        std::sort(tb.begin(), tb.end());
        EXPECT_EQ(ta, tb) << "layer " << l << " chunk " << c << " head " << h;
        EXPECT_GE(ta.front(), 0) << "a representative that is no key of its chunk";
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 50);
}

// A step plans once what does not depend on the layer (the queries' positions, L0, where each
// part's keys are rotated, the plan input's geometry and pool): one build per step, reused by
// the step's other layers, with the same bits as a plan built for every layer. Prefill windows
// then decode steps, retrieval on, kept queries on, in both position modes.
TEST(Session, PlansOncePerStepAndReusesThePlanBitForBit) {
  for (PositionMode mode : {PositionMode::kAbsolute, PositionMode::kInfLLM}) {
    SCOPED_TRACE(PositionModeName(mode));
    auto store_a = TieredStore::Open(SmallStore());
    auto store_b = TieredStore::Open(SmallStore());
    ASSERT_TRUE(store_a.ok() && store_b.ok());
    SessionOptions o = Retrieval(32);
    o.positions = mode;
    o.keep_queries = 4;
    auto a = Session::Open(store_a->get(), o);  // reuses the step plan
    auto b = Session::Open(store_b->get(), o);  // builds it for every layer
    ASSERT_TRUE(a.ok() && b.ok());
    SessionImpl& reuse = ImplOf(**a);
    SessionImpl& per_layer = ImplOf(**b);
    constexpr int64_t kPrefill = 160, kTotal = 200;
    int steps = 0, with_chunks = 0;
    for (int64_t b0 = 0; b0 < kTotal; ++steps) {
      const bool decode = b0 >= kPrefill;
      const int m = decode ? 1 : 16;
      const StepKind kind = decode ? StepKind::kDecode : StepKind::kPrefill;
      ASSERT_TRUE((*a)->BeginStep(kind).ok());
      ASSERT_TRUE((*b)->BeginStep(kind).ok());
      const uint64_t builds_a = reuse.step_plan_builds(), builds_b = per_layer.step_plan_builds();
      std::vector<int64_t> pos(m);
      for (int t = 0; t < m; ++t) pos[t] = b0 + t;
      for (int l = 0; l < kLayers; ++l) {
        std::vector<uint16_t> k, v;
        std::vector<float> q;
        for (int t = 0; t < m; ++t) {
          Token tok = MakeToken(41, l, b0 + t);
          k.insert(k.end(), tok.k.begin(), tok.k.end());
          v.insert(v.end(), tok.v.begin(), tok.v.end());
          q.insert(q.end(), tok.q.begin(), tok.q.end());
        }
        ASSERT_TRUE((*a)->Append(l, k.data(), v.data(), m, DType::kF16).ok());
        ASSERT_TRUE((*b)->Append(l, k.data(), v.data(), m, DType::kF16).ok());
        std::vector<float> out_a(static_cast<size_t>(m) * kQHeads * kDim), out_b(out_a.size());
        per_layer.ForgetStepPlan();
        ASSERT_TRUE((*a)->Attend(l, q.data(), pos.data(), m, out_a.data()).ok());
        ASSERT_TRUE((*b)->Attend(l, q.data(), pos.data(), m, out_b.data()).ok());
        ASSERT_EQ(std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)), 0)
            << "step at " << b0 << " layer " << l << ": the reused plan attends differently";
        ASSERT_EQ((*a)->last_chunks()[l], (*b)->last_chunks()[l]) << "step at " << b0 << " layer " << l;
        with_chunks += (*a)->last_chunks()[l].empty() ? 0 : 1;
      }
      EXPECT_EQ(reuse.step_plan_builds() - builds_a, 1u) << "step at " << b0 << ": one plan per step";
      EXPECT_EQ(per_layer.step_plan_builds() - builds_b, static_cast<uint64_t>(kLayers)) << "step at " << b0;
      b0 += m;
    }
    EXPECT_EQ(steps, 10 + 40);
    EXPECT_GT(with_chunks, 20) << "retrieved chunks must join the attention";
    // The kept queries (rotated once per layer call and read back) compress alike.
    auto ra = (*a)->Compress("h2o", 64);
    auto rb = (*b)->Compress("h2o", 64);
    ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status().ToString() << " " << rb.status().ToString();
    EXPECT_EQ(ra->dropped_chunks, rb->dropped_chunks);
    EXPECT_EQ(ra->kept_tokens, rb->kept_tokens);
    EXPECT_GT(ra->dropped_chunks, 0u);
  }
}

// The plan is reused only where it fits: a layer holding one more token than the step's first
// layer attends at other positions, so it builds its own plan, and attends as the first layer
// of a step would.
TEST(Session, ALayerHoldingOtherTokensBuildsItsOwnStepPlan) {
  SessionOptions o;
  o.retrieve = false;  // without retrieval, layers may be skipped and may differ in length
  o.positions = PositionMode::kInfLLM;
  auto store_a = TieredStore::Open(SmallStore());
  auto store_b = TieredStore::Open(SmallStore());
  ASSERT_TRUE(store_a.ok() && store_b.ok());
  auto a = Session::Open(store_a->get(), o);
  auto b = Session::Open(store_b->get(), o);
  ASSERT_TRUE(a.ok() && b.ok());
  // Layer 0 holds 100 tokens, layer 1 101.
  for (int64_t p = 0; p < 101; ++p)
    for (int l = 0; l < 2; ++l) {
      if (l == 0 && p == 100) continue;
      Token t = MakeToken(43, l, p);
      ASSERT_TRUE((*a)->Append(l, t.k.data(), t.v.data(), 1, DType::kF16).ok());
      ASSERT_TRUE((*b)->Append(l, t.k.data(), t.v.data(), 1, DType::kF16).ok());
    }
  const std::vector<float> q0 = MakeToken(43, 0, 99).q, q1 = MakeToken(43, 1, 100).q;
  std::vector<float> out0(q0.size()), out1(q1.size()), ref1(q1.size());
  const int64_t p0 = 99, p1 = 100;
  const uint64_t builds = ImplOf(**a).step_plan_builds();
  ASSERT_TRUE((*a)->BeginStep(StepKind::kDecode).ok());
  ASSERT_TRUE((*a)->Attend(0, q0.data(), &p0, 1, out0.data()).ok());
  ASSERT_TRUE((*a)->Attend(1, q1.data(), &p1, 1, out1.data()).ok());
  EXPECT_EQ(ImplOf(**a).step_plan_builds() - builds, 2u);
  ASSERT_TRUE((*b)->BeginStep(StepKind::kDecode).ok());  // layer 1 first in its step
  ASSERT_TRUE((*b)->Attend(1, q1.data(), &p1, 1, ref1.data()).ok());
  EXPECT_EQ(std::memcmp(out1.data(), ref1.data(), out1.size() * sizeof(float)), 0);
}

TEST(Session, MassFromAttendEqualsTheStatisticsPass) {
  // Attend takes a prefill window's representative-key statistics from its own attention;
  // Gather runs the separate statistics pass (the store's ObserveQueries, or the session's
  // InfLLM pass). Same data through both, in both position modes: the local ring's mass is
  // the same numbers after every layer step, and Attend's output is the attention over
  // sinks | chunks | local.
  for (PositionMode mode : {PositionMode::kAbsolute, PositionMode::kInfLLM}) {
    SCOPED_TRACE(PositionModeName(mode));
    auto store_a = TieredStore::Open(SmallStore());
    auto store_b = TieredStore::Open(SmallStore());
    ASSERT_TRUE(store_a.ok() && store_b.ok());
    SessionOptions o = Retrieval(32);
    o.positions = mode;
    auto a = Session::Open(store_a->get(), o);
    auto b = Session::Open(store_b->get(), o);
    ASSERT_TRUE(a.ok() && b.ok());
    const std::vector<double> inv = kernels::RopeInvFreq(kDim, 10000.0);
    constexpr int kWindow = 16;
    int compared = 0, with_chunks = 0;
    for (int64_t b0 = 0; b0 < 192; b0 += kWindow) {
      ASSERT_TRUE((*a)->BeginStep(StepKind::kPrefill).ok());
      ASSERT_TRUE((*b)->BeginStep(StepKind::kPrefill).ok());
      std::vector<int64_t> pos(kWindow);
      for (int t = 0; t < kWindow; ++t) pos[t] = b0 + t;
      for (int l = 0; l < kLayers; ++l) {
        std::vector<uint16_t> k, v;
        std::vector<float> q;
        for (int t = 0; t < kWindow; ++t) {
          Token tok = MakeToken(33, l, b0 + t);
          k.insert(k.end(), tok.k.begin(), tok.k.end());
          v.insert(v.end(), tok.v.begin(), tok.v.end());
          q.insert(q.end(), tok.q.begin(), tok.q.end());
        }
        ASSERT_TRUE((*a)->Append(l, k.data(), v.data(), kWindow, DType::kF16).ok());
        ASSERT_TRUE((*b)->Append(l, k.data(), v.data(), kWindow, DType::kF16).ok());
        std::vector<float> out(static_cast<size_t>(kWindow) * kQHeads * kDim), ref(out.size());
        ASSERT_TRUE((*a)->Attend(l, q.data(), pos.data(), kWindow, out.data()).ok());
        auto lp = ImplOf(**b).Gather(l, q.data(), pos.data(), kWindow);
        ASSERT_TRUE(lp.ok()) << lp.status().ToString();
        EXPECT_EQ((*a)->last_chunks()[l], lp->chunks) << "window " << b0 << " layer " << l;
        // The reference attention over Gather's parts, rotated as Attend rotates them.
        std::vector<float> q_ref = q;
        std::vector<std::vector<float>> kf(lp->parts.size()), vf(lp->parts.size());
        std::vector<kernels::KvSpan> parts = lp->parts;
        for (size_t i = 0; i < parts.size(); ++i) {
          const size_t n = static_cast<size_t>(parts[i].n_tokens) * kKvHeads * kDim;
          kf[i].resize(std::max<size_t>(1, n));
          vf[i].resize(std::max<size_t>(1, n));
          ToFloat(DType::kF16, parts[i].k, kf[i].data(), n);
          ToFloat(DType::kF16, parts[i].v, vf[i].data(), n);
          if (mode == PositionMode::kInfLLM && n > 0) {
            std::vector<int64_t> rp(static_cast<size_t>(parts[i].n_tokens));
            for (int t = 0; t < parts[i].n_tokens; ++t)
              rp[t] = lp->rope_positions[i] >= 0 ? lp->rope_positions[i] : parts[i].first_position + t;
            kernels::Rope(kf[i].data(), parts[i].n_tokens, kKvHeads, kDim, rp.data(), inv.data());
          }
          parts[i].k = kf[i].data();
          parts[i].v = vf[i].data();
        }
        if (mode == PositionMode::kInfLLM)
          kernels::Rope(q_ref.data(), kWindow, kQHeads, kDim, pos.data(), inv.data());
        kernels::AttentionParams ap;
        ap.q_heads = kQHeads;
        ap.kv_heads = kKvHeads;
        ap.head_dim = kDim;
        ap.dtype = DType::kF32;
        ap.n_queries = kWindow;
        ap.q = q_ref.data();
        ap.q_positions = pos.data();
        ap.parts = parts.data();
        ap.n_parts = static_cast<int>(parts.size());
        ap.out = ref.data();
        ASSERT_EQ(kernels::Attention(ap), kernels::KernelError::kOk);
        for (size_t i = 0; i < out.size(); ++i)
          ASSERT_NEAR(out[i], ref[i], 1e-5f) << "window " << b0 << " layer " << l << " element " << i;
        with_chunks += lp->n_chunks > 0 ? 1 : 0;
        lp->Release();
        const std::vector<float> mass_a = TieredStoreTestPeer::RingMass(**store_a, (*a)->sequence(), l);
        const std::vector<float> mass_b = TieredStoreTestPeer::RingMass(**store_b, (*b)->sequence(), l);
        ASSERT_FALSE(mass_a.empty());
        ASSERT_EQ(mass_a, mass_b) << "window " << b0 << " layer " << l;
        ++compared;
      }
    }
    EXPECT_EQ(compared, 12 * kLayers);
    EXPECT_GT(with_chunks, 10) << "retrieved chunks must join the attention";
    // The chunks sealed from that mass chose the same representatives.
    for (int l = 0; l < kLayers; ++l) {
      auto na = (*store_a)->ChunkCount((*a)->sequence(), l);
      ASSERT_TRUE(na.ok());
      ASSERT_GE(*na, 10u);
      std::vector<float> ra(static_cast<size_t>(SmallStore().repr_topk) * kKvHeads * kDim), rb(ra.size());
      for (uint64_t c = 0; c < *na; ++c) {
        const ChunkKey key_a{(*a)->sequence(), static_cast<uint32_t>(l), c};
        ASSERT_TRUE((*store_a)->GetRepresentatives(key_a, ra.data()).ok());
        const ChunkKey key_b{(*b)->sequence(), static_cast<uint32_t>(l), c};
        ASSERT_TRUE((*store_b)->GetRepresentatives(key_b, rb.data()).ok());
        EXPECT_EQ(ra, rb) << "layer " << l << " chunk " << c;
      }
    }
  }
}

TEST(Session, EveryKeyARepresentativeSkipsTheStatistics) {
  // With repr_topk = chunk_size every key is a representative, so the statistics choose
  // nothing: a prefill Attend runs the plain attention (no dense | chunks split, no mass), bit
  // for bit what a session with observe_prefill = false computes, the ring holds no mass, and
  // each chunk's representatives are its keys.
  StoreOptions so = SmallStore();
  so.repr_topk = so.chunk_size;
  auto store_a = TieredStore::Open(so);
  auto store_b = TieredStore::Open(so);
  ASSERT_TRUE(store_a.ok() && store_b.ok());
  SessionOptions oa = Retrieval(32), ob = Retrieval(32);
  ob.observe_prefill = false;
  auto a = Session::Open(store_a->get(), oa);
  auto b = Session::Open(store_b->get(), ob);
  ASSERT_TRUE(a.ok() && b.ok());
  constexpr int kWindow = 16;
  int with_chunks = 0;
  for (int64_t b0 = 0; b0 < 192; b0 += kWindow) {
    ASSERT_TRUE((*a)->BeginStep(StepKind::kPrefill).ok());
    ASSERT_TRUE((*b)->BeginStep(StepKind::kPrefill).ok());
    std::vector<int64_t> pos(kWindow);
    for (int t = 0; t < kWindow; ++t) pos[t] = b0 + t;
    for (int l = 0; l < kLayers; ++l) {
      std::vector<uint16_t> k, v;
      std::vector<float> q;
      for (int t = 0; t < kWindow; ++t) {
        Token tok = MakeToken(41, l, b0 + t);
        k.insert(k.end(), tok.k.begin(), tok.k.end());
        v.insert(v.end(), tok.v.begin(), tok.v.end());
        q.insert(q.end(), tok.q.begin(), tok.q.end());
      }
      ASSERT_TRUE((*a)->Append(l, k.data(), v.data(), kWindow, DType::kF16).ok());
      ASSERT_TRUE((*b)->Append(l, k.data(), v.data(), kWindow, DType::kF16).ok());
      std::vector<float> out_a(static_cast<size_t>(kWindow) * kQHeads * kDim), out_b(out_a.size());
      ASSERT_TRUE((*a)->Attend(l, q.data(), pos.data(), kWindow, out_a.data()).ok());
      ASSERT_TRUE((*b)->Attend(l, q.data(), pos.data(), kWindow, out_b.data()).ok());
      ASSERT_EQ((*a)->last_chunks()[l], (*b)->last_chunks()[l]) << "window " << b0 << " layer " << l;
      with_chunks += (*a)->last_chunks()[l].empty() ? 0 : 1;
      ASSERT_EQ(0, std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)))
          << "window " << b0 << " layer " << l;
      for (float m : TieredStoreTestPeer::RingMass(**store_a, (*a)->sequence(), l))
        ASSERT_EQ(m, 0.0f) << "the ring got mass: the statistics ran";
    }
  }
  EXPECT_GT(with_chunks, 10) << "retrieved chunks must join the attention";
  // Every key of a chunk is one of its representatives (head by head).
  const size_t per_token = static_cast<size_t>(kKvHeads) * kDim;
  std::vector<float> repr(static_cast<size_t>(so.repr_topk) * per_token), keys(repr.size());
  std::vector<uint16_t> k16(repr.size()), v16(repr.size());
  for (int l = 0; l < kLayers; ++l) {
    auto n = (*store_a)->ChunkCount((*a)->sequence(), l);
    ASSERT_TRUE(n.ok());
    ASSERT_GE(*n, 10u);
    for (uint64_t c = 0; c < *n; ++c) {
      ASSERT_TRUE(
          (*store_a)
              ->GetRepresentatives(ChunkKey{(*a)->sequence(), static_cast<uint32_t>(l), c}, repr.data())
              .ok());
      const int64_t first = so.n_sink + static_cast<int64_t>(c) * so.chunk_size;
      ASSERT_TRUE((*store_a)
                      ->ReadTokens((*a)->sequence(), l, first, first + so.chunk_size, k16.data(), v16.data())
                      .ok());
      ToFloat(DType::kF16, k16.data(), keys.data(), keys.size());
      for (int h = 0; h < kKvHeads; ++h) {
        std::vector<std::vector<float>> want, got;
        for (int t = 0; t < so.chunk_size; ++t) {
          const float* kt = keys.data() + (static_cast<size_t>(t) * kKvHeads + h) * kDim;
          want.emplace_back(kt, kt + kDim);
          const float* rt = repr.data() + (static_cast<size_t>(t) * kKvHeads + h) * kDim;
          got.emplace_back(rt, rt + kDim);
        }
        std::sort(want.begin(), want.end());
        std::sort(got.begin(), got.end());
        EXPECT_EQ(want, got) << "layer " << l << " chunk " << c << " head " << h;
      }
    }
  }
}

// A store over a cold tier with a small warm tier releases the representatives of chunks that
// left warm; a session attached afterwards builds its indexes from the representatives read
// back from the cold tier, and attends exactly as it does over a store that kept them all.
TEST(Session, ASessionAttachedAfterRepresentativesLeftMemoryAttendsAsOverAResidentStore) {
  TempDir dir;
  StoreOptions paged_o = SmallStore(dir.path());
  paged_o.warm_bytes = 8 * paged_o.chunk_bytes();
  auto paged = TieredStore::Open(paged_o);
  auto resident = TieredStore::Open(SmallStore());
  ASSERT_TRUE(paged.ok() && resident.ok());
  auto writer_p = Session::Open(paged->get(), Retrieval(64));
  auto writer_r = Session::Open(resident->get(), Retrieval(64));
  ASSERT_TRUE(writer_p.ok() && writer_r.ok());
  std::vector<float> outs_p, outs_r;
  ASSERT_TRUE(DriveSession(writer_p->get(), 29, 320, 321, &outs_p).ok());
  ASSERT_TRUE(DriveSession(writer_r->get(), 29, 320, 321, &outs_r).ok());
  EXPECT_EQ(outs_p, outs_r);
  ASSERT_TRUE((*paged)->WaitForDurable().ok());
  const size_t repr_bytes = static_cast<size_t>(paged_o.repr_topk) * kKvHeads * kDim * 2;
  ASSERT_GE((*resident)->metadata_bytes(), (*paged)->metadata_bytes() + 60 * repr_bytes)
      << "most chunks left warm, and their representatives left memory";
  const SequenceId seq_p = (*writer_p)->sequence(), seq_r = (*writer_r)->sequence();
  writer_p->reset();
  writer_r->reset();
  auto reader_p = Session::Attach(paged->get(), seq_p, Retrieval(64));
  auto reader_r = Session::Attach(resident->get(), seq_r, Retrieval(64));
  ASSERT_TRUE(reader_p.ok()) << reader_p.status().ToString();
  ASSERT_TRUE(reader_r.ok());
  outs_p.clear();
  outs_r.clear();
  for (int64_t b = 321; b < 329; ++b) {
    auto mp = StepOnce(reader_p->get(), 29, b, 0, &outs_p);
    ASSERT_TRUE(mp.ok()) << mp.status().ToString();
    ASSERT_TRUE(StepOnce(reader_r->get(), 29, b, 0, &outs_r).ok());
    for (int l = 0; l < kLayers; ++l)
      ASSERT_EQ((*reader_p)->last_chunks()[l], (*reader_r)->last_chunks()[l])
          << "step " << b << " layer " << l;
  }
  EXPECT_GT((*reader_p)->last_chunks()[0].size(), 0u) << "retrieval chose chunks";
  EXPECT_EQ(outs_p, outs_r);
}

TEST(Session, ASessionAttachedToTheSameSequenceNeverSelectsADroppedChunk) {
  // Compress drops chunks from the store; every retrieval index over the sequence learns it
  // from the store at its next step, not only the index of the session that compressed.
  auto store = TieredStore::Open(SmallStore());
  SessionOptions o = Retrieval(32);
  o.keep_queries = 16;
  auto s = Session::Open(store->get(), o);
  ASSERT_TRUE(s.ok());
  std::vector<float> outs;
  ASSERT_TRUE(DriveSession(s->get(), 23, 320, 321, &outs).ok());
  SessionOptions every = Retrieval(64 * 8);  // more than the sequence's chunks, all taken
  every.retrieval.alloc = "topk";
  auto reader = Session::Attach(store->get(), (*s)->sequence(), every);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const int64_t p = 320;
  auto attend_all = [&](Session* x) {
    ASSERT_TRUE(x->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      Token t = MakeToken(23, l, p);
      std::vector<float> out(static_cast<size_t>(kQHeads) * kDim);
      Status st = x->Attend(l, t.q.data(), &p, 1, out.data());
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  };
  attend_all(reader->get());  // indexes every chunk
  auto before = (*store)->ListChunks((*s)->sequence(), 0);
  ASSERT_TRUE(before.ok());
  EXPECT_EQ((*reader)->last_chunks()[0].size(), before->size());
  auto rep = (*s)->Compress("h2o", 8 + 32 + 8 * 8);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  ASSERT_GT(rep->dropped_chunks, 0u);
  attend_all(reader->get());
  for (int l = 0; l < kLayers; ++l) {
    auto live = (*store)->ListChunks((*s)->sequence(), l);
    ASSERT_TRUE(live.ok());
    std::vector<uint64_t> live_ids;
    for (const ChunkInfo& c : *live) live_ids.push_back(c.key.index);
    std::vector<uint64_t> chosen = (*reader)->last_chunks()[l];
    std::sort(chosen.begin(), chosen.end());
    EXPECT_EQ(chosen, live_ids) << "layer " << l;
  }
}

TEST(Session, BadCallsGetNamedErrors) {
  auto store = TieredStore::Open(SmallStore());
  auto s = Session::Open(store->get(), Retrieval(32));
  ASSERT_TRUE(s.ok());
  std::vector<float> q(kQHeads * kDim), out(q.size());
  int64_t pos = 0;
  auto expect = [](const Status& st, StatusCode code, const std::string& needle) {
    EXPECT_EQ(st.code(), code) << st.ToString();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.ToString();
  };
  expect((*s)->Attend(0, q.data(), &pos, 1, out.data()), StatusCode::kFailedPrecondition, "BeginStep");
  ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
  expect((*s)->Attend(kLayers, q.data(), &pos, 1, out.data()), StatusCode::kInvalidArgument, "layer 3");
  expect((*s)->Attend(0, nullptr, &pos, 1, out.data()), StatusCode::kInvalidArgument, "null");
  expect((*s)->Attend(0, q.data(), &pos, 1, nullptr), StatusCode::kInvalidArgument, "out");
  expect((*s)->Attend(0, q.data(), &pos, 2, out.data()), StatusCode::kInvalidArgument, "one query");
  Token t = MakeToken(1, 0, 0);
  ASSERT_TRUE((*s)->Append(0, t.k.data(), t.v.data(), 1, DType::kF16).ok());
  ASSERT_TRUE((*s)->Append(1, t.k.data(), t.v.data(), 1, DType::kF16).ok());
  expect((*s)->Attend(1, t.q.data(), &pos, 1, out.data()), StatusCode::kFailedPrecondition,
         "shallow to deep");
  {
    Status st = (*s)->Attend(0, t.q.data(), &pos, 1, out.data());
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  expect((*s)->Attend(0, t.q.data(), &pos, 1, out.data()), StatusCode::kFailedPrecondition, "layer 1");
  expect((*s)->Append(0, t.k.data(), t.v.data(), 1, DType::kF32), StatusCode::kInvalidArgument, "");
  expect((*s)->Compress("h2o", 1000).status(), StatusCode::kFailedPrecondition, "keep_queries");
  SessionOptions bad = Retrieval(32);
  bad.retrieval.alloc = "nope";
  expect(Session::Open(store->get(), bad).status(), StatusCode::kInvalidArgument, "alloc");
  bad = Retrieval(32);
  bad.keep_queries = -1;
  expect(Session::Open(store->get(), bad).status(), StatusCode::kInvalidArgument, "keep_queries");
  expect(Session::Attach(store->get(), 999, Retrieval(32)).status(), StatusCode::kNotFound, "");
  expect(Session::Open(nullptr, Retrieval(32)).status(), StatusCode::kInvalidArgument, "store");
  ASSERT_TRUE((*s)->Drop().ok());
  expect((*s)->BeginStep(StepKind::kDecode), StatusCode::kFailedPrecondition, "dropped");
  EXPECT_TRUE(MakeRetrievalPreset("nope").status().message().find("kvtier") != std::string::npos);
}

TEST(Session, CompressKeepsTheBudgetAndForgetsDroppedChunks) {
  auto store = TieredStore::Open(SmallStore());
  SessionOptions o = Retrieval(32);
  o.keep_queries = 16;
  auto s = Session::Open(store->get(), o);
  ASSERT_TRUE(s.ok());
  std::vector<float> outs;
  ASSERT_TRUE(DriveSession(s->get(), 21, 320, 321, &outs).ok());
  auto before = (*store)->ChunkCount((*s)->sequence(), 0);
  ASSERT_TRUE(before.ok());
  const int64_t budget = 8 + 32 + 8 * 8;  // sinks + local + 8 chunks
  auto rep = (*s)->Compress("h2o", budget);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_GT(rep->dropped_chunks, 0u);
  EXPECT_LE(rep->kept_tokens, static_cast<uint64_t>(budget));
  for (int l = 0; l < kLayers; ++l) {
    auto live = (*store)->ListChunks((*s)->sequence(), l);
    ASSERT_TRUE(live.ok());
    EXPECT_LE(live->size(), 8u);
  }
  // Decoding goes on over what is left and never asks for a dropped chunk.
  for (int64_t p = 321; p < 340; ++p) {
    ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      Token t = MakeToken(21, l, p);
      ASSERT_TRUE((*s)->Append(l, t.k.data(), t.v.data(), 1, DType::kF16).ok());
      std::vector<float> out(static_cast<size_t>(kQHeads) * kDim);
      Status st = (*s)->Attend(l, t.q.data(), &p, 1, out.data());
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }
  EXPECT_EQ((*s)->counters().compressions, 1u);
}

TEST(Session, PresetsAreValidAndDistinct) {
  std::vector<std::string> names = RetrievalPresetNames();
  ASSERT_EQ(names.front(), "kvtier");
  for (const std::string& n : names) {
    auto p = MakeRetrievalPreset(n);
    ASSERT_TRUE(p.ok()) << n;
    EXPECT_TRUE(p->retrieval.Validate().ok()) << n;
  }
  EXPECT_EQ(MakeRetrievalPreset("infllm")->retrieval.probe, "mean");
  EXPECT_EQ(MakeRetrievalPreset("actqkv")->retrieval.alloc, "entropy:rank=cosine");
  EXPECT_EQ(MakeRetrievalPreset("kvtier")->retrieval.index, "Exact:heads=max");
  // kvtier-fast is kvtier's choice with search reuse on, and nothing else changed.
  RetrieverOptions fast = MakeRetrievalPreset("kvtier-fast")->retrieval;
  EXPECT_GT(fast.reuse_cosine, 0.0);
  EXPECT_EQ(fast.screen_period, 1);
  fast.reuse_cosine = RecommendedRetrieval().reuse_cosine;
  EXPECT_EQ(fast.ToString(), RecommendedRetrieval().ToString());
  EXPECT_EQ(MakeRetrievalPreset("kvtier-fast")->repr_topk, 0);
}

// The comparison rows run the papers' chunk scores over the user's index kind where that kind
// computes them: InfLLM's is the mean of the representatives, which Exact does not compute.
TEST(Session, PaperRetrievalKeepsTheConfiguredKindOnlyWhereItComputesThePapersScore) {
  RetrieverOptions configured = RecommendedRetrieval();  // Exact:heads=max
  configured.budget_tokens = 777;
  auto infllm = PaperRetrieval("infllm", configured);
  ASSERT_TRUE(infllm.ok()) << infllm.status().ToString();
  EXPECT_EQ(infllm->index, "Flat");
  EXPECT_EQ(infllm->probe, "mean");
  EXPECT_EQ(infllm->alloc, "topk");
  EXPECT_EQ(infllm->budget_tokens, 777);
  auto actqkv = PaperRetrieval("actqkv", configured);
  ASSERT_TRUE(actqkv.ok());
  EXPECT_EQ(*CanonicalChunkIndexSpec(actqkv->index), *CanonicalChunkIndexSpec("Exact:heads=sum"));
  configured.index = "HNSW32:ef=32";  // a FAISS kind scores the mean already: kept
  infllm = PaperRetrieval("infllm", configured);
  ASSERT_TRUE(infllm.ok());
  EXPECT_EQ(*CanonicalChunkIndexSpec(infllm->index), *CanonicalChunkIndexSpec("HNSW32:ef=32"));
  EXPECT_FALSE(PaperRetrieval("nosuch", configured).ok());
}

// The InfLLM row's chunk score, by hand: score(c) = sum_h <p_h, (1/R) sum_r k_{c,r,h}>. The
// chunks are built so that the best single representative ranks them the other way round, so
// a row that scored best-of (what Exact computes) fails here.
TEST(Session, InfllmRowScoresTheMeanOfTheRepresentativesSummedOverHeads) {
  const ChunkShape shape{/*kv_heads=*/2, /*head_dim=*/4, /*repr=*/4, DType::kF32};
  auto row = PaperRetrieval("infllm", RecommendedRetrieval());
  ASSERT_TRUE(row.ok());
  auto index = MakeChunkIndex(row->index, shape);
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  const std::vector<float> probe = {1, 0.5f, -0.25f, 2, /*head 1*/ -1, 0.75f, 0.5f, 1};
  // [R, H, D] per chunk. Chunk 0: one representative far along the probe, three against it
  // (best-of high, mean low). Chunk 1: four moderately aligned ones (best-of lower, mean higher).
  std::vector<std::vector<float>> chunks(2, std::vector<float>(shape.repr_floats()));
  for (int r = 0; r < 4; ++r)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 4; ++d) {
        const float p = probe[h * 4 + d];
        chunks[0][(r * 2 + h) * 4 + d] = r == 0 ? 3.0f * p : -0.8f * p;
        chunks[1][(r * 2 + h) * 4 + d] = (0.5f + 0.1f * r) * p + 0.01f * (d - h);
      }
  for (uint64_t c = 0; c < 2; ++c) ASSERT_TRUE((*index)->Add(c, chunks[c].data()).ok());
  ChunkScores scores;
  ASSERT_TRUE((*index)->Score(probe.data(), &scores).ok());
  ASSERT_EQ(scores.ids, (std::vector<uint64_t>{0, 1}));
  double best_of[2] = {0, 0};
  for (int c = 0; c < 2; ++c) {
    double hand = 0;
    for (int h = 0; h < 2; ++h) {
      double best = -1e30;
      for (int r = 0; r < 4; ++r) {
        double dot = 0;
        for (int d = 0; d < 4; ++d) dot += probe[h * 4 + d] * chunks[c][(r * 2 + h) * 4 + d];
        hand += dot / 4.0;
        best = std::max(best, dot);
      }
      best_of[c] += best;
    }
    EXPECT_NEAR(scores.logit[c], hand, 1e-4 * std::max(1.0, std::abs(hand))) << "chunk " << c;
  }
  EXPECT_GT(best_of[0], best_of[1]);            // best-of would take chunk 0 first
  EXPECT_GT(scores.logit[1], scores.logit[0]);  // InfLLM's mean takes chunk 1 first
  std::vector<uint64_t> top;
  ASSERT_TRUE((*index)->Search(probe.data(), 1, &top).ok());
  EXPECT_EQ(top, (std::vector<uint64_t>{1}));
}

}  // namespace
}  // namespace kvtier
