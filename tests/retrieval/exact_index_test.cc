// Tests of retrieval/exact_index.h: the Exact index kind through the ChunkIndex interface
// (hand-computed scores, heads=sum|max, the two-stage search against the single fp32 pass,
// tie order, removal against a fresh index, all-or-nothing Add), and the kernels it rests on.
#include "retrieval/exact_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/chunk_score.h"
#include "kernels/cpu/dot.h"
#include "kvtier/options.h"

namespace kvtier {
namespace {

std::unique_ptr<ChunkIndex> Make(const std::string& spec, const ChunkShape& shape) {
  auto r = MakeChunkIndex(spec, shape);
  EXPECT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

// n random chunks ([n, R, H, D] fp32), representable exactly in `dt` (as the store's keys are).
std::vector<float> RandomReprs(size_t n, const ChunkShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> out(n * s.repr_floats());
  for (float& x : out) x = nd(rng);
  std::vector<uint8_t> tmp(out.size() * DTypeSize(s.dtype));
  FromFloat(s.dtype, out.data(), tmp.data(), out.size());
  ToFloat(s.dtype, tmp.data(), out.data(), out.size());
  return out;
}

// Adds chunks `ids` (ascending) with reprs[i] for ids[i].
void AddAll(ChunkIndex* index, const std::vector<uint64_t>& ids, const std::vector<float>& reprs) {
  const size_t per = index->shape().repr_floats();
  std::vector<uint64_t> sorted = ids;
  ASSERT_TRUE(index
                  ->Add(sorted,
                        [&](uint64_t chunk, float* repr) {
                          const size_t i = std::find(ids.begin(), ids.end(), chunk) - ids.begin();
                          std::copy_n(reprs.data() + i * per, per, repr);
                          return Status::Ok();
                        })
                  .ok());
}

std::vector<uint64_t> Iota(size_t n, uint64_t from = 0) {
  std::vector<uint64_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

// The bytes one chunk's rows take: keys + norms (full) and codes + two scales, per head, + id.
uint64_t FullRowBytes(const ChunkShape& s) {
  return static_cast<uint64_t>(s.kv_heads) * s.repr * (s.head_dim * DTypeSize(s.dtype) + sizeof(float));
}
uint64_t CodeRowBytes(const ChunkShape& s) {
  return static_cast<uint64_t>(s.kv_heads) * s.repr * (s.head_dim + 2 * sizeof(float)) + sizeof(uint64_t);
}

std::vector<uint64_t> BestOf(const ChunkIndex& index, const std::vector<float>& probe, ChunkRank rank,
                             size_t take) {
  ChunkScores s;
  EXPECT_TRUE(index.Screen(probe.data(), &s).ok());
  std::vector<uint64_t> out;
  EXPECT_TRUE(index.Best(probe.data(), s, rank, take, &out).ok());
  return out;
}

// ---- scoring, hand-computed -----------------------------------------------------------------

TEST(ExactChunkIndex, ScoresTheBestRepresentativePerHead) {
  // H = 1, D = 2, R = 2. chunk 0: keys (3,0) and (-3,0) (mean 0); chunk 1: (1,0) twice.
  const ChunkShape shape{1, 2, 2, DType::kF32};
  for (const char* spec : {"Exact", "Exact:rerank=0"}) {
    auto index = Make(spec, shape);
    ASSERT_NE(index, nullptr);
    const float c0[] = {3, 0, -3, 0}, c1[] = {1, 0, 1, 0};
    ASSERT_TRUE(index->Add(0, c0).ok());
    ASSERT_TRUE(index->Add(1, c1).ok());
    const std::vector<float> p{2, 0};
    ChunkScores s;
    ASSERT_TRUE(index->Score(p.data(), &s).ok());
    EXPECT_EQ(s.ids, (std::vector<uint64_t>{0, 1}));
    EXPECT_EQ(s.logit, (std::vector<float>{6, 2}));   // best q.k: 2*3, 2*1
    EXPECT_EQ(s.cosine, (std::vector<float>{1, 1}));  // Eq. 10 of the best key
    EXPECT_EQ(BestOf(*index, p, ChunkRank::kLogit, 1), (std::vector<uint64_t>{0})) << spec;
    std::vector<uint64_t> top;
    ASSERT_TRUE(index->Search(p.data(), 1, &top).ok());
    EXPECT_EQ(top, (std::vector<uint64_t>{0})) << spec;
  }
}

// heads: chunk 0's keys match head 0 strongly and oppose head 1; chunk 1 matches both heads
// mildly. Summed over heads chunk 1 wins (10 - 5 < 3 + 3); when the most interested head
// decides, chunk 0 wins (10 > 3).
TEST(ExactChunkIndex, HeadsMaxLetsTheMostInterestedHeadDecide) {
  const ChunkShape shape{2, 2, 1, DType::kF32};  // H = 2, D = 2, R = 1: [head0 (x, y), head1 (x, y)]
  const float c0[] = {10, 0, -5, 0}, c1[] = {3, 0, 3, 0};
  const std::vector<float> p{1, 0, 1, 0};
  for (const char* rerank : {"0", "4"}) {
    for (const char* heads : {"sum", "max"}) {
      const std::string spec = std::string("Exact:heads=") + heads + ",rerank=" + rerank;
      auto index = Make(spec, shape);
      ASSERT_NE(index, nullptr);
      ASSERT_TRUE(index->Add(0, c0).ok());
      ASSERT_TRUE(index->Add(1, c1).ok());
      ChunkScores s;
      ASSERT_TRUE(index->Score(p.data(), &s).ok());
      const bool max = std::string(heads) == "max";
      EXPECT_EQ(s.logit, max ? (std::vector<float>{10, 3}) : (std::vector<float>{5, 6})) << spec;
      // sum: the heads' cosines averaged ((1 - 1) / 2, (1 + 1) / 2); max: the best head's.
      EXPECT_EQ(s.cosine, max ? (std::vector<float>{1, 1}) : (std::vector<float>{0, 1})) << spec;
      for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine}) {
        const auto best = BestOf(*index, p, rank, 1);
        // max by cosine: a tie (1 and 1), which goes to the smaller index.
        EXPECT_EQ(best, (std::vector<uint64_t>{max ? 0u : 1u})) << spec << " " << ChunkRankName(rank);
      }
    }
  }
}

// ---- the two-stage search -------------------------------------------------------------------

// The int8 screen plus the fp32 rescoring of the best candidates must choose what the single
// fp32 pass chooses when the candidates are generous, and exactly it when every chunk is
// rescored; Score is the fp32 pass whatever the rerank setting.
TEST(ExactChunkIndex, TwoStageSearchEqualsTheSinglePass) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (const char* heads : {"sum", "max"}) {
      const ChunkShape shape{2, 16, 2, dt};
      const size_t n = 200;
      const auto reprs = RandomReprs(n, shape, 11);
      std::vector<uint64_t> ids(n);
      std::iota(ids.begin(), ids.end(), 0);
      const std::string h = std::string("Exact:heads=") + heads;
      auto single = Make(h + ",rerank=0", shape);
      auto two = Make(h, shape);  // the default: the screen's error bound picks the candidates
      auto all = Make(h + ",rerank=1,rerank_min=1000", shape);
      ASSERT_TRUE(single && two && all);
      AddAll(single.get(), ids, reprs);
      AddAll(two.get(), ids, reprs);
      AddAll(all.get(), ids, reprs);
      std::mt19937 rng(5);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (int q = 0; q < 20; ++q) {
        std::vector<float> p(shape.dim());
        for (float& x : p) x = nd(rng);
        const std::string what = std::string(DTypeName(dt)) + " " + heads + " probe " + std::to_string(q);
        ChunkScores a, b, screened;
        ASSERT_TRUE(single->Score(p.data(), &a).ok());
        ASSERT_TRUE(two->Score(p.data(), &b).ok());
        EXPECT_EQ(a.logit, b.logit) << what;
        EXPECT_EQ(a.cosine, b.cosine) << what;
        // The screen approximates the fp32 scores (int8 codes of keys and probe).
        ASSERT_TRUE(two->Screen(p.data(), &screened).ok());
        ASSERT_EQ(screened.ids, a.ids);
        for (size_t i = 0; i < n; ++i)
          EXPECT_NEAR(screened.cosine[i], a.cosine[i], 0.05) << what << " chunk " << i;
        for (ChunkRank rank : {ChunkRank::kCosine, ChunkRank::kLogit})
          for (size_t take : {size_t{1}, size_t{8}, size_t{30}, n + 5}) {
            const auto expect = BestOf(*single, p, rank, take);
            ASSERT_EQ(expect.size(), std::min(take, n));
            EXPECT_EQ(BestOf(*two, p, rank, take), expect) << what << " take " << take;
            EXPECT_EQ(BestOf(*all, p, rank, take), expect) << what << " take " << take;
          }
        std::vector<uint64_t> s1, s2;
        ASSERT_TRUE(single->Search(p.data(), 8, &s1).ok());
        ASSERT_TRUE(two->Search(p.data(), 8, &s2).ok());
        EXPECT_EQ(s1, s2) << what;
        EXPECT_EQ(s1, BestOf(*single, p, ChunkRank::kLogit, 8)) << what;
      }
    }
}

// Chunks whose scores all lie within the int8 codes' error of each other: the screen orders
// them arbitrarily, and only its error bound (ChunkScores::logit_error, cosine_error) keeps the
// two-stage choice equal to the single fp32 pass's. Each bound must hold chunk by chunk, and
// the candidates must shrink when the scores spread out.
TEST(ExactChunkIndex, ScreenErrorBoundsHoldAndMakeTheChoiceExactOnNearTies) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (const char* heads : {"sum", "max"})
      for (bool capped : {false, true}) {
        const ChunkShape shape{2, 32, 4, dt};
        const size_t n = 300, per = shape.repr_floats();
        std::mt19937 rng(17);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> base(per), reprs(n * per);
        for (float& x : base) x = nd(rng);
        for (size_t c = 0; c < n; ++c)  // every chunk the same keys, moved by 0.3% of their scale
          for (size_t i = 0; i < per; ++i) reprs[c * per + i] = base[i] + 0.003f * nd(rng);
        std::vector<uint8_t> tmp(reprs.size() * DTypeSize(dt));  // representable, as stored keys are
        FromFloat(dt, reprs.data(), tmp.data(), reprs.size());
        ToFloat(dt, tmp.data(), reprs.data(), reprs.size());
        const std::string h = std::string("Exact:heads=") + heads;
        auto single = Make(h + ",rerank=0", shape);
        auto two = Make(h, shape);
        ASSERT_TRUE(single && two);
        if (capped) {  // the older half as int8 codes only, in both (rescored from the codes)
          const uint64_t cap = n * (CodeRowBytes(shape) + FullRowBytes(shape) / 2);
          ASSERT_TRUE(single->SetMemoryCap(cap).ok());
          ASSERT_TRUE(two->SetMemoryCap(cap).ok());
        }
        AddAll(single.get(), Iota(n), reprs);
        AddAll(two.get(), Iota(n), reprs);
        if (capped) ASSERT_GT(two->compressed_chunks(), 50u);
        const auto* exact_two = dynamic_cast<const ExactChunkIndex*>(two.get());
        ASSERT_NE(exact_two, nullptr);
        for (int q = 0; q < 6; ++q) {
          std::vector<float> p(shape.dim());
          for (float& x : p) x = nd(rng);
          const std::string what = std::string(DTypeName(dt)) + " " + heads + (capped ? " capped" : "") +
                                   " probe " + std::to_string(q);
          ChunkScores exact, screened;
          ASSERT_TRUE(two->Score(p.data(), &exact).ok());
          EXPECT_TRUE(exact.logit_error.empty() && exact.cosine_error.empty()) << what;
          ASSERT_TRUE(two->Screen(p.data(), &screened).ok());
          ASSERT_EQ(screened.logit_error.size(), n);
          ASSERT_EQ(screened.cosine_error.size(), n);
          size_t reordered = 0;
          for (size_t c = 0; c < n; ++c) {
            EXPECT_LE(std::fabs(screened.logit[c] - exact.logit[c]), screened.logit_error[c])
                << what << " " << c;
            EXPECT_LE(std::fabs(screened.cosine[c] - exact.cosine[c]), screened.cosine_error[c])
                << what << " " << c;
            if (c > 0)
              reordered +=
                  (screened.logit[c] < screened.logit[c - 1]) != (exact.logit[c] < exact.logit[c - 1]);
          }
          EXPECT_GT(reordered, 10u) << what << ": the screen must really reorder these chunks";
          for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine})
            for (size_t take : {size_t{1}, size_t{5}, size_t{17}}) {
              const auto want = BestOf(*single, p, rank, take);
              ASSERT_EQ(want.size(), take);
              EXPECT_EQ(BestOf(*two, p, rank, take), want) << what << " take " << take;
            }
        }
      }
  // Spread-out scores: the bound leaves few candidates (the rescoring reads a small share).
  const ChunkShape shape{2, 64, 4, DType::kF16};
  const size_t n = 4000;
  auto index = Make("Exact:heads=max", shape);
  AddAll(index.get(), Iota(n), RandomReprs(n, shape, 23));
  const auto* exact_index = dynamic_cast<const ExactChunkIndex*>(index.get());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> p(shape.dim());
  for (float& x : p) x = nd(rng);
  const uint64_t before = exact_index->rescored_chunks();
  ASSERT_EQ(BestOf(*index, p, ChunkRank::kLogit, 64).size(), 64u);
  const uint64_t rescored = exact_index->rescored_chunks() - before;
  EXPECT_GE(rescored, 64u);
  EXPECT_LT(rescored, 400u) << "a tenth of the chunks at most for a take of 64";
}

