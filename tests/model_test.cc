// The kvtier-llama forward pass (integration/model) against the Python
// reference (models/model.py): tests/fixtures holds a seeded random tiny model
// and the logits the reference computed for a fixed prompt; regenerate them with
//   /usr/bin/python3 models/make_fixture.py --out-dir tests/fixtures
//
// Error metric: for every token, max |c++ - python| over the 256 logits divided
// by max |python| of that row (the worst row is reported).
#include "integration/model/llama.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "test_util.h"

namespace kvtier::model {
namespace {

std::string FixtureDir() {
#ifdef KVTIER_SOURCE_DIR
  return std::string(KVTIER_SOURCE_DIR) + "/tests/fixtures";
#else
  return (std::filesystem::path(__FILE__).parent_path() / "fixtures").string();
#endif
}

struct Reference {
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // [n, 256]
};

// tiny_llama_logits.bin: int32 n, int32 tokens[n], float32 logits[n][256], little-endian.
Reference LoadReference() {
  Reference r;
  std::ifstream in(FixtureDir() + "/tiny_llama_logits.bin", std::ios::binary);
  int32_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 4);
  if (!in || n <= 0 || n > 4096) return r;
  r.tokens.resize(n);
  r.logits.resize(static_cast<size_t>(n) * 256);
  in.read(reinterpret_cast<char*>(r.tokens.data()), 4 * static_cast<std::streamsize>(n));
  in.read(reinterpret_cast<char*>(r.logits.data()), 4 * static_cast<std::streamsize>(r.logits.size()));
  if (!in) r.tokens.clear();
  return r;
}

// Worst row of max|a - b| / max|b| over rows [row0, row0 + rows) of b; a holds `rows` rows.
double RowRelError(const float* a, const float* b, int rows, int vocab = 256) {
  double worst = 0;
  for (int r = 0; r < rows; ++r) {
    double diff = 0, scale = 0;
    for (int i = 0; i < vocab; ++i) {
      diff = std::max(diff, std::fabs(static_cast<double>(a[r * vocab + i]) - b[r * vocab + i]));
      scale = std::max(scale, std::fabs(static_cast<double>(b[r * vocab + i])));
    }
    worst = std::max(worst, diff / std::max(scale, 1e-30));
  }
  return worst;
}

std::string Sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", v);
  return buf;
}

StoreOptions Options(DType dtype, int n_sink, int n_local, int chunk_size) {
  StoreOptions o;
  o.n_sink = n_sink;
  o.n_local = n_local;
  o.chunk_size = chunk_size;
  o.repr_topk = 1;
  o.geometry = LlamaConfig{256, 64, 2, 4, 2, 128}.KvGeometry(dtype);  // the fixture's; sizes the chunk pools
  o.hot_bytes = 64 * o.chunk_bytes();
  o.warm_bytes = 64 * o.chunk_bytes();
  o.transfer_threads = 1;
  return o;
}

class LlamaModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = LoadReference();
    ASSERT_FALSE(ref_.tokens.empty()) << "cannot read " << FixtureDir() << "/tiny_llama_logits.bin";
    auto m = LlamaModel::Load(FixtureDir() + "/tiny_llama.safetensors");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
  }
  int n() const { return static_cast<int>(ref_.tokens.size()); }

  std::unique_ptr<LlamaSession> Session(const LlamaModel* model, const StoreOptions& o) {
    auto s = LlamaSession::Create(model, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }

  Reference ref_;
  std::unique_ptr<LlamaModel> model_;
};

TEST_F(LlamaModelTest, ConfigFromMetadata) {
  const LlamaConfig& c = model_->config();
  EXPECT_EQ(c.vocab, 256);
  EXPECT_EQ(c.d_model, 64);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.q_heads, 4);
  EXPECT_EQ(c.kv_heads, 2);
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_EQ(c.ffn_hidden, 128);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
}

// (1) fp32 weights, fp32 KV, one prefill window: the Python logits within 1e-4.
TEST_F(LlamaModelTest, Fp32MatchesPythonLogits) {
  auto s = Session(model_.get(), Options(DType::kF32, 4, 64, 8));
  ASSERT_NE(s, nullptr);
  auto logits = s->Prefill(ref_.tokens, n());
  ASSERT_TRUE(logits.ok()) << logits.status().ToString();
  const double err = RowRelError(logits->data(), ref_.logits.data(), n());
  RecordProperty("rel_error", Sci(err));
  EXPECT_LE(err, 1e-4) << "worst row relative error " << err;
  EXPECT_EQ(s->position(), n());
}

