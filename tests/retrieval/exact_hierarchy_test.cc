// Tests of the Exact index's chunk-group hierarchy (index key groups=G; retrieval/chunk_groups.h,
// ExactChunkIndex::SearchByGroups): the choice equals groups=0's over random and adversarial
// data (clustered keys where groups are skipped, ties, zero keys, removals, the cap), every
// chunk's computed score stays within its group's bound, the skips are counted; and the
// synthetic workload's key-spectrum knob changes the key statistics as documented.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "integration/workload.h"
#include "kernels/cpu/chunk_score.h"
#include "retrieval/chunk_groups.h"
#include "retrieval/exact_index.h"

namespace kvtier {
namespace {

std::unique_ptr<ExactChunkIndex> MakeExact(const std::string& spec, const ChunkShape& shape) {
  auto o = ExactIndexOptions::Parse(spec);
  EXPECT_TRUE(o.ok()) << spec << ": " << o.status().ToString();
  auto r = ExactChunkIndex::Create(shape, o.value());
  EXPECT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
  return std::move(r).value();
}

// Rounds every value to what `dt` holds (as the store's keys are).
void RoundTo(DType dt, std::vector<float>* v) {
  std::vector<uint8_t> tmp(v->size() * DTypeSize(dt));
  FromFloat(dt, v->data(), tmp.data(), v->size());
  ToFloat(dt, tmp.data(), v->data(), v->size());
}

// n chunks' representatives [n, R, H, D]. clustered: chunk c's keys are a direction that drifts
// slowly with c (a topic, strength 4) plus noise 0.3, so nearby chunks resemble each other and a
// probe along one topic leaves most groups unable to compete; else N(0, 1) keys.
std::vector<float> Reprs(size_t n, const ChunkShape& s, uint32_t seed, bool clustered) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t D = s.head_dim, H = s.kv_heads, R = s.repr;
  std::vector<float> out(n * s.repr_floats());
  if (!clustered) {
    for (float& x : out) x = nd(rng);
  } else {
    std::vector<float> topic(H * D), next(H * D);
    for (float& x : topic) x = nd(rng);
    for (float& x : next) x = nd(rng);
    for (size_t c = 0; c < n; ++c) {
      if (c % 64 == 0) {
        topic = next;
        for (float& x : next) x = nd(rng);
      }
      const float f = static_cast<float>(c % 64) / 64.0f;
      for (size_t r = 0; r < R; ++r)
        for (size_t h = 0; h < H; ++h)
          for (size_t d = 0; d < D; ++d)
            out[((c * R + r) * H + h) * D + d] =
                4.0f * ((1 - f) * topic[h * D + d] + f * next[h * D + d]) / std::sqrt(float(D)) +
                0.3f * nd(rng);
    }
  }
  RoundTo(s.dtype, &out);
  return out;
}

void AddRange(ChunkIndex* index, size_t first, size_t count, const std::vector<float>& reprs) {
  const size_t per = index->shape().repr_floats();
  std::vector<uint64_t> ids(count);
  std::iota(ids.begin(), ids.end(), first);
  ASSERT_TRUE(index
                  ->Add(ids,
                        [&](uint64_t chunk, float* repr) {
                          std::copy_n(reprs.data() + chunk * per, per, repr);
                          return Status::Ok();
                        })
                  .ok());
}

std::vector<uint64_t> ScreenThenBest(const ChunkIndex& index, const std::vector<float>& p, ChunkRank rank,
                                     size_t take) {
  ChunkScores s;
  EXPECT_TRUE(index.Screen(p.data(), &s).ok());
  std::vector<uint64_t> out;
  EXPECT_TRUE(index.Best(p.data(), s, rank, take, &out).ok());
  return out;
}

// A probe: random, or (aligned) a chunk's first representative plus a little noise.
std::vector<float> Probe(const ChunkShape& s, const std::vector<float>& reprs, size_t n, std::mt19937* rng,
                         bool aligned) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> p(s.dim());
  const size_t c = std::uniform_int_distribution<size_t>(0, n - 1)(*rng);
  for (size_t i = 0; i < p.size(); ++i)
    p[i] = aligned ? reprs[c * s.repr_floats() + i] + 0.1f * nd(*rng) : nd(*rng);
  return p;
}

