// Tests of retrieval/chunk_index.h (the interface every kind implements, its spec strings)
// and retrieval/faiss_index.h: chunk/probe vectors, exact top-k against a brute-force
// reference, ties, removal for every FAISS kind, IVF training, HNSW recall, option
// validation and edge cases. The Exact kind's own tests are in exact_index_test.cc.
#include "retrieval/chunk_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "retrieval/exact_index.h"
#include "retrieval/faiss_index.h"

namespace kvtier {
namespace {

// Random chunk vectors ([n, H*D], per-head unit norm) drawn around `clusters`
// random centres, the shape real keys have (and the hard case for recall is
// easier to reason about than uniform noise).
std::vector<float> ClusteredVectors(size_t n, int H, int D, int clusters, float noise, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const size_t dim = static_cast<size_t>(H) * D;
  std::vector<float> centres(static_cast<size_t>(clusters) * dim);
  for (float& c : centres) c = g(rng);
  std::vector<float> out(n * dim);
  std::uniform_int_distribution<int> pick(0, clusters - 1);
  for (size_t i = 0; i < n; ++i) {
    const float* c = centres.data() + static_cast<size_t>(pick(rng)) * dim;
    float* v = out.data() + i * dim;
    for (size_t j = 0; j < dim; ++j) v[j] = c[j] + noise * g(rng);
    FaissVectorIndex::ProbeVector(v, H, D, v);
  }
  return out;
}

// Brute-force reference in double: top k by inner product, ties -> smaller id.
std::vector<uint64_t> ReferenceTopK(const std::vector<uint64_t>& ids, const std::vector<float>& vecs, int dim,
                                    const float* probe, size_t k) {
  std::vector<std::pair<double, uint64_t>> all;
  for (size_t r = 0; r < ids.size(); ++r) {
    double s = 0.0;
    for (int j = 0; j < dim; ++j) s += static_cast<double>(vecs[r * dim + j]) * probe[j];
    all.emplace_back(s, ids[r]);
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<uint64_t> out;
  for (size_t i = 0; i < std::min(k, all.size()); ++i) out.push_back(all[i].second);
  return out;
}

std::unique_ptr<FaissVectorIndex> MakeIndex(int dim, const std::string& factory, int train_min = 0,
                                            int nprobe = 16) {
  FaissIndexOptions o;
  o.factory = factory;
  o.train_min = train_min;
  o.ivf_nprobe = nprobe;
  auto r = FaissVectorIndex::Create(dim, o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- vectors ----------------------------------------------------------------------

TEST(ChunkVectorTest, MeanOfRepresentativesNormalisedPerHead) {
  // R = 2 representatives, H = 2 heads, D = 2.
  const float repr[] = {
      10, 0, /* r0 h0 */ 3, 4, /* r0 h1 */
      0,  1, /* r1 h0 */ 3, 4, /* r1 h1 */
  };
  float out[4];
  FaissVectorIndex::ChunkVector(repr, 2, 2, 2, out);
  // Head 0: mean (5, 0.5), normalised; NOT the mean of the normalised keys.
  const double n0 = std::sqrt(25.0 + 0.25);
  EXPECT_NEAR(out[0], 5.0 / n0, 1e-6);
  EXPECT_NEAR(out[1], 0.5 / n0, 1e-6);
  EXPECT_NEAR(out[2], 0.6, 1e-6);
  EXPECT_NEAR(out[3], 0.8, 1e-6);
}

TEST(ChunkVectorTest, ZeroHeadsStayZero) {
  // Head 1's representatives cancel: a zero mean maps to a zero vector.
  const float repr[] = {1, 2, 1, -1, /* r0 */ 1, 2, -1, 1 /* r1 */};
  float out[4] = {9, 9, 9, 9};
  FaissVectorIndex::ChunkVector(repr, 2, 2, 2, out);
  EXPECT_NEAR(out[0], 1 / std::sqrt(5.0), 1e-6);
  EXPECT_NEAR(out[1], 2 / std::sqrt(5.0), 1e-6);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_EQ(out[3], 0.0f);
  // No representatives at all: everything zero.
  FaissVectorIndex::ChunkVector(repr, 0, 2, 2, out);
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(ProbeVectorTest, PerHeadNormalisationInPlaceAndZeroHeads) {
  float p[] = {3, 4, 0, 0, 0, -2};  // H = 3, D = 2
  FaissVectorIndex::ProbeVector(p, 3, 2, p);
  EXPECT_NEAR(p[0], 0.6, 1e-6);
  EXPECT_NEAR(p[1], 0.8, 1e-6);
  EXPECT_EQ(p[2], 0.0f);
  EXPECT_EQ(p[3], 0.0f);
  EXPECT_NEAR(p[4], 0.0, 1e-6);
  EXPECT_NEAR(p[5], -1.0, 1e-6);
}

TEST(ProbeVectorTest, InnerProductIsSumOfPerHeadCosines) {
  std::mt19937 rng(7);
  std::normal_distribution<float> g;
  const int R = 4, H = 3, D = 16;
  std::vector<float> repr(R * H * D), probe(H * D), cv(H * D), pv(H * D);
  for (float& x : repr) x = g(rng);
  for (float& x : probe) x = 5.0f * g(rng);  // scale must not matter
  FaissVectorIndex::ChunkVector(repr.data(), R, H, D, cv.data());
  FaissVectorIndex::ProbeVector(probe.data(), H, D, pv.data());
  double expect = 0.0;
  for (int h = 0; h < H; ++h) {
    std::vector<double> mean(D, 0.0);
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d) mean[d] += repr[(r * H + h) * D + d] / R;
    double dot = 0, nm = 0, np = 0;
    for (int d = 0; d < D; ++d) {
      dot += mean[d] * probe[h * D + d];
      nm += mean[d] * mean[d];
      np += static_cast<double>(probe[h * D + d]) * probe[h * D + d];
    }
    expect += dot / std::sqrt(nm * np);  // ActQKV Eq. 10 for head h
  }
  double got = 0.0;
  for (int i = 0; i < H * D; ++i) got += static_cast<double>(cv[i]) * pv[i];
  EXPECT_NEAR(got, expect, 1e-5);
}

// ---- exact search -----------------------------------------------------------------

// TopRowsAscending and KthLargest against a sort: both selection paths (a heap for k <= n/16,
// nth_element above), heavy ties, +0 against -0, infinities.
TEST(ChunkRanking, TopRowsAndKthLargestEqualASort) {
  std::mt19937 rng(9);
  for (int64_t n : {1, 5, 100, 1000, 5000})
    for (int distinct : {3, 50, 1 << 20}) {
      std::uniform_int_distribution<int> pick(0, distinct - 1);
      std::vector<float> v(static_cast<size_t>(n));
      for (float& x : v) {
        const int i = pick(rng);
        x = i == 0   ? (rng() % 2 ? 0.0f : -0.0f)
            : i == 1 ? -std::numeric_limits<float>::infinity()
                     : static_cast<float>(i % 1000) - 500.0f;
      }
      std::vector<int64_t> order(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
      for (int64_t k : {int64_t{1}, int64_t{3}, n / 16, n / 16 + 1, n / 2, n - 1, n, n + 1}) {
        if (k <= 0) continue;
        std::vector<int64_t> want(order.begin(), order.begin() + std::min(k, n));
        std::sort(want.begin(), want.end());
        std::vector<int64_t> got;
        TopRowsAscending(v.data(), n, k, &got);
        const std::string what =
            "n " + std::to_string(n) + " distinct " + std::to_string(distinct) + " k " + std::to_string(k);
        EXPECT_EQ(got, want) << what;
        const float kth = KthLargest(v.data(), n, k);
        if (k <= n)
          EXPECT_EQ(kth, v[order[k - 1]]) << what;  // +0 == -0
        else
          EXPECT_EQ(kth, -std::numeric_limits<float>::infinity()) << what;
      }
    }
  EXPECT_EQ(KthLargest(nullptr, 0, 1), std::numeric_limits<float>::infinity());
}

TEST(ChunkIndexTest, FlatTopKMatchesBruteForce) {
  const int H = 2, D = 16, dim = H * D;
  const size_t n = 3000;
  auto vecs = ClusteredVectors(n, H, D, 50, 0.5f, 1);
  // Chunk ids with gaps, added in shuffled order (exercises the sorted merge).
  std::vector<uint64_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = 3 * i + 1;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(2));
  auto index = MakeIndex(dim, "Flat");
  for (size_t i : order) ASSERT_TRUE(index->Add(ids[i], vecs.data() + i * dim).ok());
  ASSERT_EQ(index->size(), n);
  EXPECT_TRUE(index->trained());

  auto probes = ClusteredVectors(20, H, D, 50, 0.8f, 3);
  std::vector<uint64_t> all_ids;
  std::vector<float> all_scores;
  for (int q = 0; q < 20; ++q) {
    const float* p = probes.data() + q * dim;
    ASSERT_TRUE(index->ScoreAll(p, &all_ids, &all_scores).ok());
    ASSERT_TRUE(std::is_sorted(all_ids.begin(), all_ids.end()));
    for (int k : {1, 10, 64, 500}) {
      std::vector<uint64_t> got;
      std::vector<float> scores;
      ASSERT_TRUE(index->Search(p, k, &got, &scores).ok());
      EXPECT_EQ(got, ReferenceTopK(ids, vecs, dim, p, k)) << "q=" << q << " k=" << k;
      ASSERT_EQ(scores.size(), got.size());
      for (size_t i = 0; i < got.size(); ++i) {
        const size_t row = std::lower_bound(all_ids.begin(), all_ids.end(), got[i]) - all_ids.begin();
        EXPECT_EQ(scores[i], all_scores[row]);  // same exact inner product as ScoreAll
        if (i > 0) {
          EXPECT_GE(scores[i - 1], scores[i]);
        }
      }
    }
  }
}

TEST(ChunkIndexTest, FlatTiesGoToTheSmallerChunkIndex) {
  const int dim = 8;
  // 10 distinct unit vectors; chunk i gets vector i % 10, so every score is
  // shared by 12 chunks and the k-th place always sits inside a tie.
  auto base = ClusteredVectors(10, 1, dim, 10, 0.3f, 4);
  auto index = MakeIndex(dim, "Flat");
  std::vector<uint64_t> ids;
  std::vector<float> vecs;
  std::vector<uint64_t> order(120);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(5));
  for (uint64_t id : order) {
    ASSERT_TRUE(index->Add(id, base.data() + (id % 10) * dim).ok());
    ids.push_back(id);
    vecs.insert(vecs.end(), base.begin() + (id % 10) * dim, base.begin() + (id % 10 + 1) * dim);
  }
  for (int q = 0; q < 10; ++q) {
    for (int k : {1, 5, 12, 13, 30, 119}) {
      std::vector<uint64_t> got;
      ASSERT_TRUE(index->Search(base.data() + q * dim, k, &got, nullptr).ok());
      EXPECT_EQ(got, ReferenceTopK(ids, vecs, dim, base.data() + q * dim, k)) << "q=" << q << " k=" << k;
    }
  }
  // All-zero chunk vectors score 0 for any probe: the smallest indices win.
  auto zeros = MakeIndex(dim, "Flat");
  std::vector<float> z(dim, 0.0f);
  for (uint64_t id : {7, 3, 9, 1, 5}) ASSERT_TRUE(zeros->Add(id, z.data()).ok());
  std::vector<uint64_t> got;
  ASSERT_TRUE(zeros->Search(base.data(), 2, &got, nullptr).ok());
  EXPECT_EQ(got, (std::vector<uint64_t>{1, 3}));
}

// ---- removal, every kind ----------------------------------------------------------

class ChunkIndexRemoveTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ChunkIndexRemoveTest, RemovedChunksLeaveTheIndex) {
  const int H = 2, D = 8, dim = H * D;
  const size_t n = 1200;  // above IVF16's 39 x 16 = 624 training vectors
  auto vecs = ClusteredVectors(n, H, D, 16, 0.4f, 6);
  auto index = MakeIndex(dim, GetParam());
  std::vector<uint64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  ASSERT_TRUE(index->AddBatch(n, ids.data(), vecs.data()).ok());
  ASSERT_TRUE(index->trained());
  EXPECT_EQ(index->factory(), GetParam());

  // A few removals (HNSW: tombstones, no rebuild yet).
  std::set<uint64_t> removed;
  for (uint64_t id = 0; id < n; id += 23) {
    ASSERT_TRUE(index->Remove(id).ok());
    removed.insert(id);
  }
  if (GetParam().rfind("HNSW", 0) == 0) {
    EXPECT_EQ(index->tombstones(), removed.size());
  } else {
    EXPECT_EQ(index->tombstones(), 0u);
  }
  EXPECT_EQ(index->size(), n - removed.size());
  EXPECT_EQ(index->Remove(0).code(), StatusCode::kNotFound);
  EXPECT_EQ(index->Remove(n + 5).code(), StatusCode::kNotFound);

  auto check = [&]() {
    std::vector<uint64_t> got;
    std::vector<float> scores;
    for (uint64_t q = 0; q < n; q += 37) {
      // Self-search of a removed chunk's vector must not return it.
      ASSERT_TRUE(index->Search(vecs.data() + q * dim, 20, &got, &scores).ok());
      ASSERT_EQ(got.size(), 20u);
      for (uint64_t id : got) EXPECT_EQ(removed.count(id), 0u) << "removed chunk " << id << " returned";
      if (!removed.count(q)) {
        EXPECT_EQ(got[0], q);  // a live chunk finds itself first
      }
    }
    ASSERT_TRUE(index->Search(vecs.data(), static_cast<int>(n), &got, nullptr).ok());
    EXPECT_EQ(got.size(), n - removed.size());
    for (uint64_t id : got) EXPECT_EQ(removed.count(id), 0u);
    std::vector<float> all;
    ASSERT_TRUE(index->ScoreAll(vecs.data(), &got, &all).ok());
    EXPECT_EQ(got.size(), n - removed.size());
  };
  check();

  // Many removals: HNSW crosses the tombstone fraction and rebuilds.
  for (uint64_t id = 1; id < n; id += 3) {
    if (removed.count(id)) continue;
    ASSERT_TRUE(index->Remove(id).ok());
    removed.insert(id);
  }
  EXPECT_LE(static_cast<double>(index->tombstones()),
            FaissVectorIndex::kTombstoneRebuildFraction * static_cast<double>(n));
  check();

  // A removed chunk can come back (HNSW: rebuild first, then add).
  ASSERT_TRUE(index->Add(0, vecs.data()).ok());
  removed.erase(0);
  std::vector<uint64_t> got;
  ASSERT_TRUE(index->Search(vecs.data(), 1, &got, nullptr).ok());
  EXPECT_EQ(got, std::vector<uint64_t>{0});
  check();
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, ChunkIndexRemoveTest, ::testing::Values("Flat", "HNSW32", "IVF16,Flat"), [](const auto& info) {
      std::string s = info.param;
      s.erase(std::remove_if(s.begin(), s.end(), [](char c) { return !std::isalnum(c); }), s.end());
      return s;
    });

// ---- IVF training -----------------------------------------------------------------

TEST(ChunkIndexTest, IvfSearchesExactlyUntilTrainedThenViaFaiss) {
  const int H = 2, D = 8, dim = H * D;
  const size_t n = 2000;
  auto vecs = ClusteredVectors(n, H, D, 32, 0.4f, 8);
  std::vector<uint64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  auto ivf = MakeIndex(dim, "IVF16,Flat");  // default train_min = 39 x 16 = 624
  auto probes = ClusteredVectors(10, H, D, 32, 0.6f, 9);

  for (size_t i = 0; i < 623; ++i) ASSERT_TRUE(ivf->Add(ids[i], vecs.data() + i * dim).ok());
  EXPECT_FALSE(ivf->trained());
  const std::vector<uint64_t> some(ids.begin(), ids.begin() + 623);
  const std::vector<float> some_vecs(vecs.begin(), vecs.begin() + 623 * dim);
  std::vector<uint64_t> got;
  for (int q = 0; q < 10; ++q) {  // untrained: exact scan of the flat copy
    ASSERT_TRUE(ivf->Search(probes.data() + q * dim, 25, &got, nullptr).ok());
    EXPECT_EQ(got, ReferenceTopK(some, some_vecs, dim, probes.data() + q * dim, 25));
  }
  ASSERT_TRUE(ivf->Remove(5).ok());  // removal while collecting
  ASSERT_TRUE(ivf->Add(5, vecs.data() + 5 * dim).ok());
  EXPECT_FALSE(ivf->trained());
  const uint64_t before = ivf->memory_bytes();
  ASSERT_TRUE(ivf->Add(623, vecs.data() + 623 * dim).ok());  // the 624th vector trains
  EXPECT_TRUE(ivf->trained());
  EXPECT_GT(ivf->memory_bytes(), before);  // FAISS now holds a copy too
  ASSERT_TRUE(ivf->AddBatch(n - 624, ids.data() + 624, vecs.data() + 624 * dim).ok());
  // nprobe 16 >= nlist 16: every list is scanned, so results are exact.
  for (int q = 0; q < 10; ++q) {
    ASSERT_TRUE(ivf->Search(probes.data() + q * dim, 25, &got, nullptr).ok());
    EXPECT_EQ(got, ReferenceTopK(ids, vecs, dim, probes.data() + q * dim, 25));
  }

  // Explicit train_min, and nprobe 1 with k larger than the probed list:
  // FAISS finds fewer than k, so the search falls back to the exact scan.
  auto narrow = MakeIndex(dim, "IVF16,Flat", /*train_min=*/700, /*nprobe=*/1);
  ASSERT_TRUE(narrow->AddBatch(699, ids.data(), vecs.data()).ok());
  EXPECT_FALSE(narrow->trained());
  ASSERT_TRUE(narrow->AddBatch(n - 699, ids.data() + 699, vecs.data() + 699 * dim).ok());
  EXPECT_TRUE(narrow->trained());
  for (int q = 0; q < 10; ++q) {  // 2000 vectors in 16 lists: one list holds far fewer than 600
    ASSERT_TRUE(narrow->Search(probes.data() + q * dim, 600, &got, nullptr).ok());
    EXPECT_EQ(got, ReferenceTopK(ids, vecs, dim, probes.data() + q * dim, 600));
    // A small k is served by one list: approximate, but every result is a real chunk.
    ASSERT_TRUE(narrow->Search(probes.data() + q * dim, 5, &got, nullptr).ok());
    EXPECT_EQ(got.size(), 5u);
  }
}

// ---- HNSW recall ------------------------------------------------------------------

TEST(ChunkIndexTest, Hnsw32RecallAgainstFlat) {
  const int H = 2, D = 64, dim = H * D;  // 128
  const size_t n = 20000;
  const int k = 64, queries = 200;
  // Noise 1.3 x the centres' scale: about 37% of a vector's variance is its
  // cluster (0.6 -> recall ~1.0, 1.5 -> ~0.93, 3.0 (near uniform) -> ~0.72
  // on the development machine).
  auto vecs = ClusteredVectors(n, H, D, 200, 1.3f, 10);
  auto probes = ClusteredVectors(queries, H, D, 200, 1.3f, 10);  // same centres (same seed), new draws
  std::vector<uint64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  auto flat = MakeIndex(dim, "Flat");
  auto hnsw = MakeIndex(dim, "HNSW32");
  ASSERT_TRUE(flat->AddBatch(n, ids.data(), vecs.data()).ok());
  ASSERT_TRUE(hnsw->AddBatch(n, ids.data(), vecs.data()).ok());
  size_t hit = 0, total = 0;
  std::vector<uint64_t> want, got;
  for (int q = 0; q < queries; ++q) {
    const float* p = probes.data() + q * dim;
    ASSERT_TRUE(flat->Search(p, k, &want, nullptr).ok());
    ASSERT_TRUE(hnsw->Search(p, k, &got, nullptr).ok());
    ASSERT_EQ(got.size(), static_cast<size_t>(k));
    std::set<uint64_t> truth(want.begin(), want.end());
    for (uint64_t id : got) hit += truth.count(id);
    total += want.size();
  }
  const double recall = static_cast<double>(hit) / static_cast<double>(total);
  std::cout << "[ HNSW32 ] recall@" << k << " vs Flat on " << n << " clustered vectors of dim " << dim
            << " (ef_search " << hnsw->options().hnsw_ef_search << "): " << recall << "\n";
  RecordProperty("hnsw32_recall_at_64", std::to_string(recall));
  EXPECT_GE(recall, 0.9);
  EXPECT_GT(hnsw->memory_bytes(), flat->memory_bytes());  // graph on top of the vectors
}

// ---- options ----------------------------------------------------------------------

TEST(ChunkIndexOptionsTest, BadFactoryStringsAreRejected) {
  struct Case {
    std::string factory, mentions;
  } cases[] = {
      {"Bogus", "could not parse"},
      {"IVF0,Flat", "nlist = 0"},
      {"", "must not be empty"},
      {"HNSW0", "M >= 2"},
      // FAISS reads past its level table for M < 2: refused before a graph exists.
      {"HNSW1", "HNSW1: HNSW needs M >= 2 neighbours per node (got 1)"},
      {"HNSW00:ef=64", "HNSW00: HNSW needs M >= 2"},
      {"IVF64_HNSW1,Flat", "HNSW1: HNSW needs M >= 2"},
      // What FAISS would crash on (SIGFPE) or allocate gigabytes for; see CheckFactoryDescription.
      {"PQ0", "PQ0 has no sub-quantizer"},
      {"IVF64,PQ0", "PQ0 has no sub-quantizer"},
      {"IVF64,PQ0x4fs", "PQ0x4 has no sub-quantizer"},
      {"Flat,Refine(PQ0)", "PQ0 has no sub-quantizer"},
      {"IVF50000000,Flat", "number 50000000 exceeds 65536"},
      {"IVF99999999999999999999,Flat", "exceeds 65536"},
      {"PQ4x20", "code width 20 exceeds 16 bits"},
      {"IVF64,PQ8x9", "at most 8 bits per code"},
  };
  for (const auto& c : cases) {
    FaissIndexOptions o;
    o.factory = c.factory;
    Status st = o.Validate();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.factory;
    EXPECT_TRUE(Contains(st.message(), "FaissIndexOptions.factory")) << st.message();
    EXPECT_TRUE(Contains(st.message(), c.mentions)) << st.message();
    EXPECT_FALSE(Contains(st.message(), ".cpp:")) << "FAISS source location leaked: " << st.message();
    auto r = FaissVectorIndex::Create(128, o);
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  // Dimension-dependent: PQ3 needs 3 | dim.
  FaissIndexOptions pq;
  pq.factory = "PQ3";
  EXPECT_FALSE(pq.Validate(128).ok());
  EXPECT_TRUE(pq.Validate(129).ok());
  EXPECT_FALSE(FaissVectorIndex::Create(128, pq).ok());
}

TEST(ChunkIndexOptionsTest, ValidateNamesTheField) {
  FaissIndexOptions ok;
  EXPECT_TRUE(ok.Validate().ok());
  for (const char* f : {"Flat", "HNSW32", "IVF1024,Flat", "IVF256,PQ16", "IDMap2,Flat"}) {
    FaissIndexOptions o;
    o.factory = f;
    EXPECT_TRUE(o.Validate().ok()) << f << ": " << o.Validate().ToString();
  }
  auto expect_field = [](FaissIndexOptions o, const std::string& field) {
    Status st = o.Validate();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << field;
    EXPECT_TRUE(Contains(st.message(), "FaissIndexOptions." + field)) << st.message();
  };
  FaissIndexOptions o;
  o.ivf_nprobe = 0;
  expect_field(o, "ivf_nprobe");
  o = {};
  o.hnsw_ef_search = -3;
  expect_field(o, "hnsw_ef_search");
  o = {};
  o.train_min = -1;
  expect_field(o, "train_min");
  o = {};
  o.factory = "IVF1024,Flat";
  o.train_min = 100;  // fewer than one vector per list
  expect_field(o, "train_min");
  EXPECT_TRUE(Contains(o.Validate().message(), "nlist (1024)")) << o.Validate().message();
  o.train_min = 1024;
  EXPECT_TRUE(o.Validate().ok());

  auto r = FaissVectorIndex::Create(0, FaissIndexOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "dim")) << r.status().message();
}

// ---- edge cases -------------------------------------------------------------------

TEST(ChunkIndexTest, EdgeCases) {
  const int dim = 4;
  auto index = MakeIndex(dim, "Flat");
  const float v[] = {1, 0, 0, 0}, w[] = {0, 1, 0, 0};
  std::vector<uint64_t> ids{99};
  std::vector<float> scores{1.0f};

  // Empty index.
  EXPECT_TRUE(index->Search(v, 5, &ids, &scores).ok());
  EXPECT_TRUE(ids.empty());
  EXPECT_TRUE(scores.empty());
  EXPECT_TRUE(index->ScoreAll(v, &ids, &scores).ok());
  EXPECT_TRUE(ids.empty());
  EXPECT_EQ(index->Remove(1).code(), StatusCode::kNotFound);

  ASSERT_TRUE(index->Add(2, v).ok());
  ASSERT_TRUE(index->Add(1, w).ok());
  // k = 0, k > size, k < 0.
  EXPECT_TRUE(index->Search(v, 0, &ids, &scores).ok());
  EXPECT_TRUE(ids.empty());
  EXPECT_TRUE(index->Search(v, 10, &ids, &scores).ok());
  EXPECT_EQ(ids, (std::vector<uint64_t>{2, 1}));
  EXPECT_EQ(scores, (std::vector<float>{1.0f, 0.0f}));
  EXPECT_EQ(index->Search(v, -1, &ids, &scores).code(), StatusCode::kInvalidArgument);
  // Null pointers: probe and ids are required, scores is optional.
  EXPECT_EQ(index->Search(nullptr, 1, &ids, &scores).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Search(v, 1, nullptr, &scores).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(index->Search(v, 1, &ids, nullptr).ok());
  EXPECT_EQ(ids, std::vector<uint64_t>{2});
  EXPECT_EQ(index->ScoreAll(nullptr, &ids, &scores).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->ScoreAll(v, nullptr, &scores).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->ScoreAll(v, &ids, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Add(3, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->AddBatch(1, nullptr, v).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(index->AddBatch(0, nullptr, nullptr).ok());
  // Duplicates, non-finite values, ids FAISS cannot hold.
  EXPECT_EQ(index->Add(2, w).code(), StatusCode::kAlreadyExists);
  const float nan[] = {1, std::numeric_limits<float>::quiet_NaN(), 0, 0};
  EXPECT_EQ(index->Add(3, nan).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Search(nan, 1, &ids, &scores).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index->Add(uint64_t{1} << 63, v).code(), StatusCode::kInvalidArgument);
  // A batch is all or nothing.
  const uint64_t batch[] = {5, 6, 5};
  const float bv[] = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0};
  EXPECT_EQ(index->AddBatch(3, batch, bv).code(), StatusCode::kInvalidArgument);
  const uint64_t batch2[] = {5, 6, 2};
  EXPECT_EQ(index->AddBatch(3, batch2, bv).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(index->size(), 2u);
  EXPECT_EQ(index->dim(), dim);
  EXPECT_GT(index->memory_bytes(), 0u);
}

TEST(ChunkIndexTest, ConcurrentSearchesAgreeWithSequential) {
  const int H = 2, D = 16, dim = H * D;
  const size_t n = 5000;
  auto vecs = ClusteredVectors(n, H, D, 40, 0.5f, 11);
  auto probes = ClusteredVectors(64, H, D, 40, 0.7f, 12);
  std::vector<uint64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  for (const char* f : {"Flat", "HNSW32"}) {
    auto index = MakeIndex(dim, f);
    ASSERT_TRUE(index->AddBatch(n, ids.data(), vecs.data()).ok());
    std::vector<std::vector<uint64_t>> expect(64);
    for (int q = 0; q < 64; ++q)
      ASSERT_TRUE(index->Search(probes.data() + q * dim, 16, &expect[q], nullptr).ok());
    std::vector<int> mismatches(4, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&, t]() {
        std::vector<uint64_t> got;
        for (int rep = 0; rep < 4; ++rep)
          for (int q = t; q < 64; q += 2) {
            if (!index->Search(probes.data() + q * dim, 16, &got, nullptr).ok() || got != expect[q])
              ++mismatches[t];
          }
      });
    for (auto& th : threads) th.join();
    for (int m : mismatches) EXPECT_EQ(m, 0) << f;
  }
}

// ---- the ChunkIndex interface: specs and every kind ---------------------------------------

TEST(ChunkIndexSpec, RoundTripsForEveryKind) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"Exact", "Exact:heads=sum,rerank=1,rerank_min=0"},
      {"Exact:heads=max", "Exact:heads=max,rerank=1,rerank_min=0"},
      {"Exact:rerank_min=0,rerank=0,heads=max", "Exact:heads=max,rerank=0,rerank_min=0"},
      {"Exact:screen=int4,heads=max", "Exact:heads=max,rerank=1,rerank_min=0,screen=int4"},
      {"Exact:heads=max,screen=int8", "Exact:heads=max,rerank=1,rerank_min=0"},
      {"Flat", "Flat"},
      {"Flat:heads=sum", "Flat"},  // what a FAISS vector does anyway
      {"HNSW32", "HNSW32:ef=64"},
      {"HNSW16:ef=128", "HNSW16:ef=128"},
      {"IVF1024,Flat", "IVF1024,Flat:nprobe=16,train_min=0"},
      {"IVF256,PQ16:train_min=512,nprobe=4", "IVF256,PQ16:nprobe=4,train_min=512"},
      {"PQ16", "PQ16:train_min=0"},
      {"IDMap2,Flat", "IDMap2,Flat"},
      {"Quest", "Quest:heads=sum"},
      {"Quest:heads=max", "Quest:heads=max"},
  };
  const ChunkShape shape{2, 64, 4, DType::kF16};
  for (const auto& [spec, canonical] : cases) {
    auto c = CanonicalChunkIndexSpec(spec);
    ASSERT_TRUE(c.ok()) << spec << ": " << c.status().ToString();
    EXPECT_EQ(*c, canonical) << spec;
    auto again = CanonicalChunkIndexSpec(canonical);
    ASSERT_TRUE(again.ok()) << canonical;
    EXPECT_EQ(*again, canonical);
    auto index = MakeChunkIndex(spec, shape);
    ASSERT_TRUE(index.ok()) << spec << ": " << index.status().ToString();
    EXPECT_EQ((*index)->ToString(), canonical) << spec;
    EXPECT_EQ((*index)->size(), 0u);
  }
  auto e = ExactIndexOptions::Parse("Exact:heads=max,rerank=2,rerank_min=9");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->heads, ExactIndexOptions::HeadMerge::kMax);
  EXPECT_EQ(e->rerank_factor, 2);
  EXPECT_EQ(e->rerank_min, 9);
  EXPECT_EQ(e->theta_error, 0.0);                               // no certificate unless asked
  EXPECT_EQ(e->screen, ExactIndexOptions::ScreenCodes::kInt8);  // the default screen
  auto int4 = ExactIndexOptions::Parse("Exact:heads=max,theta=0.001,screen=int4");
  ASSERT_TRUE(int4.ok());
  EXPECT_EQ(int4->screen, ExactIndexOptions::ScreenCodes::kInt4);
  EXPECT_EQ(int4->ToString(), "Exact:heads=max,rerank=1,rerank_min=0,theta=0.001,screen=int4");
  auto certified = ExactIndexOptions::Parse("Exact:heads=max,theta=0.001");
  ASSERT_TRUE(certified.ok());
  EXPECT_EQ(certified->theta_error, 0.001);
  EXPECT_EQ(certified->ToString(), "Exact:heads=max,rerank=1,rerank_min=0,theta=0.001");
  auto index = MakeChunkIndex("Exact:theta=0.001", ChunkShape{2, 16, 2, DType::kF16});
  ASSERT_TRUE(index.ok());
  EXPECT_EQ((*index)->entropy_error_target(), 0.001);
  auto f = FaissIndexOptions::Parse("IVF64,Flat:nprobe=3,train_min=70");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->factory, "IVF64,Flat");
  EXPECT_EQ(f->ivf_nprobe, 3);
  EXPECT_EQ(f->train_min, 70);
}

TEST(ChunkIndexSpec, BadSpecsAreRejectedNamingTheKeyOrValue) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"Exact:", "key=value"},
      {"Exact:heads", "'heads'"},
      {"Exact:heads=avg", "bad value 'avg' for key 'heads'"},
      {"Exact:rerank=-1", "bad value '-1' for key 'rerank'"},
      {"Exact:rerank=x", "'rerank'"},
      {"Exact:rerank_min=1.5", "'rerank_min'"},
      {"Exact:screen=int2", "bad value 'int2' for key 'screen'"},
      {"Exact:theta=-0.1", "bad value '-0.1' for key 'theta'"},
      {"Exact:theta=2", "bad value '2' for key 'theta'"},
      {"Exact:bogus=1", "unknown key 'bogus'"},
      {"Exact:nprobe=4", "unknown key 'nprobe'"},
      {"Exact:heads=max,heads=sum", "duplicate key 'heads'"},
      {"Flat:heads=max", "heads=max in index spec 'Flat:heads=max' needs the Exact index"},
      {"Flat:heads=avg", "bad value 'avg' for key 'heads'"},
      {"Flat:rerank=4", "'rerank' in index spec 'Flat:rerank=4' applies to the Exact index only"},
      {"Flat:ef=32", "'ef' in index spec 'Flat:ef=32' applies to HNSW indexes only"},
      {"HNSW32:nprobe=4", "applies to IVF indexes only"},
      {"Flat:train_min=5", "applies to indexes that train"},
      {"HNSW32:ef=0", "bad value '0' for key 'ef'"},
      {"IVF64,Flat:nprobe=0", "bad value '0' for key 'nprobe'"},
      {"IVF1024,Flat:train_min=100", "nlist (1024)"},
      {"Flat:bogus=2", "unknown key 'bogus'"},
      {"Bogus", "'Bogus'"},
      {"HNSW0", "M >= 2"},
  };
  for (const auto& [spec, needle] : cases) {
    auto c = CanonicalChunkIndexSpec(spec);
    ASSERT_FALSE(c.ok()) << spec;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_TRUE(Contains(c.status().message(), needle))
        << spec << " -> " << c.status().message() << " (wanted " << needle << ")";
    auto m = MakeChunkIndex(spec, ChunkShape{2, 64, 4, DType::kF32});
    ASSERT_FALSE(m.ok()) << spec;
    EXPECT_EQ(m.status().message(), c.status().message()) << spec;
  }
  // A product quantizer's M must divide the dimension: FAISS's IVF-PQ throws otherwise and
  // leaks the coarse quantizer it built (LeakSanitizer in the fuzz target), so it never gets there.
  auto pq7 = CanonicalChunkIndexSpec("IVF64,PQ7");
  ASSERT_FALSE(pq7.ok());
  EXPECT_TRUE(Contains(pq7.status().message(), "PQ7 needs M = 7 to divide the vector dimension 1024"))
      << pq7.status().message();
  auto pq8 = MakeChunkIndex("PQ8", ChunkShape{1, 12, 4, DType::kF32});  // 12 floats per chunk vector
  ASSERT_FALSE(pq8.ok());
  EXPECT_TRUE(Contains(pq8.status().message(), "PQ8 needs M = 8 to divide the vector dimension 12"))
      << pq8.status().message();
  // Within the caps, what a chunk index can use still builds.
  for (const char* spec : {"IVF65536,Flat", "PQ16x8", "IVF64,PQ16x8", "OPQ16_64,PQ16"})
    EXPECT_TRUE(CanonicalChunkIndexSpec(spec).ok())
        << spec << ": " << CanonicalChunkIndexSpec(spec).status().ToString();
  // Shapes are checked too.
  for (const auto& [shape, field] :
       std::vector<std::pair<ChunkShape, std::string>>{{ChunkShape{0, 64, 4, DType::kF32}, "kv_heads"},
                                                       {ChunkShape{2, 0, 4, DType::kF32}, "head_dim"},
                                                       {ChunkShape{2, 8192, 4, DType::kF32}, "head_dim"},
                                                       {ChunkShape{2, 64, 0, DType::kF32}, "repr"}})
    for (const char* spec : {"Exact", "Flat"}) {
      auto m = MakeChunkIndex(spec, shape);
      ASSERT_FALSE(m.ok());
      EXPECT_TRUE(Contains(m.status().message(), "ChunkShape." + field)) << m.status().message();
    }
}

