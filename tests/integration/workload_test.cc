// Tests of integration/workload (the synthetic ∞-Bench-like generator),
// integration/json (the report writer) and integration/sysinfo.
#include "integration/workload.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "integration/json.h"
#include "integration/sysinfo.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

Geometry SmallGeometry(int layers = 2, int q_heads = 4, int kv_heads = 2, int head_dim = 32) {
  Geometry g;
  g.layers = layers;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.dtype = DType::kF32;
  return g;
}

WorkloadOptions SmallOptions(int64_t context = 4096) {
  WorkloadOptions o;
  o.context = context;
  o.question_len = 32;
  o.decode_steps = 8;
  return o;
}

Workload MakeWorkload(const Geometry& g, const WorkloadOptions& o) {
  auto w = Workload::Create(g, o);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return std::move(w).value();
}

struct Tensors {
  std::vector<float> q, k, v;
};

Tensors GenerateAll(const Workload& w, int layer, int64_t begin, int64_t end) {
  const Geometry& g = w.geometry();
  const size_t n = static_cast<size_t>(end - begin);
  Tensors t;
  t.q.resize(n * g.q_heads * g.head_dim);
  t.k.resize(n * g.kv_heads * g.head_dim);
  t.v.resize(n * g.kv_heads * g.head_dim);
  w.Generate(layer, begin, end, t.q.data(), t.k.data(), t.v.data());
  return t;
}

bool SameBytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- determinism ---------------------------------------------------------------

TEST(Workload, SameSeedSameBytes) {
  const Geometry g = SmallGeometry();
  const WorkloadOptions o = SmallOptions();
  const Workload a = MakeWorkload(g, o), b = MakeWorkload(g, o);
  for (int layer = 0; layer < g.layers; ++layer) {
    Tensors ta = GenerateAll(a, layer, 0, a.total_tokens());
    Tensors tb = GenerateAll(b, layer, 0, b.total_tokens());
    EXPECT_TRUE(SameBytes(ta.q, tb.q));
    EXPECT_TRUE(SameBytes(ta.k, tb.k));
    EXPECT_TRUE(SameBytes(ta.v, tb.v));
  }
}

TEST(Workload, BlockSplitDoesNotMatter) {
  const Geometry g = SmallGeometry();
  WorkloadOptions o = SmallOptions(5000);  // crosses RoPE (1024) and topic (256) boundaries unevenly
  o.needle_count = 3;
  const Workload w = MakeWorkload(g, o);
  const int64_t n = w.total_tokens();
  std::mt19937_64 rng(7);
  for (int layer = 0; layer < g.layers; ++layer) {
    const Tensors whole = GenerateAll(w, layer, 0, n);
    Tensors pieces;
    pieces.q.resize(whole.q.size());
    pieces.k.resize(whole.k.size());
    pieces.v.resize(whole.v.size());
    const size_t qt = static_cast<size_t>(g.q_heads) * g.head_dim, kt = g.token_elems();
    int64_t pos = 0;
    int blocks = 0;
    while (pos < n) {
      const int64_t len = std::min<int64_t>(n - pos, 1 + static_cast<int64_t>(rng() % 700));
      w.Generate(layer, pos, pos + len, pieces.q.data() + pos * qt, pieces.k.data() + pos * kt,
                 pieces.v.data() + pos * kt);
      pos += len;
      ++blocks;
    }
    EXPECT_GT(blocks, 5);
    EXPECT_TRUE(SameBytes(whole.q, pieces.q)) << "layer " << layer;
    EXPECT_TRUE(SameBytes(whole.k, pieces.k)) << "layer " << layer;
    EXPECT_TRUE(SameBytes(whole.v, pieces.v)) << "layer " << layer;
  }
}

