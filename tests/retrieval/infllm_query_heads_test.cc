// InfLLM's representatives and block score per query head (StoreOptions::repr_heads = query):
// each query head chooses its own repr_topk tokens of a chunk by the attention mass it alone
// gave them, and a chunk's score is, per query head, the mean over its representatives of
// q_h . k, summed over the query heads (Exact "heads=sum,repr=mean"). Every expected number
// below is worked out by hand in the comments; the per-kv-head mode (repr_heads = kv) chooses
// other tokens and another chunk on the same keys, masses and query.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvtier/kvtier.h"
#include "offload/observe_queries.h"
#include "offload/representatives.h"
#include "offload/store_records.h"
#include "offload/tiered_store.h"
#include "retrieval/exact_index.h"
#include "retrieval/retriever.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

// q_heads 4, kv_heads 2 (query heads 0, 1 read kv head 0; 2, 3 read kv head 1), head_dim 4.
constexpr int kQ = 4, kKv = 2, kD = 4, kChunk = 4, kR = 2;
const Geometry kGeometry{1, kQ, kKv, kD, DType::kF32};

// Chunk A's keys [token, kv head, dim]: kv head 0's token t is e_t, kv head 1's is 2 e_t.
std::vector<float> ChunkAKeys() {
  std::vector<float> k(kChunk * kKv * kD, 0.0f);
  for (int t = 0; t < kChunk; ++t) {
    k[(t * kKv + 0) * kD + t] = 1.0f;
    k[(t * kKv + 1) * kD + t] = 2.0f;
  }
  return k;
}

// Chunk A's mass per query head [q head, token]. Per kv head (the sum over its two query heads):
//   kv 0 = q0 + q1 = [5, 4, 3, 2.5]  -> tokens 0, 1
//   kv 1 = q2 + q3 = [3, 1, 2, 0.5]  -> tokens 0, 2
// Per query head: q0 -> 0, 1; q1 -> 2, 3; q2 -> 2, 1; q3 -> 0, 3.
const std::vector<float> kMassPerQueryHead{
    5, 4, 0, 0,    // q0
    0, 0, 3, 2.5,  // q1
    0, 1, 2, 0,    // q2
    3, 0, 0, 0.5,  // q3
};
const std::vector<float> kMassPerKvHead{5, 4, 3, 2.5, 3, 1, 2, 0.5};

// The representatives [r, head, dim] each mode must choose for chunk A.
std::vector<float> QueryHeadRepresentatives() {
  // r = 0: q0 e0, q1 e2, q2 2 e2, q3 2 e0;  r = 1: q0 e1, q1 e3, q2 2 e1, q3 2 e3.
  return {1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 2, 0, 0, 0, 0, 0, 2};
}
std::vector<float> KvHeadRepresentatives() {
  // r = 0: kv0 e0, kv1 2 e0;  r = 1: kv0 e1, kv1 2 e2.
  return {1, 0, 0, 0, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 2, 0};
}

TEST(InfLLMQueryHeads, EachQueryHeadChoosesItsOwnTokens) {
  const std::vector<float> keys = ChunkAKeys();
  RepresentativeInput in;
  in.geometry = kGeometry;
  in.chunk_size = kChunk;
  in.repr_topk = kR;
  in.keys = reinterpret_cast<const uint8_t*>(keys.data());
  in.mass_stride = kChunk;

  std::vector<float> per_query(kR * kQ * kD, -1.0f);
  in.out_heads = kQ;
  in.mass = kMassPerQueryHead.data();
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(per_query.data())).ok());
  EXPECT_EQ(per_query, QueryHeadRepresentatives());

  std::vector<float> per_kv(kR * kKv * kD, -1.0f);
  in.out_heads = 0;  // per kv head
  in.mass = kMassPerKvHead.data();
  ASSERT_TRUE(ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(per_kv.data())).ok());
  EXPECT_EQ(per_kv, KvHeadRepresentatives());

  in.out_heads = 3;  // not a multiple of kv_heads
  const Status bad = ChooseRepresentatives(in, reinterpret_cast<uint8_t*>(per_query.data()));
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("out_heads"), std::string::npos) << bad.ToString();
}

StoreOptions SmallStore(ReprHeads heads, const std::string& dir) {
  StoreOptions o;
  o.geometry = kGeometry;
  o.n_sink = 0;
  o.n_local = kChunk;
  o.chunk_size = kChunk;
  o.repr_topk = kR;
  o.repr_heads = heads;
  o.warm_bytes = 64 * o.chunk_bytes();
  o.hot_bytes = 16 * o.chunk_bytes();
  o.data_dir = dir;
  return o;
}

