// Tests of retrieval/quest_index.h, the "Quest" index kind: the per-chunk min/max bound holds
// against every key of random chunks, a two-chunk case computed by hand (bounds, cosines, both
// head folds, the choice), removal and chosen-chunk scoring, the bytes it counts, and bad input
// named. The interface contract every kind keeps is chunk_index_test.cc's (Quest is one of its
// kinds).
#include "retrieval/quest_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "retrieval/exact_index.h"

namespace kvtier {
namespace {

std::unique_ptr<ChunkIndex> Make(const std::string& spec, const ChunkShape& shape) {
  auto made = MakeChunkIndex(spec, shape);
  EXPECT_TRUE(made.ok()) << spec << ": " << made.status().ToString();
  return made.ok() ? std::move(made).value() : nullptr;
}

// Adds chunks 0..n-1 from reprs ([n, R, H, D]).
Status AddAll(ChunkIndex* index, const std::vector<float>& reprs, size_t n) {
  std::vector<uint64_t> chunks(n);
  std::iota(chunks.begin(), chunks.end(), 0);
  const size_t floats = index->shape().repr_floats();
  return index->Add(chunks, [&](uint64_t c, float* repr) {
    std::copy_n(reprs.data() + c * floats, floats, repr);
    return Status::Ok();
  });
}

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The bound: for random chunks (keys of several scales, some heads all negative or all
// positive), a chunk's score is at least its best key's q.k per head, folded over the heads,
// computed in double; with one key per chunk the box is the key and the bound is its q.k.
TEST(QuestIndex, ScoreBoundsEveryKeyOfTheChunk) {
  for (const char* heads : {"sum", "max"}) {
    const ChunkShape shape{3, 24, 9, DType::kF32};
    const int H = shape.kv_heads, D = shape.head_dim, R = shape.repr;
    auto index = Make(std::string("Quest:heads=") + heads, shape);
    ASSERT_NE(index, nullptr);
    std::mt19937 rng(47);
    std::normal_distribution<float> g;
    const size_t n = 80;
    std::vector<float> reprs(n * shape.repr_floats());
    for (size_t c = 0; c < n; ++c) {
      const float scale = 0.1f + static_cast<float>(c % 7);
      const float shift = c % 5 == 0 ? 3.0f : (c % 5 == 1 ? -3.0f : 0.0f);  // one-signed boxes
      for (size_t i = 0; i < shape.repr_floats(); ++i)
        reprs[c * shape.repr_floats() + i] = shift + scale * g(rng);
    }
    ASSERT_TRUE(AddAll(index.get(), reprs, n).ok());
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> p(static_cast<size_t>(shape.dim()));
      for (float& x : p) x = g(rng) * (trial % 3 == 0 ? 10.0f : 1.0f);
      ChunkScores s;
      ASSERT_TRUE(index->Score(p.data(), &s).ok());
      ASSERT_EQ(s.ids.size(), n);
      for (size_t c = 0; c < n; ++c) {
        double folded = 0.0, scale = 0.0;
        for (int h = 0; h < H; ++h) {
          double best = -std::numeric_limits<double>::infinity();
          for (int r = 0; r < R; ++r) {
            const float* k = reprs.data() + c * shape.repr_floats() + (static_cast<size_t>(r) * H + h) * D;
            double dot = 0.0;
            for (int d = 0; d < D; ++d) {
              dot += static_cast<double>(p[h * D + d]) * k[d];
              scale += std::fabs(static_cast<double>(p[h * D + d]) * k[d]);
            }
            best = std::max(best, dot);
          }
          folded = std::string(heads) == "sum" ? folded + best : (h == 0 ? best : std::max(folded, best));
        }
        EXPECT_GE(s.logit[c], folded - 1e-6 * scale) << heads << " chunk " << c << " trial " << trial;
        EXPECT_GE(s.cosine[c], -1.0f);
        EXPECT_LE(s.cosine[c], 1.0f);
      }
      // The Exact kind's score with the same representatives is the folded best key: Quest's
      // bound is never below it.
      auto exact = Make(std::string("Exact:rerank=0,heads=") + heads, shape);
      ASSERT_TRUE(AddAll(exact.get(), reprs, n).ok());
      ChunkScores e;
      ASSERT_TRUE(exact->Score(p.data(), &e).ok());
      for (size_t c = 0; c < n; ++c)
        EXPECT_GE(s.logit[c], e.logit[c] - 1e-4f * std::max(1.0f, std::fabs(e.logit[c]))) << c;
    }
  }
  // One key per chunk: the box is that key, and the bound is its q.k.
  const ChunkShape one{2, 16, 1, DType::kF32};
  auto index = Make("Quest", one);
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  std::vector<float> reprs(10 * one.repr_floats()), p(static_cast<size_t>(one.dim()));
  for (float& x : reprs) x = g(rng);
  for (float& x : p) x = g(rng);
  ASSERT_TRUE(AddAll(index.get(), reprs, 10).ok());
  ChunkScores s;
  ASSERT_TRUE(index->Score(p.data(), &s).ok());
  for (size_t c = 0; c < 10; ++c) {
    double dot = 0.0;
    for (int i = 0; i < one.dim(); ++i) dot += static_cast<double>(p[i]) * reprs[c * one.repr_floats() + i];
    EXPECT_NEAR(s.logit[c], dot, 1e-5) << c;
  }
}

// Two chunks, two heads of two dimensions, two keys each ([R, H, D]):
//   chunk 0: head 0 keys (1, -2), (3, 0): M = (3, 0),  m = (1, -2);  head 1 keys 0: M = m = 0
//   chunk 1: head 0 keys (-1, 1), (0, 4): M = (0, 4),  m = (-1, 1);  head 1 keys (2, 2) twice
// Probe head 0 (1, -1), head 1 (1, 1):
//   chunk 0: u0 = max(1, 3) + max(2, 0) = 5 (its keys give 3 and 3), u1 = 0
//   chunk 1: u0 = max(-1, 0) + max(-1, -4) = -1 (its keys give -2 and -4), u1 = 2 + 2 = 4
//   corners: chunk 0 head 0 sqrt(9 + 4) = sqrt 13, head 1 0; chunk 1 head 0 sqrt(1 + 16) =
//   sqrt 17, head 1 sqrt 8; |p_0| = |p_1| = sqrt 2. Cosines: chunk 0 head 0 5 / sqrt 26,
//   head 1 0 (an all-zero box); chunk 1 head 0 -1 / sqrt 34, head 1 4 / 4 = 1.
TEST(QuestIndex, TwoChunksByHand) {
  const ChunkShape shape{2, 2, 2, DType::kF32};
  const std::vector<float> reprs = {
      1,  -2, 0, 0, /* r1 */ 3, 0, 0, 0,  // chunk 0
      -1, 1,  2, 2, /* r1 */ 0, 4, 2, 2,  // chunk 1
  };
  const std::vector<float> p = {1, -1, 1, 1};
  const double c0 = 5.0 / std::sqrt(26.0), c1 = -1.0 / std::sqrt(34.0);

  auto sum = Make("Quest", shape);
  ASSERT_EQ(sum->ToString(), "Quest:heads=sum");
  ASSERT_TRUE(AddAll(sum.get(), reprs, 2).ok());
  ChunkScores s;
  ASSERT_TRUE(sum->Score(p.data(), &s).ok());
  EXPECT_EQ(s.ids, (std::vector<uint64_t>{0, 1}));
  EXPECT_FLOAT_EQ(s.logit[0], 5.0f);  // 5 + 0
  EXPECT_FLOAT_EQ(s.logit[1], 3.0f);  // -1 + 4
  EXPECT_NEAR(s.cosine[0], (c0 + 0.0) / 2, 1e-6);
  EXPECT_NEAR(s.cosine[1], (c1 + 1.0) / 2, 1e-6);
  std::vector<uint64_t> top;
  ASSERT_TRUE(sum->Search(p.data(), 1, &top).ok());
  EXPECT_EQ(top, std::vector<uint64_t>{0});

  auto max = Make("Quest:heads=max", shape);
  ASSERT_TRUE(AddAll(max.get(), reprs, 2).ok());
  ASSERT_TRUE(max->Score(p.data(), &s).ok());
  EXPECT_FLOAT_EQ(s.logit[0], 5.0f);
  EXPECT_FLOAT_EQ(s.logit[1], 4.0f);
  EXPECT_NEAR(s.cosine[0], c0, 1e-6);
  EXPECT_NEAR(s.cosine[1], 1.0, 1e-6);
  // By logit chunk 0 leads; by cosine chunk 1 (head 1's probe points at its box's corner).
  ChunkScores screened;
  ASSERT_TRUE(max->Screen(p.data(), &screened).ok());
  ASSERT_TRUE(max->Best(p.data(), screened, ChunkRank::kLogit, 2, &top).ok());
  EXPECT_EQ(top, (std::vector<uint64_t>{0, 1}));
  ASSERT_TRUE(max->Best(p.data(), screened, ChunkRank::kCosine, 2, &top).ok());
  EXPECT_EQ(top, (std::vector<uint64_t>{1, 0}));

  // The probe turned around: head 0 (-1, 1) gives chunk 0 max(-1, -3) + max(-2, 0) = -1 and
  // chunk 1 max(1, 0) + max(1, 4) = 5; head 1 (0, 0) adds nothing and its cosines are 0.
  const std::vector<float> q = {-1, 1, 0, 0};
  ASSERT_TRUE(sum->Score(q.data(), &s).ok());
  EXPECT_FLOAT_EQ(s.logit[0], -1.0f);
  EXPECT_FLOAT_EQ(s.logit[1], 5.0f);
  EXPECT_NEAR(s.cosine[1], 5.0 / std::sqrt(34.0) / 2, 1e-6);
  ASSERT_TRUE(sum->Search(q.data(), 1, &top).ok());
  EXPECT_EQ(top, std::vector<uint64_t>{1});
}

TEST(QuestIndex, RemoveScoreChunksAndBytes) {
  const ChunkShape shape{2, 8, 4, DType::kF16};
  auto index = Make("Quest", shape);
  std::mt19937 rng(3);
  std::normal_distribution<float> g;
  const size_t n = 30;
  std::vector<float> reprs(n * shape.repr_floats()), p(static_cast<size_t>(shape.dim()));
  for (float& x : reprs) x = g(rng);
  for (float& x : p) x = g(rng);
  ASSERT_TRUE(AddAll(index.get(), reprs, n).ok());
  const uint64_t row_bytes = 2 * (2 * 8 + 1) * sizeof(float);  // heads x (M, m, corner)
  ChunkScores all;
  ASSERT_TRUE(index->Score(p.data(), &all).ok());
  EXPECT_EQ(index->read_bytes().first_stage, n * row_bytes);
  EXPECT_EQ(index->read_bytes().rescoring, 0u);
  // Chosen chunks score as Score scored them; unknown ones are left out.
  ChunkScores some;
  ASSERT_TRUE(index->ScoreChunks(p.data(), {29, 3, 3, 400, 7}, &some).ok());
  EXPECT_EQ(some.ids, (std::vector<uint64_t>{3, 7, 29}));
  for (size_t i = 0; i < some.ids.size(); ++i) {
    EXPECT_EQ(some.logit[i], all.logit[some.ids[i]]);
    EXPECT_EQ(some.cosine[i], all.cosine[some.ids[i]]);
  }
  EXPECT_EQ(index->read_bytes().rescoring, 3 * row_bytes);
  std::vector<uint64_t> best;
  ASSERT_TRUE(index->BestOf(p.data(), {3, 7, 29}, ChunkRank::kLogit, 1, &best).ok());
  const uint64_t expect = all.logit[3] >= all.logit[7] && all.logit[3] >= all.logit[29] ? 3
                          : all.logit[7] >= all.logit[29]                               ? 7
                                                                                        : 29;
  EXPECT_EQ(best, std::vector<uint64_t>{expect});
  // Not a whole screen: Best refuses it.
  EXPECT_EQ(index->Best(p.data(), some, ChunkRank::kLogit, 1, &best).code(), StatusCode::kInvalidArgument);
  // Removal keeps the other rows' scores, in chunk order.
  ASSERT_TRUE(index->Remove({0, 5, 17, 1000}).ok());
  EXPECT_EQ(index->size(), n - 3);
  ChunkScores after;
  ASSERT_TRUE(index->Score(p.data(), &after).ok());
  size_t row = 0;
  for (uint64_t c = 0; c < n; ++c) {
    if (c == 0 || c == 5 || c == 17) continue;
    ASSERT_EQ(after.ids[row], c);
    EXPECT_EQ(after.logit[row], all.logit[c]) << c;
    EXPECT_EQ(after.cosine[row], all.cosine[c]) << c;
    ++row;
  }
  // Chunks added after a removal keep ascending.
  EXPECT_TRUE(index->Add(n, reprs.data()).ok());
  EXPECT_EQ(index->size(), n - 2);
  EXPECT_GT(index->memory_bytes(), (n - 2) * row_bytes);
}

TEST(QuestIndex, BadInputIsNamed) {
  const ChunkShape shape{2, 4, 2, DType::kF32};
  for (const auto& [spec, needle] : std::vector<std::pair<std::string, std::string>>{
           {"Quest:heads=avg", "bad value 'avg' for key 'heads'"},
           {"Quest:bogus=1", "unknown key 'bogus' for index 'Quest'"},
           {"Quest:heads=sum,heads=max", "duplicate key 'heads'"},
           {"Quest:", "key=value"}}) {
    auto c = CanonicalChunkIndexSpec(spec);
    ASSERT_FALSE(c.ok()) << spec;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(c.status().message(), needle)) << spec << ": " << c.status().message();
    auto m = MakeChunkIndex(spec, shape);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().message(), c.status().message());
  }
  EXPECT_EQ(*CanonicalChunkIndexSpec("Quest"), "Quest:heads=sum");
  EXPECT_EQ(*CanonicalChunkIndexSpec("Quest:heads=max"), "Quest:heads=max");
  auto bad_shape = MakeChunkIndex("Quest", ChunkShape{2, 0, 2, DType::kF32});
  ASSERT_FALSE(bad_shape.ok());
  EXPECT_TRUE(Contains(bad_shape.status().message(), "ChunkShape.head_dim")) << bad_shape.status().message();