TEST(Workload, NullOutputsAreSkippedAndOthersUnchanged) {
  const Geometry g = SmallGeometry();
  const Workload w = MakeWorkload(g, SmallOptions());
  const int64_t b = 1000, e = 1500;
  const Tensors all = GenerateAll(w, 1, b, e);
  std::vector<float> k(all.k.size()), q(all.q.size()), v(all.v.size());
  w.Generate(1, b, e, nullptr, k.data(), nullptr);
  w.Generate(1, b, e, q.data(), nullptr, nullptr);
  w.Generate(1, b, e, nullptr, nullptr, v.data());
  EXPECT_TRUE(SameBytes(all.k, k));
  EXPECT_TRUE(SameBytes(all.q, q));
  EXPECT_TRUE(SameBytes(all.v, v));
  w.Generate(1, b, e, nullptr, nullptr, nullptr);     // nothing to do
  w.Generate(1, b, b, q.data(), k.data(), v.data());  // empty range
}

TEST(Workload, SeedsAndLayersDiffer) {
  const Geometry g = SmallGeometry();
  WorkloadOptions o = SmallOptions();
  const Workload a = MakeWorkload(g, o);
  o.seed = 2;
  const Workload b = MakeWorkload(g, o);
  const Tensors ta = GenerateAll(a, 0, 0, 512), tb = GenerateAll(b, 0, 0, 512);
  EXPECT_FALSE(SameBytes(ta.q, tb.q));
  EXPECT_FALSE(SameBytes(ta.k, tb.k));
  EXPECT_FALSE(SameBytes(ta.v, tb.v));
  size_t equal = 0;
  for (size_t i = 0; i < ta.k.size(); ++i) equal += ta.k[i] == tb.k[i];
  EXPECT_LT(equal, ta.k.size() / 100);
  const Tensors a1 = GenerateAll(a, 1, 0, 512);
  EXPECT_FALSE(SameBytes(ta.k, a1.k));
}

TEST(Workload, NoiseIsStandardised) {
  // Values of filler tokens are N(0, 1) per component.
  const Geometry g = SmallGeometry(1, 2, 2, 64);
  const Workload w = MakeWorkload(g, SmallOptions(8192));
  std::vector<float> v(static_cast<size_t>(3000) * g.token_elems());
  w.Generate(0, 100, 3100, nullptr, nullptr, v.data());  // filler only (the needle sits near 4096)
  double s = 0, ss = 0, s4 = 0;
  for (float x : v) {
    s += x;
    ss += double(x) * x;
    s4 += double(x) * x * x * x;
  }
  const double n = static_cast<double>(v.size()), mean = s / n, var = ss / n - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(var, 1.0, 0.02);
  EXPECT_NEAR(s4 / n, 2.7, 0.05);  // Irwin-Hall(4): kurtosis 3 - 1.2/4 = 2.7 (normal: 3)
}

// ---- layout of the context --------------------------------------------------------

TEST(Workload, NeedlePositionsFollowTheOptions) {
  const Geometry g = SmallGeometry();
  WorkloadOptions o = SmallOptions(10000);
  o.question_len = 100;
  o.sink_tokens = 4;
  o.needle_count = 3;
  o.needle_len = 5;
  o.needle_depth = 0.25;
  const Workload w = MakeWorkload(g, o);
  EXPECT_EQ(w.question_begin(), 9900);
  EXPECT_EQ(w.total_tokens(), 10008);
  const int64_t hay = 9900 - 4;
  std::vector<int64_t> expect_starts, expect_pos;
  for (int i = 0; i < 3; ++i) {
    const double frac = 0.25 + i * 0.75 / 3;
    expect_starts.push_back(4 + static_cast<int64_t>(std::floor(hay * frac)));
    for (int j = 0; j < 5; ++j) expect_pos.push_back(expect_starts.back() + j);
  }
  EXPECT_EQ(w.needle_starts(), expect_starts);
  EXPECT_EQ(w.needle_positions(), expect_pos);
  EXPECT_EQ(w.needle_starts()[0], 4 + 2474);
  EXPECT_TRUE(std::is_sorted(w.needle_positions().begin(), w.needle_positions().end()));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(w.NeedleAt(expect_starts[i]), i);
    EXPECT_EQ(w.NeedleAt(expect_starts[i] + 4), i);
    EXPECT_EQ(w.NeedleAt(expect_starts[i] + 5), -1);
    EXPECT_EQ(w.NeedleAt(expect_starts[i] - 1), -1);
  }
  EXPECT_EQ(w.SoughtNeedle(9899), -1);
  EXPECT_EQ(w.SoughtNeedle(9900), 0);
  EXPECT_EQ(w.SoughtNeedle(9901), 1);
  EXPECT_EQ(w.SoughtNeedle(9902), 2);
  EXPECT_EQ(w.SoughtNeedle(9903), 0);
  EXPECT_EQ(w.SoughtNeedle(10005), (10005 - 9900) % 3);

  o.needle_depth = 0.0;
  o.needle_count = 1;
  const Workload w0 = MakeWorkload(g, o);
  EXPECT_EQ(w0.needle_starts()[0], 4);  // right after the sinks
}

