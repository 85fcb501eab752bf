#include "integration/model/llama.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <numeric>

#include "integration/model/llama_device.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/forward.h"
#include "kernels/cpu/rope.h"

namespace kvtier::model {
namespace {

constexpr const char* kModelName = "kvtier-llama";

Status ParseIntKey(const std::map<std::string, std::string>& meta, const std::string& path, const char* key,
                   int* out) {
  auto it = meta.find(key);
  if (it == meta.end()) return InvalidArgument(path + ": __metadata__ lacks '" + key + "'");
  const char* s = it->second.c_str();
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < INT32_MIN || v > INT32_MAX)
    return InvalidArgument(path + ": __metadata__ '" + key + "' is not an integer (got '" + it->second +
                           "')");
  *out = static_cast<int>(v);
  return Status::Ok();
}

Status ParseFloatKey(const std::map<std::string, std::string>& meta, const std::string& path, const char* key,
                     double* out) {
  auto it = meta.find(key);
  if (it == meta.end()) return InvalidArgument(path + ": __metadata__ lacks '" + key + "'");
  const char* s = it->second.c_str();
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s, &end);
  if (errno != 0 || end == s || *end != '\0' || !std::isfinite(v))
    return InvalidArgument(path + ": __metadata__ '" + key + "' is not a finite number (got '" + it->second +
                           "')");
  *out = v;
  return Status::Ok();
}

// The forward's kernels are the CPU twins of kernels/cpu/forward.h (and rope.h), which also
// define what the CUDA launchers compute. Shapes are validated when the model loads, so a
// KernelError here is a bug: reported as Internal, naming the kernel.
Status Check(kernels::KernelError e, const char* kernel) {
  if (e == kernels::KernelError::kOk) return Status::Ok();
  return Internal(std::string("forward: ") + kernel + ": " + kernels::KernelErrorString(e));
}

Status MatMul(const float* x, int m, int in, const float* w, int out, float* y, bool accumulate) {
  kernels::GemmParams p;
  p.m = m;
  p.k = in;
  p.n_out = out;
  p.x = x;
  p.w = w;
  p.y = y;
  p.accumulate = accumulate;
  return Check(kernels::Gemm(p), "Gemm");
}

Status RmsNorm(const float* x, int m, int d, const float* w, double eps, float* out) {
  kernels::RmsNormParams p;
  p.m = m;
  p.d = d;
  p.eps = eps;
  p.x = x;
  p.w = w;
  p.out = out;
  return Check(kernels::RmsNorm(p), "RmsNorm");
}