// What every kind promises through the interface, on the same chunks.
class ChunkIndexKindTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ChunkIndexKindTest, KeepsTheInterfaceContract) {
  const ChunkShape shape{2, 8, 3, DType::kF32};
  auto made = MakeChunkIndex(GetParam(), shape);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  ChunkIndex& index = **made;
  std::mt19937 rng(31);
  std::normal_distribution<float> g;
  const size_t n = 60;
  std::vector<float> reprs(n * shape.repr_floats());
  for (float& x : reprs) x = g(rng);
  std::vector<uint64_t> chunks(n + 2);
  std::iota(chunks.begin(), chunks.end(), 0);
  ASSERT_TRUE(index
                  .Add(chunks,
                       [&](uint64_t c, float* repr) {
                         if (c == 13 || c >= n) return NotFound("hole");  // skipped
                         std::copy_n(reprs.data() + c * shape.repr_floats(), shape.repr_floats(), repr);
                         return Status::Ok();
                       })
                  .ok());
  EXPECT_EQ(index.size(), n - 1);
  std::vector<float> p(shape.dim());
  for (float& x : p) x = g(rng);
  ChunkScores s, screened;
  ASSERT_TRUE(index.Score(p.data(), &s).ok());
  ASSERT_EQ(s.ids.size(), n - 1);
  ASSERT_EQ(s.logit.size(), n - 1);
  ASSERT_EQ(s.cosine.size(), n - 1);
  EXPECT_TRUE(std::is_sorted(s.ids.begin(), s.ids.end()));
  EXPECT_EQ(std::count(s.ids.begin(), s.ids.end(), 13u), 0);
  for (float c : s.cosine) {
    EXPECT_GE(c, -1.0f - 1e-5f);
    EXPECT_LE(c, 1.0f + 1e-5f);
  }
  ASSERT_TRUE(index.Screen(p.data(), &screened).ok());
  EXPECT_EQ(screened.ids, s.ids);
  // Best with room for everything: every chunk, in rank order (ties to the smaller index).
  for (ChunkRank rank : {ChunkRank::kCosine, ChunkRank::kLogit}) {
    std::vector<uint64_t> all;
    ASSERT_TRUE(index.Best(p.data(), screened, rank, n + 10, &all).ok());
    ASSERT_EQ(all.size(), n - 1);
    const std::vector<float>& by = s.by(rank);
    for (size_t i = 1; i < all.size(); ++i) {
      const size_t a = std::lower_bound(s.ids.begin(), s.ids.end(), all[i - 1]) - s.ids.begin();
      const size_t b = std::lower_bound(s.ids.begin(), s.ids.end(), all[i]) - s.ids.begin();
      EXPECT_TRUE(by[a] > by[b] || (by[a] == by[b] && all[i - 1] < all[i])) << GetParam() << " place " << i;
    }
    std::vector<uint64_t> few;
    ASSERT_TRUE(index.Best(p.data(), screened, rank, 5, &few).ok());
    EXPECT_EQ(few, std::vector<uint64_t>(all.begin(), all.begin() + 5)) << GetParam();
  }
  std::vector<uint64_t> top;
  ASSERT_TRUE(index.Search(p.data(), 7, &top).ok());
  EXPECT_EQ(top.size(), 7u);
  // Removal: gone for good; unknown chunks ignored.
  const std::vector<uint64_t> gone{0, 13, 20, 21, 59, 500};
  ASSERT_TRUE(index.Remove(gone).ok());
  EXPECT_EQ(index.size(), n - 5);
  ASSERT_TRUE(index.Score(p.data(), &s).ok());
  ASSERT_TRUE(index.Screen(p.data(), &screened).ok());
  std::vector<uint64_t> all;
  ASSERT_TRUE(index.Best(p.data(), screened, ChunkRank::kLogit, n, &all).ok());
  ASSERT_TRUE(index.Search(p.data(), static_cast<size_t>(n), &top).ok());
  for (uint64_t c : gone) {
    EXPECT_EQ(std::count(s.ids.begin(), s.ids.end(), c), 0) << c;
    EXPECT_EQ(std::count(all.begin(), all.end(), c), 0) << c;
    EXPECT_EQ(std::count(top.begin(), top.end(), c), 0) << c;
  }
  EXPECT_GT(index.memory_bytes(), 0u);
  EXPECT_EQ(index.shape().kv_heads, 2);
  // Scores of another index, or of this one before a change, are refused, not misread.
  auto other = MakeChunkIndex(GetParam(), shape);
  ASSERT_TRUE(other.ok());
  ChunkScores foreign;
  ASSERT_TRUE((*other)->Screen(p.data(), &foreign).ok());
  EXPECT_EQ(index.Best(p.data(), foreign, ChunkRank::kLogit, 3, &all).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(index.Remove({1}).ok());
  EXPECT_EQ(index.Best(p.data(), screened, ChunkRank::kLogit, 3, &all).code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Kinds, ChunkIndexKindTest,
                         ::testing::Values("Exact", "Exact:rerank=0", "Exact:heads=max,rerank=1,rerank_min=0",
                                           "Exact:heads=max,screen=int4", "Flat", "HNSW32",
                                           "IVF4,Flat:train_min=16", "Quest", "Quest:heads=max"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name;
                           for (char c : info.param)
                             name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return name;
                         });

TEST(FaissChunkIndex, ScoresTheMeanOfTheRepresentatives) {
  // InfLLM: the unnormalised mean of the representatives, kv heads concatenated.
  const ChunkShape shape{2, 2, 2, DType::kF32};
  auto made = MakeChunkIndex("Flat", shape);
  ASSERT_TRUE(made.ok());
  const float c0[] = {3, 0, 0, 0, /* r1 */ -3, 0, 0, 0};  // mean 0: one strong key diluted
  const float c1[] = {1, 0, 0, 2, /* r1 */ 1, 0, 0, 0};   // mean (1, 0, 0, 1)
  ASSERT_TRUE((*made)->Add(0, c0).ok());
  ASSERT_TRUE((*made)->Add(1, c1).ok());
  const std::vector<float> p{2, 0, 0, 1};
  ChunkScores s;
  ASSERT_TRUE((*made)->Score(p.data(), &s).ok());
  EXPECT_EQ(s.ids, (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(s.logit, (std::vector<float>{0, 3}));
  EXPECT_EQ(s.cosine[0], 0.0f);                                             // a zero vector: cosine 0
  EXPECT_NEAR(s.cosine[1], 3.0 / (std::sqrt(5.0) * std::sqrt(2.0)), 1e-6);  // Eq. 10 on the concatenation
  std::vector<uint64_t> top;
  ASSERT_TRUE((*made)->Search(p.data(), 1, &top).ok());
  EXPECT_EQ(top, (std::vector<uint64_t>{1}));
}

}  // namespace
}  // namespace kvtier