TEST(Workload, ValidateNamesTheBadField) {
  struct Case {
    const char* field;
    void (*mutate)(WorkloadOptions&);
  };
  const Case cases[] = {
      {"needle_depth", [](WorkloadOptions& o) { o.needle_depth = 1.0; }},
      {"needle_depth", [](WorkloadOptions& o) { o.needle_depth = -0.1; }},
      {"needle_depth", [](WorkloadOptions& o) { o.needle_depth = std::nan(""); }},
      {"context", [](WorkloadOptions& o) { o.context = o.question_len; }},
      {"context", [](WorkloadOptions& o) { o.context = 0; }},
      {"context",
       [](WorkloadOptions& o) {
         o.context = 40;
         o.question_len = 36;
         o.sink_tokens = 4;
       }},
      {"question_len", [](WorkloadOptions& o) { o.question_len = -1; }},
      {"decode_steps", [](WorkloadOptions& o) { o.decode_steps = -1; }},
      {"needle_count", [](WorkloadOptions& o) { o.needle_count = 0; }},
      {"needle_len", [](WorkloadOptions& o) { o.needle_len = 0; }},
      {"needle_len",
       [](WorkloadOptions& o) { o.needle_len = 5000; }},  // does not fit before the question window
      {"needle_len", [](WorkloadOptions& o) { o.needle_depth = 0.999; }},  // pushed into the question window
      {"needle_count",
       [](WorkloadOptions& o) {
         o.needle_count = 1000;
         o.needle_depth = 0.9;
       }},  // overlap
      {"anchor_strength", [](WorkloadOptions& o) { o.anchor_strength = -1; }},
      {"noise", [](WorkloadOptions& o) { o.noise = std::numeric_limits<float>::infinity(); }},
      {"sink_strength", [](WorkloadOptions& o) { o.sink_strength = -2; }},
      {"sink_query", [](WorkloadOptions& o) { o.sink_query = -2; }},
      {"sink_tokens", [](WorkloadOptions& o) { o.sink_tokens = -1; }},
      {"topic_strength", [](WorkloadOptions& o) { o.topic_strength = -1; }},
      {"topic_len", [](WorkloadOptions& o) { o.topic_len = 0; }},
      {"needle_value", [](WorkloadOptions& o) { o.needle_value = -1; }},
      {"signal_band", [](WorkloadOptions& o) { o.signal_band = 0; }},
      {"signal_band", [](WorkloadOptions& o) { o.signal_band = 1.5; }},
      {"rope_base", [](WorkloadOptions& o) { o.rope_base = 1.0; }},
      {"rope_scaling", [](WorkloadOptions& o) { o.rope_scaling = 0.5; }},
  };
  EXPECT_TRUE(WorkloadOptions{}.Validate().ok());
  EXPECT_TRUE(SmallOptions().Validate().ok());
  for (const Case& c : cases) {
    WorkloadOptions o = SmallOptions();
    c.mutate(o);
    const Status s = o.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(s.message().find(c.field), std::string::npos)
        << "expected '" << c.field << "' in: " << s.message();
    auto w = Workload::Create(SmallGeometry(), o);
    EXPECT_FALSE(w.ok()) << c.field;
  }
  Geometry odd = SmallGeometry();
  odd.head_dim = 33;
  auto w = Workload::Create(odd, SmallOptions());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("head_dim"), std::string::npos) << w.status().message();
  Geometry bad = SmallGeometry();
  bad.kv_heads = 3;
  EXPECT_FALSE(Workload::Create(bad, SmallOptions()).ok());
}