// Copies a tensor out of the file after checking its exact shape.
Status Take(const SafeTensors& st, const std::string& name, std::vector<int64_t> shape,
            std::vector<float>* out) {
  auto t = st.Find(name);
  if (!t.ok()) return InvalidArgument(t.status().message());
  if ((*t)->shape != shape)
    return InvalidArgument(st.path + ": tensor '" + name + "' has shape " + (*t)->ShapeString() +
                           ", expected " + ShapeToString(shape));
  KVTIER_ASSIGN_OR_RETURN(*out, st.ToFloat32(name));
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------
// LlamaConfig

Status LlamaConfig::Validate() const {
  auto positive = [](const char* name, int v) -> Status {
    if (v <= 0)
      return InvalidArgument(std::string("llama config: ") + name + " must be > 0 (got " + std::to_string(v) +
                             ")");
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(positive("vocab", vocab));
  KVTIER_RETURN_IF_ERROR(positive("d_model", d_model));
  KVTIER_RETURN_IF_ERROR(positive("n_layers", n_layers));
  KVTIER_RETURN_IF_ERROR(positive("q_heads", q_heads));
  KVTIER_RETURN_IF_ERROR(positive("kv_heads", kv_heads));
  KVTIER_RETURN_IF_ERROR(positive("ffn_hidden", ffn_hidden));
  if (d_model % q_heads != 0)
    return InvalidArgument("llama config: d_model (" + std::to_string(d_model) +
                           ") must be a multiple of q_heads (" + std::to_string(q_heads) + ")");
  if (q_heads % kv_heads != 0)
    return InvalidArgument("llama config: q_heads (" + std::to_string(q_heads) +
                           ") must be a multiple of kv_heads (" + std::to_string(kv_heads) + ")");
  if (head_dim() % 2 != 0 || head_dim() > kernels::kMaxHeadDim)
    return InvalidArgument("llama config: head_dim (" + std::to_string(head_dim()) +
                           ") must be even and <= " + std::to_string(kernels::kMaxHeadDim));
  if (!(rope_theta > 0) || !std::isfinite(rope_theta))
    return InvalidArgument("llama config: rope_theta must be > 0 (got " + std::to_string(rope_theta) + ")");
  if (!(norm_eps > 0) || !std::isfinite(norm_eps))
    return InvalidArgument("llama config: norm_eps must be > 0 (got " + std::to_string(norm_eps) + ")");
  return Status::Ok();
}

Result<LlamaConfig> LlamaConfig::FromMetadata(const std::map<std::string, std::string>& meta,
                                              const std::string& path) {
  auto it = meta.find("model");
  if (it == meta.end() || it->second != kModelName)
    return InvalidArgument(path + ": __metadata__ 'model' is '" +
                           (it == meta.end() ? std::string("(absent)") : it->second) + "', expected '" +
                           kModelName + "'");
  LlamaConfig c;
  KVTIER_RETURN_IF_ERROR(ParseIntKey(meta, path, "vocab", &c.vocab));
  KVTIER_RETURN_IF_ERROR(ParseIntKey(meta, path, "d_model", &c.d_model));
  KVTIER_RETURN_IF_ERROR(ParseIntKey(meta, path, "n_layers", &c.n_layers));
  KVTIER_RETURN_IF_ERROR(ParseIntKey(meta, path, "q_heads", &c.q_heads));
  KVTIER_RETURN_IF_ERROR(ParseIntKey(meta, path, "kv_heads", &c.kv_heads));
  KVTIER_RETURN_IF_ERROR(ParseIntKey(meta, path, "ffn_hidden", &c.ffn_hidden));
  KVTIER_RETURN_IF_ERROR(ParseFloatKey(meta, path, "rope_theta", &c.rope_theta));
  KVTIER_RETURN_IF_ERROR(ParseFloatKey(meta, path, "norm_eps", &c.norm_eps));
  Status st = c.Validate();
  if (!st.ok()) return InvalidArgument(path + ": " + st.message());
  return c;
}

Geometry LlamaConfig::KvGeometry(DType dtype) const {
  Geometry g;
  g.layers = n_layers;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim();
  g.dtype = dtype;
  return g;
}

// ---------------------------------------------------------------------------
// LlamaModel

Result<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(SafeTensors st, LoadSafeTensors(path));
  return FromSafeTensors(st);
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::FromSafeTensors(const SafeTensors& st) {
  KVTIER_ASSIGN_OR_RETURN(LlamaConfig c, LlamaConfig::FromMetadata(st.metadata, st.path));
  auto m = std::unique_ptr<LlamaModel>(new LlamaModel());
  m->config_ = c;
  const int64_t d = c.d_model, hd = c.head_dim(), qd = c.q_heads * hd, kvd = c.kv_heads * hd,
                f = c.ffn_hidden;
  KVTIER_RETURN_IF_ERROR(Take(st, "embed", {c.vocab, d}, &m->embed_));
  KVTIER_RETURN_IF_ERROR(Take(st, "final_norm", {d}, &m->final_norm_));
  KVTIER_RETURN_IF_ERROR(Take(st, "lm_head", {c.vocab, d}, &m->lm_head_));
  m->layers_.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LlamaLayer& L = m->layers_[i];
    KVTIER_RETURN_IF_ERROR(Take(st, p + "attn_norm", {d}, &L.attn_norm));
    KVTIER_RETURN_IF_ERROR(Take(st, p + "wq", {qd, d}, &L.wq));
    KVTIER_RETURN_IF_ERROR(Take(st, p + "wk", {kvd, d}, &L.wk));
    KVTIER_RETURN_IF_ERROR(Take(st, p + "wv", {kvd, d}, &L.wv));
    KVTIER_RETURN_IF_ERROR(Take(st, p + "wo", {d, qd}, &L.wo));
    KVTIER_RETURN_IF_ERROR(Take(st, p + "mlp_norm", {d}, &L.mlp_norm));
    KVTIER_RETURN_IF_ERROR(Take(st, p + "w_gate", {f, d}, &L.w_gate));
    KVTIER_RETURN_IF_ERROR(Take(st, p + "w_up", {f, d}, &L.w_up));
    KVTIER_RETURN_IF_ERROR(Take(st, p + "w_down", {d, f}, &L.w_down));
  }
  return m;
}

// ---------------------------------------------------------------------------
// LlamaSession

LlamaSession::LlamaSession(const LlamaModel* model, std::unique_ptr<TieredStore> store,
                           std::unique_ptr<Session> session)
    : model_(model), store_(std::move(store)), session_(std::move(session)) {
  inv_freq_ = kernels::RopeInvFreq(model->config().head_dim(), model->config().rope_theta);
}

void LlamaSession::ApplyRope(float* x, int m, int heads, const int64_t* positions) const {
  kernels::Rope(x, m, heads, model_->config().head_dim(), positions, inv_freq_.data());
}

LlamaSession::~LlamaSession() {
  if (session_) session_->Drop().IgnoreError();  // best effort: the store goes away with us
}

Result<std::unique_ptr<LlamaSession>> LlamaSession::Create(const LlamaModel* model, StoreOptions options,
                                                           PositionMode positions) {
  if (model == nullptr) return InvalidArgument("LlamaSession: model is null");
  if (positions != PositionMode::kAbsolute && positions != PositionMode::kInfLLM)
    return InvalidArgument("LlamaSession: unknown position mode " +
                           std::to_string(static_cast<int>(positions)));
  options.geometry = model->config().KvGeometry(options.geometry.dtype);
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<TieredStore> store, TieredStore::Open(options));
  SessionOptions so;
  so.retrieve = false;  // every live chunk until EnableRetrieval or SetChunkSelector
  so.positions = positions;
  so.rope_theta = model->config().rope_theta;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Session> session, Session::Open(store.get(), so));
  HotTier* hot = store->hot_tier();
  auto s = std::unique_ptr<LlamaSession>(new LlamaSession(model, std::move(store), std::move(session)));
  if (hot->device() == Device::kCuda) {
    // The forward follows the KV memory onto the device: a prefill window is at most n_local tokens.
    KVTIER_ASSIGN_OR_RETURN(
        s->device_, LlamaDeviceForward::Create(model, hot, s->store_->options().n_local,
                                               s->store_->options().geometry.dtype, positions, s->inv_freq_));
  }
  return s;
}