// Every rank, take, rerank and probe kind: SearchByGroups chooses what groups=0 chooses.
void ExpectSameChoice(const ChunkShape& shape, const std::string& heads, const std::vector<float>& reprs,
                      size_t n, const std::vector<uint64_t>& removed, uint32_t seed, GroupSkips* skips) {
  for (const char* rerank : {"1", "0"})
    for (int G : {8, 32}) {
      const std::string base = "Exact:heads=" + heads + ",rerank=" + rerank;
      auto flat = MakeExact(base, shape);
      auto grouped = MakeExact(base + ",groups=" + std::to_string(G), shape);
      // Two batches (the last group of the first one is refreshed by the second).
      AddRange(flat.get(), 0, n / 2, reprs);
      AddRange(flat.get(), n / 2, n - n / 2, reprs);
      AddRange(grouped.get(), 0, n / 2, reprs);
      AddRange(grouped.get(), n / 2, n - n / 2, reprs);
      ASSERT_TRUE(flat->Remove(removed).ok());
      ASSERT_TRUE(grouped->Remove(removed).ok());
      std::mt19937 rng(seed);
      for (int q = 0; q < 12; ++q) {
        const std::vector<float> p = Probe(shape, reprs, n, &rng, q % 2 == 0);
        for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine})
          for (size_t take : {size_t{1}, size_t{8}, size_t{40}, n + 5}) {
            std::vector<uint64_t> got;
            ASSERT_TRUE(grouped->SearchByGroups(p.data(), rank, take, &got).ok());
            EXPECT_EQ(got, ScreenThenBest(*flat, p, rank, take))
                << base << ",groups=" << G << " probe " << q << " rank "
                << (rank == ChunkRank::kLogit ? "logit" : "cosine") << " take " << take;
          }
        std::vector<uint64_t> a, b;
        ASSERT_TRUE(grouped->Search(p.data(), 16, &a).ok());
        ASSERT_TRUE(flat->Search(p.data(), 16, &b).ok());
        EXPECT_EQ(a, b);
      }
      const GroupSkips g = grouped->group_skips();
      // 12 probes x (2 ranks x 4 takes + Search): every search covers every group and chunk.
      const uint64_t searches = 12 * 9, rows = grouped->size(), groups = (rows + G - 1) / G;
      EXPECT_EQ(g.groups_visited + g.groups_skipped, searches * groups);
      EXPECT_EQ(g.chunks_visited + g.chunks_skipped, searches * rows);
      EXPECT_EQ(flat->group_skips().chunks_visited, 0u);
      *skips += g;
    }
}

TEST(ExactHierarchy, ChoosesWhatGroupsOffChoosesOnRandomKeys) {
  const ChunkShape shape{2, 16, 4, DType::kF16};
  const size_t n = 300;
  for (const char* heads : {"sum", "max"}) {
    GroupSkips skips;
    ExpectSameChoice(shape, heads, Reprs(n, shape, 5, false), n, {}, 7, &skips);
  }
}

TEST(ExactHierarchy, SkipsGroupsOfClusteredKeysAndStillChoosesTheSame) {
  for (DType dt : {DType::kF32, DType::kBF16})
    for (const char* heads : {"sum", "max"}) {
      const ChunkShape shape{2, 32, 2, dt};
      const size_t n = 700;
      GroupSkips skips;
      ExpectSameChoice(shape, heads, Reprs(n, shape, 11, true), n, {3, 4, 5, 100, 101, 350, 699}, 13, &skips);
      // The probes along one topic leave most groups unable to reach the top: skipped.
      EXPECT_GT(skips.chunk_skip_rate(), 0.3) << heads;
    }
}

