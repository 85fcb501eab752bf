// Session's input rules (include/kvtier/session.h), the ones the C API and Python inherit:
// K/V and queries must be finite, positions must be the layer's last appended tokens (>= 0,
// increasing, ending at the last token appended), and a dropped
// session refuses every later call, a second Drop included. Each refusal is InvalidArgument
// or FailedPrecondition naming what was wrong, and a refused Append stores nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "engine/session_internal.h"
#include "kernels/dtype.h"
#include "kvtier/kvtier.h"
#include "offload/tiered_store.h"

namespace kvtier {
namespace {

constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kDim = 16;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

StoreOptions SmallStore(DType dtype) {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, dtype};
  so.n_sink = 4;
  so.n_local = 16;
  so.chunk_size = 4;
  so.repr_topk = 2;
  so.hot_bytes = 64 * so.chunk_bytes();
  so.warm_bytes = 256 * so.chunk_bytes();
  return so;
}

SessionOptions Small() {
  SessionOptions o;
  o.retrieval.budget_tokens = 8;
  return o;
}

void ExpectError(const Status& st, StatusCode code, const std::vector<std::string>& needles) {
  EXPECT_EQ(st.code(), code) << st.ToString();
  for (const std::string& n : needles)
    EXPECT_NE(st.message().find(n), std::string::npos) << n << " in " << st.ToString();
}

// n tokens of K and V in `dtype`, every element 0.25 (finite).
std::vector<uint8_t> Tokens(DType dtype, int n) {
  std::vector<float> f(static_cast<size_t>(n) * kKvHeads * kDim, 0.25f);
  std::vector<uint8_t> b(f.size() * DTypeSize(dtype));
  FromFloat(dtype, f.data(), b.data(), f.size());
  return b;
}

void Poison(DType dtype, std::vector<uint8_t>* b, size_t elem, float value) {
  FromFloat(dtype, &value, b->data() + elem * DTypeSize(dtype), 1);
}

TEST(SessionInputs, NonFiniteKvIsRefusedNamingLayerTokenAndHeadAndNothingIsAppended) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    auto store = TieredStore::Open(SmallStore(dtype));
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto s = Session::Open(store->get(), Small());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    const std::vector<uint8_t> good = Tokens(dtype, 8);
    ASSERT_TRUE((*s)->Append(1, good.data(), good.data(), 8, dtype).ok());
    // Token 5, kv head 1, element 3 of v: NaN; then +inf and -inf in k.
    const size_t elem = 5 * kKvHeads * kDim + 1 * kDim + 3;
    struct Case {
      bool in_k;
      float value;
      const char* spelled;
    };
    for (const Case& c : {Case{false, kNaN, "nan"}, Case{true, kInf, "inf"}, Case{true, -kInf, "-inf"}}) {
      std::vector<uint8_t> bad = good;
      Poison(dtype, &bad, elem, c.value);
      const void* k = c.in_k ? bad.data() : good.data();
      const void* v = c.in_k ? good.data() : bad.data();
      const std::string tensor = c.in_k ? "k[5][1][3]" : "v[5][1][3]";
      ExpectError((*s)->Append(1, k, v, 8, dtype), StatusCode::kInvalidArgument,
                  {"layer 1", tensor, c.spelled, "token 5", "kv head 1", "not finite", "nothing"});
    }
    auto len = (*store)->SequenceLength((*s)->sequence(), 1);
    ASSERT_TRUE(len.ok());
    EXPECT_EQ(*len, 8) << "a refused Append must store nothing";
    EXPECT_EQ((*s)->counters().tokens_appended, 8u);
  }
}

TEST(SessionInputs, NonFiniteQueryIsRefusedWithOrWithoutRetrieval) {
  for (bool retrieve : {true, false}) {
    SCOPED_TRACE(retrieve ? "retrieval" : "every chunk");
    auto store = TieredStore::Open(SmallStore(DType::kF32));
    ASSERT_TRUE(store.ok());
    SessionOptions o = Small();
    o.retrieve = retrieve;
    auto s = Session::Open(store->get(), o);
    ASSERT_TRUE(s.ok());
    const std::vector<uint8_t> kv = Tokens(DType::kF32, 1);
    ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
    ASSERT_TRUE((*s)->Append(0, kv.data(), kv.data(), 1, DType::kF32).ok());
    std::vector<float> q(kQHeads * kDim, 0.5f), out(q.size());
    q[2 * kDim + 7] = kNaN;
    int64_t pos = 0;
    ExpectError((*s)->Attend(0, q.data(), &pos, 1, out.data()), StatusCode::kInvalidArgument,
                {"layer 0", "q[0][2][7]", "nan", "not finite"});
    q[2 * kDim + 7] = 0.5f;
    Status st = (*s)->Attend(0, q.data(), &pos, 1, out.data());
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (float x : out) EXPECT_TRUE(std::isfinite(x));
  }
}

