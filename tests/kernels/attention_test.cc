// Tests of the CPU attention kernel (kernels/cpu/attention.h) against a naive
// double-precision full attention: concatenate all keys, causal mask by
// position, GQA, softmax, weighted V; mass = per-key probability sums.
#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/dtype.h"

namespace kvtier::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A random value in +-[0.05, 1]: never zero.
float Val(std::mt19937& rng) {
  std::uniform_real_distribution<float> mag(0.05f, 1.0f);
  return (rng() & 1u) ? mag(rng) : -mag(rng);
}

struct PartData {
  int n = 0;
  int64_t pos0 = 0;
  bool want_mass = false;
  std::vector<uint8_t> k, v;  // storage bytes [n, kv_heads, head_dim]
  std::vector<float> kf, vf;  // the same values decoded to fp32 (what the kernel sees)
  std::vector<float> mass;    // [kv_heads, n]
};

struct Problem {
  int q_heads = 8, kv_heads = 2, head_dim = 64, m = 1;
  DType dt = DType::kF32;
  float scale = 0.125f;
  bool causal = true;
  std::vector<float> q;         // [m, q_heads, head_dim]
  std::vector<int64_t> qpos;    // [m]
  std::vector<PartData> parts;  // in "natural" order: sinks, chunks..., local

  size_t RowLen() const { return static_cast<size_t>(kv_heads) * head_dim; }

  void AddPart(int n, int64_t pos0, bool want_mass, std::mt19937& rng) {
    PartData p;
    p.n = n;
    p.pos0 = pos0;
    p.want_mass = want_mass;
    const size_t elems = static_cast<size_t>(n) * RowLen();
    std::vector<float> kraw(elems), vraw(elems);
    for (auto& x : kraw) x = Val(rng);
    for (auto& x : vraw) x = Val(rng);
    p.k.resize(elems * DTypeSize(dt) + 1);  // +1: never a zero-size allocation
    p.v.resize(elems * DTypeSize(dt) + 1);
    FromFloat(dt, kraw.data(), p.k.data(), elems);
    FromFloat(dt, vraw.data(), p.v.data(), elems);
    p.kf.resize(elems);
    p.vf.resize(elems);
    ToFloat(dt, p.k.data(), p.kf.data(), elems);
    ToFloat(dt, p.v.data(), p.vf.data(), elems);
    if (want_mass) p.mass.assign(static_cast<size_t>(kv_heads) * n, 0.0f);
    parts.push_back(std::move(p));
  }

  void MakeQueries(const std::vector<int64_t>& positions, std::mt19937& rng) {
    m = static_cast<int>(positions.size());
    qpos = positions;
    q.resize(static_cast<size_t>(m) * q_heads * head_dim);
    for (auto& x : q) x = 2.0f * Val(rng);  // sharper softmax than +-1
  }
};

struct Ref {
  std::vector<double> out;                // [m, q_heads, head_dim]
  std::vector<double> lse;                // [m, q_heads]
  std::vector<std::vector<double>> mass;  // per part [kv_heads, n]
  int visible_rows = 0;                   // (query, head) rows that see at least one key
};