TEST(ExactHierarchy, TiesZeroKeysAndDuplicatesChooseTheSame) {
  const ChunkShape shape{2, 16, 2, DType::kF32};
  const size_t n = 260;
  std::vector<float> reprs = Reprs(n, shape, 17, true);
  const size_t per = shape.repr_floats();
  // Chunks 20-59: all zero keys (cosine 0, logit 0); 100-179: copies of chunk 99 (ties broken to
  // the smaller chunk index); 200-203: copies of chunk 5, far from their neighbours.
  std::fill(reprs.begin() + 20 * per, reprs.begin() + 60 * per, 0.0f);
  for (size_t c = 100; c < 180; ++c) std::copy_n(reprs.begin() + 99 * per, per, reprs.begin() + c * per);
  for (size_t c = 200; c < 204; ++c) std::copy_n(reprs.begin() + 5 * per, per, reprs.begin() + c * per);
  for (const char* heads : {"sum", "max"}) {
    GroupSkips skips;
    ExpectSameChoice(shape, heads, reprs, n, {0, 99, 120, 259}, 19, &skips);
  }
  // A probe along chunk 99's keys: its copies tie; the first ones by chunk index are chosen.
  auto flat = MakeExact("Exact:heads=sum", shape);
  auto grouped = MakeExact("Exact:heads=sum,groups=8", shape);
  AddRange(flat.get(), 0, n, reprs);
  AddRange(grouped.get(), 0, n, reprs);
  const std::vector<float> p(reprs.begin() + 99 * per, reprs.begin() + 99 * per + shape.dim());
  std::vector<uint64_t> got;
  ASSERT_TRUE(grouped->SearchByGroups(p.data(), ChunkRank::kCosine, 5, &got).ok());
  EXPECT_EQ(got, ScreenThenBest(*flat, p, ChunkRank::kCosine, 5));
  // A zero probe: every cosine is 0, every logit 0: the first chunks by index.
  const std::vector<float> zero(shape.dim(), 0.0f);
  for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine}) {
    ASSERT_TRUE(grouped->SearchByGroups(zero.data(), rank, 6, &got).ok());
    EXPECT_EQ(got, ScreenThenBest(*flat, zero, rank, 6));
  }
}

TEST(ExactHierarchy, CompressedRowsTurnTheHierarchyOffWithTheSameChoice) {
  const ChunkShape shape{2, 16, 2, DType::kF16};
  const size_t n = 400;
  const std::vector<float> reprs = Reprs(n, shape, 23, true);
  auto flat = MakeExact("Exact:heads=max", shape);
  auto grouped = MakeExact("Exact:heads=max,groups=16", shape);
  for (ExactChunkIndex* index : {flat.get(), grouped.get()}) {
    ASSERT_TRUE(index->SetMemoryCap(60 * 1024).ok());
    AddRange(index, 0, n, reprs);
  }
  ASSERT_GT(grouped->compressed_chunks(), 0u);
  std::mt19937 rng(29);
  for (int q = 0; q < 6; ++q) {
    const std::vector<float> p = Probe(shape, reprs, n, &rng, true);
    std::vector<uint64_t> got;
    ASSERT_TRUE(grouped->SearchByGroups(p.data(), ChunkRank::kLogit, 10, &got).ok());
    EXPECT_EQ(got, ScreenThenBest(*flat, p, ChunkRank::kLogit, 10));
  }
  EXPECT_EQ(grouped->group_skips().chunks_visited + grouped->group_skips().chunks_skipped, 0u);
}

