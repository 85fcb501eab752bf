#include "retrieval/probe.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <system_error>

namespace kvtier {

// ---- ProbeBuilder ---------------------------------------------------------------------

ProbeBuilder::~ProbeBuilder() = default;

Status ProbeBuilder::CheckQueries(const char* what, int layer, const float* q, int m, const float* out) const {
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
  const int G = g.group_size(), D = g.head_dim;
  std::fill_n(probe, static_cast<size_t>(g.kv_heads) * D, 0.0f);
  const float w = 1.0f / static_cast<float>(m * G);
  for (int i = 0; i < m; ++i)
    for (int h = 0; h < g.q_heads; ++h) {
      const float* src = q + (static_cast<size_t>(i) * g.q_heads + h) * D;
      float* dst = probe + static_cast<size_t>(h / G) * D;
      for (int d = 0; d < D; ++d) dst[d] += w * src[d];
    }
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

namespace {
// Eq. 8: sigma^2 = sum_{i=1..t} sum_j (q_j^i - z-bar^t)^2 / (mt - 1), from the running sum of
// squared deviations m2 and the count mt (>= 2). The one place the denominator lives.
double Eq8Variance(double m2, int64_t count) { return m2 / static_cast<double>(count - 1); }
}  // namespace

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
    for (size_t d = 0; d < D; ++d) s.variance[d] = Eq8Variance(ls.m2[off + d], ls.count);
  }
  return s;
}

Status ActProbeBuilder::Build(int layer, const float* q, int m, float* probe) {
  KVTIER_RETURN_IF_ERROR(CheckQueries("Build", layer, q, m, probe));
  const int Hq = g_.q_heads, Hkv = g_.kv_heads, D = g_.head_dim, G = g_.group_size();
  const size_t row = static_cast<size_t>(Hq) * D;  // stride between consecutive queries of one head
  LayerState& ls = layers_[layer];
  if (ls.mean.empty()) {
    ls.mean.assign(row, 0.0);
    ls.m2.assign(row, 0.0);
  }

  // Step 1, Eq. 8 (running form): merge this window into the statistics of every q head, so that
  // mean = z-bar^t = sum_{i=1..t} sum_j q_j^i / (mt) and m2 = sum_{i=1..t} sum_j (q_j^i - z-bar^t)^2.
  // Chan et al.: with the window's own mean mu_w and sum of squares M2_w (two-pass, fp64),
  //   delta = mu_w - mean, N = n + m, mean += delta * m / N, M2 += M2_w + delta^2 * n * m / N.
  const int64_t n_old = ls.count;
  const int64_t n_all = n_old + m;
  std::vector<double> wmean(D), wm2(D);
  for (int h = 0; h < Hq; ++h) {
    const float* qh = q + static_cast<size_t>(h) * D;
    std::fill(wmean.begin(), wmean.end(), 0.0);
    std::fill(wm2.begin(), wm2.end(), 0.0);
    for (int j = 0; j < m; ++j)
      for (int d = 0; d < D; ++d) wmean[d] += qh[j * row + d];
    for (int d = 0; d < D; ++d) wmean[d] /= m;
    for (int j = 0; j < m; ++j)
      for (int d = 0; d < D; ++d) {
        const double dev = qh[j * row + d] - wmean[d];
        wm2[d] += dev * dev;
      }
    double* mean = ls.mean.data() + static_cast<size_t>(h) * D;
    double* m2 = ls.m2.data() + static_cast<size_t>(h) * D;
    const double fb = static_cast<double>(m) / static_cast<double>(n_all);
    const double fab = static_cast<double>(n_old) * static_cast<double>(m) / static_cast<double>(n_all);
    for (int d = 0; d < D; ++d) {
      const double delta = wmean[d] - mean[d];
      mean[d] += delta * fb;
      m2[d] += wm2[d] + delta * delta * fab;
    }
  }
  ls.count = n_all;

  // Edge case: first window with m == 1. Eq. 8's denominator mt - 1 is 0 and sigma^2 is
  // undefined, so the probe falls back to mean pooling (which for m == 1 is the query itself).
  if (n_all < 2) {
    MeanPoolProbe(g_, q, m, probe);
    return Status::Ok();
  }

  std::vector<double> var(D), l1(m), acc(static_cast<size_t>(Hkv) * D, 0.0);
  for (int h = 0; h < Hq; ++h) {
    const float* qh = q + static_cast<size_t>(h) * D;
    const double* mean = ls.mean.data() + static_cast<size_t>(h) * D;
    const double* m2 = ls.m2.data() + static_cast<size_t>(h) * D;
    // Eq. 8: sigma^2 per dimension (a vector, like z-bar). Edge case: a dimension with
    // sigma^2 <= eps (in particular sigma^2 == 0) contributes 0 to phi instead of inf/NaN.
    for (int d = 0; d < D; ++d) var[d] = Eq8Variance(m2[d], n_all);
    // Eq. 7: phi_j = (q_j - z-bar)^2 / sigma^2 elementwise; ||phi_j||_1 = sum_d phi_jd (phi >= 0).
    double total = 0.0;  // ||Phi||_1 = sum_j ||phi_j||_1
    for (int j = 0; j < m; ++j) {
      double s = 0.0;
      for (int d = 0; d < D; ++d) {
        if (!(var[d] > opt_.eps)) continue;  // sigma^2 <= eps: phi_jd = 0
        const double dev = qh[j * row + d] - mean[d];
        s += dev * dev / var[d];
      }
      l1[j] = s;
      total += s;
    }
    // Eq. 9: weight_j = ||phi_j||_1 / ||Phi||_1. Edge case: ||Phi||_1 == 0 (every query equals
    // z-bar in every dimension with sigma^2 > eps) -> uniform weights 1/m (mean pooling).
    const bool uniform = !(total > 0.0);
    // Eq. 9: Q_probe = sum_j weight_j q_j for this q head; then GQA: the kv-head probe is the
    // mean of the probes of the G q heads in its group (the mapping mean pooling uses too).
    double* dst = acc.data() + static_cast<size_t>(h / G) * D;
    for (int j = 0; j < m; ++j) {
      const double w = (uniform ? 1.0 / m : l1[j] / total) / G;
      if (w == 0.0) continue;
      for (int d = 0; d < D; ++d) dst[d] += w * qh[j * row + d];
    }
  }
  for (size_t i = 0; i < acc.size(); ++i) probe[i] = static_cast<float>(acc[i]);
  return Status::Ok();
}

// ---- question ---------------------------------------------------------------------------

Status QuestionProbeOptions::Validate() const {
  if (base != "act" && base != "mean")
    return InvalidArgument("QuestionProbeOptions.base must be 'act' or 'mean' (got '" + base + "')");
  if (!std::isfinite(weight) || weight < 0.0 || weight > 1.0)
    return InvalidArgument("QuestionProbeOptions.weight must be in [0, 1] (got " + FormatSpecDouble(weight) + ")");
  if (!std::isfinite(eps) || eps < 0.0)
    return InvalidArgument("QuestionProbeOptions.eps must be finite and >= 0 (got " + FormatSpecDouble(eps) + ")");
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
  for (size_t i = 0; i < qv.size(); ++i)
    probe[i] = static_cast<float>((1.0 - w) * probe[i] + w * qv[i]);
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
  return InvalidArgument("unknown probe '" + fs.name + "' in spec '" + spec + "' (known: mean, act, question)");
}

}  // namespace kvtier