Ref Naive(const Problem& pb) {
  const int G = pb.q_heads / pb.kv_heads, D = pb.head_dim;
  Ref r;
  r.out.assign(static_cast<size_t>(pb.m) * pb.q_heads * D, 0.0);
  r.lse.assign(static_cast<size_t>(pb.m) * pb.q_heads, -kInf);
  r.mass.resize(pb.parts.size());
  for (size_t pi = 0; pi < pb.parts.size(); ++pi)
    r.mass[pi].assign(static_cast<size_t>(pb.kv_heads) * pb.parts[pi].n, 0.0);
  struct Key {
    size_t part;
    int t;
  };
  std::vector<Key> keys;  // all keys concatenated
  for (size_t pi = 0; pi < pb.parts.size(); ++pi)
    for (int t = 0; t < pb.parts[pi].n; ++t) keys.push_back({pi, t});
  std::vector<double> s(keys.size());
  for (int i = 0; i < pb.m; ++i) {
    for (int h = 0; h < pb.q_heads; ++h) {
      const int g = h / G;
      const float* q = pb.q.data() + (static_cast<size_t>(i) * pb.q_heads + h) * D;
      double mx = -kInf;
      for (size_t j = 0; j < keys.size(); ++j) {
        const PartData& p = pb.parts[keys[j].part];
        const int64_t pos = p.pos0 + keys[j].t;
        if (pb.causal && pos > pb.qpos[i]) {
          s[j] = -kInf;
          continue;
        }
        const float* k =
            p.kf.data() + static_cast<size_t>(keys[j].t) * pb.RowLen() + static_cast<size_t>(g) * D;
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
        s[j] = dot * pb.scale;
        mx = std::max(mx, s[j]);
      }
      if (mx == -kInf) continue;  // no visible key: out 0, lse -inf
      ++r.visible_rows;
      double sum = 0;
      for (size_t j = 0; j < keys.size(); ++j) sum += s[j] == -kInf ? 0.0 : std::exp(s[j] - mx);
      double* o = r.out.data() + (static_cast<size_t>(i) * pb.q_heads + h) * D;
      for (size_t j = 0; j < keys.size(); ++j) {
        if (s[j] == -kInf) continue;
        const double pj = std::exp(s[j] - mx) / sum;
        const PartData& p = pb.parts[keys[j].part];
        const float* v =
            p.vf.data() + static_cast<size_t>(keys[j].t) * pb.RowLen() + static_cast<size_t>(g) * D;
        for (int d = 0; d < D; ++d) o[d] += pj * v[d];
        r.mass[keys[j].part][static_cast<size_t>(g) * p.n + keys[j].t] += pj;
      }
      r.lse[static_cast<size_t>(i) * pb.q_heads + h] = mx + std::log(sum);
    }
  }
  return r;
}

struct Result {
  KernelError err = KernelError::kOk;
  std::vector<float> out, lse;
};

// Runs the kernel with the parts in the order `order` (indices into pb.parts);
// out and lse are poisoned with NaN first. Mass arrays are accumulated into
// pb.parts[*].mass.
Result RunKernel(Problem& pb, const std::vector<int>& order, bool with_lse = true) {
  std::vector<KvSpan> spans;
  for (int idx : order) {
    PartData& p = pb.parts[idx];
    KvSpan s;
    s.k = p.k.data();
    s.v = p.v.data();
    s.n_tokens = p.n;
    s.first_position = p.pos0;
    s.mass = p.want_mass ? p.mass.data() : nullptr;
    spans.push_back(s);
  }
  Result res;
  res.out.assign(static_cast<size_t>(pb.m) * pb.q_heads * pb.head_dim, kNaN);
  res.lse.assign(static_cast<size_t>(pb.m) * pb.q_heads, kNaN);
  AttentionParams prm;
  prm.q_heads = pb.q_heads;
  prm.kv_heads = pb.kv_heads;
  prm.head_dim = pb.head_dim;
  prm.dtype = pb.dt;
  prm.scale = pb.scale;
  prm.n_queries = pb.m;
  prm.q = pb.q.data();
  prm.q_positions = pb.qpos.data();
  prm.parts = spans.data();
  prm.n_parts = static_cast<int>(spans.size());
  prm.out = res.out.data();
  prm.lse = with_lse ? res.lse.data() : nullptr;
  prm.causal = pb.causal;
  res.err = Attention(prm);
  return res;
}