TEST(SessionInputs, NegativeOrNonIncreasingPositionsAreRefused) {
  auto store = TieredStore::Open(SmallStore(DType::kF32));
  ASSERT_TRUE(store.ok());
  auto s = Session::Open(store->get(), Small());
  ASSERT_TRUE(s.ok());
  const std::vector<uint8_t> kv = Tokens(DType::kF32, 4);
  ASSERT_TRUE((*s)->Append(0, kv.data(), kv.data(), 4, DType::kF32).ok());
  std::vector<float> q(4 * kQHeads * kDim, 0.5f), out(q.size());
  ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
  int64_t pos = -3;
  // Each error names the call the caller made (an Attend's check is Gather's code).
  const Status attend = (*s)->Attend(0, q.data(), &pos, 1, out.data());
  ExpectError(attend, StatusCode::kInvalidArgument,
              {"Session::Attend", "positions must be >= 0", "positions[0] = -3"});
  EXPECT_EQ(attend.message().find("Gather"), std::string::npos) << attend.ToString();
  ExpectError(ImplOf(**s).Gather(0, q.data(), &pos, 1).status(), StatusCode::kInvalidArgument,
              {"Session::Gather", "positions[0] = -3"});
  ExpectError((*s)->Observe(0, q.data(), &pos, 1), StatusCode::kInvalidArgument,
              {"Session::Observe", "positions[0] = -3"});
  ASSERT_TRUE((*s)->BeginStep(StepKind::kPrefill).ok());
  const int64_t window[4] = {-1, 0, 1, 2};
  ExpectError((*s)->Attend(0, q.data(), window, 4, out.data()), StatusCode::kInvalidArgument,
              {"positions[0] = -1"});
  const int64_t repeated[4] = {0, 1, 1, 2};
  ExpectError((*s)->Attend(0, q.data(), repeated, 4, out.data()), StatusCode::kInvalidArgument, {"increase"});
  const int64_t ok[4] = {0, 1, 2, 3};
  Status st = (*s)->Attend(0, q.data(), ok, 4, out.data());
  EXPECT_TRUE(st.ok()) << st.ToString();
}