// ---- RoPE -------------------------------------------------------------------------

// Llama-3.1 scaled frequency of pair p, computed independently of the library.
double ScaledTheta(int p, int D, double base, double factor) {
  const double f = std::pow(base, -2.0 * p / D);
  const double wl = 2 * M_PI / f;
  if (wl < 8192.0 / 4) return f;
  if (wl > 8192.0) return f / factor;
  const double smooth = (8192.0 / wl - 1.0) / 3.0;
  return (1 - smooth) * f / factor + smooth * f;
}

TEST(Workload, RopeRotatesPairsByAbsolutePosition) {
  const Geometry g = SmallGeometry(1, 4, 2, 32);
  WorkloadOptions o = SmallOptions(70000);
  o.decode_steps = 4;
  const Workload rot = MakeWorkload(g, o);
  o.apply_rope = false;
  const Workload raw = MakeWorkload(g, o);
  const int D = g.head_dim, P = D / 2;
  for (int64_t pos : {int64_t{0}, int64_t{1}, int64_t{1023}, int64_t{1024}, int64_t{5555}, int64_t{69999},
                      int64_t{70003}}) {
    const Tensors a = GenerateAll(rot, 0, pos, pos + 1), b = GenerateAll(raw, 0, pos, pos + 1);
    EXPECT_TRUE(SameBytes(a.v, b.v));  // values are not rotated
    auto check = [&](const std::vector<float>& x, const std::vector<float>& y, int heads) {
      for (int h = 0; h < heads; ++h)
        for (int p = 0; p < P; ++p) {
          const float* xr = &x[h * D];
          const float* yr = &y[h * D];
          const double th = pos * ScaledTheta(p, D, o.rope_base, o.rope_scaling);
          const double ex = yr[p] * std::cos(th) - yr[p + P] * std::sin(th);
          const double ey = yr[p] * std::sin(th) + yr[p + P] * std::cos(th);
          const double norm = std::hypot(yr[p], yr[p + P]);
          EXPECT_NEAR(std::hypot(xr[p], xr[p + P]), norm, 1e-5 * (1 + norm))
              << "pos " << pos << " pair " << p;
          EXPECT_NEAR(xr[p], ex, 2e-5 * (1 + norm)) << "pos " << pos << " pair " << p;
          EXPECT_NEAR(xr[p + P], ey, 2e-5 * (1 + norm)) << "pos " << pos << " pair " << p;
        }
    };
    check(a.q, b.q, g.q_heads);
    check(a.k, b.k, g.kv_heads);
    if (pos == 0) {
      EXPECT_TRUE(SameBytes(a.q, b.q));
      EXPECT_TRUE(SameBytes(a.k, b.k));
    } else {
      EXPECT_FALSE(SameBytes(a.k, b.k));
    }
  }
}

// ---- attention structure (naive full softmax) ------------------------------------

struct AttentionStats {
  double needle_share = 0;  // seekers: mass on the sought needle's tokens
  double best_other_block =
      0;  // seekers: largest mass on any other needle_len-aligned block (sinks excluded)
  double seeker_sink_share = 0;
  double filler_sink_share = 0;
  double local_over_far = 0;  // filler: per-token mass within topic_len / per-token mass beyond 4*topic_len
  int seekers = 0, fillers = 0;
};