// screen=int4: every chunk screened from 4-bit codes with a bound per chunk, the candidates
// rescored from the int8 codes with theirs, then from the stored keys. Near ties (every chunk
// within the int4 error of the others) and spread scores, both head folds, repr=mean, and rows
// the cap compressed (scored from their int8 codes, the int4 bound widened by the int8 one):
// each bound holds chunk by chunk, the choice is the single fp32 pass's, and each stage reads
// and counts what it says.
TEST(ExactChunkIndex, Int4ScreenBoundsHoldAndThreeStagesChooseTheFp32TopB) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (const char* heads : {"sum", "max"})
      for (const char* repr : {"", ",repr=mean"})
        for (bool capped : {false, true})
          for (float spread : {0.003f, 0.3f}) {
            const ChunkShape shape{2, 32, 4, dt};
            const size_t n = 300, per = shape.repr_floats();
            std::mt19937 rng(19);
            std::normal_distribution<float> nd(0.0f, 1.0f);
            std::vector<float> base(per), reprs(n * per);
            for (float& x : base) x = nd(rng);
            for (size_t c = 0; c < n; ++c)
              for (size_t i = 0; i < per; ++i) reprs[c * per + i] = base[i] + spread * nd(rng);
            std::vector<uint8_t> tmp(reprs.size() * DTypeSize(dt));
            FromFloat(dt, reprs.data(), tmp.data(), reprs.size());
            ToFloat(dt, tmp.data(), reprs.data(), reprs.size());
            const std::string h = std::string("Exact:heads=") + heads + repr;
            auto single = Make(h + ",rerank=0", shape);
            auto int8 = Make(h, shape);
            auto int4 = Make(h + ",screen=int4", shape);
            ASSERT_TRUE(single && int8 && int4);
            if (capped) {  // the older rows as codes only, in all three
              const uint64_t cap = n * (CodeRowBytes(shape) + FullRowBytes(shape) / 2);
              for (auto* idx : {single.get(), int8.get(), int4.get()})
                ASSERT_TRUE(idx->SetMemoryCap(cap).ok());
            }
            for (auto* idx : {single.get(), int8.get(), int4.get()}) AddAll(idx, Iota(n), reprs);
            const auto* x4 = dynamic_cast<const ExactChunkIndex*>(int4.get());
            ASSERT_NE(x4, nullptr);
            if (capped && *repr == '\0') {
              ASSERT_GT(x4->compressed_chunks(), 30u);
              ASSERT_EQ(x4->evicted_chunks(), 0u);
            }
            EXPECT_EQ(x4->Int4RowBytes(), static_cast<uint64_t>(x4->CodeRowBytes()) -
                                              static_cast<uint64_t>(*repr ? 1 : 4) * 2 * (32 - 8 * 2))
                << "4-bit codes: half the code bytes, the same scales";
            for (int q = 0; q < 4; ++q) {
              std::vector<float> p(shape.dim());
              for (float& x : p) x = nd(rng);
              const std::string what = std::string(DTypeName(dt)) + " " + heads + repr +
                                       (capped ? " capped" : "") + " spread " + std::to_string(spread) +
                                       " probe " + std::to_string(q);
              // The reference: the fp32 pass over this index's rows (under the cap the int4 index,
              // whose code rows are larger, compresses more of them than the others).
              ChunkScores exact, s4, s8;
              ASSERT_TRUE((capped ? int4 : single)->Score(p.data(), &exact).ok());
              const IndexReadBytes b0 = x4->read_bytes();
              ASSERT_TRUE(int4->Screen(p.data(), &s4).ok());
              EXPECT_EQ(x4->read_bytes().first_stage - b0.first_stage, n * x4->Int4RowBytes()) << what;
              ASSERT_TRUE(int8->Screen(p.data(), &s8).ok());
              ASSERT_EQ(s4.logit_error.size(), n);
              double e4 = 0.0, e8 = 0.0;
              for (size_t c = 0; c < n; ++c) {
                EXPECT_LE(std::fabs(s4.logit[c] - exact.logit[c]), s4.logit_error[c]) << what << " " << c;
                EXPECT_LE(std::fabs(s4.cosine[c] - exact.cosine[c]), s4.cosine_error[c]) << what << " " << c;
                e4 += s4.logit_error[c];
                e8 += s8.logit_error[c];
              }
              EXPECT_GT(e4, 4.0 * e8) << what << ": the 4-bit step is 127/7 the int8 one";
              for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine})
                for (size_t take : {size_t{1}, size_t{5}, size_t{17}}) {
                  const auto want =
                      capped ? TakeBest(exact.by(rank), exact.ids, take) : BestOf(*single, p, rank, take);
                  ASSERT_EQ(want.size(), take);
                  const uint64_t coded0 = x4->code_rescored_chunks(), fp0 = x4->rescored_chunks();
                  const IndexReadBytes r0 = x4->read_bytes();
                  std::vector<uint64_t> got;
                  ASSERT_TRUE(int4->Best(p.data(), s4, rank, take, &got).ok());
                  EXPECT_EQ(got, want) << what << " take " << take;
                  const uint64_t coded = x4->code_rescored_chunks() - coded0,
                                 fp = x4->rescored_chunks() - fp0;
                  EXPECT_GE(coded, take) << what;
                  EXPECT_GE(fp, take) << what;
                  EXPECT_LE(fp, coded) << what << ": the fp32 stage rescores a subset of the int8 one";
                  if (!capped) {  // int8 groups of 8 rows, then fp32 rows
                    const uint64_t read = x4->read_bytes().rescoring - r0.rescoring - fp * x4->FullRowBytes();
                    const uint64_t group = kernels::kI8Block * x4->CodeRowBytes();
                    EXPECT_EQ(read % group, 0u) << what;
                    EXPECT_GE(read, (coded + 7) / 8 * group) << what;
                    EXPECT_LE(read, std::min(coded, (n + 7) / 8) * group) << what << ": no group read twice";
                  }
                }
            }
          }
}