// The bound against the fp32 pass's scores (Score), chunk by chunk, for keys that make the
// bound tight (a group of identical keys has radius 0: the rounding margins alone cover it).
TEST(ExactHierarchy, EveryChunksComputedScoreIsWithinItsGroupsBound) {
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int trial = 0; trial < 24; ++trial) {
    const int H = 1 + trial % 3, D = 8 << (trial % 4), R = 1 + trial % 2, G = 8 * (1 + trial % 3);
    const ChunkShape shape{H, D, R, trial % 2 ? DType::kF32 : DType::kF16};
    const size_t n = 50 + static_cast<size_t>(trial) * 7;
    std::vector<float> reprs(n * shape.repr_floats());
    const float big = trial % 4 == 3 ? 1e4f : 1.0f;
    for (size_t c = 0; c < n; ++c) {
      const int kind = static_cast<int>((c / 8) % 4);  // identical, zero, scaled copies, random
      for (size_t i = 0; i < shape.repr_floats(); ++i) {
        float& x = reprs[c * shape.repr_floats() + i];
        const float base = reprs[(c / 8 * 8) * shape.repr_floats() + i];
        if (kind == 0) x = c % 8 == 0 ? big * nd(rng) : base;
        if (kind == 1) x = 0.0f;
        if (kind == 2) x = c % 8 == 0 ? nd(rng) : base * static_cast<float>(1 + c % 8);
        if (kind == 3) x = big * nd(rng);
      }
    }
    RoundTo(shape.dtype, &reprs);
    for (const char* heads : {"sum", "max"}) {
      auto index = MakeExact(std::string("Exact:rerank=0,heads=") + heads, shape);
      AddRange(index.get(), 0, n, reprs);
      ChunkGroupBounds bounds(H, D, R, G);
      bounds.Update(n, 0, [&](int h, size_t row, float* keys, float* inv_norm) {
        for (int r = 0; r < R; ++r) {
          const float* k = reprs.data() + ((row * R + r) * H + h) * D;
          std::copy_n(k, D, keys + r * D);
          inv_norm[r] = kernels::InverseNorm(k, D);
        }
      });
      const kernels::HeadFold fold(
          std::string(heads) == "max" ? kernels::HeadFold::Kind::kMax : kernels::HeadFold::Kind::kSum, H);
      for (int q = 0; q < 6; ++q) {
        std::vector<float> p(shape.dim());
        // Probes along a group's keys (the tightest case), random ones and a zero probe.
        const size_t c = std::uniform_int_distribution<size_t>(0, n - 1)(rng);
        for (size_t i = 0; i < p.size(); ++i)
          p[i] = q == 5 ? 0.0f : q % 2 ? nd(rng) : reprs[c * shape.repr_floats() + i];
        RoundTo(shape.dtype, &p);
        ChunkScores exact;
        ASSERT_TRUE(index->Score(p.data(), &exact).ok());
        for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine}) {
          std::vector<float> upper;
          bounds.UpperBounds(p.data(), fold, rank, &upper);
          ASSERT_EQ(upper.size(), (n + G - 1) / G);
          for (size_t row = 0; row < n; ++row)
            ASSERT_LE(exact.by(rank)[row], upper[row / G])
                << "trial " << trial << " heads " << heads << " probe " << q << " chunk " << row << " rank "
                << (rank == ChunkRank::kLogit ? "logit" : "cosine");
        }
      }
    }
  }
}

TEST(ExactHierarchy, KeysThatAreNotFiniteAreNeverSkipped) {
  const ChunkShape shape{1, 8, 1, DType::kF32};
  ChunkGroupBounds bounds(1, 8, 1, 8);
  bounds.Update(16, 0, [&](int, size_t row, float* keys, float* inv_norm) {
    for (int d = 0; d < 8; ++d) keys[d] = row == 3 ? std::numeric_limits<float>::quiet_NaN() : 1.0f;
    inv_norm[0] = kernels::InverseNorm(keys, 8);
  });
  const std::vector<float> p(8, 1.0f);
  std::vector<float> upper;
  bounds.UpperBounds(p.data(), kernels::HeadFold(kernels::HeadFold::Kind::kSum, 1), ChunkRank::kLogit,
                     &upper);
  EXPECT_TRUE(std::isinf(upper[0]));
  EXPECT_NEAR(upper[1], 8.0f, 1e-3f);
  const std::vector<float> nan_probe(8, std::numeric_limits<float>::quiet_NaN());
  bounds.UpperBounds(nan_probe.data(), kernels::HeadFold(kernels::HeadFold::Kind::kSum, 1),
                     ChunkRank::kCosine, &upper);
  EXPECT_TRUE(std::isnan(upper[1]));
  (void)shape;
}

TEST(ExactHierarchy, SpecKeyGroups) {
  auto o = ExactIndexOptions::Parse("Exact:groups=32");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o.value().groups, 32);
  EXPECT_EQ(o.value().ToString(), "Exact:heads=sum,rerank=1,rerank_min=0,groups=32");
  EXPECT_EQ(ExactIndexOptions::Parse(o.value().ToString()).value().groups, 32);
  EXPECT_EQ(ExactIndexOptions().ToString().find("groups"), std::string::npos);  // off: not spelled
  for (const char* bad : {"Exact:groups=12", "Exact:groups=-8", "Exact:groups=x"}) {
    auto r = ExactIndexOptions::Parse(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().ToString().find("groups"), std::string::npos) << r.status().ToString();
  }
}