Status LlamaSession::ReplaceSession(SessionOptions options, ChunkSelector selector) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Session> s,
                          Session::Attach(store_.get(), session_->sequence(), options));
  ImplOf(*s).SetChunkSelector(std::move(selector));
  session_ = std::move(s);
  return Status::Ok();
}

Status LlamaSession::KeepQueries(int n) {
  if (position_ != 0)
    return FailedPrecondition("KeepQueries: the session has already run " + std::to_string(position_) +
                              " tokens");
  SessionOptions o = session_->options();
  o.keep_queries = n;
  return ReplaceSession(o, nullptr);
}

Status LlamaSession::SetChunkSelector(ChunkSelector selector) {
  if (position_ != 0)
    return FailedPrecondition("SetChunkSelector: the session has already run " + std::to_string(position_) +
                              " tokens");
  SessionOptions o = session_->options();
  o.retrieve = false;
  return ReplaceSession(o, std::move(selector));
}

Status LlamaSession::EnableRetrieval(const RetrieverOptions& options) {
  if (position_ != 0)
    return FailedPrecondition("EnableRetrieval: the session has already run " + std::to_string(position_) +
                              " tokens; enable retrieval before the first one (the probe sees every window)");
  SessionOptions o = session_->options();
  o.retrieve = true;
  o.retrieval = options;
  Status st = ReplaceSession(o, nullptr);
  if (!st.ok()) return InvalidArgument("EnableRetrieval: " + st.message());
  return Status::Ok();
}