// The int4 codes in their blocks and the kernel: the vector paths (AVX-512 VNNI, AVX2) equal the
// scalar twin bit for bit at every head width they treat differently, the scalar twin equals
// the integer dot of the codes written, and 4-bit quantisation is within half a step.
TEST(ExactChunkIndexKernels, Int4BlockDotMatchesTheScalarTwinAndTheCodes) {
  std::mt19937 rng(13);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  constexpr int B = kernels::kI4Block;
  for (int d :
       {1, 2, 3, 4, 5, 6, 15, 16, 17, 30, 32, 62, 64, 66, 128, 130, 510, 512, 514, 1000, 1024, 1030}) {
    const size_t n_blocks = d > 600 ? 5 : 37;
    const size_t bb = kernels::I4BlockBytes(d);
    EXPECT_EQ(bb, static_cast<size_t>((d + 3) / 4) * 16);
    std::vector<uint8_t> blocks(n_blocks * bb, 0);
    std::vector<int8_t> codes(n_blocks * B * static_cast<size_t>(d));
    for (size_t b = 0; b < n_blocks; ++b)
      for (int j = 0; j < B; ++j)
        for (int e = 0; e < d; ++e) {
          const int8_t c = static_cast<int8_t>(static_cast<int>(rng() % 16) - 8);  // [-8, 7]
          codes[(b * B + j) * d + e] = c;
          kernels::PutI4(blocks.data() + b * bb, e, j, c);
        }
    for (size_t b = 0; b < n_blocks; ++b)
      for (int j = 0; j < B; ++j)
        for (int e = 0; e < d; ++e)
          ASSERT_EQ(kernels::GetI4(blocks.data() + b * bb, e, j), codes[(b * B + j) * d + e]) << d;
    std::vector<float> p(d);
    for (auto& v : p) v = nd(rng);
    std::vector<int16_t> p16(kernels::I4ProbeLength(d), 0);
    kernels::QuantizeProbeI16(p.data(), d, p16.data());
    std::vector<int32_t> out(n_blocks * B), ref(n_blocks * B);
    kernels::DotI4Blocks(blocks.data(), n_blocks, p16.data(), d, out.data());
    kernels::DotI4BlocksScalar(blocks.data(), n_blocks, p16.data(), d, ref.data());
    EXPECT_EQ(out, ref) << "vector path vs scalar twin, d " << d;
    // Each vector path on its own, whichever DotI4Blocks dispatches to at this width.
#if defined(__AVX2__)
    std::fill(out.begin(), out.end(), 0);
    kernels::dot_internal::DotI4BlocksAvx2(blocks.data(), n_blocks, p16.data(), d, out.data());
    EXPECT_EQ(out, ref) << "AVX2 path vs scalar twin, d " << d;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (d <= 512) {
      std::fill(out.begin(), out.end(), 0);
      kernels::dot_internal::DotI4BlocksAvx512(blocks.data(), n_blocks, p16.data(), d, out.data());
      EXPECT_EQ(out, ref) << "AVX-512 VNNI path vs scalar twin, d " << d;
    }
#endif
    for (size_t row = 0; row < n_blocks * B; ++row) {
      int64_t want = 0;
      for (int e = 0; e < d; ++e) want += static_cast<int64_t>(codes[row * d + e]) * p16[e];
      ASSERT_EQ(ref[row], want) << "d " << d << " row " << row;
    }
  }
  // Extreme codes at the widest head: no overflow.
  {
    const int d = 4096;
    std::vector<uint8_t> block(kernels::I4BlockBytes(d), 0x88);  // every code -8
    std::vector<float> p(d, -1.0f);
    std::vector<int16_t> p16(kernels::I4ProbeLength(d), 0);
    kernels::QuantizeProbeI16(p.data(), d, p16.data());
    int32_t out[B], ref[B];
    kernels::DotI4Blocks(block.data(), 1, p16.data(), d, out);
    kernels::DotI4BlocksScalar(block.data(), 1, p16.data(), d, ref);
    for (int j = 0; j < B; ++j) {
      EXPECT_EQ(out[j], ref[j]);
      EXPECT_EQ(out[j], static_cast<int64_t>(-8) * p16[0] * d);
    }
  }
  for (int d : {1, 7, 64, 129}) {
    std::vector<float> x(d);
    for (auto& v : x) v = nd(rng);
    std::vector<int8_t> c(d);
    const float scale = kernels::QuantizeI4(x.data(), d, c.data());
    float m = 0.0f;
    for (float v : x) m = std::max(m, std::fabs(v));
    EXPECT_FLOAT_EQ(scale, m / 7.0f);
    for (int e = 0; e < d; ++e) {
      EXPECT_LE(std::abs(c[e]), 7);
      EXPECT_LE(std::fabs(c[e] * scale - x[e]), 0.5f * scale * 1.0001f) << d << " " << e;
    }
  }
  std::vector<float> zero(8, 0.0f);
  std::vector<int8_t> c(8, 5);
  EXPECT_EQ(kernels::QuantizeI4(zero.data(), 8, c.data()), 0.0f);
  for (int8_t v : c) EXPECT_EQ(v, 0);
}

// Best's contract for any screen: every score within its stated error of the exact one, the
// choice is the exact top take. Adversarial screens here: the exact best chunks screened as
// low as their bound allows and the rest as high, with errors up to half the scores' spread,
// so the rescoring (and the skipping of candidates once the take-th best exact score is
// above the rest's upper bounds) must rely on the bounds alone.
// BestOf scores chosen chunks exactly: over every chunk it is the single exact pass's choice,
// over a subset the best of that subset by the exact scores; unknown chunks are left out.
TEST(ExactChunkIndex, BestOfChoosesFromTheGivenChunksByExactScores) {
  for (const char* heads : {"sum", "max"})
    for (DType dt : {DType::kF32, DType::kF16}) {
      const ChunkShape shape{2, 16, 4, dt};
      const size_t n = 300;
      const std::string spec = std::string("Exact:heads=") + heads;
      auto index = Make(spec, shape);
      AddAll(index.get(), Iota(n), RandomReprs(n, shape, 41));
      auto single = Make(spec + ",rerank=0", shape);
      AddAll(single.get(), Iota(n), RandomReprs(n, shape, 41));
      std::mt19937 rng(6);
      std::normal_distribution<float> nd;
      for (int q = 0; q < 5; ++q) {
        std::vector<float> p(shape.dim());
        for (float& x : p) x = nd(rng);
        ChunkScores exact;
        ASSERT_TRUE(index->Score(p.data(), &exact).ok());
        for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine})
          for (size_t take : {size_t{1}, size_t{10}, size_t{60}}) {
            std::vector<uint64_t> got;
            ASSERT_TRUE(index->BestOf(p.data(), Iota(n), rank, take, &got).ok());
            EXPECT_EQ(got, BestOf(*single, p, rank, take)) << heads << " take " << take;
            // Every third chunk, given out of order, plus chunks the index does not hold.
            std::vector<uint64_t> subset{100000, 7777};
            for (size_t c = n; c-- > 0;)
              if (c % 3 == 0) subset.push_back(c);
            std::vector<uint64_t> ids;
            std::vector<float> by;
            for (size_t c = 0; c < n; c += 3) {
              ids.push_back(c);
              by.push_back(exact.by(rank)[c]);
            }
            ASSERT_TRUE(index->BestOf(p.data(), subset, rank, take, &got).ok());
            EXPECT_EQ(got, TakeBest(by, ids, take)) << heads << " take " << take;
          }
      }
    }
  // The FAISS kinds cannot: FailedPrecondition, which the Retriever's reuse takes as "keep the
  // stored choice".
  auto flat = Make("Flat", ChunkShape{2, 16, 4, DType::kF32});
  std::vector<uint64_t> out;
  std::vector<float> p(32, 1.0f);
  EXPECT_EQ(flat->BestOf(p.data(), {0, 1}, ChunkRank::kLogit, 1, &out).code(),
            StatusCode::kFailedPrecondition);
}