// Full causal softmax of sampled queries (every `seeker_stride`-th question /
// decode position, `fillers` filler positions) over all keys before them.
AttentionStats MeasureAttention(const Workload& w, int seeker_stride = 1, int fillers = 24) {
  const Geometry& g = w.geometry();
  const WorkloadOptions& o = w.options();
  const int D = g.head_dim, H = g.kv_heads, Hq = g.q_heads, G = g.group_size();
  const int64_t T = w.total_tokens();
  std::vector<float> K(static_cast<size_t>(T) * H * D), qrow(static_cast<size_t>(Hq) * D);
  std::vector<double> p(T);
  AttentionStats st;
  double local_per = 0, far_per = 0;
  std::vector<int64_t> positions;
  for (int64_t t = w.question_begin(); t < T; t += seeker_stride) positions.push_back(t);
  for (int i = 0; i < fillers; ++i) positions.push_back(1024 + (o.context - 2048) * i / fillers);
  for (int layer = 0; layer < g.layers; ++layer) {
    w.Generate(layer, 0, T, nullptr, K.data(), nullptr);
    for (int64_t pos : positions) {
      w.Generate(layer, pos, pos + 1, qrow.data(), nullptr, nullptr);
      const int sought = w.SoughtNeedle(pos);
      for (int qh = 0; qh < Hq; ++qh) {
        const int h = qh / G;
        const float* q = &qrow[static_cast<size_t>(qh) * D];
        double mx = -1e300;
        for (int64_t t = 0; t <= pos; ++t) {
          const float* k = &K[(static_cast<size_t>(t) * H + h) * D];
          double s = 0;
          for (int d = 0; d < D; ++d) s += double(q[d]) * k[d];
          p[t] = s / std::sqrt(double(D));
          mx = std::max(mx, p[t]);
        }
        double z = 0;
        for (int64_t t = 0; t <= pos; ++t) z += (p[t] = std::exp(p[t] - mx));
        for (int64_t t = 0; t <= pos; ++t) p[t] /= z;
        double sink = 0;
        for (int t = 0; t < o.sink_tokens; ++t) sink += p[t];
        if (sought >= 0) {
          const int64_t ns = w.needle_starts()[sought];
          double needle = 0;
          for (int j = 0; j < o.needle_len; ++j) needle += p[ns + j];
          // Largest mass on any other block of needle_len tokens (sliding, not overlapping the needle).
          double best = 0, run = 0;
          for (int64_t t = o.sink_tokens; t <= pos; ++t) {
            run += p[t];
            if (t - o.needle_len >= o.sink_tokens) run -= p[t - o.needle_len];
            const int64_t b = t - o.needle_len + 1;
            if (b >= o.sink_tokens && (t < ns || b >= ns + o.needle_len)) best = std::max(best, run);
          }
          st.needle_share += needle;
          st.best_other_block += best;
          st.seeker_sink_share += sink;
          ++st.seekers;
        } else {
          double local = 0, far = 0;
          int64_t nl = 0, nf = 0;
          for (int64_t t = std::max<int64_t>(o.sink_tokens, pos - o.topic_len); t <= pos; ++t, ++nl)
            local += p[t];
          for (int64_t t = o.sink_tokens; t < pos - 4 * o.topic_len; ++t, ++nf) far += p[t];
          st.filler_sink_share += sink;
          local_per += local / nl;
          far_per += nf ? far / nf : 0;
          ++st.fillers;
        }
      }
    }
  }
  st.needle_share /= st.seekers;
  st.best_other_block /= st.seekers;
  st.seeker_sink_share /= st.seekers;
  st.filler_sink_share /= st.fillers;
  st.local_over_far = local_per / far_per;
  return st;
}