// Chunk B: every key 0.3 (1, 1, 1, 1) in both kv heads, so any choice takes the same keys.
constexpr float kB = 0.3f;

// Appends chunk A (with its mass, per query head or per kv head as the store keeps it), chunk B
// and two chunks of zero keys that push A and B out of the local window.
void FillStore(TieredStore* st, SequenceId seq) {
  const std::vector<float> a = ChunkAKeys(), v(kChunk * kKv * kD, 1.0f);
  ASSERT_TRUE(st->Append(seq, 0, a.data(), v.data(), kChunk, DType::kF32).ok());
  if (st->options().repr_heads == ReprHeads::kQuery) {
    const Status kv = st->AddLocalAttention(seq, 0, 0, kChunk, kMassPerKvHead.data());
    EXPECT_EQ(kv.code(), StatusCode::kFailedPrecondition) << kv.ToString();
    EXPECT_NE(kv.message().find("repr_heads=query"), std::string::npos) << kv.ToString();
    ASSERT_TRUE(st->AddLocalQueryAttention(seq, 0, 0, kChunk, kMassPerQueryHead.data()).ok());
  } else {
    const Status q = st->AddLocalQueryAttention(seq, 0, 0, kChunk, kMassPerQueryHead.data());
    EXPECT_EQ(q.code(), StatusCode::kFailedPrecondition) << q.ToString();
    ASSERT_TRUE(st->AddLocalAttention(seq, 0, 0, kChunk, kMassPerKvHead.data()).ok());
  }
  const std::vector<float> b(kChunk * kKv * kD, kB), zeros(2 * kChunk * kKv * kD, 0.0f),
      v2(2 * kChunk * kKv * kD, 1.0f);
  ASSERT_TRUE(st->Append(seq, 0, b.data(), v.data(), kChunk, DType::kF32).ok());
  ASSERT_TRUE(st->Append(seq, 0, zeros.data(), v2.data(), 2 * kChunk, DType::kF32).ok());
}