// ScreenRows gives rows [begin, end) of the whole screen, the int8 pass's scores and bounds or
// the fp32 pass's, whatever the range's alignment to the int8 blocks; ScoreChunks gives the
// chosen chunks' exact scores, ascending, the ones the index does not hold left out.
TEST(ExactChunkIndex, ScreenRowsAndScoreChunksAreTheWholeScreensRows) {
  for (const char* spec : {"Exact:heads=sum", "Exact:heads=max", "Exact:heads=max,rerank=0"})
    for (DType dt : {DType::kF32, DType::kF16}) {
      SCOPED_TRACE(std::string(spec) + " " + DTypeName(dt));
      const ChunkShape shape{2, 16, 4, dt};
      const size_t n = 203;  // not a multiple of the 8-row int8 blocks
      auto index = Make(spec, shape);
      AddAll(index.get(), Iota(n, 5), RandomReprs(n, shape, 43));
      std::mt19937 rng(8);
      std::normal_distribution<float> nd;
      std::vector<float> p(shape.dim());
      for (float& x : p) x = nd(rng);
      ChunkScores whole, exact, part;
      ASSERT_TRUE(index->Screen(p.data(), &whole).ok());
      ASSERT_TRUE(index->Score(p.data(), &exact).ok());
      const bool approximate = std::string(spec).find("rerank=0") == std::string::npos;
      ASSERT_EQ(whole.logit_error.empty(), !approximate);
      for (auto [b, e] :
           std::vector<std::pair<size_t, size_t>>{{0, n}, {0, 8}, {5, 77}, {8, 16}, {200, 203}, {9, 9}}) {
        ASSERT_TRUE(index->ScreenRows(p.data(), b, e, &part).ok());
        ASSERT_EQ(part.ids.size(), e - b);
        ASSERT_EQ(part.logit.size(), e - b);
        ASSERT_EQ(part.logit_error.size(), approximate ? e - b : 0u);
        for (size_t i = 0; i < e - b; ++i) {
          EXPECT_EQ(part.ids[i], whole.ids[b + i]);
          if (approximate) {  // the same int8 arithmetic, bit for bit
            EXPECT_EQ(part.logit[i], whole.logit[b + i]) << "row " << b + i;
            EXPECT_EQ(part.cosine[i], whole.cosine[b + i]) << "row " << b + i;
            EXPECT_EQ(part.logit_error[i], whole.logit_error[b + i]) << "row " << b + i;
            EXPECT_EQ(part.cosine_error[i], whole.cosine_error[b + i]) << "row " << b + i;
          } else {  // the fp32 pass, summed in another order
            EXPECT_NEAR(part.logit[i], whole.logit[b + i], 1e-4f * (1.0f + std::fabs(whole.logit[b + i])));
            EXPECT_NEAR(part.cosine[i], whole.cosine[b + i], 1e-5f);
          }
        }
      }
      // A partial screen is no whole one: Best refuses it.
      ASSERT_TRUE(index->ScreenRows(p.data(), 0, n, &part).ok());
      std::vector<uint64_t> out;
      EXPECT_EQ(index->Best(p.data(), part, ChunkRank::kLogit, 3, &out).code(), StatusCode::kInvalidArgument);
      for (auto [b, e] : std::vector<std::pair<size_t, size_t>>{{0, n + 1}, {10, 9}, {n + 1, n + 1}})
        EXPECT_EQ(index->ScreenRows(p.data(), b, e, &part).code(), StatusCode::kInvalidArgument)
            << b << " " << e;
      EXPECT_EQ(index->ScreenRows(nullptr, 0, 1, &part).code(), StatusCode::kInvalidArgument);
      // ScoreChunks: out of order, a duplicate, chunks the index does not hold.
      ChunkScores chosen;
      ASSERT_TRUE(index->ScoreChunks(p.data(), {150, 7, 100000, 150, 4, 207, 33}, &chosen).ok());
      ASSERT_EQ(chosen.ids, (std::vector<uint64_t>{7, 33, 150, 207}));
      EXPECT_TRUE(chosen.logit_error.empty());
      for (size_t i = 0; i < chosen.ids.size(); ++i) {
        const size_t row = chosen.ids[i] - 5;
        EXPECT_NEAR(chosen.logit[i], exact.logit[row], 1e-4f * (1.0f + std::fabs(exact.logit[row])));
        EXPECT_NEAR(chosen.cosine[i], exact.cosine[row], 1e-5f);
      }
      EXPECT_EQ(index->ScoreChunks(p.data(), {7}, nullptr).code(), StatusCode::kInvalidArgument);
    }
  // The FAISS kinds can do neither.
  auto flat = Make("Flat", ChunkShape{2, 16, 4, DType::kF32});
  AddAll(flat.get(), Iota(10), RandomReprs(10, ChunkShape{2, 16, 4, DType::kF32}, 3));
  std::vector<float> p(32, 1.0f);
  ChunkScores out;
  EXPECT_EQ(flat->ScreenRows(p.data(), 0, 8, &out).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(flat->ScoreChunks(p.data(), {1, 2}, &out).code(), StatusCode::kFailedPrecondition);
}

TEST(ExactChunkIndex, BestIsExactForAnyScreenWithinItsBounds) {
  // screen=int4 adds a stage (the int8 codes' bound rules chunks out before the fp32 pass); its
  // choice too must hold for any first stage within its bounds.
  for (const char* spec : {"Exact:heads=max", "Exact:heads=max,screen=int4", "Exact:heads=sum,screen=int4"}) {
    const ChunkShape shape{2, 16, 4, DType::kF32};
    const size_t n = 500;
    auto index = Make(spec, shape);
    AddAll(index.get(), Iota(n), RandomReprs(n, shape, 31));
    auto single = Make(std::string(spec).find("sum") != std::string::npos ? "Exact:heads=sum,rerank=0"
                                                                          : "Exact:heads=max,rerank=0",
                       shape);
    AddAll(single.get(), Iota(n), RandomReprs(n, shape, 31));
    std::mt19937 rng(4);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int q = 0; q < 10; ++q) {
      std::vector<float> p(shape.dim());
      for (float& x : p) x = nd(rng);
      ChunkScores exact;
      ASSERT_TRUE(index->Score(p.data(), &exact).ok());
      for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine})
        for (size_t take : {size_t{1}, size_t{8}, size_t{40}}) {
          const std::vector<float>& by = exact.by(rank);
          const auto [lo, hi] = std::minmax_element(by.begin(), by.end());
          const float spread = *hi - *lo;
          std::vector<size_t> order(n);
          std::iota(order.begin(), order.end(), size_t{0});
          std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return by[a] > by[b]; });
          std::vector<bool> top(n, false);
          for (size_t i = 0; i < 2 * take; ++i) top[order[i]] = true;
          ChunkScores screened;
          ASSERT_TRUE(index->Screen(p.data(), &screened).ok());  // for its stamp
          for (std::vector<float>* v :
               {&screened.logit, &screened.cosine, &screened.logit_error, &screened.cosine_error})
            v->assign(n, 0.0f);
          std::vector<float>& s = rank == ChunkRank::kLogit ? screened.logit : screened.cosine;
          std::vector<float>& e = rank == ChunkRank::kLogit ? screened.logit_error : screened.cosine_error;
          for (size_t c = 0; c < n; ++c) {
            e[c] = 0.5f * spread * u(rng);
            s[c] = top[c] ? by[c] - e[c] : by[c] + e[c];
          }
          std::vector<uint64_t> got;
          ASSERT_TRUE(index->Best(p.data(), screened, rank, take, &got).ok());
          EXPECT_EQ(got, BestOf(*single, p, rank, take))
              << spec << " probe " << q << " rank " << (rank == ChunkRank::kLogit ? "logit" : "cosine")
              << " take " << take;
        }
    }
  }
}

TEST(ExactChunkIndex, RefineForEntropyRescoresUntilTheThetaBoundIsMet) {
  const ChunkShape shape{2, 16, 4, DType::kF16};
  const size_t n = 600;
  auto made = ExactChunkIndex::Create(shape, *ExactIndexOptions::Parse("Exact:heads=max"));
  ASSERT_TRUE(made.ok());
  ExactChunkIndex* index = made->get();
  AddAll(index, Iota(n), RandomReprs(n, shape, 53));
  auto single = Make("Exact:heads=max,rerank=0", shape);
  AddAll(single.get(), Iota(n), RandomReprs(n, shape, 53));
  std::mt19937 rng(6);
  std::normal_distribution<float> nd;
  for (int q = 0; q < 4; ++q) {
    std::vector<float> p(shape.dim());
    for (float& x : p) x = nd(rng);
    ChunkScores exact, screened;
    ASSERT_TRUE(single->Score(p.data(), &exact).ok());
    const double theta_fp32 = SoftmaxEntropy(exact.cosine.data(), static_cast<int>(n));
    ASSERT_TRUE(index->Screen(p.data(), &screened).ok());
    const double screened_bound =
        SoftmaxEntropyErrorBound(screened.cosine.data(), screened.cosine_error.data(), static_cast<int>(n));
    ASSERT_GT(screened_bound, 0.0);
    ASSERT_TRUE(std::isfinite(screened_bound));

    // A target the screen meets already: nothing is rescored and the scores stay.
    const ChunkScores before = screened;
    const uint64_t refined0 = index->entropy_rescored_chunks();
    double bound = -1.0;
    ASSERT_TRUE(index->RefineForEntropy(p.data(), 2.0 * screened_bound, &screened, &bound).ok());
    EXPECT_EQ(bound, screened_bound);
    EXPECT_EQ(index->entropy_rescored_chunks(), refined0);
    EXPECT_TRUE(screened.exact_rows.empty());
    EXPECT_EQ(screened.cosine, before.cosine);

    // A target 20 times below the screen's bound: chunks are rescored (a minority of them,
    // the ones that weigh most), their scores are the fp32 pass's bit for bit, and the bound
    // then holds the target and the true error.
    const double target = screened_bound / 20.0;
    const IndexReadBytes read0 = index->read_bytes();
    const uint64_t rescored0 = index->rescored_chunks();
    ASSERT_TRUE(index->RefineForEntropy(p.data(), target, &screened, &bound).ok());
    const uint64_t refined = index->entropy_rescored_chunks() - refined0;
    EXPECT_GT(refined, 0u) << "probe " << q;
    EXPECT_LT(refined, n) << "probe " << q;
    EXPECT_EQ(index->rescored_chunks() - rescored0, refined);
    EXPECT_EQ(index->read_bytes().rescoring - read0.rescoring, refined * FullRowBytes(shape));
    ASSERT_EQ(screened.exact_rows.size(), refined);
    EXPECT_TRUE(std::is_sorted(screened.exact_rows.begin(), screened.exact_rows.end()));
    for (int64_t r : screened.exact_rows) {
      const size_t c = static_cast<size_t>(r);
      EXPECT_EQ(screened.cosine[c], exact.cosine[c]) << "row " << r;
      EXPECT_EQ(screened.logit[c], exact.logit[c]) << "row " << r;
      EXPECT_EQ(screened.cosine_error[c], 0.0f);
      EXPECT_EQ(screened.logit_error[c], 0.0f);
    }
    EXPECT_LE(bound, target) << "probe " << q;
    EXPECT_EQ(bound, SoftmaxEntropyErrorBound(screened.cosine.data(), screened.cosine_error.data(),
                                              static_cast<int>(n)));
    EXPECT_LE(std::abs(SoftmaxEntropy(screened.cosine.data(), static_cast<int>(n)) - theta_fp32), bound);

    // Best from the refined scores chooses the fp32 pass's chunks and reads none of the
    // refined chunks again.
    for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine}) {
      ChunkScores plain;
      ASSERT_TRUE(index->Screen(p.data(), &plain).ok());
      std::vector<uint64_t> from_plain, from_refined;
      const uint64_t r0 = index->rescored_chunks();
      ASSERT_TRUE(index->Best(p.data(), plain, rank, 16, &from_plain).ok());
      const uint64_t r1 = index->rescored_chunks();
      ASSERT_TRUE(index->Best(p.data(), screened, rank, 16, &from_refined).ok());
      const uint64_t r2 = index->rescored_chunks();
      EXPECT_EQ(from_refined, BestOf(*single, p, rank, 16));
      EXPECT_EQ(from_plain, from_refined);
      EXPECT_LT(r2 - r1, r1 - r0) << "the refined chunks among Best's candidates are not read again";
    }
  }
}