// (2) fp16 weights and fp16 KV against the fp32 reference: rounding every weight
// and key/value to fp16 (relative step 2^-11) moves the logits by ~1e-3 of their scale.
TEST_F(LlamaModelTest, Fp16MatchesPythonLogitsLoosely) {
  auto m = LlamaModel::Load(FixtureDir() + "/tiny_llama_f16.safetensors");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto s = Session(m->get(), Options(DType::kF16, 4, 64, 8));
  ASSERT_NE(s, nullptr);
  auto logits = s->Prefill(ref_.tokens, 16);
  ASSERT_TRUE(logits.ok()) << logits.status().ToString();
  const double err = RowRelError(logits->data(), ref_.logits.data(), n());
  RecordProperty("rel_error", Sci(err));
  EXPECT_LE(err, 1e-2) << "worst row relative error " << err;
}

// (3) Windows of 8 give the logits of one window: the same keys, a different grouping of queries.
TEST_F(LlamaModelTest, WindowedPrefillEqualsOneWindow) {
  auto one = Session(model_.get(), Options(DType::kF32, 4, 64, 8));
  auto win = Session(model_.get(), Options(DType::kF32, 4, 64, 8));
  ASSERT_TRUE(one && win);
  auto a = one->Prefill(ref_.tokens, n());
  auto b = win->Prefill(ref_.tokens, 8);
  ASSERT_TRUE(a.ok() && b.ok());
  const double err = RowRelError(b->data(), a->data(), n());
  RecordProperty("rel_error", Sci(err));
  EXPECT_LE(err, 1e-6) << "worst row relative error " << err;
}

// (4) Decoding token by token after a prefix gives the logits of prefilling everything.
TEST_F(LlamaModelTest, DecodeEqualsPrefill) {
  auto full = Session(model_.get(), Options(DType::kF32, 4, 64, 8));
  auto dec = Session(model_.get(), Options(DType::kF32, 4, 64, 8));
  ASSERT_TRUE(full && dec);
  auto all = full->Prefill(ref_.tokens, n());
  ASSERT_TRUE(all.ok());
  const int prefix = 20;
  auto pre = dec->Prefill(std::vector<int32_t>(ref_.tokens.begin(), ref_.tokens.begin() + prefix), 8);
  ASSERT_TRUE(pre.ok());
  double worst = RowRelError(pre->data(), all->data(), prefix);
  for (int t = prefix; t < n(); ++t) {
    auto l = dec->Decode(ref_.tokens[t]);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    worst = std::max(worst, RowRelError(l->data(), all->data() + static_cast<size_t>(t) * 256, 1));
    EXPECT_EQ(LlamaSession::Argmax(*l), LlamaSession::Argmax(std::vector<float>(
                                            all->begin() + t * 256, all->begin() + (t + 1) * 256)));
  }
  RecordProperty("rel_error", Sci(worst));
  EXPECT_LE(worst, 1e-5) << "worst row relative error " << worst;
  EXPECT_EQ(dec->position(), n());
}

// (5) A sequence much longer than sinks + local window: most keys live in sealed
// chunks, which the default selector fetches, so attention is still full.
TEST_F(LlamaModelTest, SealedChunksStillMatchPython) {
  auto s = Session(model_.get(), Options(DType::kF32, 4, 8, 4));
  ASSERT_NE(s, nullptr);
  const int prefix = 30;
  auto pre = s->Prefill(std::vector<int32_t>(ref_.tokens.begin(), ref_.tokens.begin() + prefix), 8);
  ASSERT_TRUE(pre.ok()) << pre.status().ToString();
  double worst = RowRelError(pre->data(), ref_.logits.data(), prefix);
  for (int t = prefix; t < n(); ++t) {
    auto l = s->Decode(ref_.tokens[t]);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    worst = std::max(worst, RowRelError(l->data(), ref_.logits.data() + static_cast<size_t>(t) * 256, 1));
  }
  RecordProperty("rel_error", Sci(worst));
  EXPECT_LE(worst, 1e-4) << "worst row relative error " << worst;
  for (int l = 0; l < 2; ++l) {
    auto count = s->store()->ChunkCount(s->sequence(), l);
    ASSERT_TRUE(count.ok());
    EXPECT_GE(*count, static_cast<uint64_t>((n() - 4 - 8 - 4) / 4)) << "layer " << l;
  }
  EXPECT_GT(s->store()->counters().chunks_sealed, 0u);

  // Without the chunks (sinks + local window only) the logits must differ: the chunks mattered.
  auto sparse = Session(model_.get(), Options(DType::kF32, 4, 8, 4));
  ASSERT_NE(sparse, nullptr);
  ASSERT_TRUE(sparse
                  ->SetChunkSelector([](int, const float*, const int64_t*, int, const std::vector<ChunkInfo>&)
                                         -> Result<std::vector<uint64_t>> { return std::vector<uint64_t>{}; })
                  .ok());
  auto sl = sparse->Prefill(ref_.tokens, 8);
  ASSERT_TRUE(sl.ok()) << sl.status().ToString();
  const double sparse_err = RowRelError(sl->data(), ref_.logits.data(), n());
  RecordProperty("sparse_rel_error", Sci(sparse_err));
  EXPECT_GT(sparse_err, 1e-3);
}

