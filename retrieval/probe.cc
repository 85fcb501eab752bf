#include "retrieval/probe.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <system_error>

#include "kernels/cpu/probe.h"

namespace kvtier {
namespace {
kernels::ProbeShape ProbeShapeOf(const Geometry& g) {
  kernels::ProbeShape s;
  s.q_heads = g.q_heads;
  s.kv_heads = g.kv_heads;
  s.head_dim = g.head_dim;
  return s;
}
}  // namespace

// ---- ProbeBuilder ---------------------------------------------------------------------

ProbeBuilder::~ProbeBuilder() = default;

Status ProbeBuilder::CheckQueries(const char* what, int layer, const float* q, int m,
                                  const float* out) const {
  const std::string name = std::string("ProbeBuilder::") + what;
  if (layer < 0 || layer >= g_.layers)
    return InvalidArgument(name + ": layer " + std::to_string(layer) + " out of range [0, " +
                           std::to_string(g_.layers) + ")");
  if (m < 1) return InvalidArgument(name + ": m must be >= 1 (got " + std::to_string(m) + ")");
  if (q == nullptr) return InvalidArgument(name + ": q must not be null");
  if (out == nullptr) return InvalidArgument(name + ": output must not be null");
  const size_t n = static_cast<size_t>(m) * g_.q_heads * g_.head_dim;
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(q[i]))
      return InvalidArgument(name + ": q has a non-finite value at element " + std::to_string(i) +
                             " (layer " + std::to_string(layer) + ")");
  return Status::Ok();
}

Status ProbeBuilder::BuildDecode(int layer, const float* q, float* probe) {
  // ActQKV Sec. 4.2: Q_probe^t = q^t. Mapped to kv heads by the mean over each GQA group.
  // Deliberately no statistics update: decode queries do not feed Eq. 8.
  KVTIER_RETURN_IF_ERROR(CheckQueries("BuildDecode", layer, q, 1, probe));
  MeanPoolProbe(g_, q, 1, probe);
  return Status::Ok();
}

Status ProbeBuilder::SetQuestion(int layer, const float* q, int m) {
  return FailedPrecondition("probe builder '" + ToString() +
                            "' does not use a question (use 'question:...' to set one)");
}

void ProbeBuilder::Reset() {}

void MeanPoolProbe(const Geometry& g, const float* q, int m, float* probe) {
  kernels::MeanPoolProbe(ProbeShapeOf(g), q, m, probe);
}

// ---- mean -----------------------------------------------------------------------------

Result<std::unique_ptr<MeanProbeBuilder>> MeanProbeBuilder::Make(const Geometry& g) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  return std::unique_ptr<MeanProbeBuilder>(new MeanProbeBuilder(g));
}

Status MeanProbeBuilder::Build(int layer, const float* q, int m, float* probe) {
  KVTIER_RETURN_IF_ERROR(CheckQueries("Build", layer, q, m, probe));
  MeanPoolProbe(g_, q, m, probe);
  return Status::Ok();
}

// ---- act ------------------------------------------------------------------------------

Status ActProbeOptions::Validate() const {
  if (!std::isfinite(eps) || eps < 0.0)
    return InvalidArgument("ActProbeOptions.eps must be finite and >= 0 (got " + FormatSpecDouble(eps) + ")");
  return Status::Ok();
}

ActProbeBuilder::ActProbeBuilder(const Geometry& g, const ActProbeOptions& o)
    : ProbeBuilder(g), opt_(o), layers_(static_cast<size_t>(g.layers)) {}

Result<std::unique_ptr<ActProbeBuilder>> ActProbeBuilder::Make(const Geometry& g, const ActProbeOptions& o) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  KVTIER_RETURN_IF_ERROR(o.Validate());
  return std::unique_ptr<ActProbeBuilder>(new ActProbeBuilder(g, o));
}

std::string ActProbeBuilder::ToString() const { return "act:eps=" + FormatSpecDouble(opt_.eps); }

void ActProbeBuilder::Reset() {
  for (auto& ls : layers_) ls = LayerState{};
}