std::vector<int> Identity(size_t n) {
  std::vector<int> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

std::vector<int> Shuffled(size_t n, uint32_t seed) {
  std::vector<int> v = Identity(n);
  std::mt19937 rng(seed);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

// max |a - b| / max |b|
double RelErr(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den == 0 ? num : num / den;
}

void ExpectMatches(const Problem& pb, const Result& got, const Ref& ref, bool check_lse = true,
                   double tol = 1e-5) {
  ASSERT_EQ(got.err, KernelError::kOk) << KernelErrorString(got.err);
  // Every output element written and finite.
  for (size_t i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(got.out[i])) << "out[" << i << "]";
  EXPECT_LE(RelErr(got.out, ref.out), tol);
  // Rows that see no key are exactly zero.
  for (int i = 0; i < pb.m; ++i)
    for (int h = 0; h < pb.q_heads; ++h) {
      const size_t row = static_cast<size_t>(i) * pb.q_heads + h;
      if (ref.lse[row] != -kInf) continue;
      for (int d = 0; d < pb.head_dim; ++d) ASSERT_EQ(got.out[row * pb.head_dim + d], 0.0f);
    }
  if (check_lse) {
    for (size_t r = 0; r < ref.lse.size(); ++r) {
      if (ref.lse[r] == -kInf) {
        EXPECT_EQ(got.lse[r], -std::numeric_limits<float>::infinity()) << "row " << r;
      } else {
        ASSERT_TRUE(std::isfinite(got.lse[r])) << "row " << r;
        EXPECT_NEAR(got.lse[r], ref.lse[r], tol * std::max(1.0, std::abs(ref.lse[r]))) << "row " << r;
      }
    }
  }
}

// Mass: equals the naive per-key probability sums (on top of `base`, the value
// the arrays held before the call), and sums to the number of rows that see a key.
void ExpectMass(const Problem& pb, const Ref& ref, float base, double tol = 1e-5) {
  double total = 0;
  double num = 0, den = 0;
  for (size_t pi = 0; pi < pb.parts.size(); ++pi) {
    const PartData& p = pb.parts[pi];
    if (!p.want_mass) continue;
    for (size_t j = 0; j < p.mass.size(); ++j) {
      const double got = static_cast<double>(p.mass[j]) - base;
      num = std::max(num, std::abs(got - ref.mass[pi][j]));
      den = std::max(den, std::abs(ref.mass[pi][j]));
      total += got;
    }
  }
  EXPECT_LE(den == 0 ? num : num / den, tol);
  bool all = true;
  for (const PartData& p : pb.parts) all = all && (p.want_mass || p.n == 0);
  if (all) {
    EXPECT_NEAR(total, ref.visible_rows, 1e-4 * std::max(1, ref.visible_rows));
  }
}

// ---------------------------------------------------------------------------
// Shape sweep: GQA group x head_dim x m x dtype x sinks.
// ---------------------------------------------------------------------------
struct Shape {
  int group;
  int head_dim;
  int m;
  DType dt;
  bool sinks;
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "{group " << s.group << ", head_dim " << s.head_dim << ", m " << s.m << ", " << DTypeName(s.dt)
      << (s.sinks ? ", sinks}" : ", no sinks}");
}

std::string ShapeName(const testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  std::ostringstream os;  // (not std::string operator+: GCC 12 -Wrestrict false positive)
  os << "g" << s.group << "_d" << s.head_dim << "_m" << s.m << "_" << DTypeName(s.dt)
     << (s.sinks ? "_sinks" : "_nosinks");
  return os.str();
}

// Builds: sinks (4 tokens at 0..3, optional), ragged chunks at increasing,
// gapped positions, then a local window of m + 40 tokens; the m queries are
// the last m positions of the window (window mode is causal inside it).
Problem MakeStandard(const Shape& s, uint32_t seed, bool mass) {
  std::mt19937 rng(seed);
  Problem pb;
  pb.kv_heads = 2;
  pb.q_heads = 2 * s.group;
  pb.head_dim = s.head_dim;
  pb.dt = s.dt;
  pb.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  if (s.sinks) pb.AddPart(4, 0, mass, rng);
  int64_t pos = 100;
  for (int n : {1, 7, 32, 33, 7, 1, 32}) {
    pb.AddPart(n, pos, mass, rng);
    pos += n + 50;
  }
  const int local = s.m + 40;
  pb.AddPart(local, pos, mass, rng);
  std::vector<int64_t> qp;
  for (int i = 0; i < s.m; ++i) qp.push_back(pos + local - s.m + i);
  pb.MakeQueries(qp, rng);
  return pb;
}

class AttentionShapes : public testing::TestWithParam<Shape> {};

TEST_P(AttentionShapes, MatchesNaiveInOrder) {
  Problem pb = MakeStandard(GetParam(), 1234, /*mass=*/false);
  const Ref ref = Naive(pb);
  const Result got = RunKernel(pb, Identity(pb.parts.size()));
  ExpectMatches(pb, got, ref);
}

TEST_P(AttentionShapes, MatchesNaiveShuffledWithMass) {
  Problem pb = MakeStandard(GetParam(), 777, /*mass=*/true);
  const float base = 0.25f;  // mass is ADDED to what the arrays hold
  for (PartData& p : pb.parts) std::fill(p.mass.begin(), p.mass.end(), base);
  const Ref ref = Naive(pb);
  const Result got = RunKernel(pb, Shuffled(pb.parts.size(), 99));
  ExpectMatches(pb, got, ref);
  ExpectMass(pb, ref, base);
}

std::vector<Shape> SweepShapes() {
  std::vector<Shape> v;
  for (int group : {1, 4, 8})
    for (int d : {32, 64, 128})
      for (int m : {1, 17, 64})
        for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
          for (bool sinks : {false, true}) v.push_back(Shape{group, d, m, dt, sinks});
  return v;
}

INSTANTIATE_TEST_SUITE_P(AttentionSweep, AttentionShapes, testing::ValuesIn(SweepShapes()), ShapeName);

// Head dims that are not a multiple of the SIMD width, and odd GQA groups.
INSTANTIATE_TEST_SUITE_P(
    AttentionOddDims, AttentionShapes,
    testing::Values(Shape{1, 8, 3, DType::kF32, true}, Shape{2, 40, 5, DType::kF16, false},
                    Shape{3, 80, 17, DType::kBF16, true}, Shape{4, 96, 1, DType::kF32, true},
                    Shape{1, 200, 9, DType::kF32, true}, Shape{5, 17, 2, DType::kF16, true},
                    Shape{2, 256, 4, DType::kBF16, false}),
    ShapeName);

// ---------------------------------------------------------------------------
// Long contexts (exercise split-K and its LSE merge) under several thread counts.
// ---------------------------------------------------------------------------
struct LongCase {
  int m;
  DType dt;
  int kv_heads;
  int threads;
};

void PrintTo(const LongCase& c, std::ostream* os) {
  *os << "{m " << c.m << ", " << DTypeName(c.dt) << ", kv_heads " << c.kv_heads << ", threads " << c.threads
      << "}";
}

class AttentionLong : public testing::TestWithParam<LongCase> {};

TEST_P(AttentionLong, MatchesNaive) {
  const LongCase c = GetParam();
  std::mt19937 rng(4242 + c.m);
  Problem pb;
  pb.kv_heads = c.kv_heads;
  pb.q_heads = 4 * c.kv_heads;
  pb.head_dim = 64;
  pb.dt = c.dt;
  pb.scale = 0.125f;
  pb.AddPart(4, 0, true, rng);
  int64_t pos = 16;
  const int sizes[] = {32, 1, 7, 33, 32, 32, 64, 5};
  for (int i = 0; pos < 6000; ++i) {
    const int n = sizes[i % 8];
    pb.AddPart(n, pos, true, rng);
    pos += n + (i % 3);
  }
  pb.AddPart(300, pos, true, rng);
  std::vector<int64_t> qp;
  for (int i = 0; i < c.m; ++i) qp.push_back(pos + 300 - c.m + i);
  pb.MakeQueries(qp, rng);
  const Ref ref = Naive(pb);
  Result got;
  // Allow arenas wider than the machine (the kernel plans its split-K by the
  // arena's concurrency; this exercises more splits than the cores would).
  tbb::global_control allow(tbb::global_control::max_allowed_parallelism,
                            std::max<size_t>(c.threads, tbb::global_control::active_value(
                                                            tbb::global_control::max_allowed_parallelism)));
  tbb::task_arena arena(c.threads);
  arena.execute([&] { got = RunKernel(pb, Shuffled(pb.parts.size(), 5)); });
  ExpectMatches(pb, got, ref);
  ExpectMass(pb, ref, 0.0f);
}

INSTANTIATE_TEST_SUITE_P(AttentionSplits, AttentionLong,
                         testing::Values(LongCase{1, DType::kF32, 1, 1}, LongCase{1, DType::kF32, 1, 2},
                                         LongCase{1, DType::kF16, 2, 2}, LongCase{1, DType::kBF16, 2, 4},
                                         LongCase{1, DType::kF16, 1, 8}, LongCase{17, DType::kF32, 1, 2},
                                         LongCase{17, DType::kF16, 2, 8}, LongCase{64, DType::kBF16, 1, 4}),
                         [](const testing::TestParamInfo<LongCase>& i) {
                           std::ostringstream os;
                           os << "m" << i.param.m << "_" << DTypeName(i.param.dt) << "_kv" << i.param.kv_heads
                              << "_t" << i.param.threads;
                           return os.str();
                         });

// ---------------------------------------------------------------------------
// Masking corner cases.
// ---------------------------------------------------------------------------
TEST(AttentionMask, ScrambledPositionsPartialMasksEverywhere) {
  // Parts and queries at interleaved positions, so every part is partially
  // visible to some queries; one query sits before every key.
  std::mt19937 rng(31337);
  Problem pb;
  pb.q_heads = 8;
  pb.kv_heads = 2;
  pb.head_dim = 64;
  pb.dt = DType::kF16;
  pb.scale = 0.125f;
  const int64_t starts[] = {50, 0, 120, 37, 90, 10};
  const int lens[] = {40, 9, 33, 1, 64, 17};
  for (int i = 0; i < 6; ++i) pb.AddPart(lens[i], starts[i], true, rng);
  std::vector<int64_t> qp = {-1, 0, 5, 40, 55, 89, 91, 130, 200, 3, 151};
  pb.MakeQueries(qp, rng);
  const Ref ref = Naive(pb);
  const Result got = RunKernel(pb, Identity(pb.parts.size()));
  ExpectMatches(pb, got, ref);
  ExpectMass(pb, ref, 0.0f);
  // Query 0 (position -1) sees nothing.
  for (int h = 0; h < pb.q_heads; ++h) EXPECT_EQ(got.lse[h], -std::numeric_limits<float>::infinity());
}

TEST(AttentionMask, NonCausalIgnoresPositions) {
  std::mt19937 rng(5);
  Problem pb;
  pb.q_heads = 4;
  pb.kv_heads = 4;
  pb.head_dim = 32;
  pb.dt = DType::kBF16;
  pb.scale = 0.2f;
  pb.causal = false;
  pb.AddPart(20, 1000, true, rng);
  pb.AddPart(13, 5000, true, rng);
  pb.MakeQueries({0, 1, 2}, rng);  // all keys are in the "future"
  const Ref ref = Naive(pb);
  const Result got = RunKernel(pb, Identity(pb.parts.size()));
  ExpectMatches(pb, got, ref);
  ExpectMass(pb, ref, 0.0f);
  EXPECT_EQ(ref.visible_rows, 12);

  // Non-causal does not need q_positions.
  AttentionParams prm;
  std::vector<KvSpan> spans;
  for (PartData& p : pb.parts) spans.push_back(KvSpan{p.k.data(), p.v.data(), p.n, p.pos0, nullptr});
  std::vector<float> out(pb.q.size(), kNaN);
  prm.q_heads = pb.q_heads;
  prm.kv_heads = pb.kv_heads;
  prm.head_dim = pb.head_dim;
  prm.dtype = pb.dt;
  prm.scale = pb.scale;
  prm.n_queries = pb.m;
  prm.q = pb.q.data();
  prm.q_positions = nullptr;
  prm.parts = spans.data();
  prm.n_parts = static_cast<int>(spans.size());
  prm.out = out.data();
  prm.causal = false;
  ASSERT_EQ(Attention(prm), KernelError::kOk);
  EXPECT_LE(RelErr(out, ref.out), 1e-5);
}

TEST(AttentionMask, QueryWithNoVisibleKey) {
  std::mt19937 rng(8);
  Problem pb;
  pb.q_heads = 4;
  pb.kv_heads = 1;
  pb.head_dim = 64;
  pb.dt = DType::kF32;
  pb.AddPart(16, 100, true, rng);
  pb.MakeQueries({99, 100, 50}, rng);  // queries 0 and 2 see nothing, 1 sees one key
  const Ref ref = Naive(pb);
  const Result got = RunKernel(pb, Identity(1));
  ExpectMatches(pb, got, ref);
  ExpectMass(pb, ref, 0.0f);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int h = 0; h < 4; ++h) {
    EXPECT_EQ(got.lse[0 * 4 + h], ninf);
    EXPECT_EQ(got.lse[2 * 4 + h], ninf);
  }
  for (int d = 0; d < 64; ++d) EXPECT_EQ(got.out[d], 0.0f);
  // Query 1 sees exactly one key: output = that V row, its mass is 4 (= q heads), lse = its score.
  for (int h = 0; h < 4; ++h)
    for (int d = 0; d < 64; ++d) EXPECT_NEAR(got.out[(4 + h) * 64 + d], pb.parts[0].vf[d], 1e-6);
  EXPECT_NEAR(pb.parts[0].mass[0], 4.0, 1e-5);
  for (int t = 1; t < 16; ++t) EXPECT_EQ(pb.parts[0].mass[t], 0.0f);
}

TEST(AttentionMask, NoPartsAtAll) {
  std::mt19937 rng(9);
  Problem pb;
  pb.MakeQueries({10, 11}, rng);
  const Ref ref = Naive(pb);
  const Result got = RunKernel(pb, {});
  ExpectMatches(pb, got, ref);
  for (float x : got.out) EXPECT_EQ(x, 0.0f);
  for (float x : got.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

TEST(AttentionMask, EmptySpansAreSkipped) {
  std::mt19937 rng(10);
  Problem pb;
  pb.AddPart(0, 0, true, rng);
  pb.AddPart(12, 0, true, rng);
  pb.AddPart(0, 7, false, rng);
  pb.MakeQueries({20}, rng);
  // An empty span may have null k/v.
  const Ref ref = Naive(pb);
  std::vector<KvSpan> spans;
  for (PartData& p : pb.parts)
    spans.push_back(KvSpan{p.n ? p.k.data() : nullptr, p.n ? p.v.data() : nullptr, p.n, p.pos0,
                           p.want_mass ? p.mass.data() : nullptr});
  std::vector<float> out(pb.q.size(), kNaN);
  AttentionParams prm;
  prm.q_heads = pb.q_heads;
  prm.kv_heads = pb.kv_heads;
  prm.head_dim = pb.head_dim;
  prm.dtype = pb.dt;
  prm.scale = pb.scale;
  prm.n_queries = pb.m;
  prm.q = pb.q.data();
  prm.q_positions = pb.qpos.data();
  prm.parts = spans.data();
  prm.n_parts = 3;
  prm.out = out.data();
  ASSERT_EQ(Attention(prm), KernelError::kOk);
  EXPECT_LE(RelErr(out, ref.out), 1e-5);
  ExpectMass(pb, ref, 0.0f);
}

TEST(AttentionMisc, LseOptionalAndDefaultScale) {
  std::mt19937 rng(11);
  Problem pb;
  pb.head_dim = 64;
  pb.scale = 0.125f;  // == 1/sqrt(64)
  pb.AddPart(50, 0, true, rng);
  pb.MakeQueries({60, 61}, rng);
  const Ref ref = Naive(pb);
  // No lse requested, but mass requested: the kernel needs its own lse.
  const Result got = RunKernel(pb, Identity(1), /*with_lse=*/false);
  ExpectMatches(pb, got, ref, /*check_lse=*/false);
  ExpectMass(pb, ref, 0.0f);
  for (float x : got.lse) EXPECT_TRUE(std::isnan(x));  // untouched
  // scale = 0 means 1/sqrt(head_dim).
  pb.scale = 0.0f;
  for (PartData& p : pb.parts) std::fill(p.mass.begin(), p.mass.end(), 0.0f);
  const Result got2 = RunKernel(pb, Identity(1));
  ExpectMatches(pb, got2, ref);
}

TEST(AttentionMisc, MassOnlyForSomeParts) {
  std::mt19937 rng(21);
  Problem pb;
  pb.q_heads = 8;
  pb.kv_heads = 2;
  pb.head_dim = 64;
  pb.dt = DType::kF16;
  pb.AddPart(4, 0, true, rng);
  for (int i = 0; i < 40; ++i) pb.AddPart(1 + (i * 7) % 33, 100 + 40 * i, i % 3 == 0, rng);
  pb.AddPart(50, 3000, false, rng);
  pb.MakeQueries({3040, 3049}, rng);
  const Ref ref = Naive(pb);
  const Result got = RunKernel(pb, Shuffled(pb.parts.size(), 3));
  ExpectMatches(pb, got, ref);
  ExpectMass(pb, ref, 0.0f);
}

TEST(AttentionMisc, ConcurrentCallersGetIndependentResults) {
  // Scratch is per thread; callers on different threads must not interfere.
  std::mt19937 rng(22);
  Problem pb;
  pb.AddPart(3000, 0, false, rng);
  pb.AddPart(700, 5000, false, rng);
  pb.MakeQueries({5699}, rng);
  const Ref ref = Naive(pb);
  std::vector<Result> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      Problem local = pb;  // own copy (RunKernel writes mass through it)
      for (int rep = 0; rep < 20; ++rep)
        results[t] = RunKernel(local, Shuffled(local.parts.size(), t * 100 + rep));
    });
  for (auto& th : threads) th.join();
  for (const Result& r : results) ExpectMatches(pb, r, ref);
}

TEST(AttentionMisc, ZeroQueriesIsANoOp) {
  AttentionParams prm;
  prm.q_heads = 8;
  prm.kv_heads = 2;
  prm.head_dim = 64;
  prm.n_queries = 0;
  EXPECT_EQ(Attention(prm), KernelError::kOk);
}

// ---------------------------------------------------------------------------
// Bad parameters: the right error, no crash, nothing written.
// ---------------------------------------------------------------------------
class AttentionBadParams : public testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(12);
    pb.AddPart(10, 0, false, rng);
    pb.MakeQueries({20}, rng);
    span = KvSpan{pb.parts[0].k.data(), pb.parts[0].v.data(), 10, 0, nullptr};
    out.assign(pb.q.size(), kNaN);
    prm.q_heads = pb.q_heads;
    prm.kv_heads = pb.kv_heads;
    prm.head_dim = pb.head_dim;
    prm.dtype = pb.dt;
    prm.scale = pb.scale;
    prm.n_queries = 1;
    prm.q = pb.q.data();
    prm.q_positions = pb.qpos.data();
    prm.parts = &span;
    prm.n_parts = 1;
    prm.out = out.data();
    ASSERT_EQ(Attention(prm), KernelError::kOk);
    out.assign(pb.q.size(), kNaN);
  }
  void ExpectError(const AttentionParams& p, KernelError want) {
    EXPECT_EQ(Attention(p), want) << KernelErrorString(want);
    for (float x : out) ASSERT_TRUE(std::isnan(x)) << "output written despite error";
  }
  Problem pb;
  KvSpan span;
  std::vector<float> out;
  AttentionParams prm;
};