TEST(Workload, AttentionStructureAt8K) {
  const Geometry g = SmallGeometry(2, 4, 2, 64);
  WorkloadOptions o;  // default knobs
  o.context = 8192;
  const Workload w = MakeWorkload(g, o);
  const AttentionStats st = MeasureAttention(w);
  std::printf(
      "[workload 8K, D=64, default knobs] seekers: needle share %.3f, best other %d-token block %.4f, "
      "sinks %.3f | filler queries: sinks %.3f, per-token local/far %.1f\n",
      st.needle_share, o.needle_len, st.best_other_block, st.seeker_sink_share, st.filler_sink_share,
      st.local_over_far);
  ::testing::Test::RecordProperty("needle_share_8k", std::to_string(st.needle_share));
  // The needle gets the largest share of the question/decode queries' mass ...
  EXPECT_GT(st.needle_share, 0.3);
  EXPECT_LT(st.needle_share, 0.95);  // ... but not all of it
  EXPECT_GT(st.needle_share, 5 * st.best_other_block);
  EXPECT_GT(st.needle_share, st.seeker_sink_share);
  // Sinks get a noticeable share of filler queries' mass.
  EXPECT_GT(st.filler_sink_share, 0.05);
  // Filler queries attend locally: a token within topic_len gets more mass than a far one.
  EXPECT_GT(st.local_over_far, 3.0);
}

// The headline figure: with default knobs at 128K context, how much of a
// question query's attention lands on its needle under full attention.
TEST(Workload, NeedleShareAt128K) {
  for (int head_dim : {64, 128}) {
    const Geometry g = SmallGeometry(1, 4, 2, head_dim);
    const WorkloadOptions o;  // defaults: 128K context, needle at depth 0.5
    const AttentionStats st = MeasureAttention(MakeWorkload(g, o), /*seeker_stride=*/8, /*fillers=*/4);
    std::printf(
        "[workload 128K, D=%d, default knobs] seekers: needle share %.3f, best other block %.4f, sinks %.3f "
        "| "
        "filler queries: sinks %.3f, per-token local/far %.1f\n",
        head_dim, st.needle_share, st.best_other_block, st.seeker_sink_share, st.filler_sink_share,
        st.local_over_far);
    ::testing::Test::RecordProperty("needle_share_128k_d" + std::to_string(head_dim),
                                    std::to_string(st.needle_share));
    EXPECT_GT(st.needle_share, 0.2) << "D=" << head_dim;
    EXPECT_LT(st.needle_share, 0.6) << "D=" << head_dim;
    EXPECT_GT(st.needle_share, 5 * st.best_other_block) << "D=" << head_dim;
    EXPECT_GT(st.filler_sink_share, 0.03) << "D=" << head_dim;
    EXPECT_GT(st.local_over_far, 3.0) << "D=" << head_dim;
  }
}

TEST(Workload, NoAnchorNoNeedle) {
  const Geometry g = SmallGeometry(1, 4, 2, 64);
  WorkloadOptions o;
  o.context = 8192;
  o.anchor_strength = 0;  // no signal: the needle is just noise
  const AttentionStats st = MeasureAttention(MakeWorkload(g, o));
  std::printf("[workload 8K, anchor_strength 0] needle share %.4f\n", st.needle_share);
  EXPECT_LT(st.needle_share, 0.02);
}

TEST(Workload, NeedleValuesCarryTheirDirection) {
  const Geometry g = SmallGeometry(1, 2, 2, 64);
  WorkloadOptions o = SmallOptions(4096);
  o.needle_count = 2;
  const Workload w = MakeWorkload(g, o);
  const int64_t s0 = w.needle_starts()[0], s1 = w.needle_starts()[1];
  std::vector<float> v0(o.needle_len * g.token_elems()), v1(v0.size());
  w.Generate(0, s0, s0 + o.needle_len, nullptr, nullptr, v0.data());
  w.Generate(0, s1, s1 + o.needle_len, nullptr, nullptr, v1.data());
  // Mean over the needle's tokens: the shared direction (norm ~ sqrt(D)) dominates the noise (~sqrt(D/len)).
  for (int h = 0; h < g.kv_heads; ++h) {
    std::vector<double> m0(g.head_dim), m1(g.head_dim);
    for (int j = 0; j < o.needle_len; ++j)
      for (int d = 0; d < g.head_dim; ++d) {
        m0[d] += v0[(j * g.kv_heads + h) * g.head_dim + d] / o.needle_len;
        m1[d] += v1[(j * g.kv_heads + h) * g.head_dim + d] / o.needle_len;
      }
    double n0 = 0, n1 = 0, dot = 0;
    for (int d = 0; d < g.head_dim; ++d) {
      n0 += m0[d] * m0[d];
      n1 += m1[d] * m1[d];
      dot += m0[d] * m1[d];
    }
    EXPECT_GT(std::sqrt(n0), 0.8 * std::sqrt(double(g.head_dim)));
    EXPECT_LT(std::abs(dot) / std::sqrt(n0 * n1), 0.5);  // distinct needles, distinct directions
  }
}