TEST(ExactChunkIndex, TiedChunksGoToTheSmallerIndexFirst) {
  // Every chunk holds (1,0) twice: every score ties, in both stages and in a single pass, and
  // the smaller chunk index must win and come first. With p = (0,1) every dot is +0 or -0,
  // which compare equal and must tie too.
  const ChunkShape shape{1, 2, 2, DType::kF32};
  const float c[] = {1, 0, 1, 0};
  for (int rerank : {0, 1, 4})
    for (const std::vector<float>& p :
         {std::vector<float>{1, 0}, std::vector<float>{0, 1}, std::vector<float>{0, -1}}) {
      auto index = Make("Exact:rerank=" + std::to_string(rerank) + ",rerank_min=0", shape);
      ASSERT_NE(index, nullptr);
      for (uint64_t id : {3, 5, 9, 10}) ASSERT_TRUE(index->Add(id, c).ok());
      const std::string what = "rerank " + std::to_string(rerank) + " p (" + std::to_string(p[0]) + "," +
                               std::to_string(p[1]) + ")";
      for (ChunkRank rank : {ChunkRank::kCosine, ChunkRank::kLogit}) {
        EXPECT_EQ(BestOf(*index, p, rank, 1), (std::vector<uint64_t>{3})) << what;
        EXPECT_EQ(BestOf(*index, p, rank, 3), (std::vector<uint64_t>{3, 5, 9})) << what;
      }
      std::vector<uint64_t> top;
      ASSERT_TRUE(index->Search(p.data(), 2, &top).ok());
      EXPECT_EQ(top, (std::vector<uint64_t>{3, 5})) << what;
    }
}

// ---- removal --------------------------------------------------------------------------------

// Removing chunks compacts the rows and requantises them into new lanes; the result must be
// bit for bit the index built afresh from the kept chunks: the int8 screen (which the lanes
// feed), the fp32 scores and the choices.
TEST(ExactChunkIndex, RemovalEqualsAFreshIndex) {
  for (const std::string spec : {"Exact:rerank=1,rerank_min=0", "Exact:rerank=1,rerank_min=0,screen=int4"})
    for (DType dt : {DType::kF32, DType::kF16}) {
      const ChunkShape shape{2, 16, 3, dt};
      const size_t n = 50;
      const auto reprs = RandomReprs(n, shape, 17);
      std::vector<uint64_t> ids(n);
      for (size_t i = 0; i < n; ++i) ids[i] = 2 * i + 1;  // gaps
      auto compacted = Make(spec, shape);
      ASSERT_NE(compacted, nullptr);
      AddAll(compacted.get(), ids, reprs);
      // Chunks from several int8 groups, the first and the last, and indices the index never held.
      const std::vector<uint64_t> gone{1, 7, 9, 33, 35, 37, 4, 99, 1000};
      ASSERT_TRUE(compacted->Remove(gone).ok());
      std::vector<uint64_t> kept_ids;
      std::vector<float> kept_reprs;
      for (size_t i = 0; i < n; ++i) {
        if (std::count(gone.begin(), gone.end(), ids[i])) continue;
        kept_ids.push_back(ids[i]);
        kept_reprs.insert(kept_reprs.end(), reprs.begin() + i * shape.repr_floats(),
                          reprs.begin() + (i + 1) * shape.repr_floats());
      }
      ASSERT_EQ(compacted->size(), kept_ids.size());
      ASSERT_EQ(kept_ids.size(), n - 7);
      auto fresh = Make(spec, shape);
      ASSERT_NE(fresh, nullptr);
      AddAll(fresh.get(), kept_ids, kept_reprs);
      std::mt19937 rng(3);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (int q = 0; q < 10; ++q) {
        std::vector<float> p(shape.dim());
        for (float& x : p) x = nd(rng);
        ChunkScores a, b;
        ASSERT_TRUE(compacted->Screen(p.data(), &a).ok());
        ASSERT_TRUE(fresh->Screen(p.data(), &b).ok());
        EXPECT_EQ(a.ids, kept_ids);
        EXPECT_EQ(a.ids, b.ids);
        EXPECT_EQ(a.logit, b.logit) << spec << " " << DTypeName(dt) << " probe " << q;
        EXPECT_EQ(a.cosine, b.cosine) << spec << " " << DTypeName(dt) << " probe " << q;
        EXPECT_EQ(a.logit_error, b.logit_error) << spec << " " << DTypeName(dt) << " probe " << q;
        ASSERT_TRUE(compacted->Score(p.data(), &a).ok());
        ASSERT_TRUE(fresh->Score(p.data(), &b).ok());
        EXPECT_EQ(a.logit, b.logit);
        EXPECT_EQ(a.cosine, b.cosine);
        for (size_t take : {size_t{1}, size_t{5}, size_t{20}})
          EXPECT_EQ(BestOf(*compacted, p, ChunkRank::kCosine, take),
                    BestOf(*fresh, p, ChunkRank::kCosine, take));
      }
      // A chunk index above every kept one can come back; everything can go.
      ASSERT_TRUE(compacted->Add(500, reprs.data()).ok());
      EXPECT_EQ(compacted->size(), kept_ids.size() + 1);
      ASSERT_TRUE(compacted->Remove(std::vector<uint64_t>(kept_ids.begin(), kept_ids.end())).ok());
      ASSERT_TRUE(compacted->Remove({500}).ok());
      EXPECT_EQ(compacted->size(), 0u);
      ChunkScores empty;
      std::vector<float> p(shape.dim(), 1.0f);
      ASSERT_TRUE(compacted->Screen(p.data(), &empty).ok());
      EXPECT_TRUE(empty.ids.empty());
      std::vector<uint64_t> none{7};
      ASSERT_TRUE(compacted->Best(p.data(), empty, ChunkRank::kLogit, 4, &none).ok());
      EXPECT_TRUE(none.empty());
    }
}

// ---- Add -----------------------------------------------------------------------------------

TEST(ExactChunkIndex, AddIsAllOrNothingSkipsHolesAndKeepsChunkOrder) {
  const ChunkShape shape{2, 8, 2, DType::kF16};
  const auto reprs = RandomReprs(12, shape, 23);
  const size_t per = shape.repr_floats();
  auto reader = [&](uint64_t chunk, float* repr) -> Status {
    if (chunk == 4) return NotFound("chunk 4 is a hole");
    if (chunk == 9) return IOError("chunk 9 cannot be read");
    std::copy_n(reprs.data() + chunk * per, per, repr);
    return Status::Ok();
  };
  auto index = Make("Exact:rerank=1,rerank_min=0", shape);
  ASSERT_NE(index, nullptr);
  ASSERT_TRUE(index->Add({0, 1, 2, 3, 4, 5}, reader).ok());
  EXPECT_EQ(index->size(), 5u);  // chunk 4 skipped
  std::vector<float> p(shape.dim(), 0.5f);
  p[3] = -2.0f;
  ChunkScores before, after;
  ASSERT_TRUE(index->Screen(p.data(), &before).ok());
  EXPECT_EQ(before.ids, (std::vector<uint64_t>{0, 1, 2, 3, 5}));
  // A failing read undoes the batch (6, 7, 8 were read before 9 failed).
  const Status st = index->Add({6, 7, 8, 9, 10}, reader);
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_EQ(index->size(), 5u);
  ASSERT_TRUE(index->Screen(p.data(), &after).ok());
  EXPECT_EQ(after.ids, before.ids);
  EXPECT_EQ(after.logit, before.logit);
  EXPECT_EQ(after.cosine, before.cosine);
  // Chunks come in ascending order, above every one indexed.
  EXPECT_EQ(index->Add({5}, reader).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Add({7, 6}, reader).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Add(3, reprs.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->size(), 5u);
  ASSERT_TRUE(index->Add({6, 7, 8, 10, 11}, reader).ok());
  EXPECT_EQ(index->size(), 10u);
  EXPECT_GT(index->memory_bytes(), 10u * 2 * 2 * 8 * 2);  // at least the fp16 keys
  // Scores of another state are refused, not misread.
  ChunkScores stale = before;
  std::vector<uint64_t> out;
  EXPECT_EQ(index->Best(p.data(), stale, ChunkRank::kLogit, 2, &out).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Score(nullptr, &after).code(), StatusCode::kInvalidArgument);
}

TEST(ExactChunkIndex, ReserveGrowsOnceToWhatTheBatchesBring) {
  // A first sync hands a long sequence over in batches; reserved for all of them, the index
  // holds exactly their rows (no growth slack) from the first batch on, and scores as an index
  // that grew batch by batch. 96 chunks: a multiple of the int8 block, so no padded group.
  const ChunkShape shape{2, 16, 2, DType::kF16};
  constexpr size_t kChunks = 96;
  static_assert(kChunks % kernels::kI8Block == 0);
  const auto reprs = RandomReprs(kChunks, shape, 41);
  auto grown = Make("Exact", shape), reserved = Make("Exact", shape);
  ASSERT_TRUE(grown && reserved);
  reserved->Reserve(kChunks);
  const uint64_t at_reserve = reserved->memory_bytes();
  EXPECT_EQ(at_reserve, kChunks * (FullRowBytes(shape) + CodeRowBytes(shape)));
  for (size_t b = 0; b < kChunks; b += 16) {
    const std::vector<uint64_t> ids = Iota(16, b);
    const std::vector<float> part(reprs.begin() + b * shape.repr_floats(),
                                  reprs.begin() + (b + 16) * shape.repr_floats());
    AddAll(grown.get(), ids, part);
    AddAll(reserved.get(), ids, part);
    EXPECT_EQ(reserved->memory_bytes(), at_reserve) << "grew at the batch from chunk " << b;
  }
  EXPECT_GT(grown->memory_bytes(), at_reserve) << "growing batch by batch leaves slack";
  std::vector<float> p(shape.dim());
  for (size_t i = 0; i < p.size(); ++i) p[i] = std::sin(0.7f * static_cast<float>(i));
  ChunkScores a, b;
  ASSERT_TRUE(grown->Score(p.data(), &a).ok());
  ASSERT_TRUE(reserved->Score(p.data(), &b).ok());
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.logit, b.logit);
  EXPECT_EQ(a.cosine, b.cosine);
  // A capped index keeps to its cap: Reserve asks for nothing.
  auto capped = Make("Exact", shape);
  ASSERT_TRUE(capped->SetMemoryCap(64 * (FullRowBytes(shape) + CodeRowBytes(shape))).ok());
  const uint64_t empty = capped->memory_bytes();
  capped->Reserve(10 * kChunks);
  EXPECT_EQ(capped->memory_bytes(), empty);
}

