#include "integration/kv_source.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace kvtier {
namespace {

class SyntheticSource final : public KvSource {
 public:
  explicit SyntheticSource(Workload work) : work_(std::move(work)) {}
  Geometry geometry() const override {
    Geometry g = work_.geometry();
    g.dtype = DType::kF32;
    return g;
  }
  int64_t context() const override { return work_.options().context; }
  int64_t question_begin() const override { return work_.question_begin(); }
  int64_t total_tokens() const override { return work_.total_tokens(); }
  void Generate(int layer, int64_t begin, int64_t end, float* q, float* k, float* v) const override {
    work_.Generate(layer, begin, end, q, k, v);
  }
  std::vector<TokenRange> SoughtNeedles(int64_t position) const override {
    const int n = work_.SoughtNeedle(position);
    if (n < 0) return {};
    const int64_t b = work_.needle_starts()[static_cast<size_t>(n)];
    return {TokenRange{b, b + work_.options().needle_len}};
  }
  uint64_t memory_bytes() const override { return 0; }

 private:
  Workload work_;
};

class TraceSource final : public KvSource {
 public:
  explicit TraceSource(std::shared_ptr<const KvTrace> t) : t_(std::move(t)) {}
  Geometry geometry() const override { return t_->geometry(); }
  int64_t context() const override { return t_->context; }
  int64_t question_begin() const override { return t_->question_begin; }
  int64_t total_tokens() const override { return t_->n_tokens(); }
  void Generate(int layer, int64_t begin, int64_t end, float* q, float* k, float* v) const override {
    if (layer < 0 || layer >= t_->layers || begin < 0 || begin > end || end > t_->n_tokens()) {
      std::fprintf(
          stderr,
          "kvtier::TraceSource::Generate: bad arguments layer=%d [%lld, %lld) (layers %d, tokens %lld)\n",
          layer, static_cast<long long>(begin), static_cast<long long>(end), t_->layers,
          static_cast<long long>(t_->n_tokens()));
      std::abort();
    }
    const size_t l = static_cast<size_t>(layer);
    const size_t qt = static_cast<size_t>(t_->q_heads) * t_->head_dim,
                 kt = static_cast<size_t>(t_->kv_heads) * t_->head_dim;
    const size_t b = static_cast<size_t>(begin), e = static_cast<size_t>(end);
    if (q) std::copy(t_->q[l].begin() + b * qt, t_->q[l].begin() + e * qt, q);
    if (k) std::copy(t_->k[l].begin() + b * kt, t_->k[l].begin() + e * kt, k);
    if (v) std::copy(t_->v[l].begin() + b * kt, t_->v[l].begin() + e * kt, v);
  }
  // Every query from the question on seeks every needle: a real prompt asks one thing.
  std::vector<TokenRange> SoughtNeedles(int64_t position) const override {
    if (position < t_->question_begin) return {};
    return t_->needles;
  }
  uint64_t memory_bytes() const override { return t_->qkv_bytes(); }

 private:
  std::shared_ptr<const KvTrace> t_;
};

}  // namespace

void AdoptTrace(const KvTrace& trace, Geometry* geometry, WorkloadOptions* workload) {
  geometry->layers = trace.layers;
  geometry->q_heads = trace.q_heads;
  geometry->kv_heads = trace.kv_heads;
  geometry->head_dim = trace.head_dim;
  workload->context = trace.context;
  workload->question_len = static_cast<int>(trace.context - trace.question_begin);
  workload->decode_steps = static_cast<int>(trace.decode_steps());
}

Result<std::unique_ptr<KvSource>> MakeKvSource(const Geometry& geometry, const WorkloadOptions& workload,
                                               std::shared_ptr<const KvTrace> trace) {
  if (!trace) {
    KVTIER_ASSIGN_OR_RETURN(Workload work, Workload::Create(geometry, workload));
    return std::unique_ptr<KvSource>(new SyntheticSource(std::move(work)));
  }
  KVTIER_RETURN_IF_ERROR(trace->Validate());
  Geometry shape = geometry;
  shape.dtype = DType::kF32;
  if (!(shape == trace->geometry()))
    return InvalidArgument("geometry mismatch: " + geometry.ToString() + " but the trace is " +
                           trace->geometry().ToString());
  if (workload.context != trace->context || workload.question_len != trace->context - trace->question_begin ||
      workload.decode_steps != trace->decode_steps())
    return InvalidArgument(
        "context mismatch: context/question_len/decode_steps " + std::to_string(workload.context) + "/" +
        std::to_string(workload.question_len) + "/" + std::to_string(workload.decode_steps) +
        " but the trace has " + std::to_string(trace->context) + "/" +
        std::to_string(trace->context - trace->question_begin) + "/" + std::to_string(trace->decode_steps()));
  return std::unique_ptr<KvSource>(new TraceSource(std::move(trace)));
}

}  // namespace kvtier
