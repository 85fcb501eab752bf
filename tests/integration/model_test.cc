// The kvtier-llama forward pass (integration/model) against the Python
// reference (models/model.py): tests/fixtures holds a seeded random tiny model
// and the logits the reference computed for a fixed prompt; regenerate them with
//   /usr/bin/python3 models/make_fixture.py --out-dir tests/fixtures
//
// Error metric: for every token, max |c++ - python| over the 256 logits divided
// by max |python| of that row (the worst row is reported).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "integration/model/llama.h"
#include "integration/model/llama_device.h"
#include "kernels/cpu/rope.h"
#include "tests/test_util.h"

#if KVTIER_HAVE_CUDA
#include "kernels/cuda/kernels.h"
#endif

namespace kvtier::model {
namespace {

std::string FixtureDir() { return std::string(KVTIER_SOURCE_DIR) + "/tests/fixtures"; }

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
    EXPECT_EQ(LlamaSession::Argmax(*l),
              LlamaSession::Argmax(std::vector<float>(all->begin() + t * 256, all->begin() + (t + 1) * 256)));
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
  EXPECT_NE(bad_token.status().message().find("vocabulary"), std::string::npos)
      << bad_token.status().message();
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
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
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
  ExpectBad(Image(R"({"t":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 16),
            "unsupported dtype 'F64'");
  ExpectBad(Image(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 12), "needs 12 bytes");
  ExpectBad(Image("{" + ok_tensor + "}", 4), "go past the data section");
  ExpectBad(Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "reversed");
  ExpectBad(Image("{" + ok_tensor + R"(,"u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
            "overlap");
  ExpectBad(Image("{" + ok_tensor + "," + ok_tensor + "}", 8), "duplicate entry 't'");
  ExpectBad(Image(R"({"__metadata__":{"x":1}})", 0), "not a string");
  ExpectBad(Image(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8), "\"dtype\"");
  // What nlohmann's grammar accepts and the format does not: a repeated key anywhere, nesting
  // without end, numbers that are not non-negative integers where sizes go.
  ExpectBad(Image(R"({"t":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8),
            "duplicate key 'dtype' under 't'");
  ExpectBad(Image(R"({"__metadata__":{"k":"a","k":"b"}})", 0), "duplicate __metadata__ key 'k'");
  ExpectBad(Image(R"({"x":[[[[[[[[[[1]]]]]]]]]]})", 0), "nested deeper than 8 levels");
  ExpectBad(Image(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
            "not a non-negative integer");
  ExpectBad(Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", 8),
            "not a non-negative integer");
  ExpectBad(Image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,1e999]}})", 8), "bad JSON");
  ExpectBad(Image("{\"t\xff\":1}", 0), "bad JSON at byte");  // not UTF-8

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
  EXPECT_NE(m1.status().message().find("'layers.1.wv' is missing"), std::string::npos)
      << m1.status().message();

  SafeTensors shape = *base;
  shape.tensors.at("lm_head").shape = {128, 128};
  auto m2 = LlamaModel::FromSafeTensors(shape);
  ASSERT_FALSE(m2.ok());
  EXPECT_NE(m2.status().message().find("'lm_head' has shape [128, 128], expected [256, 64]"),
            std::string::npos)
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

// The whole hot pool of `o` (which holds every chunk of these tests): k = budget / chunk_size
// chunks per layer.
RetrieverOptions AllChunks(const StoreOptions& o, const std::string& probe = "mean",
                           const std::string& alloc = "topk") {
  RetrieverOptions r;
  r.probe = probe;
  r.alloc = alloc;
  r.budget_tokens = static_cast<int>(o.hot_bytes / o.chunk_bytes()) * o.chunk_size;
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
  ASSERT_TRUE((*inf)->EnableRetrieval(AllChunks(o, "act", "entropy")).ok());
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
  const StoreOptions o = Options(DType::kF32, 4, 8, 4);
  auto s = Session(model_.get(), o);
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->EnableRetrieval(AllChunks(o)).ok());
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
    RetrieverOptions r = AllChunks(o, std::string(alloc) == "topk" ? "mean" : "act", alloc);
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
  const double after =
      RowRelError(b->data() + skip, a->data() + skip, static_cast<int>(tokens.size()) - fits);
  RecordProperty("rel_error_before_memory", Sci(before));
  RecordProperty("rel_error_with_memory", Sci(after));
  EXPECT_LE(before, 1e-6);
  EXPECT_GT(after, 1e-4)
      << "memory keys must be rotated at the local window's start, not their true positions";
  for (float v : *b) ASSERT_TRUE(std::isfinite(v));
}

// (9) Bad options get errors that name them.
TEST_F(LlamaModelTest, BadRetrievalOptionsAreRejected) {
  struct Case {
    RetrieverOptions r;
    std::string expect;
  };
  std::vector<Case> cases(5);
  cases[0].r.probe = "bogus";
  cases[0].expect = "probe";
  cases[1].r.alloc = "nope";
  cases[1].expect = "alloc";
  cases[2].r.budget_tokens = -1;
  cases[2].expect = "budget_tokens";
  cases[3].r.index = "Bogus";
  cases[3].expect = "Bogus";
  cases[4].r.budget_tokens = 65 * 4;  // the hot pool holds 64 chunks of 4
  cases[4].expect = "budget_tokens 260 needs 65 chunks of 4 tokens, and the hot slot pool holds 64";
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

// ---------------------------------------------------------------------------
// The forward on the GPU (integration/model/llama_device.h). Without a device, what runs here
// is its host side: the weight and activation layouts, the packed upload image, argument
// checks, and the refusals (library and CLI) naming why there is no device. The comparison with
// the CPU forward runs on a GPU or the emulated device (make test-gpu-emulated) and skips
// without either.

namespace kvtier::model {
namespace {

bool HaveCudaDevice() {
#if KVTIER_HAVE_CUDA
  return kernels::cuda::DeviceCount() > 0;
#else
  return false;
#endif
}

std::string ShippedModelPath() { return std::string(KVTIER_SOURCE_DIR) + "/models/kvtier-tiny.safetensors"; }

// Every tensor of a layout, with its name, in placement order.
std::vector<std::pair<std::string, DeviceTensor>> Tensors(const DeviceWeightLayout& w) {
  std::vector<std::pair<std::string, DeviceTensor>> t = {
      {"embed", w.embed}, {"final_norm", w.final_norm}, {"lm_head", w.lm_head}};
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const auto& L = w.layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    for (auto [n, d] : {std::pair{"attn_norm", L.attn_norm},
                        {"wq", L.wq},
                        {"wk", L.wk},
                        {"wv", L.wv},
                        {"wo", L.wo},
                        {"mlp_norm", L.mlp_norm},
                        {"w_gate", L.w_gate},
                        {"w_up", L.w_up},
                        {"w_down", L.w_down}})
      t.emplace_back(p + n, d);
  }
  t.emplace_back("inv_freq", w.inv_freq);
  return t;
}

// Aligned, in order, disjoint, inside `total`.
void ExpectPacked(const std::vector<std::pair<std::string, DeviceTensor>>& t, size_t total) {
  size_t end = 0;
  for (const auto& [name, d] : t) {
    EXPECT_EQ(d.offset % kDeviceAlignment, 0u) << name;
    EXPECT_GE(d.offset, end) << name << " overlaps the tensor before it";
    EXPECT_LT(d.offset - end, kDeviceAlignment) << name << ": more padding than alignment needs";
    end = d.offset + d.bytes;
  }
  EXPECT_LE(end, total);
  EXPECT_EQ(total % kDeviceAlignment, 0u);
  EXPECT_LT(total - end, kDeviceAlignment);
}

TEST(DeviceForwardPlan, WeightImageHoldsEveryTensorAtItsOffset) {
  auto m = LlamaModel::Load(ShippedModelPath());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const LlamaModel& model = **m;
  const LlamaConfig& c = model.config();
  const DeviceWeightLayout w = PlanDeviceWeights(c);
  ASSERT_EQ(w.layers.size(), static_cast<size_t>(c.n_layers));
  const auto tensors = Tensors(w);
  ExpectPacked(tensors, w.total);
  // Size accounting: the fp32 parameters of the model (the file's 1.25 MB is fp32 too) plus
  // head_dim / 2 doubles, and at most one alignment gap per tensor.
  const size_t d = c.d_model, hd = c.head_dim(), f = c.ffn_hidden, v = c.vocab;
  const size_t per_layer = 2 * d + (c.q_heads * hd) * d * 2 + (c.kv_heads * hd) * d * 2 + 3 * f * d;
  const size_t params = 2 * v * d + d + c.n_layers * per_layer;
  size_t sum = 0;
  for (const auto& t : tensors) sum += t.second.bytes;
  EXPECT_EQ(sum, params * 4 + hd / 2 * 8);
  EXPECT_LT(w.total, sum + tensors.size() * kDeviceAlignment);

  const std::vector<double> inv_freq = kernels::RopeInvFreq(c.head_dim(), c.rope_theta);
  auto image = PackDeviceWeights(model, w, inv_freq);
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  ASSERT_EQ(image->size(), w.total);
  auto same = [&](const DeviceTensor& t, const void* src, size_t bytes, const std::string& name) {
    ASSERT_EQ(t.bytes, bytes) << name;
    EXPECT_EQ(std::memcmp(image->data() + t.offset, src, bytes), 0) << name;
  };
  same(w.embed, model.embed().data(), model.embed().size() * 4, "embed");
  same(w.final_norm, model.final_norm().data(), model.final_norm().size() * 4, "final_norm");
  same(w.lm_head, model.lm_head().data(), model.lm_head().size() * 4, "lm_head");
  for (int l = 0; l < c.n_layers; ++l) {
    const LlamaLayer& L = model.layers()[l];
    const auto& P = w.layers[l];
    same(P.wq, L.wq.data(), L.wq.size() * 4, "wq");
    same(P.wk, L.wk.data(), L.wk.size() * 4, "wk");
    same(P.wv, L.wv.data(), L.wv.size() * 4, "wv");
    same(P.wo, L.wo.data(), L.wo.size() * 4, "wo");
    same(P.w_gate, L.w_gate.data(), L.w_gate.size() * 4, "w_gate");
    same(P.w_up, L.w_up.data(), L.w_up.size() * 4, "w_up");
    same(P.w_down, L.w_down.data(), L.w_down.size() * 4, "w_down");
    same(P.attn_norm, L.attn_norm.data(), L.attn_norm.size() * 4, "attn_norm");
    same(P.mlp_norm, L.mlp_norm.data(), L.mlp_norm.size() * 4, "mlp_norm");
  }
  same(w.inv_freq, inv_freq.data(), inv_freq.size() * 8, "inv_freq");
  // The padding is zero: the bytes no tensor covers.
  std::vector<bool> covered(image->size(), false);
  for (const auto& t : tensors) std::fill_n(covered.begin() + t.second.offset, t.second.bytes, true);
  for (size_t i = 0; i < image->size(); ++i)
    if (!covered[i]) ASSERT_EQ((*image)[i], 0) << "padding byte " << i;

  auto short_freq = PackDeviceWeights(model, w, std::vector<double>(3));
  ASSERT_FALSE(short_freq.ok());
  EXPECT_EQ(short_freq.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_freq.status().message().find("inv_freq holds 3 values"), std::string::npos)
      << short_freq.status().message();
  DeviceWeightLayout fewer = w;
  fewer.layers.pop_back();
  auto bad_layout = PackDeviceWeights(model, fewer, inv_freq);
  ASSERT_FALSE(bad_layout.ok());
  EXPECT_NE(bad_layout.status().message().find("layers"), std::string::npos) << bad_layout.status().message();
}

TEST(DeviceForwardPlan, ActivationLayoutFitsTheLargestWindowInTheStoreDtype) {
  const LlamaConfig c{256, 128, 4, 8, 2, 256, 1e6, 1e-5};  // kvtier-tiny's shape: head_dim 16
  const size_t m = 64, d = 128, qd = 128, kvd = 32, f = 256;
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    auto a = PlanDeviceActivations(c, static_cast<int>(m), t);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(a->max_tokens, 64);
    EXPECT_EQ(a->kv_dtype, t);
    EXPECT_EQ(a->tokens.bytes, m * 4);
    EXPECT_EQ(a->positions.bytes, m * 8);
    EXPECT_EQ(a->x.bytes, m * d * 4);
    EXPECT_EQ(a->h.bytes, m * d * 4);
    EXPECT_EQ(a->q.bytes, m * qd * 4);
    EXPECT_EQ(a->k.bytes, m * kvd * 4);
    EXPECT_EQ(a->v.bytes, m * kvd * 4);
    EXPECT_EQ(a->att.bytes, m * qd * 4);
    EXPECT_EQ(a->gate.bytes, m * f * 4);
    EXPECT_EQ(a->up.bytes, m * f * 4);
    // f32 K/V are appended from k and v themselves; f16/bf16 get conversion buffers.
    EXPECT_EQ(a->k_store.bytes, t == DType::kF32 ? 0 : m * kvd * 2);
    EXPECT_EQ(a->v_store.bytes, a->k_store.bytes);
    EXPECT_EQ(a->logits.bytes, m * 256 * 4);
    ExpectPacked({{"tokens", a->tokens},
                  {"positions", a->positions},
                  {"x", a->x},
                  {"h", a->h},
                  {"q", a->q},
                  {"k", a->k},
                  {"v", a->v},
                  {"att", a->att},
                  {"gate", a->gate},
                  {"up", a->up},
                  {"k_store", a->k_store},
                  {"v_store", a->v_store},
                  {"logits", a->logits}},
                 a->total);
  }
  auto zero = PlanDeviceActivations(c, 0, DType::kF16);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("max_tokens must be >= 1 (got 0)"), std::string::npos)
      << zero.status().message();
  auto dtype = PlanDeviceActivations(c, 8, static_cast<DType>(5));
  ASSERT_FALSE(dtype.ok());
  EXPECT_NE(dtype.status().message().find("f32, f16 or bf16 (got 5)"), std::string::npos)
      << dtype.status().message();
  LlamaConfig broken = c;
  broken.kv_heads = 3;
  auto cfg = PlanDeviceActivations(broken, 8, DType::kF16);
  ASSERT_FALSE(cfg.ok());
  EXPECT_NE(cfg.status().message().find("kv_heads"), std::string::npos) << cfg.status().message();
}

TEST(DeviceForwardPlan, CreateRefusesAHostTierAndAnUnknownPositionMode) {
  auto m = LlamaModel::Load(ShippedModelPath());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const LlamaConfig& c = (*m)->config();
  auto host = HostHotTier::Create(1 << 20, 4096);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  const std::vector<double> inv_freq = kernels::RopeInvFreq(c.head_dim(), c.rope_theta);
  // Both position modes run on the device; a host tier is refused in either.
  for (const PositionMode mode : {PositionMode::kAbsolute, PositionMode::kInfLLM}) {
    auto on_host = LlamaDeviceForward::Create(m->get(), host->get(), 64, DType::kF16, mode, inv_freq);
    ASSERT_FALSE(on_host.ok());
    EXPECT_EQ(on_host.status().code(), StatusCode::kUnavailable) << on_host.status().ToString();
    EXPECT_NE(on_host.status().message().find("no CUDA device"), std::string::npos)
        << on_host.status().message();
  }
#if KVTIER_HAVE_CUDA
  // A CUDA build checks the mode first: the refusal names it, device or not.
  auto unknown = LlamaDeviceForward::Create(m->get(), host->get(), 64, DType::kF16,
                                            static_cast<PositionMode>(7), inv_freq);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument) << unknown.status().ToString();
  EXPECT_NE(unknown.status().message().find("unknown position mode 7"), std::string::npos)
      << unknown.status().message();
#endif
}

StoreOptions DeviceOptions(const LlamaConfig& c, DType dtype, Device device) {
  StoreOptions o;
  o.n_sink = 4;
  o.n_local = 64;
  o.chunk_size = 16;
  o.repr_topk = 1;
  o.geometry = c.KvGeometry(dtype);
  o.hot_bytes = 64 * o.chunk_bytes();
  o.warm_bytes = 64 * o.chunk_bytes();
  o.transfer_threads = 1;
  o.device = device;
  return o;
}

TEST(DeviceForward, SessionOnACudaTierWithoutADeviceIsUnavailable) {
  if (HaveCudaDevice()) GTEST_SKIP() << "a CUDA device is present: DeviceForwardMatchesCpuForward covers it";
  auto m = LlamaModel::Load(ShippedModelPath());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto s = LlamaSession::Create(m->get(), DeviceOptions((*m)->config(), DType::kF16, Device::kCuda),
                                PositionMode::kAbsolute);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().ToString();
  // A CUDA build without a device says so; a build without CUDA does not know the tier name.
  EXPECT_TRUE(s.status().message().find("no CUDA device") != std::string::npos ||
              s.status().message().find("cuda") != std::string::npos)
      << s.status().message();
  auto host = LlamaSession::Create(m->get(), DeviceOptions((*m)->config(), DType::kF16, Device::kCpu));
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  EXPECT_FALSE((*host)->on_device());
}

std::string RunKvtierCli(const std::string& args, int* code) {
  const std::string cmd = std::string(KVTIER_BINARY_DIR) + "/kvtier " + args + " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  *code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

TEST(DeviceForward, InfiniteOnCudaSaysWhyItCannotRun) {
  const std::string base = "infinite --weights " + ShippedModelPath() +
                           " --task passkey --context 1024 --samples 1 "
                           "--quiet --device cuda";
  // What the device forward does not take is a usage error on any machine, named.
  int code = -1;
  std::string out = RunKvtierCli(base + " --compare", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("does not take --compare"), std::string::npos) << out;
  if (HaveCudaDevice()) return;  // DeviceForward*MatchesCpuForward and gpu_check.sh run it
  // Without a device (or without CUDA in the build): Unavailable with the reason, exit 1, in
  // either position mode (infllm, the default, runs on the device too).
  for (const char* positions : {"", " --positions absolute"}) {
    out = RunKvtierCli(base + positions, &code);
    EXPECT_EQ(code, 1) << out;
    EXPECT_NE(out.find("Unavailable"), std::string::npos) << out;
  }
  out = RunKvtierCli(base + " --positions absolute", &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("Unavailable"), std::string::npos) << out;
  EXPECT_NE(out.find("cuda"), std::string::npos) << out;
#if KVTIER_HAVE_CUDA
  EXPECT_NE(out.find("no CUDA device"), std::string::npos) << out;
#endif
}

// A seeded random kvtier-llama with head_dim 64 (kvtier-tiny's is 16; the CUDA attention
// kernel takes both), weights ~ N(0, 1/sqrt(fan_in)) and norms near 1.
std::unique_ptr<LlamaModel> RandomModel(uint32_t seed) {
  const LlamaConfig c{256, 256, 2, 4, 2, 512, 10000.0, 1e-5};
  SafeTensors st;
  st.path = "random-head64";
  st.metadata = {{"model", "kvtier-llama"}, {"vocab", "256"},          {"d_model", "256"},
                 {"n_layers", "2"},         {"q_heads", "4"},          {"kv_heads", "2"},
                 {"ffn_hidden", "512"},     {"rope_theta", "10000.0"}, {"norm_eps", "1e-05"}};
  std::mt19937 rng(seed);
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool norm) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::normal_distribution<float> nd(norm ? 1.0f : 0.0f,
                                       norm ? 0.1f : 1.0f / std::sqrt(float(shape.back())));
    TensorInfo t;
    t.dtype = DType::kF32;
    t.shape = shape;
    t.offset = st.data.size();
    t.size = static_cast<size_t>(n) * 4;
    st.data.resize(t.offset + t.size);
    for (int64_t i = 0; i < n; ++i) {
      const float v = nd(rng);
      std::memcpy(st.data.data() + t.offset + 4 * i, &v, 4);
    }
    st.tensors[name] = t;
  };
  const int64_t d = c.d_model, qd = 256, kvd = 128, f = c.ffn_hidden;
  add("embed", {256, d}, false);
  add("final_norm", {d}, true);
  add("lm_head", {256, d}, false);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "attn_norm", {d}, true);
    add(p + "wq", {qd, d}, false);
    add(p + "wk", {kvd, d}, false);
    add(p + "wv", {kvd, d}, false);
    add(p + "wo", {d, qd}, false);
    add(p + "mlp_norm", {d}, true);
    add(p + "w_gate", {f, d}, false);
    add(p + "w_up", {f, d}, false);
    add(p + "w_down", {d, f}, false);
  }
  auto m = LlamaModel::FromSafeTensors(st);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(*m) : nullptr;
}