  auto index = Make("Quest", shape);
  std::vector<float> repr(shape.repr_floats(), 1.0f);
  ASSERT_TRUE(index->Add(4, repr.data()).ok());
  // Not ascending: named, nothing added.
  Status st = index->Add(3, repr.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(st.message(), "chunk 3 is not above")) << st.message();
  // A non-finite representative: named (chunk, representative, head, element); the batch is
  // all or nothing.
  std::vector<float> bad(2 * shape.repr_floats(), 1.0f);
  bad[shape.repr_floats() + 1 * 8 + 1 * 4 + 2] =
      std::numeric_limits<float>::quiet_NaN();  // chunk 6, r1, h1, d2
  st = index->Add({5, 6}, [&](uint64_t c, float* out) {
    std::copy_n(bad.data() + (c - 5) * shape.repr_floats(), shape.repr_floats(), out);
    return Status::Ok();
  });
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(st.message(), "chunk 6's representative 1, head 1, element 2 is not finite"))
      << st.message();
  EXPECT_EQ(index->size(), 1u);
  // A reader's other errors stop the batch as they are.
  st = index->Add({7}, [](uint64_t, float*) { return IOError("disk gone"); });
  EXPECT_EQ(st.code(), StatusCode::kIOError);
  EXPECT_EQ(index->size(), 1u);
  // Null pointers.
  ChunkScores s;
  std::vector<uint64_t> out;
  st = index->Score(nullptr, &s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(st.message(), "probe must not be null")) << st.message();
  const std::vector<float> p(static_cast<size_t>(shape.dim()), 1.0f);
  EXPECT_EQ(index->Score(p.data(), nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->ScoreChunks(nullptr, {4}, &s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->BestOf(p.data(), {4}, ChunkRank::kLogit, 1, nullptr).code(), StatusCode::kInvalidArgument);
  // No memory cap, and no part screens.
  EXPECT_EQ(index->SetMemoryCap(1 << 20).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->ScreenRows(p.data(), 0, 1, &s).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvtier
