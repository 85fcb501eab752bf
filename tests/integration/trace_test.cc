// Traces of real attention (integration/kv_trace.h, integration/model/trace_capture.h,
// integration/kv_source.h): the file format and its corruption errors, the capture
// against the model's own computation and its store, and replays through RunJob and
// the policy comparison.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "integration/kv_source.h"
#include "integration/kv_trace.h"
#include "integration/model/llama.h"
#include "integration/model/trace_capture.h"
#include "integration/policy_eval.h"
#include "integration/run_job.h"
#include "store/checksum.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

std::string SourceDir() { return KVTIER_SOURCE_DIR; }

// A small valid trace with random q/k/v.
KvTrace RandomTrace() {
  KvTrace t;
  t.layers = 2;
  t.q_heads = 4;
  t.kv_heads = 2;
  t.head_dim = 8;
  t.context = 40;
  t.question_begin = 32;
  t.needles = {{10, 14}, {20, 22}};
  for (int i = 0; i < 45; ++i) t.tokens.push_back(i * 7 % 256);
  t.source = "unit test";
  t.answer = "12345";
  std::mt19937 rng(7);
  std::normal_distribution<float> n;
  for (int l = 0; l < t.layers; ++l) {
    t.q.emplace_back(45 * 4 * 8);
    t.k.emplace_back(45 * 2 * 8);
    t.v.emplace_back(45 * 2 * 8);
    for (auto* a : {&t.q[l], &t.k[l], &t.v[l]})
      for (float& x : *a) x = n(rng);
  }
  return t;
}

void ExpectSame(const KvTrace& a, const KvTrace& b) {
  EXPECT_EQ(a.geometry(), b.geometry());
  EXPECT_EQ(a.context, b.context);
  EXPECT_EQ(a.question_begin, b.question_begin);
  EXPECT_EQ(a.needles, b.needles);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.source, b.source);
  EXPECT_EQ(a.answer, b.answer);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
}