Result<ActStats> ActProbeBuilder::Stats(int layer, int q_head) const {
  if (layer < 0 || layer >= g_.layers)
    return InvalidArgument("ActProbeBuilder::Stats: layer " + std::to_string(layer) + " out of range");
  if (q_head < 0 || q_head >= g_.q_heads)
    return InvalidArgument("ActProbeBuilder::Stats: q_head " + std::to_string(q_head) + " out of range");
  const LayerState& ls = layers_[layer];
  ActStats s;
  s.count = ls.count;
  if (ls.count == 0) return s;
  const size_t D = static_cast<size_t>(g_.head_dim), off = static_cast<size_t>(q_head) * D;
  s.mean.assign(ls.mean.begin() + off, ls.mean.begin() + off + D);
  if (ls.count >= 2) {
    s.variance.resize(D);
    for (size_t d = 0; d < D; ++d) s.variance[d] = kernels::ActVariance(ls.m2[off + d], ls.count);
  }
  return s;
}

Status ActProbeBuilder::Build(int layer, const float* q, int m, float* probe) {
  KVTIER_RETURN_IF_ERROR(CheckQueries("Build", layer, q, m, probe));
  const size_t row = static_cast<size_t>(g_.q_heads) * g_.head_dim;
  LayerState& ls = layers_[layer];
  if (ls.mean.empty()) {
    ls.mean.assign(row, 0.0);
    ls.m2.assign(row, 0.0);
  }
  // Step 1, Eq. 8 (running form): merge this window into the statistics of every q head FIRST,
  // so that mean = z-bar^t and m2 = sum_{i=1..t} sum_j (q_j^i - z-bar^t)^2 include window t.
  // Steps 2-3, Eq. 7 and Eq. 9 (mean pooling while count < 2). The arithmetic is
  // kernels/cpu/probe, the twin of the CUDA probe kernels.
  const kernels::ProbeShape shape = ProbeShapeOf(g_);
  kernels::ActMergeWindow(shape, q, m, ls.count, ls.mean.data(), ls.m2.data());
  ls.count += m;
  kernels::ActWeightedProbe(shape, q, m, ls.mean.data(), ls.m2.data(), ls.count, opt_.eps, probe);
  return Status::Ok();
}

// ---- question ---------------------------------------------------------------------------

Status QuestionProbeOptions::Validate() const {
  if (base != "act" && base != "mean")
    return InvalidArgument("QuestionProbeOptions.base must be 'act' or 'mean' (got '" + base + "')");
  if (!std::isfinite(weight) || weight < 0.0 || weight > 1.0)
    return InvalidArgument("QuestionProbeOptions.weight must be in [0, 1] (got " + FormatSpecDouble(weight) +
                           ")");
  if (!std::isfinite(eps) || eps < 0.0)
    return InvalidArgument("QuestionProbeOptions.eps must be finite and >= 0 (got " + FormatSpecDouble(eps) +
                           ")");
  return Status::Ok();
}

QuestionProbeBuilder::QuestionProbeBuilder(const Geometry& g, const QuestionProbeOptions& o,
                                           std::unique_ptr<ProbeBuilder> base)
    : ProbeBuilder(g), opt_(o), base_(std::move(base)), question_(static_cast<size_t>(g.layers)) {}

Result<std::unique_ptr<QuestionProbeBuilder>> QuestionProbeBuilder::Make(const Geometry& g,
                                                                         const QuestionProbeOptions& o) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  KVTIER_RETURN_IF_ERROR(o.Validate());
  std::unique_ptr<ProbeBuilder> base;
  if (o.base == "act") {
    ActProbeOptions ao;
    ao.eps = o.eps;
    KVTIER_ASSIGN_OR_RETURN(base, ActProbeBuilder::Make(g, ao));
  } else {
    KVTIER_ASSIGN_OR_RETURN(base, MeanProbeBuilder::Make(g));
  }
  return std::unique_ptr<QuestionProbeBuilder>(new QuestionProbeBuilder(g, o, std::move(base)));
}

std::string QuestionProbeBuilder::ToString() const {
  std::string s = "question:base=" + opt_.base;
  if (opt_.base == "act") s += ",eps=" + FormatSpecDouble(opt_.eps);
  return s + ",weight=" + FormatSpecDouble(opt_.weight);
}