// Prefill (windows of 32 over 200 tokens: chunks seal, leave the local window and come back
// from the warm tier) and 8 greedy decode steps on the CPU and on the device, same store
// options but the hot tier. Tolerance, the worst row's max |gpu - cpu| / max |cpu|: 1e-4 with
// f32 K/V (cuBLAS and the split-K attention sum in other orders than the twins: fp32 rounding
// through 2-4 layers), 2e-3 with f16 and 1e-2 with bf16 (a K/V element that lands on the other
// side of a rounding edge differs by one ulp of the store dtype); the argmax must agree wherever
// the CPU's top two logits are 1e-2 (relative) apart.
void CompareDeviceWithCpu(const LlamaModel& model, const std::string& what) {
  const LlamaConfig& c = model.config();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> byte(32, 126);
  std::vector<int32_t> prompt(200);
  for (int32_t& t : prompt) t = byte(rng);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(what + " " + DTypeName(dtype));
    auto cpu = LlamaSession::Create(&model, DeviceOptions(c, dtype, Device::kCpu), PositionMode::kAbsolute);
    auto gpu = LlamaSession::Create(&model, DeviceOptions(c, dtype, Device::kCuda), PositionMode::kAbsolute);
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    ASSERT_TRUE((*gpu)->on_device());
    const double tol = dtype == DType::kF32 ? 1e-4 : (dtype == DType::kF16 ? 2e-3 : 1e-2);
    auto a = (*cpu)->Prefill(prompt, 32);
    auto b = (*gpu)->Prefill(prompt, 32);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const int vocab = c.vocab;
    double worst = RowRelError(b->data(), a->data(), static_cast<int>(prompt.size()), vocab);
    std::vector<float> last(a->end() - vocab, a->end());
    int disagreements = 0;
    for (int step = 0; step < 8; ++step) {
      const int32_t next = LlamaSession::Argmax(last);
      auto la = (*cpu)->Decode(next);
      auto lb = (*gpu)->Decode(next);
      ASSERT_TRUE(la.ok()) << la.status().ToString();
      ASSERT_TRUE(lb.ok()) << lb.status().ToString();
      worst = std::max(worst, RowRelError(lb->data(), la->data(), 1, vocab));
      std::vector<float> sorted = *la;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      const double mag = std::max(std::fabs(sorted[0]), 1e-30f);
      if ((sorted[0] - sorted[1]) / mag > 1e-2 && LlamaSession::Argmax(*la) != LlamaSession::Argmax(*lb))
        ++disagreements;
      last = *la;
    }
    ::testing::Test::RecordProperty(what + "_" + DTypeName(dtype) + "_rel_error", Sci(worst));
    EXPECT_LE(worst, tol) << "worst row relative error " << worst;
    EXPECT_EQ(disagreements, 0);
    EXPECT_EQ((*gpu)->position(), (*cpu)->position());
  }
}

TEST(DeviceForward, DeviceForwardMatchesCpuForward) {
  if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: the device forward needs a GPU (never run on one)";
  auto random = RandomModel(20261125);
  ASSERT_NE(random, nullptr);
  CompareDeviceWithCpu(*random, "random head_dim 64");
}

// The shipped model: the same comparison. kvtier-tiny's head_dim is 16, which the CUDA
// attention kernel takes with lanes 16..31 of each warp idle (kernels/cuda/attention.cu).
TEST(DeviceForward, ShippedModelOnDeviceMatchesCpuForward) {
  if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: the device forward needs a GPU (never run on one)";
  auto shipped = LlamaModel::Load(ShippedModelPath());
  ASSERT_TRUE(shipped.ok()) << shipped.status().ToString();
  CompareDeviceWithCpu(**shipped, "kvtier-tiny");
}

}  // namespace
}  // namespace kvtier::model