TEST(KvTraceFile, RoundTrip) {
  TempDir dir;
  const KvTrace t = RandomTrace();
  const std::string path = dir.path() + "/t.kvtrace";
  ASSERT_TRUE(WriteKvTrace(path, t).ok());
  auto back = ReadKvTrace(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSame(t, *back);
  EXPECT_EQ(back->decode_steps(), 5);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(KvTraceFile, EveryCorruptionIsNamed) {
  auto bytes = EncodeKvTrace(RandomTrace());
  ASSERT_TRUE(bytes.ok());
  const std::string good = *bytes;
  auto expect_error = [](const std::string& file, const std::string& what) {
    auto r = DecodeKvTrace(file, "x");
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().ToString();
  };
  std::string s = good;
  s[good.size() / 2] ^= 0x10;  // a q/k/v byte
  expect_error(s, "CRC mismatch");
  s = good;
  s[100] ^= 0x01;  // a token
  expect_error(s, "CRC mismatch");
  expect_error(good.substr(0, good.size() - 100), "truncated");
  expect_error(good.substr(0, 20), "truncated");
  expect_error("", "truncated");
  expect_error(good + "xx", "trailing bytes");
  s = good;
  s[0] = 'X';
  expect_error(s, "bad magic");
  s = good;
  s[8] = 2;  // version
  expect_error(s, "unsupported version 2");
  // A header whose shape does not account for the bytes, with a CRC that matches it
  // (a writer bug, not damage).
  s = good;
  const uint32_t layers = 3;
  std::memcpy(s.data() + 24, &layers, 4);
  const uint32_t crc = Crc32c(s.data(), s.size() - 4);
  std::memcpy(s.data() + s.size() - 4, &crc, 4);
  expect_error(s, "geometry mismatch");

  auto missing = ReadKvTrace("/nonexistent/dir/t.kvtrace");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  KvTrace bad = RandomTrace();
  bad.needles.clear();
  EXPECT_EQ(EncodeKvTrace(bad).status().code(), StatusCode::kInvalidArgument);
  bad = RandomTrace();
  bad.needles = {{38, 44}};  // past the prompt
  EXPECT_NE(bad.Validate().message().find("needle range"), std::string::npos);
  bad = RandomTrace();
  bad.k[1].pop_back();
  EXPECT_NE(bad.Validate().message().find("layer 1"), std::string::npos);
}

// A well-formed file of zero tokens (and zero needles, empty texts): every array the reader
// fills is empty, so its data() is null. Reading it must not hand that null to memcpy
// (undefined behaviour even for 0 bytes; the UBSan suite fails on it), and the trace is
// then refused for what it is: no prompt, no question, no decode step.
TEST(KvTraceFile, ZeroTokensIsRefusedWithoutUndefinedBehaviour) {
  std::string s = "KVTTRACE";
  auto u32 = [&s](uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [&s](uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); };
  u32(KvTrace::kVersion);
  u32(0);
  u64(0);  // file_bytes, patched below
  for (uint32_t d : {1u, 1u, 1u, 4u}) u32(d);
  u64(0);  // n_tokens
  u64(0);  // context
  u64(0);  // question_begin
  u32(0);  // n_needles
  u32(0);  // source: 0 bytes
  u32(0);  // answer: 0 bytes
  const uint64_t total = s.size() + 4;
  std::memcpy(s.data() + 16, &total, 8);
  const uint32_t crc = Crc32c(s.data(), s.size());
  s.append(reinterpret_cast<const char*>(&crc), 4);
  auto r = DecodeKvTrace(s, "empty");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  EXPECT_NE(r.status().message().find("n_tokens (0)"), std::string::npos) << r.status().ToString();
}

TEST(KvSource, TraceServesItsSlicesAndSyntheticEqualsWorkload) {
  auto t = std::make_shared<const KvTrace>(RandomTrace());
  Geometry g{8, 8, 2, 64, DType::kF16};
  WorkloadOptions w;
  AdoptTrace(*t, &g, &w);
  EXPECT_EQ(g, (Geometry{2, 4, 2, 8, DType::kF16}));
  EXPECT_EQ(w.context, 40);
  EXPECT_EQ(w.question_len, 8);
  EXPECT_EQ(w.decode_steps, 5);
  auto src = MakeKvSource(g, w, t);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  std::vector<float> q(3 * 32), k(3 * 16), v(3 * 16);
  (*src)->Generate(1, 41, 44, q.data(), k.data(), v.data());
  EXPECT_TRUE(std::equal(q.begin(), q.end(), t->q[1].begin() + 41 * 32));
  EXPECT_TRUE(std::equal(k.begin(), k.end(), t->k[1].begin() + 41 * 16));
  EXPECT_TRUE(std::equal(v.begin(), v.end(), t->v[1].begin() + 41 * 16));
  EXPECT_TRUE((*src)->SoughtNeedles(31).empty());
  EXPECT_EQ((*src)->SoughtNeedles(32), t->needles);
  EXPECT_EQ((*src)->SoughtNeedles(44), t->needles);
  // Not adopted: named mismatches.
  Geometry other{3, 4, 2, 8, DType::kF16};
  EXPECT_NE(MakeKvSource(other, w, t).status().message().find("geometry mismatch"), std::string::npos);
  WorkloadOptions w2 = w;
  w2.decode_steps = 4;
  EXPECT_NE(MakeKvSource(g, w2, t).status().message().find("context mismatch"), std::string::npos);

  Geometry sg{2, 4, 2, 16, DType::kF16};
  WorkloadOptions sw;
  sw.context = 2048;
  sw.decode_steps = 2;
  auto syn = MakeKvSource(sg, sw, nullptr);
  ASSERT_TRUE(syn.ok());
  auto work = Workload::Create(sg, sw);
  ASSERT_TRUE(work.ok());
  std::vector<float> a(4 * 64), b(4 * 64);
  (*syn)->Generate(1, 2046, 2050, a.data(), nullptr, nullptr);
  work->Generate(1, 2046, 2050, b.data(), nullptr, nullptr);
  EXPECT_EQ(a, b);
  ASSERT_EQ((*syn)->SoughtNeedles(2049).size(), 1u);
  EXPECT_EQ((*syn)->SoughtNeedles(2049)[0].begin, work->needle_starts()[0]);
  EXPECT_EQ((*syn)->SoughtNeedles(2049)[0].end - (*syn)->SoughtNeedles(2049)[0].begin, sw.needle_len);
}

// The capture hook against the model: it changes no bit of the forward pass, what it
// sees is what the store holds, and layer 0's q/k/v equal a direct computation from the
// weights.
class TraceCaptureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = model::LlamaModel::Load(SourceDir() + "/tests/fixtures/tiny_llama.safetensors");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
    for (int i = 0; i < 150; ++i) tokens_.push_back((i * 37 + 11) % 256);
  }
  StoreOptions Store() const {
    StoreOptions o;
    o.geometry = model_->config().KvGeometry(DType::kF32);
    o.n_sink = 8;
    o.n_local = 32;
    o.chunk_size = 16;
    o.repr_topk = 2;
    o.hot_bytes = 64 * o.chunk_bytes();
    o.warm_bytes = 64 * o.chunk_bytes();
    o.transfer_threads = 1;
    return o;
  }
  std::unique_ptr<model::LlamaModel> model_;
  std::vector<int32_t> tokens_;
};