TEST_F(LlamaModelTest, RejectsBadCalls) {
  auto s = Session(model_.get(), Options(DType::kF32, 4, 8, 4));
  ASSERT_NE(s, nullptr);
  auto too_wide = s->Prefill(ref_.tokens, 16);
  ASSERT_FALSE(too_wide.ok());
  EXPECT_EQ(too_wide.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_wide.status().message().find("n_local"), std::string::npos) << too_wide.status().message();
  auto bad_token = s->Decode(300);
  ASSERT_FALSE(bad_token.ok());
  EXPECT_NE(bad_token.status().message().find("vocabulary"), std::string::npos) << bad_token.status().message();
  EXPECT_TRUE(s->Decode(65).ok());  // a rejected call leaves the session usable
  EXPECT_EQ(s->position(), 1);
}

// ---------------------------------------------------------------------------
// SafeTensors

std::vector<uint8_t> Image(const std::string& header, size_t data_bytes, uint64_t header_len_override = 0) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes, 0);
  const uint64_t len = header_len_override ? header_len_override : header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(len >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  return out;
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
}

// Parsing fails with InvalidArgument naming the file and containing `what`.
void ExpectBad(const std::vector<uint8_t>& image, const std::string& what) {
  TempDir dir;
  const std::string path = dir.path() + "/bad.safetensors";
  WriteFile(path, image);
  auto st = LoadSafeTensors(path);
  ASSERT_FALSE(st.ok()) << "expected an error containing '" << what << "'";
  EXPECT_EQ(st.status().code(), StatusCode::kInvalidArgument) << st.status().ToString();
  EXPECT_NE(st.status().message().find(path), std::string::npos) << st.status().message();
  EXPECT_NE(st.status().message().find(what), std::string::npos) << st.status().message();
}