std::vector<float> Representatives(TieredStore* st, SequenceId seq, uint64_t chunk) {
  std::vector<float> r(st->options().repr_elems(), -1.0f);
  const Status s = st->GetRepresentatives(ChunkKey{seq, 0, chunk}, r.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return r;
}

TEST(InfLLMQueryHeads, TheStoreKeepsRepresentativesPerQueryHead) {
  for (ReprHeads heads : {ReprHeads::kQuery, ReprHeads::kKv}) {
    auto s = TieredStore::Open(SmallStore(heads, ""));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto seq = (*s)->CreateSequence();
    ASSERT_TRUE(seq.ok());
    FillStore(s->get(), *seq);
    EXPECT_EQ(Representatives(s->get(), *seq, 0),
              heads == ReprHeads::kQuery ? QueryHeadRepresentatives() : KvHeadRepresentatives());
    const int h = heads == ReprHeads::kQuery ? kQ : kKv;
    EXPECT_EQ(Representatives(s->get(), *seq, 1), std::vector<float>(kR * h * kD, kB));
  }
}

TEST(InfLLMQueryHeads, RepresentativesPersistAndAMismatchedStoreIsRefused) {
  TempDir dir;
  SequenceId seq = 0;
  {
    auto s = TieredStore::Open(SmallStore(ReprHeads::kQuery, dir.path()));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto created = (*s)->CreateSequence();
    ASSERT_TRUE(created.ok());
    seq = *created;
    FillStore(s->get(), seq);
    ASSERT_TRUE((*s)->CloseSequence(seq).ok());
  }
  {
    // Reopened, the chunks' representatives come back from their meta records.
    auto s = TieredStore::Open(SmallStore(ReprHeads::kQuery, dir.path()));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(Representatives(s->get(), seq, 0), QueryHeadRepresentatives());
    EXPECT_EQ(Representatives(s->get(), seq, 1), std::vector<float>(kR * kQ * kD, kB));
  }
  // The same directory opened per kv head: refused, naming both layouts.
  auto kv = TieredStore::Open(SmallStore(ReprHeads::kKv, dir.path()));
  ASSERT_FALSE(kv.ok());
  EXPECT_EQ(kv.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(kv.status().message().find("repr_heads query"), std::string::npos) << kv.status().ToString();
  EXPECT_NE(kv.status().message().find("repr_heads kv"), std::string::npos) << kv.status().ToString();
}

TEST(InfLLMQueryHeads, StoreRecordVersionTwoCarriesTheQueryHeads) {
  using namespace store_records;
  StoreLayout kv{kGeometry, 0, kChunk, kChunk, kR};
  StoreLayout query = kv;
  query.repr_heads = ReprHeads::kQuery;
  const std::string kv_bytes = EncodeStoreRecord(kv), query_bytes = EncodeStoreRecord(query);
  uint32_t version = 0;
  std::memcpy(&version, kv_bytes.data() + 4, 4);
  EXPECT_EQ(version, 1u) << "a store per kv head writes the record as before";
  std::memcpy(&version, query_bytes.data() + 4, 4);
  EXPECT_EQ(version, 2u);
  EXPECT_EQ(query_bytes.size(), kv_bytes.size() + 1);
  auto back = DecodeStoreRecord(query_bytes, "x");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->repr_heads, ReprHeads::kQuery);
  std::string bad = query_bytes;
  bad.back() = 7;
  auto refused = DecodeStoreRecord(bad, "x");
  EXPECT_EQ(refused.status().code(), StatusCode::kCorruption);
  EXPECT_NE(refused.status().message().find("repr_heads"), std::string::npos) << refused.status().ToString();
}

// Every query head's probe is q = (0, 0, 1, 1). Chunk A's block score, per query head the mean
// over its two representatives of q . k, summed over the query heads:
//   q0 (e0, e1): (0 + 0) / 2 = 0;  q1 (e2, e3): (1 + 1) / 2 = 1;
//   q2 (2e2, 2e1): (2 + 0) / 2 = 1;  q3 (2e0, 2e3): (0 + 2) / 2 = 1;   sum = 3.
// Chunk B: every head's mean key is 0.3 (1, 1, 1, 1), q . k = 0.6, four heads: 2.4.
// Per kv head (probe: the mean of each group's queries, the same q), A: kv0 (e0, e1) 0, kv1 (2e0, 2e2)
// (0 + 2) / 2 = 1, sum 1; B: 2 x 0.6 = 1.2. InfLLM per query head takes A, per kv head B.
TEST(InfLLMQueryHeads, BlockScoreIsTheMeanOverRepresentativesSummedOverQueryHeads) {
  auto index = MakeChunkIndex("Exact:heads=sum,repr=mean,rerank=0", ChunkShape{kQ, kD, kR, DType::kF32});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ((*index)->ToString(), "Exact:heads=sum,repr=mean,rerank=0,rerank_min=0");
  const std::vector<float> a = QueryHeadRepresentatives(), b(kR * kQ * kD, kB);
  ASSERT_TRUE((*index)->Add(0, a.data()).ok());
  ASSERT_TRUE((*index)->Add(1, b.data()).ok());
  const std::vector<float> probe{0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1};
  ChunkScores s;
  ASSERT_TRUE((*index)->Score(probe.data(), &s).ok());
  ASSERT_EQ(s.ids, (std::vector<uint64_t>{0, 1}));
  EXPECT_FLOAT_EQ(s.logit[0], 3.0f);
  EXPECT_FLOAT_EQ(s.logit[1], 2.4f);
  // The int8 screen and its rescoring choose what the fp32 pass chooses.
  auto screened = MakeChunkIndex("Exact:heads=sum,repr=mean", ChunkShape{kQ, kD, kR, DType::kF32});
  ASSERT_TRUE(screened.ok());
  ASSERT_TRUE((*screened)->Add(0, a.data()).ok());
  ASSERT_TRUE((*screened)->Add(1, b.data()).ok());
  std::vector<uint64_t> best;
  ASSERT_TRUE((*screened)->Search(probe.data(), 1, &best).ok());
  EXPECT_EQ(best, (std::vector<uint64_t>{0}));
  // FAISS Flat's inner product with the mean representative is the same score.
  auto flat = MakeChunkIndex("Flat", ChunkShape{kQ, kD, kR, DType::kF32});
  ASSERT_TRUE(flat.ok());
  ASSERT_TRUE((*flat)->Add(0, a.data()).ok());
  ASSERT_TRUE((*flat)->Add(1, b.data()).ok());
  ChunkScores f;
  ASSERT_TRUE((*flat)->Score(probe.data(), &f).ok());
  EXPECT_FLOAT_EQ(f.logit[0], 3.0f);
  EXPECT_FLOAT_EQ(f.logit[1], 2.4f);
  // repr=max keeps the best representative instead: q1 1, q2 2, q3 2, q0 0 -> 5.
  auto max = MakeChunkIndex("Exact:heads=sum,rerank=0", ChunkShape{kQ, kD, kR, DType::kF32});
  ASSERT_TRUE(max.ok());
  ASSERT_TRUE((*max)->Add(0, a.data()).ok());
  ChunkScores m;
  ASSERT_TRUE((*max)->Score(probe.data(), &m).ok());
  EXPECT_FLOAT_EQ(m.logit[0], 5.0f);
  EXPECT_EQ(MakeChunkIndex("Exact:repr=median", ChunkShape{kQ, kD, kR, DType::kF32}).status().code(),
            StatusCode::kInvalidArgument);
}

// The Retriever on each store: InfLLM's probe (the query, per query head under repr_heads =
// query, pooled per kv head otherwise) and a budget of one chunk.
TEST(InfLLMQueryHeads, PerQueryHeadSelectionDiffersFromPerKvHead) {
  const std::vector<float> q{0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1};
  for (const char* index : {"Exact:heads=sum,repr=mean", "Flat"}) {
    for (ReprHeads heads : {ReprHeads::kQuery, ReprHeads::kKv}) {
      auto s = TieredStore::Open(SmallStore(heads, ""));
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      auto seq = (*s)->CreateSequence();
      ASSERT_TRUE(seq.ok());
      FillStore(s->get(), *seq);
      RetrieverOptions ro;
      ro.probe = "mean";
      ro.alloc = "topk";
      ro.index = index;
      ro.budget_tokens = kChunk;
      auto r = Retriever::Create(s->get(), ro);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      (*r)->BeginStep();
      auto sel = (*r)->Select(*seq, 0, q.data(), 1, /*decode=*/true);
      ASSERT_TRUE(sel.ok()) << sel.status().ToString();
      EXPECT_EQ(sel->chunks, (std::vector<uint64_t>{heads == ReprHeads::kQuery ? 0u : 1u}))
          << index << (heads == ReprHeads::kQuery ? " per query head" : " per kv head");
    }
  }
}

// A cuda tier's Exact retrieval backend pools its decode probe per kv head: refused by name.
TEST(InfLLMQueryHeads, CudaExactBackendIsRefusedByName) {
  StoreOptions o = SmallStore(ReprHeads::kQuery, "");
  o.device = Device::kCuda;
  auto s = TieredStore::Open(o);
  if (!s.ok()) GTEST_SKIP() << "no cuda hot tier here: " << s.status().ToString();
  RetrieverOptions ro;
  ro.probe = "mean";
  ro.alloc = "topk";
  ro.index = "Exact:heads=sum,repr=mean";
  ro.budget_tokens = kChunk;
  auto r = Retriever::Create(s->get(), ro);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("repr_heads=query"), std::string::npos) << r.status().ToString();
  ro.index = "Flat";  // FAISS kinds stay on the host
  EXPECT_TRUE(Retriever::Create(s->get(), ro).ok());
}