void QuestionProbeBuilder::Reset() {
  base_->Reset();
  for (auto& qv : question_) qv.clear();
}

bool QuestionProbeBuilder::has_question(int layer) const {
  return layer >= 0 && layer < g_.layers && !question_[layer].empty();
}

Status QuestionProbeBuilder::SetQuestion(int layer, const float* q, int m) {
  KVTIER_RETURN_IF_ERROR(CheckQueries("SetQuestion", layer, q, m, /*out=*/q));  // no caller output here
  std::vector<float> pooled(g_.token_elems());
  MeanPoolProbe(g_, q, m, pooled.data());  // the question's queries, pooled to kv heads
  question_[layer] = std::move(pooled);
  return Status::Ok();
}

Status QuestionProbeBuilder::Build(int layer, const float* q, int m, float* probe) {
  KVTIER_RETURN_IF_ERROR(base_->Build(layer, q, m, probe));
  const std::vector<float>& qv = question_[layer];
  if (qv.empty()) return Status::Ok();  // no question: the base probe
  const double w = opt_.weight;
  for (size_t i = 0; i < qv.size(); ++i) probe[i] = static_cast<float>((1.0 - w) * probe[i] + w * qv[i]);
  return Status::Ok();
}

// ---- factory ------------------------------------------------------------------------------

Result<std::unique_ptr<ProbeBuilder>> MakeProbeBuilder(const std::string& spec, const Geometry& g) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "probe"));
  auto unknown_key = [&](const std::string& key, const char* known) {
    return InvalidArgument("unknown key '" + key + "' for probe '" + fs.name + "' in spec '" + spec +
                           "' (known: " + known + ")");
  };
  if (fs.name == "mean") {
    if (!fs.params.empty()) return unknown_key(fs.params[0].first, "none");
    KVTIER_ASSIGN_OR_RETURN(auto b, MeanProbeBuilder::Make(g));
    return std::unique_ptr<ProbeBuilder>(std::move(b));
  }
  if (fs.name == "act") {
    ActProbeOptions o;
    for (const auto& [key, value] : fs.params) {
      if (key != "eps") return unknown_key(key, "eps");
      KVTIER_ASSIGN_OR_RETURN(o.eps, ParseSpecDouble(spec, key, value));
    }
    if (Status st = o.Validate(); !st.ok())
      return InvalidArgument("bad value for key 'eps' in probe spec '" + spec + "': " + st.message());
    KVTIER_ASSIGN_OR_RETURN(auto b, ActProbeBuilder::Make(g, o));
    return std::unique_ptr<ProbeBuilder>(std::move(b));
  }
  if (fs.name == "question") {
    QuestionProbeOptions o;
    bool eps_given = false;
    for (const auto& [key, value] : fs.params) {
      if (key == "base") {
        if (value != "act" && value != "mean")
          return InvalidArgument("bad value '" + value + "' for key 'base' in probe spec '" + spec +
                                 "' (expected act or mean)");
        o.base = value;
      } else if (key == "weight") {
        KVTIER_ASSIGN_OR_RETURN(o.weight, ParseSpecDouble(spec, key, value));
        if (o.weight < 0.0 || o.weight > 1.0)
          return InvalidArgument("bad value '" + value + "' for key 'weight' in probe spec '" + spec +
                                 "' (expected a number in [0, 1])");
      } else if (key == "eps") {
        KVTIER_ASSIGN_OR_RETURN(o.eps, ParseSpecDouble(spec, key, value));
        if (o.eps < 0.0)
          return InvalidArgument("bad value '" + value + "' for key 'eps' in probe spec '" + spec +
                                 "' (expected a number >= 0)");
        eps_given = true;
      } else {
        return unknown_key(key, "base, weight, eps");
      }
    }
    if (eps_given && o.base != "act")
      return InvalidArgument("key 'eps' in probe spec '" + spec + "' applies only to base=act");
    KVTIER_ASSIGN_OR_RETURN(auto b, QuestionProbeBuilder::Make(g, o));
    return std::unique_ptr<ProbeBuilder>(std::move(b));
  }
  return InvalidArgument("unknown probe '" + fs.name + "' in spec '" + spec +
                         "' (known: mean, act, question)");
}

}  // namespace kvtier
