// Probe builders: how the queries of a window become the probe that chunk
// retrieval matches against the chunk representatives.
//
// A probe is [kv_heads, head_dim] fp32 per layer. Builders are pluggable by
// factory string ("name" or "name:key=value,key=value"; ToString() gives the
// canonical string with every parameter, and it rebuilds the same builder):
//
//   mean                          InfLLM: mean over the window's queries and
//                                 the q heads of each GQA group.
//   act[:eps=E]                   ActQKV activation-aware probe (Sec. 4.1,
//                                 Eq. 7-9) with running statistics (Eq. 8).
//   question[:base=act|mean,eps=E,weight=W]
//                                 Q-LLM-style: (1 - W) * base + W * question,
//                                 once a question is set for the layer.
//
// Decoding (ActQKV Sec. 4.2) uses the current query itself as the probe:
// BuildDecode maps q [1, q_heads, head_dim] to kv heads by the mean over each
// group and never touches running statistics.
//
// Threading: one builder per sequence. Calls for different layers may run
// concurrently (per-layer state is allocated up front); calls for the same
// layer, and Reset(), must not overlap with anything else.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "store/factory_spec.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

class ProbeBuilder {
 public:
  virtual ~ProbeBuilder();

  /// Builds the probe of one window of one layer: q is [m, q_heads, head_dim] fp32 (m >= 1),
  /// probe out is [kv_heads, head_dim] fp32 (GQA: the q heads of a group map to their kv head).
  /// Stateful builders (act) update their running statistics for `layer` here.
  /// InvalidArgument for a bad layer, m < 1, a null pointer or a non-finite query value;
  /// on error nothing (statistics included) has changed.
  virtual Status Build(int layer, const float* q, int m, float* probe) = 0;

  /// Decoding (ActQKV Sec. 4.2): the probe is the current query itself, q [1, q_heads, head_dim]
  /// mapped to kv heads (mean over the group). Running statistics are NOT updated by decode
  /// steps, and no question weighting is applied: every builder returns the same decode probe.
  virtual Status BuildDecode(int layer, const float* q, float* probe);

  /// Sets the question (q [m, q_heads, head_dim], m >= 1) that question-aware builders mix into
  /// the probes of `layer`. Builders that do not use a question return FailedPrecondition
  /// (generic on the base class so that a builder from the factory needs no downcast).
  virtual Status SetQuestion(int layer, const float* q, int m);

  /// Factory string that rebuilds it, e.g. "act:eps=1e-06".
  virtual std::string ToString() const = 0;

  /// Forgets running statistics and questions (new sequence).
  virtual void Reset();

  const Geometry& geometry() const { return g_; }

 protected:
  explicit ProbeBuilder(const Geometry& g) : g_(g) {}
  /// Checks layer range, non-null q and out, m >= 1 and that all m*q_heads*head_dim
  /// values of q are finite; `what` names the call in the message.
  Status CheckQueries(const char* what, int layer, const float* q, int m, const float* out) const;

  Geometry g_;
};

/// InfLLM mean pooling: probe[h] = mean over the m queries and the q heads of kv head h's GQA
/// group ([m, q_heads, head_dim] -> [kv_heads, head_dim]).
/// No argument checks.
void MeanPoolProbe(const Geometry& g, const float* q, int m, float* probe);

/// "mean": InfLLM's probe (MeanPoolProbe). Stateless.
class MeanProbeBuilder final : public ProbeBuilder {
 public:
  static Result<std::unique_ptr<MeanProbeBuilder>> Make(const Geometry& g);
  Status Build(int layer, const float* q, int m, float* probe) override;
  std::string ToString() const override { return "mean"; }

 private:
  explicit MeanProbeBuilder(const Geometry& g) : ProbeBuilder(g) {}
};

struct ActProbeOptions {
  /// A dimension whose running variance sigma^2 is <= eps contributes 0 to phi (Eq. 7) instead
  /// of dividing by ~0 (default 1e-6; must be finite and >= 0; 0 drops only sigma^2 == 0).
  double eps = 1e-6;
  Status Validate() const;
};

/// Running statistics of one (layer, q head): Eq. 8 over every query of every window so far.
struct ActStats {
  int64_t count = 0;             ///< m*t: query vectors seen by this layer (same for all heads)
  std::vector<double> mean;      ///< z-bar, [head_dim]; empty when count == 0
  std::vector<double> variance;  ///< sigma^2 per dimension, unbiased (/(count-1)); empty when count < 2
};

