// ObserveQueries: see offload/observe_queries.h.

#include "offload/observe_queries.h"

#include <algorithm>
#include <vector>

#include "offload/attention_backend.h"

namespace kvtier {

Status HostCopyOfView(HotTier* hot, size_t token_bytes, HotView* view,
                      std::vector<std::vector<uint8_t>>* storage) {
  if (hot->device() == Device::kCpu) return Status::Ok();
  // One download of at most n_sink + n_local + chunk_size tokens per call, and only prefill
  // windows observe. A host mirror kept by Append would save that copy but would have to be
  // kept in step by every path that fills the regions (Append, reopen, recovery, attach); the
  // read-back cannot go stale.
  std::vector<kernels::KvSpan*> spans{&view->sinks};
  for (int i = 0; i < view->n_local_spans; ++i) spans.push_back(&view->local[i]);
  storage->resize(2 * spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    kernels::KvSpan& sp = *spans[i];
    const size_t bytes = static_cast<size_t>(sp.n_tokens) * token_bytes;
    std::vector<uint8_t>& k = (*storage)[2 * i];
    std::vector<uint8_t>& v = (*storage)[2 * i + 1];
    k.resize(std::max<size_t>(1, bytes));
    v.resize(std::max<size_t>(1, bytes));
    KVTIER_RETURN_IF_ERROR(hot->Download(k.data(), static_cast<const uint8_t*>(sp.k), bytes));
    KVTIER_RETURN_IF_ERROR(hot->Download(v.data(), static_cast<const uint8_t*>(sp.v), bytes));
    sp.k = k.data();
    sp.v = v.data();
  }
  return Status::Ok();
}

Status ObserveQueries(TieredStore& store, SequenceId seq, int layer, const float* q, const int64_t* positions,
                      int m) {
  if (m <= 0)
    return InvalidArgument("ObserveQueries: query count must be > 0 (got " + std::to_string(m) + ")");
  if (q == nullptr || positions == nullptr)
    return InvalidArgument("ObserveQueries: q and positions must not be null");
  LayerStepView step;
  KVTIER_RETURN_IF_ERROR(store.BeginLayerStep(seq, layer, nullptr, nullptr, &step));
  HotView& view = step.hot;
  HotTier* hot = store.hot_tier();
  const StoreOptions& options = store.options();
  const size_t token_bytes = options.geometry.token_elems() * DTypeSize(options.geometry.dtype);
  const Geometry& g = options.geometry;
  // This attention (for the representative-key statistics) runs on the host: on a device tier
  // over host copies of the sinks and local window (HostCopyOfView).
  std::vector<std::vector<uint8_t>> host_copy;
  KVTIER_RETURN_IF_ERROR(HostCopyOfView(hot, token_bytes, &view, &host_copy));
  std::vector<kernels::KvSpan> parts{view.sinks};
  for (int i = 0; i < view.n_local_spans; ++i) parts.push_back(view.local[i]);
  return AddWindowMass(store, seq, layer, g.dtype, q, positions, m, parts, "ObserveQueries");
}

Status AddWindowMass(TieredStore& store, SequenceId seq, int layer, DType dtype, const float* q,
                     const int64_t* positions, int m, std::vector<kernels::KvSpan> parts, const char* what) {
  const StoreOptions& options = store.options();
  const Geometry& g = options.geometry;
  const int n_local_spans = static_cast<int>(parts.size()) - 1;
  // Per kv head the kernel's mass is the sum over the kv head's query heads. A store whose
  // representatives are per query head (ReprHeads::kQuery) needs each query head's own: the
  // attention runs once per member j of the GQA groups, over the queries of heads
  // {kv * group + j} alone as an MHA geometry (q_heads = kv_heads), whose mass per "kv head" kv
  // is query head kv * group + j's. Softmax is per query head, so each run's mass is exactly
  // that head's share of the attention over the parts.
  const bool per_query = options.repr_heads == ReprHeads::kQuery;
  const int group = g.q_heads / g.kv_heads;
  const int runs = per_query ? group : 1;
  Geometry run_g = g;
  if (per_query) run_g.q_heads = g.kv_heads;
  const int out_heads = per_query ? g.q_heads : g.kv_heads;
  std::vector<float> mass_sinks(static_cast<size_t>(g.kv_heads) * std::max(1, parts[0].n_tokens), 0.0f);
  std::vector<std::vector<float>> mass_local(n_local_spans), mass_out(n_local_spans);
  parts[0].mass = mass_sinks.data();
  for (int i = 0; i < n_local_spans; ++i) {
    const kernels::KvSpan& sp = parts[1 + i];
    mass_local[i].assign(static_cast<size_t>(g.kv_heads) * sp.n_tokens, 0.0f);
    mass_out[i].assign(static_cast<size_t>(out_heads) * sp.n_tokens, 0.0f);
    parts[1 + i].mass = mass_local[i].data();
  }
  std::vector<float> out(static_cast<size_t>(m) * g.q_heads * g.head_dim);
  std::vector<float> q_run(per_query ? static_cast<size_t>(m) * g.kv_heads * g.head_dim : 0);
  const size_t D = static_cast<size_t>(g.head_dim);
  for (int j = 0; j < runs; ++j) {
    const float* q_in = q;
    if (per_query) {
      for (int t = 0; t < m; ++t)
        for (int kv = 0; kv < g.kv_heads; ++kv)
          std::copy_n(q + (static_cast<size_t>(t) * g.q_heads + static_cast<size_t>(kv) * group + j) * D, D,
                      q_run.data() + (static_cast<size_t>(t) * g.kv_heads + kv) * D);
      q_in = q_run.data();
      std::fill(mass_sinks.begin(), mass_sinks.end(), 0.0f);
      for (auto& ml : mass_local) std::fill(ml.begin(), ml.end(), 0.0f);
    }
    const kernels::AttentionParams p = DenseAttentionParams(run_g, dtype, q_in, positions, m, parts.data(),
                                                            static_cast<int>(parts.size()), out.data());
    const kernels::KernelError err = kernels::Attention(p);
    if (err != kernels::KernelError::kOk)
      return InvalidArgument(std::string(what) + ": attention failed: " + kernels::KernelErrorString(err));
    for (int i = 0; i < n_local_spans; ++i) {
      const size_t n = static_cast<size_t>(parts[1 + i].n_tokens);
      for (int kv = 0; kv < g.kv_heads; ++kv) {
        const int h = per_query ? kv * group + j : kv;
        std::copy_n(mass_local[i].data() + kv * n, n, mass_out[i].data() + static_cast<size_t>(h) * n);
      }
    }
  }
  for (int i = 0; i < n_local_spans; ++i) {
    const int64_t first = parts[1 + i].first_position;
    const int n = parts[1 + i].n_tokens;
    if (n == 0) continue;
    KVTIER_RETURN_IF_ERROR(per_query ? store.AddLocalQueryAttention(seq, layer, first, n, mass_out[i].data())
                                     : store.AddLocalAttention(seq, layer, first, n, mass_out[i].data()));
  }
  return Status::Ok();
}

}  // namespace kvtier