TEST(ExactChunkIndex, StoredKeysScoreAsTheirFloats) {
  // The keys are kept in the store's dtype: Score equals an fp32 pass over the converted keys.
  const ChunkShape shape{1, 24, 2, DType::kBF16};
  const auto reprs = RandomReprs(3, shape, 29);
  auto index = Make("Exact:rerank=0", shape);
  ASSERT_NE(index, nullptr);
  AddAll(index.get(), {0, 1, 2}, reprs);
  std::vector<float> p(shape.dim());
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  for (float& x : p) x = nd(rng);
  ChunkScores s;
  ASSERT_TRUE(index->Score(p.data(), &s).ok());
  for (int c = 0; c < 3; ++c) {
    float best = -1e30f;
    for (int r = 0; r < 2; ++r)
      best = std::max(best, kernels::Dot(reprs.data() + (c * 2 + r) * 24, p.data(), 24));
    EXPECT_EQ(s.logit[c], best) << "chunk " << c;
  }
}

// ---- bounded memory (SetMemoryCap) ----------------------------------------------------------

TEST(ExactChunkIndexCap, MemoryNeverExceedsTheCapOnALongSequence) {
  // screen=int4: a compressed row keeps its 4-bit codes beside its int8 ones, and the cap counts them.
  for (const std::string spec : {"Exact", "Exact:screen=int4"}) {
    const bool int4 = spec != "Exact";
    const ChunkShape shape{2, 16, 4, DType::kF16};
    const size_t n = 3000;
    const auto reprs = RandomReprs(n, shape, 41);
    const size_t per = shape.repr_floats();
    const uint64_t cap = 64 << 10;  // holds ~80 full chunks, or ~200 as codes only
    auto index = Make(spec, shape);
    ASSERT_NE(index, nullptr);
    ASSERT_TRUE(index->SetMemoryCap(cap).ok());
    EXPECT_EQ(index->memory_cap(), cap);
    uint64_t most = 0;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(index->Add(i, reprs.data() + i * per).ok());
      ASSERT_LE(index->memory_bytes(), cap) << "after chunk " << i;
      most = std::max(most, index->memory_bytes());
    }
    EXPECT_GT(most, cap / 2);  // the cap is used, not just obeyed
    // Codes only first, then eviction of the oldest: every chunk left is newer than every evicted one.
    EXPECT_GT(index->evicted_chunks(), 0u);
    EXPECT_GT(index->compressed_chunks(), 0u);
    EXPECT_EQ(index->size() + index->evicted_chunks(), n);
    EXPECT_EQ(index->evicted_chunks() % kernels::kI8Block, 0u);
    ChunkScores s;
    ASSERT_TRUE(index->Score(std::vector<float>(shape.dim(), 1.0f).data(), &s).ok());
    ASSERT_EQ(s.ids.size(), index->size());
    EXPECT_EQ(s.ids.front(), index->evicted_chunks());
    EXPECT_EQ(s.ids.back(), n - 1);
    EXPECT_LE(index->size() * CodeRowBytes(shape), cap);

    // Unbounded, the slack is at most an eighth of the rows' bytes (vectors never double).
    auto open = Make(spec, shape);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(open->Add(i, reprs.data() + i * per).ok());
    // The 4-bit codes: (head_dim / 4) x 2 bytes and two scales per key.
    const uint64_t int4_row = int4 ? uint64_t{2} * 4 * (16 / 4 * 2 + 8) : 0;
    const uint64_t rows = n * (FullRowBytes(shape) + CodeRowBytes(shape) + int4_row);
    EXPECT_GE(open->memory_bytes(), rows);
    EXPECT_LE(open->memory_bytes(), rows + rows / 8 + 4096);
    EXPECT_EQ(open->compressed_chunks(), 0u);
    EXPECT_EQ(open->evicted_chunks(), 0u);
    // A cap set later shrinks the index at once.
    ASSERT_TRUE(open->SetMemoryCap(cap).ok());
    EXPECT_LE(open->memory_bytes(), cap);
    EXPECT_GT(open->evicted_chunks(), 0u);
  }
}

TEST(ExactChunkIndexCap, CompressedChunksScoreWithinTheCodeErrorAndChooseTheSameTop) {
  // Old chunks past the cap keep int8 codes only. Each key element is then off by at most half
  // a code step (max|k| / 254), so a representative's dot with p is off by at most
  // |p|_1 max|k| / 254; the chunk's best-of-R and the head sum move by no more than that sum.
  const ChunkShape shape{2, 32, 4, DType::kF16};
  const size_t n = 400, per = shape.repr_floats();
  auto reprs = RandomReprs(n, shape, 43);
  std::vector<float> p(shape.dim());
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (float& x : p) x = nd(rng);
  // A clear case: chunks 10, 50 and 90 (all compressed below) hold a key along the probe.
  for (size_t c : {10, 50, 90})
    for (int h = 0; h < shape.kv_heads; ++h)
      for (int d = 0; d < shape.head_dim; ++d)
        reprs[c * per + (1 * shape.kv_heads + h) * shape.head_dim + d] = 2.0f * p[h * shape.head_dim + d];
  std::vector<uint8_t> tmp(reprs.size() * 2);  // representable in f16, as the store's keys are
  FromFloat(DType::kF16, reprs.data(), tmp.data(), reprs.size());
  ToFloat(DType::kF16, tmp.data(), reprs.data(), reprs.size());
  for (const char* spec : {"Exact", "Exact:rerank=0", "Exact:heads=max", "Exact:heads=max,screen=int4"}) {
    auto exact = Make(spec, shape), capped = Make(spec, shape);
    ASSERT_TRUE(capped->SetMemoryCap(n * (CodeRowBytes(shape) + FullRowBytes(shape) / 2)).ok());
    AddAll(exact.get(), Iota(n), reprs);
    AddAll(capped.get(), Iota(n), reprs);
    ASSERT_EQ(capped->evicted_chunks(), 0u) << spec;
    ASSERT_GT(capped->compressed_chunks(), 100u) << spec;
    ChunkScores a, b;
    ASSERT_TRUE(exact->Score(p.data(), &a).ok());
    ASSERT_TRUE(capped->Score(p.data(), &b).ok());
    ASSERT_EQ(a.ids, b.ids);
    size_t differ = 0;
    for (size_t c = 0; c < n; ++c) {
      float bound = 0.0f;
      for (int h = 0; h < shape.kv_heads; ++h) {
        float p1 = 0.0f, kmax = 0.0f;
        for (int d = 0; d < shape.head_dim; ++d) p1 += std::fabs(p[h * shape.head_dim + d]);
        for (int r = 0; r < shape.repr; ++r)
          for (int d = 0; d < shape.head_dim; ++d)
            kmax = std::max(kmax, std::fabs(reprs[c * per + (r * shape.kv_heads + h) * shape.head_dim + d]));
        bound += p1 * kmax / 254.0f * 1.01f;  // 1%: fp32 rounding of the sums
      }
      if (c >= capped->compressed_chunks()) {
        EXPECT_EQ(a.logit[c], b.logit[c]) << spec << " full chunk " << c;  // untouched
      } else {
        EXPECT_NEAR(a.logit[c], b.logit[c], bound) << spec << " chunk " << c;
        differ += a.logit[c] != b.logit[c];
      }
    }
    EXPECT_GT(differ, 0u) << spec;  // the compressed chunks really are scored from codes
    // The clear case chooses alike, through both stages.
    for (ChunkRank rank : {ChunkRank::kLogit, ChunkRank::kCosine}) {
      const auto want = BestOf(*exact, p, rank, 3);
      EXPECT_EQ(want, (std::vector<uint64_t>{10, 50, 90})) << spec;
      EXPECT_EQ(BestOf(*capped, p, rank, 3), want) << spec;
    }
  }
}