int32_t LlamaSession::Argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

Result<std::vector<float>> LlamaSession::Prefill(const std::vector<int32_t>& tokens, int window) {
  const int n_local = store_->options().n_local;
  if (window <= 0 || window > n_local)
    return InvalidArgument("Prefill: window must be in [1, n_local = " + std::to_string(n_local) + "] (got " +
                           std::to_string(window) +
                           "): a window's own keys must still be in the local window");
  const int vocab = model_->config().vocab;
  std::vector<float> logits(tokens.size() * static_cast<size_t>(vocab));
  for (size_t i = 0; i < tokens.size(); i += static_cast<size_t>(window)) {
    const int m = static_cast<int>(std::min<size_t>(window, tokens.size() - i));
    KVTIER_RETURN_IF_ERROR(Run(tokens.data() + i, m, logits.data() + i * vocab, /*decode=*/false));
  }
  return logits;
}

Result<std::vector<float>> LlamaSession::Decode(int32_t token) {
  std::vector<float> logits(static_cast<size_t>(model_->config().vocab));
  KVTIER_RETURN_IF_ERROR(Run(&token, 1, logits.data(), /*decode=*/true));
  return logits;
}

Status LlamaSession::Run(const int32_t* tokens, int m, float* logits, bool decode) {
  if (!broken_.ok())
    return FailedPrecondition("LlamaSession: an earlier forward pass failed part-way (" + broken_.ToString() +
                              "); start a new session");
  const int vocab = model_->config().vocab;
  for (int t = 0; t < m; ++t)
    if (tokens[t] < 0 || tokens[t] >= vocab)  // checked before anything is appended: the session stays usable
      return InvalidArgument("token " + std::to_string(tokens[t]) + " at position " +
                             std::to_string(position_ + t) + " is outside the vocabulary [0, " +
                             std::to_string(vocab) + ")");
  Status st = Forward(tokens, m, logits, decode);
  if (!st.ok()) broken_ = st;
  return st;
}

namespace {}  // namespace