TEST(SessionInputs, PositionsMustBeTheLayersLastAppendedTokens) {
  for (PositionMode mode : {PositionMode::kAbsolute, PositionMode::kInfLLM}) {
    SCOPED_TRACE(PositionModeName(mode));
    auto store = TieredStore::Open(SmallStore(DType::kF32));
    ASSERT_TRUE(store.ok());
    SessionOptions o = Small();
    o.positions = mode;
    auto s = Session::Open(store->get(), o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    std::vector<float> q(48 * kQHeads * kDim, 0.5f), out(q.size(), 7.0f);
    std::vector<int64_t> window(48);
    for (int i = 0; i < 48; ++i) window[static_cast<size_t>(i)] = i;
    // A prefill window on a layer that holds nothing: refused, out untouched.
    ASSERT_TRUE((*s)->BeginStep(StepKind::kPrefill).ok());
    ExpectError((*s)->Attend(0, q.data(), window.data(), 48, out.data()), StatusCode::kFailedPrecondition,
                {"Session::Attend", "layer 0 holds no tokens"});
    EXPECT_EQ(out[0], 7.0f);
    ExpectError(ImplOf(**s).Gather(0, q.data(), window.data(), 48).status(), StatusCode::kFailedPrecondition,
                {"Session::Gather", "layer 0 holds no tokens"});
    ExpectError((*s)->Observe(0, q.data(), window.data(), 48), StatusCode::kFailedPrecondition,
                {"Session::Observe", "layer 0 holds no tokens"});
    // 48 tokens appended: positions 0..47 are right, anything else names what the layer holds.
    const std::vector<uint8_t> kv = Tokens(DType::kF32, 48);
    ASSERT_TRUE((*s)->Append(0, kv.data(), kv.data(), 48, DType::kF32).ok());
    std::vector<int64_t> shifted(window);
    for (int64_t& p : shifted) p += 1;
    ExpectError((*s)->Attend(0, q.data(), shifted.data(), 48, out.data()), StatusCode::kInvalidArgument,
                {"layer 0 holds positions 0..47", "last 48 appended", "0..47", "got 1..48"});
    ExpectError((*s)->Attend(0, q.data(), window.data() + 8, 39, out.data()), StatusCode::kInvalidArgument,
                {"layer 0 holds positions 0..47", "last 39 appended tokens, 9..47", "got 8..46"});
    const int64_t gap[2] = {40, 47};
    ExpectError((*s)->Attend(0, q.data(), gap, 2, out.data()), StatusCode::kInvalidArgument,
                {"46..47", "got 40..47"});
    ExpectError((*s)->Observe(0, q.data(), shifted.data(), 48), StatusCode::kInvalidArgument,
                {"Session::Observe", "layer 0 holds positions 0..47"});
    EXPECT_EQ(out[0], 7.0f);
    Status st = (*s)->Attend(0, q.data(), window.data(), 48, out.data());
    ASSERT_TRUE(st.ok()) << st.ToString();
    // More queries than the layer holds tokens.
    ASSERT_TRUE((*s)->Append(1, kv.data(), kv.data(), 8, DType::kF32).ok());
    ExpectError((*s)->Attend(1, q.data(), window.data(), 48, out.data()), StatusCode::kInvalidArgument,
                {"layer 1 holds positions 0..7", "48 queries"});
    // A decode step: the one query is the last token, not INT64_MAX nor an earlier one.
    ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
    ASSERT_TRUE((*s)->Append(0, kv.data(), kv.data(), 1, DType::kF32).ok());
    int64_t pos = std::numeric_limits<int64_t>::max();
    ExpectError((*s)->Attend(0, q.data(), &pos, 1, out.data()), StatusCode::kInvalidArgument,
                {"layer 0 holds positions 0..48", "48..48", std::to_string(pos)});
    pos = 47;
    ExpectError(ImplOf(**s).Gather(0, q.data(), &pos, 1).status(), StatusCode::kInvalidArgument,
                {"Session::Gather", "layer 0 holds positions 0..48", "got 47..47"});
    pos = 48;
    st = (*s)->Attend(0, q.data(), &pos, 1, out.data());
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
}

TEST(SessionInputs, AnAttachedSessionAttendsAtTheAppendersPositions) {
  // A second session over a sequence another one appends to attends at the appender's
  // positions; the rule counts the sequence's tokens, whoever appended them.
  auto store = TieredStore::Open(SmallStore(DType::kF32));
  ASSERT_TRUE(store.ok());
  auto a = Session::Open(store->get(), Small());
  ASSERT_TRUE(a.ok());
  auto b = Session::Attach(store->get(), (*a)->sequence(), Small());
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const std::vector<uint8_t> kv = Tokens(DType::kF32, 40);
  std::vector<float> q(kQHeads * kDim, 0.5f), out(q.size());
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE((*a)->Append(l, kv.data(), kv.data(), 40, DType::kF32).ok());
  int64_t pos = 39;
  for (Session* s : {a->get(), b->get()}) {
    ASSERT_TRUE(s->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      Status st = s->Attend(l, q.data(), &pos, 1, out.data());
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  }
}

TEST(SessionInputs, DroppedSessionRefusesEveryLaterCallASecondDropIncluded) {
  auto store = TieredStore::Open(SmallStore(DType::kF32));
  ASSERT_TRUE(store.ok());
  auto s = Session::Open(store->get(), Small());
  ASSERT_TRUE(s.ok());
  const std::vector<uint8_t> kv = Tokens(DType::kF32, 1);
  ASSERT_TRUE((*s)->Append(0, kv.data(), kv.data(), 1, DType::kF32).ok());
  ASSERT_TRUE((*s)->Drop().ok());
  std::vector<float> q(kQHeads * kDim, 0.5f), out(q.size());
  int64_t pos = 0;
  ExpectError((*s)->Drop(), StatusCode::kFailedPrecondition, {"Drop", "dropped"});
  ExpectError((*s)->Close(), StatusCode::kFailedPrecondition, {"dropped"});
  ExpectError((*s)->Append(0, kv.data(), kv.data(), 1, DType::kF32), StatusCode::kFailedPrecondition,
              {"dropped"});
  ExpectError((*s)->BeginStep(StepKind::kDecode), StatusCode::kFailedPrecondition, {"dropped"});
  ExpectError((*s)->Attend(0, q.data(), &pos, 1, out.data()), StatusCode::kFailedPrecondition, {"dropped"});
  ExpectError(ImplOf(**s).Gather(0, q.data(), &pos, 1).status(), StatusCode::kFailedPrecondition,
              {"dropped"});
  ExpectError((*s)->Observe(0, q.data(), &pos, 1), StatusCode::kFailedPrecondition, {"dropped"});
  ExpectError((*s)->SetQuestion(0, q.data(), 1), StatusCode::kFailedPrecondition, {"dropped"});
  ExpectError((*s)->Compress("h2o", 100).status(), StatusCode::kFailedPrecondition, {"dropped"});
  EXPECT_EQ((*s)->counters().tokens_appended, 1u);  // counters stay readable
}

}  // namespace
}  // namespace kvtier