// GatherSubset: the chosen chunks' representatives side by side score exactly as ScoreChunks
// scores them in place, bit for bit, for any probe; a second gather into the same subset
// replaces the first; compressed chunks and the FAISS kinds are FailedPrecondition.
TEST(ExactChunkIndex, AGatheredSubsetScoresAsScoreChunksBitForBit) {
  for (const char* spec : {"Exact:heads=sum", "Exact:heads=max", "Exact:heads=max,rerank=0"})
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
      for (int repr : {1, 4, 16}) {
        SCOPED_TRACE(std::string(spec) + " " + DTypeName(dt) + " repr " + std::to_string(repr));
        const ChunkShape shape{2, 16, repr, dt};
        const size_t n = 203;
        auto index = Make(spec, shape);
        AddAll(index.get(), Iota(n, 5), RandomReprs(n, shape, 51));
        std::mt19937 rng(9);
        std::normal_distribution<float> nd;
        // Out of order, a duplicate, chunks the index does not hold; then another choice.
        const std::vector<std::vector<uint64_t>> choices{{150, 7, 100000, 150, 4, 207, 33, 5},
                                                         {6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 199}};
        std::unique_ptr<ChunkSubset> subset;
        for (const auto& chosen : choices) {
          ASSERT_TRUE(index->GatherSubset(chosen, &subset).ok());
          ASSERT_NE(subset, nullptr);
          const ChunkSubset* first = subset.get();
          for (int probe = 0; probe < 3; ++probe) {
            std::vector<float> p(shape.dim());
            for (float& x : p) x = nd(rng);
            ChunkScores want, got;
            ASSERT_TRUE(index->ScoreChunks(p.data(), chosen, &want).ok());
            ASSERT_TRUE(subset->Score(p.data(), &got).ok());
            EXPECT_EQ(got.ids, want.ids);
            ASSERT_EQ(got.logit.size(), want.logit.size());
            EXPECT_EQ(0, std::memcmp(got.logit.data(), want.logit.data(), got.logit.size() * sizeof(float)));
            EXPECT_EQ(0,
                      std::memcmp(got.cosine.data(), want.cosine.data(), got.cosine.size() * sizeof(float)));
            EXPECT_TRUE(got.logit_error.empty());
            EXPECT_EQ(subset->size(), want.ids.size());
            std::vector<uint64_t> out;  // not a whole screen
            EXPECT_EQ(index->Best(p.data(), got, ChunkRank::kLogit, 1, &out).code(),
                      StatusCode::kInvalidArgument);
          }
          EXPECT_GE(subset->memory_bytes(), subset->size() * shape.kv_heads * repr * 16 * DTypeSize(dt));
          // The next gather keeps this object (its buffers).
          ASSERT_TRUE(index->GatherSubset(chosen, &subset).ok());
          EXPECT_EQ(subset.get(), first);
        }
        std::vector<float> p(shape.dim(), 1.0f);
        EXPECT_EQ(subset->Score(nullptr, nullptr).code(), StatusCode::kInvalidArgument);
        EXPECT_EQ(index->GatherSubset({7}, nullptr).code(), StatusCode::kInvalidArgument);
      }
  // A chunk kept as int8 codes only is not gathered (its stored keys are gone).
  const ChunkShape shape{2, 16, 4, DType::kF16};
  auto capped = Make("Exact", shape);
  ASSERT_TRUE(capped->SetMemoryCap(64 * (FullRowBytes(shape) + CodeRowBytes(shape))).ok());
  AddAll(capped.get(), Iota(200), RandomReprs(200, shape, 3));
  ASSERT_GT(capped->compressed_chunks(), 0u);
  std::unique_ptr<ChunkSubset> subset;
  const uint64_t oldest_kept = 200 - capped->size();
  EXPECT_EQ(capped->GatherSubset({oldest_kept, 199}, &subset).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(capped->GatherSubset({199}, &subset).ok());
  // The FAISS kinds cannot score chosen chunks alone.
  auto flat = Make("Flat", ChunkShape{2, 16, 4, DType::kF32});
  EXPECT_EQ(flat->GatherSubset({0, 1}, &subset).code(), StatusCode::kFailedPrecondition);
}

TEST(ExactChunkIndexCap, ARebuildInOneAddEndsWhereTheIncrementalAddsDid) {
  // After a reopen or an attach the Retriever hands every chunk over in one Add: the capped
  // index must end as the chunk-by-chunk one did (same chunks, same compression, same scores).
  const ChunkShape shape{2, 16, 4, DType::kBF16};
  const size_t n = 1500, per = shape.repr_floats();
  const auto reprs = RandomReprs(n, shape, 47);
  const uint64_t cap = 48 << 10;
  auto step = Make("Exact", shape), batch = Make("Exact", shape), halves = Make("Exact", shape);
  for (auto* idx : {step.get(), batch.get(), halves.get()}) ASSERT_TRUE(idx->SetMemoryCap(cap).ok());
  for (size_t i = 0; i < n; ++i) ASSERT_TRUE(step->Add(i, reprs.data() + i * per).ok());
  AddAll(batch.get(), Iota(n), reprs);
  AddAll(halves.get(), Iota(700), std::vector<float>(reprs.begin(), reprs.begin() + 700 * per));
  AddAll(halves.get(), Iota(n - 700, 700), std::vector<float>(reprs.begin() + 700 * per, reprs.end()));
  std::vector<float> p(shape.dim());
  for (int d = 0; d < shape.dim(); ++d) p[d] = std::sin(0.3f * d);
  ChunkScores want;
  ASSERT_TRUE(step->Score(p.data(), &want).ok());
  EXPECT_GT(step->evicted_chunks(), 0u);
  for (auto* idx : {batch.get(), halves.get()}) {
    EXPECT_EQ(idx->size(), step->size());
    EXPECT_EQ(idx->compressed_chunks(), step->compressed_chunks());
    EXPECT_EQ(idx->evicted_chunks(), step->evicted_chunks());
    EXPECT_EQ(idx->memory_bytes(), step->memory_bytes());
    ChunkScores got;
    ASSERT_TRUE(idx->Score(p.data(), &got).ok());
    EXPECT_EQ(got.ids, want.ids);
    EXPECT_EQ(got.logit, want.logit);
    EXPECT_EQ(got.cosine, want.cosine);
    EXPECT_EQ(BestOf(*idx, p, ChunkRank::kLogit, 8), BestOf(*step, p, ChunkRank::kLogit, 8));
  }
}

TEST(ExactChunkIndexCap, RemovalOfCompressedChunksEqualsAFreshCappedIndex) {
  // Remove moves codes lane by lane (compressed chunks have nothing to requantise from).
  const ChunkShape shape{1, 8, 2, DType::kF32};
  const size_t n = 64, per = shape.repr_floats();
  const auto reprs = RandomReprs(n, shape, 53);
  auto index = Make("Exact:rerank=0", shape);
  ASSERT_TRUE(index->SetMemoryCap(n * (CodeRowBytes(shape) + FullRowBytes(shape) / 2)).ok());
  AddAll(index.get(), Iota(n), reprs);
  const uint64_t compressed = index->compressed_chunks();
  ASSERT_GT(compressed, 9u);
  ChunkScores before;
  std::vector<float> p(shape.dim(), 0.25f);
  p[2] = -1.0f;
  ASSERT_TRUE(index->Score(p.data(), &before).ok());
  ASSERT_TRUE(index->Remove({0, 3, 9, n - 1}).ok());
  EXPECT_EQ(index->compressed_chunks(), compressed - 3);
  ChunkScores after;
  ASSERT_TRUE(index->Score(p.data(), &after).ok());
  ASSERT_EQ(after.ids.size(), n - 4);
  for (size_t i = 0, j = 0; i < before.ids.size(); ++i) {
    if (j < after.ids.size() && after.ids[j] == before.ids[i]) {
      EXPECT_EQ(after.logit[j], before.logit[i]) << "chunk " << before.ids[i];
      EXPECT_EQ(after.cosine[j], before.cosine[i]) << "chunk " << before.ids[i];
      ++j;
    }
  }
  (void)per;
}

TEST(ExactChunkIndexCap, BadCapsAreRefusedNamingTheOption) {
  StoreOptions o;
  o.index_bytes = 1000;
  Status st = o.Validate();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("index_bytes"), std::string::npos) << st.ToString();
  o.index_bytes = 1 << 20;
  EXPECT_TRUE(o.Validate().ok());
  o.index_bytes = 0;
  EXPECT_TRUE(o.Validate().ok());
  // The FAISS kinds hold a flat copy FAISS builds on: they cannot be capped, and say so.
  auto flat = Make("Flat", ChunkShape{2, 8, 2, DType::kF16});
  ASSERT_NE(flat, nullptr);
  st = flat->SetMemoryCap(1 << 20);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("index_bytes"), std::string::npos) << st.ToString();
  EXPECT_TRUE(flat->SetMemoryCap(0).ok());
}

// ---- kernels the index rests on -------------------------------------------------------------

TEST(ExactChunkIndexKernels, DotKeysEqualsDotKeyKeyByKey) {
  // The batched dot (eight keys, transposed lanes) must give DotKey's bits for every key, at
  // every length, count and spacing: the rescoring and the full scores rest on it. Signed
  // zeros and large magnitudes are in the mix (lane sums that cancel exactly, rounding).
  std::mt19937 rng(29);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32})
    for (int n : {8, 16, 24, 64, 128, 256, 3, 12}) {
      const size_t es = DTypeSize(t);
      for (size_t pad : {size_t{0}, size_t{5}}) {
        const size_t stride = (static_cast<size_t>(n) + pad) * es;
        for (size_t count : {size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{17}, size_t{64}}) {
          std::vector<float> k((static_cast<size_t>(n) + pad) * count), p(n);
          for (size_t i = 0; i < k.size(); ++i) k[i] = i % 13 == 0 ? -0.0f : (i % 29 == 0 ? 3.0e4f : nd(rng));
          for (int i = 0; i < n; ++i) p[i] = i % 7 == 0 ? 0.0f : nd(rng);
          std::vector<uint8_t> stored(k.size() * es);
          FromFloat(t, k.data(), stored.data(), k.size());
          std::vector<float> got(count, std::nanf(""));
          kernels::DotKeys(t, stored.data(), stride, p.data(), n, count, got.data());
          for (size_t i = 0; i < count; ++i) {
            const float want = kernels::DotKey(t, stored.data() + i * stride, p.data(), n);
            ASSERT_EQ(0, std::memcmp(&want, &got[i], sizeof(float)))
                << DTypeName(t) << " n " << n << " pad " << pad << " count " << count << " key " << i << ": "
                << want << " vs " << got[i];
          }
        }
      }
    }
}