/// "act": ActQKV's activation-aware probe-Query (Sec. 4.1).
///
/// Statistics are kept per (layer, q head): every q head has its own mean z-bar and per-dimension
/// variance sigma^2 (Eq. 8), accumulated in fp64 with the Chan et al. parallel form of Welford's
/// update (window mean and window sum of squared deviations, merged into the running ones), which
/// equals Eq. 8's direct sums exactly in exact arithmetic and stays stable in floating point.
/// Eq. 8 writes mt for the count; windows may have different m here, so the count is the total
/// number of query vectors seen, and the denominator is (count - 1).
///
/// For each window (Build), per q head:
///   1. merge the window into the running statistics FIRST (Eq. 8 sums i = 1..t: the current
///      window is included, so z-bar and sigma^2 are z-bar^t and sigma^2 over windows 1..t);
///   2. phi_j = (q_j - z-bar)^2 / sigma^2 elementwise (Eq. 7);
///   3. weight_j = ||phi_j||_1 / ||Phi||_1 (Eq. 9), probe_head = sum_j weight_j q_j.
/// The kv-head probe is the mean of the probes of the q heads in its GQA group (the same mapping
/// that mean pooling uses).
///
/// Edge cases:
///   - first window with m == 1 (count 1, mt - 1 = 0, sigma^2 undefined): the probe is mean
///     pooling (here: the single query, mapped to kv heads); the statistics still take it in.
///   - a dimension with sigma^2 <= eps (eps = 0: sigma^2 == 0) contributes 0 to every phi_j.
///   - ||Phi||_1 == 0 (every query equals z-bar in every dimension that counts): uniform weights
///     1/m, i.e. mean pooling of that head.
///   - non-finite input: InvalidArgument, statistics unchanged.
/// Because the current window is part of sigma^2, each phi_jd <= count - 1: no overflow.
class ActProbeBuilder final : public ProbeBuilder {
 public:
  static Result<std::unique_ptr<ActProbeBuilder>> Make(const Geometry& g, const ActProbeOptions& o = {});
  Status Build(int layer, const float* q, int m, float* probe) override;
  std::string ToString() const override;
  void Reset() override;

  /// The running statistics of (layer, q_head); InvalidArgument when either is out of range.
  Result<ActStats> Stats(int layer, int q_head) const;
  const ActProbeOptions& options() const { return opt_; }

 private:
  ActProbeBuilder(const Geometry& g, const ActProbeOptions& o);
  struct LayerState {
    int64_t count = 0;         // query vectors merged so far (all heads see the same windows)
    std::vector<double> mean;  // [q_heads, head_dim]
    std::vector<double> m2;    // [q_heads, head_dim] sum of squared deviations from mean
  };
  ActProbeOptions opt_;
  std::vector<LayerState> layers_;  // [layers]
};

struct QuestionProbeOptions {
  std::string base = "act";  ///< base builder: "act" or "mean" (default act)
  double weight = 0.5;       ///< question weight w in [0, 1] (default 0.5)
  double eps = 1e-6;         ///< eps of the act base (ActProbeOptions::eps); unused with base=mean
  Status Validate() const;
};

/// "question": Q-LLM-style question-aware probe. The question's queries are pooled to kv heads
/// by mean pooling (MeanPoolProbe) and kept per layer; once a question is set for a layer,
///   probe = (1 - w) * base_probe + w * question_probe,
/// and without one the probe equals the base probe. The question does not feed the base's
/// statistics. Build always runs the base (so act statistics advance either way). BuildDecode is
/// the base class's (current query, no question). Reset() forgets the base's statistics and all
/// questions; SetQuestion again replaces a layer's question.
class QuestionProbeBuilder final : public ProbeBuilder {
 public:
  static Result<std::unique_ptr<QuestionProbeBuilder>> Make(const Geometry& g,
                                                            const QuestionProbeOptions& o = {});
  Status Build(int layer, const float* q, int m, float* probe) override;
  Status SetQuestion(int layer, const float* q, int m) override;
  std::string ToString() const override;
  void Reset() override;

  bool has_question(int layer) const;
  const QuestionProbeOptions& options() const { return opt_; }

 private:
  QuestionProbeBuilder(const Geometry& g, const QuestionProbeOptions& o, std::unique_ptr<ProbeBuilder> base);
  QuestionProbeOptions opt_;
  std::unique_ptr<ProbeBuilder> base_;
  std::vector<std::vector<float>> question_;  // [layers][kv_heads * head_dim]; empty = no question
};

/// Builds a probe builder from its factory string (see the top of this file). Unknown names,
/// unknown or duplicate keys, malformed "key=value" items and bad values are InvalidArgument
/// naming them; a bad geometry is InvalidArgument from Geometry::Validate.
Result<std::unique_ptr<ProbeBuilder>> MakeProbeBuilder(const std::string& spec, const Geometry& g);

}  // namespace kvtier