// ---- the workload's key spectrum ---------------------------------------------------------------

// Per pair p of head 0's pre-RoPE keys: the mean square over `n` filler tokens.
std::vector<double> PairPower(const WorkloadOptions& base, const std::string& spectrum, int D) {
  WorkloadOptions o = base;
  EXPECT_TRUE(ParseKeySpectrum(spectrum, &o).ok()) << spectrum;
  const Geometry g{1, 2, 1, D, DType::kF32};
  auto w = Workload::Create(g, o);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  const int64_t n = 4000;
  std::vector<float> k(static_cast<size_t>(n) * D);
  w.value().Generate(0, 100, 100 + n, nullptr, k.data(), nullptr);
  std::vector<double> power(D / 2, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int d = 0; d < D; ++d) power[d % (D / 2)] += static_cast<double>(k[t * D + d]) * k[t * D + d] / n;
  return power;
}

TEST(ExactHierarchy, KeySpectrumShapesTheKeyNoiseAsDocumented) {
  WorkloadOptions o;
  o.context = 8192;
  o.apply_rope = false;
  o.topic_strength = 0.0f;  // noise alone in the keys (the filler's topic is 0)
  o.sink_tokens = 0;
  const int D = 64, P = D / 2;
  const std::vector<double> iso = PairPower(o, "off", D);
  const std::vector<double> decayed = PairPower(o, "decay=0.5", D);
  const std::vector<double> outlier = PairPower(o, "decay=0,outliers=2,scale=4", D);
  double iso_sum = 0, dec_sum = 0, out_sum = 0;
  for (int p = 0; p < P; ++p) {
    iso_sum += iso[p];
    dec_sum += decayed[p];
    out_sum += outlier[p];
  }
  // The noise keeps its power; isotropic pairs hold 2 noise^2 each.
  EXPECT_NEAR(dec_sum / iso_sum, 1.0, 0.02);
  EXPECT_NEAR(out_sum / iso_sum, 1.0, 0.02);
  EXPECT_NEAR(iso[0] / iso[P - 1], 1.0, 0.1);
  // decay=0.5: the power on pair p is ~ (1 + p)^-1.
  EXPECT_NEAR(decayed[0] / decayed[P - 1], static_cast<double>(P), 0.1 * P);
  EXPECT_NEAR(decayed[1] / decayed[3], 2.0, 0.2);
  // outliers=2,scale=4: pairs 0 and 1 hold 16x the power of the others.
  EXPECT_NEAR(outlier[0] / outlier[5], 16.0, 1.6);
  EXPECT_NEAR(outlier[1] / outlier[P - 1], 16.0, 1.6);
  EXPECT_NEAR(outlier[2] / outlier[P - 1], 1.0, 0.1);
  // "calibrated" is the documented setting; "off" restores the isotropic bytes.
  WorkloadOptions c = o;
  ASSERT_TRUE(ParseKeySpectrum("calibrated", &c).ok());
  EXPECT_EQ(KeySpectrumString(c), "decay=0.5,outliers=0,scale=1");
  ASSERT_TRUE(ParseKeySpectrum("off", &c).ok());
  EXPECT_EQ(KeySpectrumString(c), "off");
  EXPECT_EQ(PairPower(c, "off", D), iso);
  for (const char* bad : {"decay=-1", "decay", "outliers=1.5", "scale=0", "wobble=1"}) {
    WorkloadOptions b = o;
    EXPECT_FALSE(ParseKeySpectrum(bad, &b).ok()) << bad;
  }
  WorkloadOptions too_many = o;
  ASSERT_TRUE(ParseKeySpectrum("decay=0,outliers=40,scale=2", &too_many).ok());
  EXPECT_FALSE(Workload::Create(Geometry{1, 2, 1, D, DType::kF32}, too_many).ok());
}

}  // namespace
}  // namespace kvtier