// ---- JSON writer -------------------------------------------------------------------

TEST(JsonWriter, CompactNesting) {
  JsonWriter w;
  w.BeginObject();
  w.Key("quality").BeginObject().Key("needle_hit_rate").Double(0.93).Key("n").Int(-7).EndObject();
  w.Key("list")
      .BeginArray()
      .Int(1)
      .String("a")
      .Bool(true)
      .Bool(false)
      .Null()
      .BeginArray()
      .EndArray()
      .BeginObject()
      .EndObject()
      .EndArray();
  w.Key("u").Uint(18446744073709551615ull);
  w.EndObject();
  EXPECT_TRUE(w.complete());
  EXPECT_EQ(w.str(), R"({"quality":{"needle_hit_rate":0.93,"n":-7},"list":[1,"a",true,false,null,[],{}],)"
                     R"("u":18446744073709551615})");
}

TEST(JsonWriter, Pretty) {
  JsonWriter w(/*pretty=*/true, 2);
  w.BeginObject()
      .Key("a")
      .Int(1)
      .Key("b")
      .BeginArray()
      .Int(2)
      .Int(3)
      .EndArray()
      .Key("c")
      .BeginObject()
      .EndObject()
      .EndObject();
  EXPECT_EQ(w.str(), "{\n  \"a\": 1,\n  \"b\": [\n    2,\n    3\n  ],\n  \"c\": {}\n}");
  EXPECT_TRUE(w.complete());
}

TEST(JsonWriter, Escaping) {
  EXPECT_EQ(JsonWriter::Quote("plain"), "\"plain\"");
  EXPECT_EQ(JsonWriter::Quote("q\"b\\s/"), "\"q\\\"b\\\\s/\"");
  EXPECT_EQ(JsonWriter::Quote("\n\r\t\b\f"), "\"\\n\\r\\t\\b\\f\"");
  // DEL (0x7f) needs no escape in JSON, and nlohmann writes it as it is.
  EXPECT_EQ(JsonWriter::Quote(std::string("\x01\x1f\x7f", 3)), "\"\\u0001\\u001f\x7f\"");
  EXPECT_EQ(JsonWriter::Quote(std::string("a\0b", 3)), "\"a\\u0000b\"");
  EXPECT_EQ(JsonWriter::Quote("h\xC3\xA9llo \xE2\x88\x9E"),
            "\"h\xC3\xA9llo \xE2\x88\x9E\"");                    // UTF-8 passes through
  EXPECT_EQ(JsonWriter::Quote("a\xFFz"), "\"a\xEF\xBF\xBDz\"");  // invalid UTF-8: U+FFFD, not an exception
  JsonWriter w;
  w.BeginObject().Key("k\"ey").String("v\nal").EndObject();
  EXPECT_EQ(w.str(), R"({"k\"ey":"v\nal"})");
}