TEST_F(AttentionBadParams, NullPointers) {
  AttentionParams p = prm;
  p.q = nullptr;
  ExpectError(p, KernelError::kNullPointer);
  p = prm;
  p.out = nullptr;
  ExpectError(p, KernelError::kNullPointer);
  p = prm;
  p.q_positions = nullptr;
  ExpectError(p, KernelError::kNullPointer);
  p = prm;
  p.parts = nullptr;  // n_parts > 0
  ExpectError(p, KernelError::kNullPointer);
  KvSpan s = span;
  s.k = nullptr;
  p = prm;
  p.parts = &s;
  ExpectError(p, KernelError::kNullPointer);
  s = span;
  s.v = nullptr;
  ExpectError(p, KernelError::kNullPointer);
}

TEST_F(AttentionBadParams, BadShapes) {
  AttentionParams p = prm;
  p.q_heads = 7;  // not a multiple of kv_heads = 2
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.kv_heads = 0;
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.q_heads = 0;
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.q_heads = -8;
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.head_dim = 0;
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.head_dim = -64;
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.head_dim = kMaxHeadDim + 1;
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.n_queries = -1;
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.n_parts = -1;
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.scale = std::numeric_limits<float>::infinity();
  ExpectError(p, KernelError::kBadShape);
  p = prm;
  p.scale = kNaN;
  ExpectError(p, KernelError::kBadShape);
  KvSpan s = span;
  s.n_tokens = -1;
  p = prm;
  p.parts = &s;
  ExpectError(p, KernelError::kBadShape);
  s = span;
  s.first_position = std::numeric_limits<int64_t>::max() - 3;  // last position overflows
  ExpectError(p, KernelError::kBadShape);
}