TEST(ExactChunkIndexKernels, DotKeyOfAStoredKeyEqualsDotOfItsFloats) {
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
        EXPECT_NEAR(kernels::Dot(back.data(), p.data(), n), ref,
                    1e-4 * (1.0 + std::sqrt(static_cast<double>(n))));
      }
    }
}

TEST(ExactChunkIndexKernels, QuantizedBlockDotMatchesFloatDot) {
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
    if (d % 2) {
      EXPECT_EQ(p16.back(), 0) << "the pad must be 0";
    }
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

// Bit equality, NaN included (a NaN equals a NaN, +0 differs from -0).
bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

TEST(ExactChunkIndexKernels, MaxScaledI8DotsEqualsTheScalarFold) {
  // The screen's fold over a group's representatives, vectorised over its 8 rows, must give the
  // bits of acc = std::max(acc, x) in representative order: NaN products (0 x inf), signed
  // zeros, equal values and infinities included.
  constexpr int B = kernels::kI8Block;
  std::mt19937 rng(51);
  std::uniform_int_distribution<int32_t> dot(-40000, 40000);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (int R : {1, 2, 7, 32}) {
    for (int rep = 0; rep < 200; ++rep) {
      std::vector<int32_t> dots(static_cast<size_t>(R) * B);
      std::vector<float> scale(dots.size()), cos_scale(dots.size());
      for (size_t j = 0; j < dots.size(); ++j) {
        dots[j] = rep % 3 == 0 && j % 5 == 0 ? 0 : dot(rng);
        scale[j] = rep % 4 == 0 && j % 7 == 0 ? (j % 2 ? -0.0f : 0.0f) : std::fabs(nd(rng));
        cos_scale[j] = rep % 5 == 0 && j % 11 == 0 ? inf : std::fabs(nd(rng));
        if (rep % 6 == 0 && j % 3 == 0) scale[j] = scale[(j + B) % dots.size()];  // equal values
      }
      float best[B], best_cos[B], max_scale[B], max_cos_scale[B];
      kernels::MaxScaledI8Dots(dots.data(), scale.data(), cos_scale.data(), R, best, best_cos, max_scale,
                               max_cos_scale);
      for (int lane = 0; lane < B; ++lane) {
        float b = static_cast<float>(dots[lane]) * scale[lane];
        float bc = static_cast<float>(dots[lane]) * cos_scale[lane];
        float ms = scale[lane], mc = cos_scale[lane];
        for (int r = 1; r < R; ++r) {
          const size_t j = static_cast<size_t>(r) * B + lane;
          b = std::max(b, static_cast<float>(dots[j]) * scale[j]);
          bc = std::max(bc, static_cast<float>(dots[j]) * cos_scale[j]);
          ms = std::max(ms, scale[j]);
          mc = std::max(mc, cos_scale[j]);
        }
        ASSERT_TRUE(SameBits(best[lane], b)) << "R " << R << " rep " << rep << " lane " << lane;
        ASSERT_TRUE(SameBits(best_cos[lane], bc)) << "R " << R << " rep " << rep << " lane " << lane;
        ASSERT_TRUE(SameBits(max_scale[lane], ms)) << "R " << R << " rep " << rep << " lane " << lane;
        ASSERT_TRUE(SameBits(max_cos_scale[lane], mc)) << "R " << R << " rep " << rep << " lane " << lane;
      }
    }
  }
}

// MaxDotAndCosine as it folded before its lanes were reduced in a tree: with AVX-512 and
// n >= 16, sixteen lanes (lane l takes dots l, l + 16, ...) from *best, then the lanes into
// *best in lane order, then the tail in order; else every dot in order.
void MaxDotAndCosineReference(const float* dot, const float* inv_norm, float inv_p, size_t n, float* best,
                              float* best_cos) {
  float b = *best, bc = *best_cos;
  size_t r = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    float lb[16], lc[16];
    for (int l = 0; l < 16; ++l) lb[l] = b, lc[l] = bc;
    for (; r + 16 <= n; r += 16)
      for (int l = 0; l < 16; ++l) {
        lb[l] = std::max(lb[l], dot[r + l]);
        lc[l] = std::max(lc[l], dot[r + l] * inv_norm[r + l] * inv_p);
      }
    for (int l = 0; l < 16; ++l) {
      b = std::max(b, lb[l]);
      bc = std::max(bc, lc[l]);
    }
  }
#endif
  for (; r < n; ++r) {
    b = std::max(b, dot[r]);
    bc = std::max(bc, dot[r] * inv_norm[r] * inv_p);
  }
  *best = b;
  *best_cos = bc;
}

TEST(ExactChunkIndexKernels, MaxDotAndCosineKeepsItsBitsAndBestOfKeysEqualsIt) {
  // The rescoring's per-chunk fold: MaxDotAndCosine (its lanes now reduced in a tree), MaxDot
  // (the logit alone) and BestOfKeys (the dots kept in registers) must give the bits of the
  // lane-by-lane fold above, for every dtype, head width and count of keys, with signed zeros
  // (the sign a tie keeps), NaN and infinite dots in the mix.
  std::mt19937 rng(53);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16})
    for (int D : {8, 16, 24, 12})
      for (size_t R : {size_t{1}, size_t{8}, size_t{15}, size_t{16}, size_t{17}, size_t{32}, size_t{40}})
        for (int rep = 0; rep < 20; ++rep) {
          SCOPED_TRACE(std::string(DTypeName(t)) + " D " + std::to_string(D) + " R " + std::to_string(R) +
                       " rep " + std::to_string(rep));
          // Keys: zero keys (dots of +0 and -0 against a probe with negative elements), copies of
          // one key (equal dots), an infinite element (infinite or NaN dots) in some.
          std::vector<float> keys(R * static_cast<size_t>(D)), p(static_cast<size_t>(D));
          for (float& x : p) x = nd(rng);
          for (size_t r = 0; r < R; ++r)
            for (int d = 0; d < D; ++d) {
              float& k = keys[r * D + static_cast<size_t>(d)];
              k = rep % 3 == 0 && r % 4 != 1 ? (d % 2 ? -0.0f : 0.0f) : nd(rng);
              if (rep % 5 == 1 && r > 0 && r % 3 == 0) k = keys[static_cast<size_t>(d)];
              if (rep % 7 == 2 && r == R / 2 && d == 0) k = inf;
            }
          const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(t);
          std::vector<uint8_t> stored(R * key_bytes);
          FromFloat(t, keys.data(), stored.data(), keys.size());
          std::vector<float> inv_norm(R);
          for (size_t r = 0; r < R; ++r) inv_norm[r] = rep % 4 == 3 && r % 5 == 0 ? 0.0f : std::fabs(nd(rng));
          const float inv_p = kernels::InverseNorm(p.data(), D);
          std::vector<float> dots(R);
          kernels::DotKeys(t, stored.data(), key_bytes, p.data(), D, R, dots.data());
          // A key's dot is never -0 (DotKey's sum starts at +0): signed zeros and NaNs as dots
          // straight, for the two folds that take dots.
          std::vector<float> raw(R);
          for (size_t r = 0; r < R; ++r)
            raw[r] = rng() % 4 == 0 ? -1.0f : (rng() % 9 == 0 ? std::nanf("") : (rng() % 2 ? 0.0f : -0.0f));
          for (float start : {-inf, -1.0f}) {
            float want_b = start, want_c = -1.0f, b = start, c = -1.0f, only = start;
            MaxDotAndCosineReference(raw.data(), inv_norm.data(), inv_p, R, &want_b, &want_c);
            kernels::MaxDotAndCosine(raw.data(), inv_norm.data(), inv_p, R, &b, &c);
            kernels::MaxDot(raw.data(), R, &only);
            ASSERT_TRUE(SameBits(b, want_b)) << b << " vs " << want_b;
            ASSERT_TRUE(SameBits(c, want_c)) << c << " vs " << want_c;
            ASSERT_TRUE(SameBits(only, want_b)) << only << " vs " << want_b;
          }
          for (float start : {-inf, 0.0f, -0.0f}) {
            float want_b = start, want_c = -1.0f;
            MaxDotAndCosineReference(dots.data(), inv_norm.data(), inv_p, R, &want_b, &want_c);
            float b = start, c = -1.0f;
            kernels::MaxDotAndCosine(dots.data(), inv_norm.data(), inv_p, R, &b, &c);
            ASSERT_TRUE(SameBits(b, want_b)) << b << " vs " << want_b;
            ASSERT_TRUE(SameBits(c, want_c)) << c << " vs " << want_c;
            float only = start;
            kernels::MaxDot(dots.data(), R, &only);
            ASSERT_TRUE(SameBits(only, want_b)) << only << " vs " << want_b;
            std::vector<float> scratch(R, std::nanf(""));
            float kb = start, kc = -1.0f;
            kernels::BestOfKeys(t, stored.data(), key_bytes, p.data(), D, R, inv_norm.data(), inv_p, &kb, &kc,
                                scratch.data());
            ASSERT_TRUE(SameBits(kb, want_b)) << kb << " vs " << want_b;
            ASSERT_TRUE(SameBits(kc, want_c)) << kc << " vs " << want_c;
            float lb = start, untouched = 7.0f;
            kernels::BestOfKeys(t, stored.data(), key_bytes, p.data(), D, R, nullptr, inv_p, &lb, &untouched,
                                scratch.data());
            ASSERT_TRUE(SameBits(lb, want_b)) << lb << " vs " << want_b;
            ASSERT_EQ(untouched, 7.0f) << "no inverse norms: the cosine is not touched";
          }
        }
}

}  // namespace
}  // namespace kvtier