TEST(JsonWriter, Numbers) {
  auto one = [](auto fn) {
    JsonWriter w;
    fn(w);
    return w.str();
  };
  EXPECT_EQ(one([](JsonWriter& w) { w.Int(std::numeric_limits<int64_t>::min()); }), "-9223372036854775808");
  EXPECT_EQ(one([](JsonWriter& w) { w.Int(std::numeric_limits<int64_t>::max()); }), "9223372036854775807");
  EXPECT_EQ(one([](JsonWriter& w) { w.Double(0.1); }), "0.1");
  EXPECT_EQ(one([](JsonWriter& w) { w.Double(1.0); }), "1");
  EXPECT_EQ(one([](JsonWriter& w) { w.Double(-2.5); }), "-2.5");
  EXPECT_EQ(one([](JsonWriter& w) { w.Double(std::nan("")); }), "null");
  EXPECT_EQ(one([](JsonWriter& w) { w.Double(std::numeric_limits<double>::infinity()); }), "null");
  for (double x : {1.0 / 3.0, 2.0 / 3.0 * 1e-300, 1.7976931348623157e308, 123456789.123456789, 5e-324}) {
    const std::string s = one([&](JsonWriter& w) { w.Double(x); });
    EXPECT_EQ(std::strtod(s.c_str(), nullptr), x) << s;  // round-trips
  }
}

TEST(JsonWriter, MisuseIsFlagged) {
  {
    JsonWriter w;
    w.BeginObject().Int(1);  // value without a key
    EXPECT_FALSE(w.ok());
  }
  {
    JsonWriter w;
    w.BeginArray().Key("x");  // key in an array
    EXPECT_FALSE(w.ok());
  }
  {
    JsonWriter w;
    w.BeginArray().EndObject();  // mismatched close
    EXPECT_FALSE(w.ok());
  }
  {
    JsonWriter w;
    w.Int(1).Int(2);  // two top-level values
    EXPECT_FALSE(w.ok());
  }
  {
    JsonWriter w;
    w.BeginObject().Key("a");
    EXPECT_TRUE(w.ok());
    EXPECT_FALSE(w.complete());
    w.EndObject();  // key without value
    EXPECT_FALSE(w.ok());
  }
}

// ---- sysinfo -----------------------------------------------------------------------

TEST(SysInfo, PeakRssFollowsMappedMemory) {
  KVTIER_SKIP_UNDER_SANITIZER(
      "RSS includes the sanitizer's shadow memory and allocator quarantine, which "
      "grow on their own between two readings");
  const uint64_t cur = CurrentRssBytes(), peak = PeakRssBytes();
  EXPECT_GT(cur, 0u);
  EXPECT_GE(peak, cur);
  // Touch 64 MiB (mmap'd directly, so unmapping surely returns it): the peak follows.
  {
    const size_t size = size_t{64} << 20;
    void* mem = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(mem, MAP_FAILED);
    char* big = static_cast<char*>(mem);
    for (size_t i = 0; i < size; i += 4096) big[i] = static_cast<char>(i | 1);
    EXPECT_GE(PeakRssBytes(), cur + (48u << 20));
    EXPECT_GE(CurrentRssBytes(), cur + (48u << 20));
    munmap(mem, size);
  }
  if (ResetPeakRss()) {
    EXPECT_LT(PeakRssBytes(), cur + (48u << 20));  // the unmapped 64 MiB no longer counts
  } else {
    std::printf("ResetPeakRss not permitted here; skipped that check\n");
  }
  EXPECT_GE(PeakRssBytes(), CurrentRssBytes());
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

TEST(Workload, QuestionAnchorEveryKeepsOnlySomeSeekers) {
  const Geometry g{1, 2, 1, 16, DType::kF32};
  WorkloadOptions o;
  o.context = 4096;
  o.question_len = 16;
  o.decode_steps = 4;
  o.needle_count = 2;
  o.question_anchor_every = 4;
  auto w = Workload::Create(g, o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const int64_t qb = w->question_begin();
  std::vector<int> sought;
  for (int64_t p = qb; p < o.context; ++p) sought.push_back(w->SoughtNeedle(p));
  EXPECT_EQ(sought, (std::vector<int>{0, -1, -1, -1, 1, -1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1}));
  // Decode steps always seek.
  for (int64_t p = o.context; p < w->total_tokens(); ++p) EXPECT_GE(w->SoughtNeedle(p), 0);
  o.question_anchor_every = 0;
  EXPECT_FALSE(Workload::Create(g, o).ok());
}

}  // namespace
}  // namespace kvtier