TEST_F(TraceCaptureTest, CaptureSeesWhatTheModelComputesAndStores) {
  const model::LlamaConfig& c = model_->config();
  const int hd = c.head_dim(), qt = c.q_heads * hd, kt = c.kv_heads * hd;
  const size_t n = tokens_.size();
  std::vector<std::vector<float>> q(c.n_layers, std::vector<float>(n * qt)),
      k(c.n_layers, std::vector<float>(n * kt)), v = k;
  int calls = 0;
  auto with = model::LlamaSession::Create(model_.get(), Store());
  auto without = model::LlamaSession::Create(model_.get(), Store());
  ASSERT_TRUE(with.ok() && without.ok());
  (*with)->SetQkvCapture([&](int l, int64_t first, int m, const float* qp, const float* kp, const float* vp) {
    ++calls;
    std::copy(qp, qp + m * qt, q[l].begin() + first * qt);
    std::copy(kp, kp + m * kt, k[l].begin() + first * kt);
    std::copy(vp, vp + m * kt, v[l].begin() + first * kt);
  });
  auto la = (*with)->Prefill(tokens_, 32);
  auto lb = (*without)->Prefill(tokens_, 32);
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_EQ(*la, *lb) << "the capture must not change a bit of the logits";
  EXPECT_EQ(calls, c.n_layers * 5);  // 150 tokens in windows of 32

  // What the (fp32) store holds, from every tier, is exactly what was captured.
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<float> sk(n * kt), sv(n * kt);
    ASSERT_TRUE((*with)
                    ->store()
                    ->ReadTokens((*with)->sequence(), l, 0, static_cast<int64_t>(n), sk.data(), sv.data())
                    .ok());
    EXPECT_EQ(sk, k[l]) << "layer " << l;
    EXPECT_EQ(sv, v[l]) << "layer " << l;
  }

  // Layer 0 from the weights, in double: RMSNorm(embed) -> wq/wk/wv -> rotate-half RoPE.
  const model::LlamaLayer& L0 = model_->layers()[0];
  double worst = 0;
  for (size_t t = 0; t < n; t += 7) {
    const float* x = model_->embed().data() + static_cast<size_t>(tokens_[t]) * c.d_model;
    double ss = 0;
    for (int i = 0; i < c.d_model; ++i) ss += static_cast<double>(x[i]) * x[i];
    const double r = 1.0 / std::sqrt(ss / c.d_model + c.norm_eps);
    std::vector<double> h(c.d_model);
    for (int i = 0; i < c.d_model; ++i) h[i] = x[i] * r * L0.attn_norm[i];
    auto project = [&](const std::vector<float>& w, int rows, bool rope) {
      std::vector<double> y(rows, 0.0);
      for (int o = 0; o < rows; ++o)
        for (int i = 0; i < c.d_model; ++i) y[o] += w[static_cast<size_t>(o) * c.d_model + i] * h[i];
      if (rope)
        for (int head = 0; head < rows / hd; ++head)
          for (int i = 0; i < hd / 2; ++i) {
            const double a = static_cast<double>(t) / std::pow(c.rope_theta, 2.0 * i / hd);
            double& x1 = y[head * hd + i];
            double& x2 = y[head * hd + i + hd / 2];
            const double r1 = x1 * std::cos(a) - x2 * std::sin(a), r2 = x2 * std::cos(a) + x1 * std::sin(a);
            x1 = r1;
            x2 = r2;
          }
      return y;
    };
    const std::vector<double> eq = project(L0.wq, qt, true), ek = project(L0.wk, kt, true),
                              ev = project(L0.wv, kt, false);
    for (int i = 0; i < qt; ++i) worst = std::max(worst, std::fabs(eq[i] - q[0][t * qt + i]));
    for (int i = 0; i < kt; ++i) {
      worst = std::max(worst, std::fabs(ek[i] - k[0][t * kt + i]));
      worst = std::max(worst, std::fabs(ev[i] - v[0][t * kt + i]));
    }
  }
  EXPECT_LT(worst, 1e-4);
}

TEST_F(TraceCaptureTest, InfLLMModeCapturesKeysAtTheirTruePositions) {
  // While nothing is sealed InfLLM equals absolute positions, so the captures must agree
  // although the InfLLM store holds keys before RoPE.
  std::vector<int32_t> few(tokens_.begin(), tokens_.begin() + 30);
  std::vector<float> ka, ki;
  for (auto mode : {model::PositionMode::kAbsolute, model::PositionMode::kInfLLM}) {
    auto s = model::LlamaSession::Create(model_.get(), Store(), mode);
    ASSERT_TRUE(s.ok());
    std::vector<float>& dst = mode == model::PositionMode::kAbsolute ? ka : ki;
    (*s)->SetQkvCapture([&](int l, int64_t, int m, const float*, const float* kp, const float*) {
      if (l == 1) dst.insert(dst.end(), kp, kp + m * model_->config().kv_heads * model_->config().head_dim());
    });
    ASSERT_TRUE((*s)->Prefill(few, 30).ok());
  }
  ASSERT_EQ(ka.size(), ki.size());
  for (size_t i = 0; i < ka.size(); ++i) ASSERT_NEAR(ka[i], ki[i], 1e-5) << i;
}