TEST(SafeTensorsTest, ParsesTensorsAndMetadata) {
  const std::string h =
      R"({"__metadata__":{"k":"v\"\u00e9"},"b":{"dtype":"F16","shape":[3],"data_offsets":[8,14]},)"
      R"( "a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"( "c":{"dtype":"BF16","shape":[],"data_offsets":[14,16]}})";
  std::vector<uint8_t> img = Image(h, 16);
  const size_t d = 8 + h.size();
  const float a[2] = {1.5f, -2.0f};
  std::memcpy(img.data() + d, a, 8);
  const uint16_t b[3] = {FloatToF16(0.5f), FloatToF16(3.0f), FloatToF16(-1.0f)};
  std::memcpy(img.data() + d + 8, b, 6);
  const uint16_t c = FloatToBf16(4.0f);
  std::memcpy(img.data() + d + 14, &c, 2);
  auto st = ParseSafeTensors("mem", img);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->metadata.at("k"), "v\"\xc3\xa9");
  ASSERT_EQ(st->tensors.size(), 3u);
  EXPECT_EQ(st->tensors.at("b").shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(*st->ToFloat32("a"), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(*st->ToFloat32("b"), (std::vector<float>{0.5f, 3.0f, -1.0f}));
  EXPECT_EQ(*st->ToFloat32("c"), (std::vector<float>{4.0f}));
  EXPECT_EQ(st->ToFloat32("zz").status().code(), StatusCode::kNotFound);
}

TEST(SafeTensorsTest, MalformedFilesNameTheProblem) {
  const std::string ok_tensor = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  ExpectBad({1, 2, 3, 4, 5}, "too short");
  ExpectBad(Image("{}", 0, 1000), "header length 1000 goes past the end");
  ExpectBad(Image(R"({"t":{"dtype":"F32",)", 8), "bad JSON");
  ExpectBad(Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} x)", 8), "bad JSON");
  ExpectBad(Image(R"({"t":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 16), "unsupported dtype 'F64'");
  ExpectBad(Image(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 12), "needs 12 bytes");
  ExpectBad(Image("{" + ok_tensor + "}", 4), "go past the data section");
  ExpectBad(Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "reversed");
  ExpectBad(Image("{" + ok_tensor + R"(,"u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "overlap");
  ExpectBad(Image("{" + ok_tensor + "," + ok_tensor + "}", 8), "duplicate entry 't'");
  ExpectBad(Image(R"({"__metadata__":{"x":1}})", 0), "not a string");
  ExpectBad(Image(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8), "\"dtype\"");

  auto missing = LoadSafeTensors("/nonexistent/kvtier.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

TEST(SafeTensorsTest, TruncatedFixture) {
  std::ifstream in(FixtureDir() + "/tiny_llama.safetensors", std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 1000u);
  bytes.resize(bytes.size() - 100);  // cut into the last tensor
  ExpectBad(bytes, "go past the data section");
  bytes.resize(20);  // cut into the header
  ExpectBad(bytes, "goes past the end of the file");
}

TEST(SafeTensorsTest, ModelChecksTensorsAndConfig) {
  auto base = LoadSafeTensors(FixtureDir() + "/tiny_llama.safetensors");
  ASSERT_TRUE(base.ok()) << base.status().ToString();

  SafeTensors missing = *base;
  missing.tensors.erase("layers.1.wv");
  auto m1 = LlamaModel::FromSafeTensors(missing);
  ASSERT_FALSE(m1.ok());
  EXPECT_EQ(m1.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m1.status().message().find("'layers.1.wv' is missing"), std::string::npos) << m1.status().message();

  SafeTensors shape = *base;
  shape.tensors.at("lm_head").shape = {128, 128};
  auto m2 = LlamaModel::FromSafeTensors(shape);
  ASSERT_FALSE(m2.ok());
  EXPECT_NE(m2.status().message().find("'lm_head' has shape [128, 128], expected [256, 64]"), std::string::npos)
      << m2.status().message();

  SafeTensors cfg = *base;
  cfg.metadata["q_heads"] = "3";
  auto m3 = LlamaModel::FromSafeTensors(cfg);
  ASSERT_FALSE(m3.ok());
  EXPECT_NE(m3.status().message().find("q_heads"), std::string::npos) << m3.status().message();

  SafeTensors name = *base;
  name.metadata["model"] = "gpt2";
  auto m4 = LlamaModel::FromSafeTensors(name);
  ASSERT_FALSE(m4.ok());
  EXPECT_NE(m4.status().message().find("'gpt2'"), std::string::npos) << m4.status().message();

  SafeTensors num = *base;
  num.metadata["norm_eps"] = "1e-5x";
  auto m5 = LlamaModel::FromSafeTensors(num);
  ASSERT_FALSE(m5.ok());
  EXPECT_NE(m5.status().message().find("norm_eps"), std::string::npos) << m5.status().message();
}

}  // namespace
}  // namespace kvtier::model

// ---------------------------------------------------------------------------
// Retrieval inside the model and InfLLM positions.

namespace kvtier::model {
namespace {

// Every chunk the retriever could pick fits: k = budget / chunk_size chunks per layer.
RetrieverOptions AllChunks(const std::string& probe = "mean", const std::string& alloc = "topk") {
  RetrieverOptions r;
  r.probe = probe;
  r.alloc = alloc;
  r.budget_tokens = 1 << 16;
  return r;
}

// The reference prompt repeated to `n` tokens: long enough that most keys live in chunks.
std::vector<int32_t> Repeat(const std::vector<int32_t>& tokens, size_t n) {
  std::vector<int32_t> out;
  while (out.size() < n) out.push_back(tokens[out.size() % tokens.size()]);
  return out;
}

// (6) kInfLLM on a sequence shorter than sinks + local window: nothing is in memory (no
// chunk is sealed), every key keeps its true position, so the logits are kAbsolute's --
// through prefill windows and decode, with retrieval on and a budget covering every chunk.
TEST_F(LlamaModelTest, InfLLMEqualsAbsoluteWhileNothingIsInMemory) {
  const StoreOptions o = Options(DType::kF32, 16, 64, 8);
  ASSERT_LT(n(), o.n_sink + o.n_local);
  auto abs = Session(model_.get(), o);
  auto inf = LlamaSession::Create(model_.get(), o, PositionMode::kInfLLM);
  ASSERT_TRUE(abs && inf.ok()) << inf.status().ToString();
  ASSERT_TRUE((*inf)->EnableRetrieval(AllChunks("act", "entropy")).ok());
  EXPECT_EQ((*inf)->position_mode(), PositionMode::kInfLLM);
  const int prefix = 40;
  const std::vector<int32_t> head(ref_.tokens.begin(), ref_.tokens.begin() + prefix);
  auto a = abs->Prefill(head, 8);
  auto b = (*inf)->Prefill(head, 8);
  ASSERT_TRUE(a.ok() && b.ok()) << b.status().ToString();
  double worst = RowRelError(b->data(), a->data(), prefix);
  for (int t = prefix; t < n(); ++t) {
    auto la = abs->Decode(ref_.tokens[t]);
    auto lb = (*inf)->Decode(ref_.tokens[t]);
    ASSERT_TRUE(la.ok() && lb.ok()) << lb.status().ToString();
    worst = std::max(worst, RowRelError(lb->data(), la->data(), 1));
  }
  RecordProperty("rel_error", Sci(worst));
  EXPECT_LE(worst, 1e-6) << "worst row relative error " << worst;
  for (int l = 0; l < 2; ++l) {
    auto count = (*inf)->store()->ChunkCount((*inf)->sequence(), l);
    ASSERT_TRUE(count.ok());
    EXPECT_EQ(*count, 0u) << "layer " << l << ": the test needs nothing in memory";
  }
  EXPECT_EQ((*inf)->total_chunks(), 0u);
}

// (7) kAbsolute with the retriever picking every chunk (topk, k >= chunks) is still the
// reference model: the Python logits within 1e-4, with most keys in sealed chunks.
TEST_F(LlamaModelTest, RetrievalOfAllChunksMatchesPython) {
  auto s = Session(model_.get(), Options(DType::kF32, 4, 8, 4));
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->EnableRetrieval(AllChunks()).ok());
  const int prefix = 30;
  auto pre = s->Prefill(std::vector<int32_t>(ref_.tokens.begin(), ref_.tokens.begin() + prefix), 8);
  ASSERT_TRUE(pre.ok()) << pre.status().ToString();
  double worst = RowRelError(pre->data(), ref_.logits.data(), prefix);
  for (int t = prefix; t < n(); ++t) {
    auto l = s->Decode(ref_.tokens[t]);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    worst = std::max(worst, RowRelError(l->data(), ref_.logits.data() + static_cast<size_t>(t) * 256, 1));
    for (int layer = 0; layer < 2; ++layer) {
      auto count = s->store()->ChunkCount(s->sequence(), layer);
      ASSERT_TRUE(count.ok());
      EXPECT_EQ(s->last_chunks()[layer].size(), *count) << "token " << t << " layer " << layer;
    }
  }
  RecordProperty("rel_error", Sci(worst));
  EXPECT_LE(worst, 1e-4) << "worst row relative error " << worst;
  EXPECT_GT(s->total_chunks(), 0u);
}

// (8) A small budget: topk takes at most k = budget / chunk_size chunks per layer and step,
// the entropy allocator at most L * k per step; with kInfLLM positions the logits stay finite.
TEST_F(LlamaModelTest, SmallBudgetPicksAtMostTheBudget) {
  StoreOptions o = Options(DType::kF32, 4, 16, 4);
  o.warm_bytes = 512 * o.chunk_bytes();
  const std::vector<int32_t> tokens = Repeat(ref_.tokens, 320);
  for (const char* alloc : {"topk", "entropy"}) {
    SCOPED_TRACE(alloc);
    auto s = LlamaSession::Create(model_.get(), o, PositionMode::kInfLLM);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    RetrieverOptions r = AllChunks(std::string(alloc) == "topk" ? "mean" : "act", alloc);
    r.budget_tokens = 8;  // k = 2 chunks per layer
    ASSERT_TRUE((*s)->EnableRetrieval(r).ok());
    size_t most_per_step = 0;
    for (size_t b = 0; b < tokens.size(); b += 8) {
      auto l = (*s)->Prefill(std::vector<int32_t>(tokens.begin() + b, tokens.begin() + b + 8), 8);
      ASSERT_TRUE(l.ok()) << l.status().ToString();
      for (float v : *l) ASSERT_TRUE(std::isfinite(v));
      size_t step = 0;
      for (const auto& c : (*s)->last_chunks()) {
        step += c.size();
        if (std::string(alloc) == "topk") {
          EXPECT_LE(c.size(), 2u);
        }
      }
      EXPECT_LE(step, 4u) << "at token " << b;
      most_per_step = std::max(most_per_step, step);
    }
    auto d = (*s)->Decode(65);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    size_t step = 0;
    for (const auto& c : (*s)->last_chunks()) step += c.size();
    EXPECT_LE(step, 4u);
    EXPECT_GT(most_per_step, 0u) << "retrieval never picked a chunk";
    auto count = (*s)->store()->ChunkCount((*s)->sequence(), 0);
    ASSERT_TRUE(count.ok());
    EXPECT_GT(*count, 50u);  // most of the sequence is in memory
  }
}

// (8b) The InfLLM positions take effect exactly when memory appears: with every chunk
// attended, kInfLLM equals kAbsolute while the sequence fits in sinks + local window
// (true positions for all keys), and differs once chunks exist (memory sits at the
// local window's start instead of its true positions).
TEST_F(LlamaModelTest, InfLLMPositionsApplyOnlyToMemory) {
  StoreOptions o = Options(DType::kF32, 4, 16, 4);
  o.warm_bytes = 256 * o.chunk_bytes();
  const std::vector<int32_t> tokens = Repeat(ref_.tokens, 120);
  auto abs = Session(model_.get(), o);
  auto inf = LlamaSession::Create(model_.get(), o, PositionMode::kInfLLM);
  ASSERT_TRUE(abs && inf.ok());
  auto a = abs->Prefill(tokens, 4);
  auto b = (*inf)->Prefill(tokens, 4);  // the default selector: every chunk
  ASSERT_TRUE(a.ok() && b.ok()) << b.status().ToString();
  const int fits = o.n_sink + o.n_local;
  const double before = RowRelError(b->data(), a->data(), fits);
  const size_t skip = static_cast<size_t>(fits) * 256;
  const double after = RowRelError(b->data() + skip, a->data() + skip, static_cast<int>(tokens.size()) - fits);
  RecordProperty("rel_error_before_memory", Sci(before));
  RecordProperty("rel_error_with_memory", Sci(after));
  EXPECT_LE(before, 1e-6);
  EXPECT_GT(after, 1e-4) << "memory keys must be rotated at the local window's start, not their true positions";
  for (float v : *b) ASSERT_TRUE(std::isfinite(v));
}

// (9) Bad options get errors that name them.
TEST_F(LlamaModelTest, BadRetrievalOptionsAreRejected) {
  struct Case { RetrieverOptions r; std::string expect; };
  std::vector<Case> cases(4);
  cases[0].r.probe = "bogus";
  cases[0].expect = "probe";
  cases[1].r.alloc = "nope";
  cases[1].expect = "alloc";
  cases[2].r.budget_tokens = -1;
  cases[2].expect = "budget_tokens";
  cases[3].r.index = "Bogus";
  cases[3].expect = "Bogus";
  for (const Case& c : cases) {
    auto s = Session(model_.get(), Options(DType::kF32, 4, 8, 4));
    ASSERT_NE(s, nullptr);
    Status st = s->EnableRetrieval(c.r);
    ASSERT_FALSE(st.ok()) << c.expect;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << st.message();
    EXPECT_EQ(s->retriever(), nullptr);
  }
  auto s = Session(model_.get(), Options(DType::kF32, 4, 8, 4));
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->Decode(65).ok());
  Status late = s->EnableRetrieval(RetrieverOptions{});
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition) << late.ToString();
  EXPECT_NE(late.message().find("before the first"), std::string::npos) << late.message();

  auto mode = ParsePositionMode("relative");
  ASSERT_FALSE(mode.ok());
  EXPECT_NE(mode.status().message().find("absolute | infllm"), std::string::npos) << mode.status().message();
  EXPECT_EQ(*ParsePositionMode("infllm"), PositionMode::kInfLLM);
  EXPECT_EQ(*ParsePositionMode("absolute"), PositionMode::kAbsolute);
  auto bad = LlamaSession::Create(model_.get(), Options(DType::kF32, 4, 8, 4), static_cast<PositionMode>(7));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("position mode"), std::string::npos) << bad.status().message();
}

}  // namespace
}  // namespace kvtier::model