TEST_F(AttentionBadParams, BadDType) {
  AttentionParams p = prm;
  p.dtype = static_cast<DType>(7);
  ExpectError(p, KernelError::kBadDType);
}

TEST_F(AttentionBadParams, ExtremePositionsDoNotOverflow) {
  // Positions near the ends of int64 are legal as long as the span fits.
  KvSpan s = span;
  s.first_position = std::numeric_limits<int64_t>::max() - 9;  // last token at INT64_MAX
  std::vector<int64_t> qp = {std::numeric_limits<int64_t>::min()};
  AttentionParams p = prm;
  p.parts = &s;
  p.q_positions = qp.data();
  EXPECT_EQ(Attention(p), KernelError::kOk);
  for (float x : out) EXPECT_EQ(x, 0.0f);  // sees nothing
  qp[0] = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(Attention(p), KernelError::kOk);
  for (float x : out) EXPECT_TRUE(std::isfinite(x));
  s.first_position = std::numeric_limits<int64_t>::min();
  qp[0] = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(Attention(p), KernelError::kOk);
  for (float x : out) EXPECT_TRUE(std::isfinite(x));
}

TEST(AttentionErrors, Strings) {
  EXPECT_STREQ(KernelErrorString(KernelError::kOk), "ok");
  EXPECT_STREQ(KernelErrorString(KernelError::kBadShape), "bad shape");
  EXPECT_STREQ(KernelErrorString(KernelError::kNullPointer), "null pointer");
  EXPECT_STREQ(KernelErrorString(KernelError::kBadDType), "bad dtype");
  EXPECT_STREQ(KernelErrorString(KernelError::kOutOfMemory), "out of memory");
  EXPECT_NE(KernelErrorString(static_cast<KernelError>(99)), nullptr);
}

}  // namespace
}  // namespace kvtier::kernels