// ObserveQueries gives each query head its own mass: with one representative, a query head
// whose query points at one token's key (and at nothing else) takes that token.
TEST(InfLLMQueryHeads, ObservedQueriesGiveEachQueryHeadItsOwnMass) {
  StoreOptions o = SmallStore(ReprHeads::kQuery, "");
  o.repr_topk = 1;
  auto s = TieredStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto seq = (*s)->CreateSequence();
  ASSERT_TRUE(seq.ok());
  // Keys: kv head 0's token t is 4 e_t, kv head 1's is 4 e_(3 - t).
  std::vector<float> k(kChunk * kKv * kD, 0.0f), v(kChunk * kKv * kD, 1.0f);
  for (int t = 0; t < kChunk; ++t) {
    k[(t * kKv + 0) * kD + t] = 4.0f;
    k[(t * kKv + 1) * kD + (3 - t)] = 4.0f;
  }
  ASSERT_TRUE((*s)->Append(*seq, 0, k.data(), v.data(), kChunk, DType::kF32).ok());
  // One query at position 3 (it sees the whole chunk): q0 = 8 e1, q1 = 8 e2, q2 = 8 e0, q3 = 8 e3.
  // q0 and q1 read kv head 0: tokens 1 and 2; q2 and q3 read kv head 1: tokens 3 and 0.
  std::vector<float> q(kQ * kD, 0.0f);
  q[0 * kD + 1] = q[1 * kD + 2] = q[2 * kD + 0] = q[3 * kD + 3] = 8.0f;
  const int64_t pos = 3;
  ASSERT_TRUE(ObserveQueries(**s, *seq, 0, q.data(), &pos, 1).ok());
  const std::vector<float> b(kChunk * kKv * kD, kB), zeros(2 * kChunk * kKv * kD, 0.0f),
      v2(2 * kChunk * kKv * kD, 1.0f);
  ASSERT_TRUE((*s)->Append(*seq, 0, b.data(), v.data(), kChunk, DType::kF32).ok());
  ASSERT_TRUE((*s)->Append(*seq, 0, zeros.data(), v2.data(), 2 * kChunk, DType::kF32).ok());
  // q0: kv0 token 1 = 4 e1; q1: kv0 token 2 = 4 e2; q2: kv1 token 3 = 4 e0; q3: kv1 token 0 = 4 e3.
  EXPECT_EQ(Representatives(s->get(), *seq, 0),
            (std::vector<float>{0, 4, 0, 0, 0, 0, 4, 0, 4, 0, 0, 0, 0, 0, 0, 4}));
}