// The trained model on a passkey prompt at its training length: the trace marks the
// question line, the answer's copy, and the model's greedy output.
TEST(TraceCapture, PasskeyTraceOfTheTrainedModel) {
  auto m = model::LlamaModel::Load(SourceDir() + "/models/kvtier-tiny.safetensors");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  model::TraceCaptureOptions o;
  o.context = 512;
  o.seed = 3;
  auto t = model::CaptureKvTrace(**m, o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(t->Validate().ok());
  EXPECT_LE(t->context + static_cast<int64_t>(t->answer.size()), 512);  // whole filler lines up to 512 bytes
  EXPECT_GT(t->context, 400);
  EXPECT_EQ(t->decode_steps(), 5);
  std::string prompt;
  for (int64_t i = 0; i < t->context; ++i) prompt.push_back(static_cast<char>(t->tokens[i]));
  EXPECT_EQ(prompt.substr(t->question_begin), "What is the pass key? The pass key is ");
  ASSERT_EQ(t->needles.size(), 1u);
  EXPECT_EQ(prompt.substr(t->needles[0].begin, t->needles[0].end - t->needles[0].begin), t->answer);
  std::string output;
  for (int64_t i = t->context; i < t->n_tokens(); ++i) output.push_back(static_cast<char>(t->tokens[i]));
  EXPECT_EQ(output, t->answer) << t->source;
  EXPECT_NE(t->source.find("(correct)"), std::string::npos) << t->source;
  o.task = "nope";
  EXPECT_EQ(model::CaptureKvTrace(**m, o).status().code(), StatusCode::kInvalidArgument);
}

// A replay of a real trace through RunJob: with every chunk in the budget it is full
// attention (recall 1, error ~0, every needle hit); the policy comparison runs on it too.
TEST(TraceReplay, FullBudgetEqualsFullAttentionAndPoliciesRun) {
  auto m = model::LlamaModel::Load(SourceDir() + "/models/kvtier-tiny.safetensors");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  model::TraceCaptureOptions co;
  co.context = 1024;
  auto t = model::CaptureKvTrace(**m, co);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto trace = std::make_shared<const KvTrace>(std::move(*t));

  TempDir dir;
  RunOptions o;
  o.trace = trace;
  o.store.geometry = Geometry{8, 8, 2, 64, DType::kF32};  // the shape is the trace's; the dtype is kept
  o.store.n_sink = 16;
  o.store.n_local = 128;
  o.store.chunk_size = 32;
  o.store.warm_bytes = 64ull << 20;
  o.store.hot_bytes = 16ull << 20;
  o.store.data_dir = dir.path() + "/data";
  o.budget = 1024;
  o.window = 128;
  o.spearman_windows = 2;
  o.progress = false;
  auto rep = RunJob(o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_EQ(rep->options.workload.context, trace->context);
  EXPECT_EQ(rep->options.store.geometry, (Geometry{4, 8, 2, 16, DType::kF32}));
  EXPECT_EQ(rep->step_ms_all.size(), static_cast<size_t>(trace->decode_steps()));
  EXPECT_DOUBLE_EQ(rep->needle_hit_rate, 1.0);
  EXPECT_DOUBLE_EQ(rep->question_needle_hit_rate, 1.0);
  EXPECT_NEAR(rep->attention_recall, 1.0, 1e-6);
  EXPECT_LT(rep->output_rel_error, 1e-5);
  EXPECT_LT(rep->question_output_rel_error, 1e-5);
  EXPECT_EQ(rep->spearman_act.samples, 2 * 4);
  EXPECT_NE(rep->ToTable().find("trace: kvtier-llama"), std::string::npos) << rep->ToTable();
  EXPECT_NE(rep->ToJson().find("\"source\": \"trace\""), std::string::npos);

  PolicyEvalOptions po;
  po.trace = trace;
  po.policies = {"h2o", "streaming"};
  po.budget = 256;
  po.sink_tokens = 16;
  po.local_tokens = 64;
  auto rows = EvaluatePolicies(po);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  ASSERT_EQ(rows->size(), 2u);
  for (const PolicyEvalRow& r : *rows) {
    EXPECT_GE(r.needle_retention, 0.0);
    EXPECT_LE(r.needle_retention, 1.0);
    EXPECT_GT(r.attention_recall, 0.0);
    EXPECT_LE(r.attention_recall, 1.0 + 1e-9);
  }
}

}  // namespace
}  // namespace kvtier