Status LlamaSession::Forward(const int32_t* tokens, int m, float* logits, bool decode) {
  if (device_) {  // the hot tier is on the GPU: so is the forward (llama_device.h)
    std::vector<int64_t> pos(static_cast<size_t>(m));
    std::iota(pos.begin(), pos.end(), position_);
    KVTIER_RETURN_IF_ERROR(device_->Forward(session_.get(), tokens, pos.data(), m, decode, logits, capture_));
    position_ += m;
    return Status::Ok();
  }
  const LlamaConfig& c = model_->config();
  const int d = c.d_model, hd = c.head_dim(), qd = c.q_heads * hd, kvd = c.kv_heads * hd, f = c.ffn_hidden;
  const Geometry& g = store_->options().geometry;
  const bool infllm = session_->options().positions == PositionMode::kInfLLM;
  const size_t md = static_cast<size_t>(m);
  std::vector<int64_t> pos(md);
  std::iota(pos.begin(), pos.end(), position_);

  std::vector<float> x(md * d), h(md * d), q(md * qd), k(md * kvd), v(md * kvd), att(md * qd);
  std::vector<float> q_rot, k_rot;  // kInfLLM with a capture: rotated copies at the true positions
  std::vector<float> gate(md * f), up(md * f);
  std::vector<uint8_t> kb(md * kvd * DTypeSize(g.dtype)), vb(kb.size());
  {
    kernels::EmbeddingParams p;
    p.m = m;
    p.d = d;
    p.vocab = c.vocab;
    p.tokens = tokens;
    p.table = model_->embed().data();
    p.out = x.data();
    KVTIER_RETURN_IF_ERROR(Check(kernels::Embedding(p), "Embedding"));
  }
  KVTIER_RETURN_IF_ERROR(session_->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill));

  for (int l = 0; l < c.n_layers; ++l) {
    const LlamaLayer& L = model_->layers()[l];
    KVTIER_RETURN_IF_ERROR(RmsNorm(x.data(), m, d, L.attn_norm.data(), c.norm_eps, h.data()));
    KVTIER_RETURN_IF_ERROR(MatMul(h.data(), m, d, L.wq.data(), qd, q.data(), false));
    KVTIER_RETURN_IF_ERROR(MatMul(h.data(), m, d, L.wk.data(), kvd, k.data(), false));
    KVTIER_RETURN_IF_ERROR(MatMul(h.data(), m, d, L.wv.data(), kvd, v.data(), false));
    // kAbsolute: the engine (this model) applies RoPE; kInfLLM: the session does, at attention
    // time, and the store keeps keys before RoPE.
    if (!infllm) {
      ApplyRope(q.data(), m, c.q_heads, pos.data());
      ApplyRope(k.data(), m, c.kv_heads, pos.data());
    }
    if (capture_) {
      if (infllm) {  // the capture sees queries and keys at their true positions in both modes
        q_rot = q;
        k_rot = k;
        ApplyRope(q_rot.data(), m, c.q_heads, pos.data());
        ApplyRope(k_rot.data(), m, c.kv_heads, pos.data());
        capture_(l, position_, m, q_rot.data(), k_rot.data(), v.data());
      } else {
        capture_(l, position_, m, q.data(), k.data(), v.data());
      }
    }
    // The window's K/V go into the store first, so its queries find them in the local window.
    FromFloat(g.dtype, k.data(), kb.data(), k.size());
    FromFloat(g.dtype, v.data(), vb.data(), v.size());
    KVTIER_RETURN_IF_ERROR(session_->Append(l, kb.data(), vb.data(), m, g.dtype));
    Status st = session_->Attend(l, q.data(), pos.data(), m, att.data());
    if (!st.ok()) return Status(st.code(), "layer " + std::to_string(l) + ": " + st.message());

    KVTIER_RETURN_IF_ERROR(MatMul(att.data(), m, qd, L.wo.data(), d, x.data(), true));
    KVTIER_RETURN_IF_ERROR(RmsNorm(x.data(), m, d, L.mlp_norm.data(), c.norm_eps, h.data()));
    KVTIER_RETURN_IF_ERROR(MatMul(h.data(), m, d, L.w_gate.data(), f, gate.data(), false));
    KVTIER_RETURN_IF_ERROR(MatMul(h.data(), m, d, L.w_up.data(), f, up.data(), false));
    kernels::SwiGluParams sg;  // gate = SiLU(gate) * up
    sg.n = gate.size();
    sg.gate = gate.data();
    sg.up = up.data();
    KVTIER_RETURN_IF_ERROR(Check(kernels::SwiGlu(sg), "SwiGlu"));
    KVTIER_RETURN_IF_ERROR(MatMul(gate.data(), m, f, L.w_down.data(), d, x.data(), true));
  }
  KVTIER_RETURN_IF_ERROR(RmsNorm(x.data(), m, d, model_->final_norm().data(), c.norm_eps, h.data()));
  KVTIER_RETURN_IF_ERROR(MatMul(h.data(), m, d, model_->lm_head().data(), c.vocab, logits, false));
  position_ += m;
  return Status::Ok();
}

}  // namespace kvtier::model