// The same keys and query through the engine API: a session's prefill Attend over a store whose
// representatives are per query head gives each query head its own mass (the kernel's mass is
// per kv head, so Gather's host pass computes it), and the representatives come out as
// ObserveQueries' above. Before, Attend stopped at the store's refusal of a kv head's sum.
TEST(InfLLMQueryHeads, SessionAttendGivesEachQueryHeadItsOwnMass) {
  for (const PositionMode mode : {PositionMode::kAbsolute, PositionMode::kInfLLM}) {
    SCOPED_TRACE(mode == PositionMode::kAbsolute ? "absolute positions" : "infllm positions");
    StoreOptions o = SmallStore(ReprHeads::kQuery, "");
    o.repr_topk = 1;
    auto s = TieredStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto preset = MakeRetrievalPreset("infllm");
    ASSERT_TRUE(preset.ok());
    SessionOptions so;
    so.retrieval = preset->retrieval;
    so.retrieval.budget_tokens = kChunk;
    so.positions = mode;
    auto session = Session::Open(s->get(), so);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    Session& ses = **session;
    std::vector<float> k(kChunk * kKv * kD, 0.0f), v(kChunk * kKv * kD, 1.0f);
    for (int t = 0; t < kChunk; ++t) {
      k[(t * kKv + 0) * kD + t] = 4.0f;
      k[(t * kKv + 1) * kD + (3 - t)] = 4.0f;
    }
    ASSERT_TRUE(ses.Append(0, k.data(), v.data(), kChunk, DType::kF32).ok());
    std::vector<float> q(kQ * kD, 0.0f), out(kQ * kD);
    q[0 * kD + 1] = q[1 * kD + 2] = q[2 * kD + 0] = q[3 * kD + 3] = 8.0f;
    const int64_t pos = 3;
    ASSERT_TRUE(ses.BeginStep(StepKind::kPrefill).ok());
    const Status st = ses.Attend(0, q.data(), &pos, 1, out.data());
    ASSERT_TRUE(st.ok()) << st.ToString();
    const std::vector<float> b(kChunk * kKv * kD, kB), zeros(2 * kChunk * kKv * kD, 0.0f),
        v2(2 * kChunk * kKv * kD, 1.0f);
    ASSERT_TRUE(ses.Append(0, b.data(), v.data(), kChunk, DType::kF32).ok());
    ASSERT_TRUE(ses.Append(0, zeros.data(), v2.data(), 2 * kChunk, DType::kF32).ok());
    const std::vector<float> got = Representatives(s->get(), ses.sequence(), 0);
    if (mode == PositionMode::kAbsolute) {
      // As ObservedQueriesGiveEachQueryHeadItsOwnMass: q0 4 e1, q1 4 e2, q2 4 e0, q3 4 e3.
      EXPECT_EQ(got, (std::vector<float>{0, 4, 0, 0, 0, 0, 4, 0, 4, 0, 0, 0, 0, 0, 0, 4}));
    } else {
      // Rotated scores move the mass, but each query head's representative is one of its kv
      // head's keys, and the two query heads of a kv head need not agree: not a kv head's sum.
      for (int h = 0; h < kQ; ++h) {
        const int kv = h / (kQ / kKv);
        bool is_key = false;
        for (int t = 0; t < kChunk; ++t)
          is_key = is_key || std::equal(got.begin() + h * kD, got.begin() + (h + 1) * kD,
                                        k.begin() + (t * kKv + kv) * kD);
        EXPECT_TRUE(is_key) << "query head " << h;
      }
    }
  }
}

}  // namespace
}  // namespace kvtier
