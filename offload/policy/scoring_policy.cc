#include "offload/policy/scoring_policy.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvtier {

ScoringPolicy::~ScoringPolicy() = default;

Status PolicyGeometry::Validate() const {
  if (layers < 1)
    return InvalidArgument("PolicyGeometry: layers must be >= 1, got " + std::to_string(layers));
  if (q_heads < 1 || kv_heads < 1)
    return InvalidArgument("PolicyGeometry: q_heads and kv_heads must be >= 1, got " +
                           std::to_string(q_heads) + " and " + std::to_string(kv_heads));
  if (q_heads % kv_heads != 0)
    return InvalidArgument("PolicyGeometry: q_heads " + std::to_string(q_heads) +
                           " is not a multiple of kv_heads " + std::to_string(kv_heads));
  if (head_dim < 1)
    return InvalidArgument("PolicyGeometry: head_dim must be >= 1, got " + std::to_string(head_dim));
  if (sink_tokens < 0 || local_tokens < 0)
    return InvalidArgument("PolicyGeometry: sink_tokens and local_tokens must be >= 0, got " +
                           std::to_string(sink_tokens) + " and " + std::to_string(local_tokens));
  return Status::Ok();
}

Status AttentionObservation::Validate(const PolicyGeometry& g) const {
  const std::string where = "AttentionObservation (layer " + std::to_string(layer) + "): ";
  if (layer < 0 || layer >= g.layers)
    return InvalidArgument(where + "layer out of range [0, " + std::to_string(g.layers) + ")");
  if (n_queries < 1)
    return InvalidArgument(where + "n_queries must be >= 1, got " + std::to_string(n_queries));
  if (n_keys < 1) return InvalidArgument(where + "n_keys must be >= 1, got " + std::to_string(n_keys));
  if (key_positions == nullptr || query_positions == nullptr || attention == nullptr)
    return InvalidArgument(where + "key_positions, query_positions and attention are required");
  for (int64_t i = 0; i < n_keys; ++i) {
    if (key_positions[i] < 0)
      return InvalidArgument(where + "negative key position " + std::to_string(key_positions[i]));
    if (i > 0 && key_positions[i] <= key_positions[i - 1])
      return InvalidArgument(where + "key positions not strictly increasing at index " + std::to_string(i));
  }
  for (int i = 0; i < n_queries; ++i)
    if (i > 0 && query_positions[i] <= query_positions[i - 1])
      return InvalidArgument(where + "query positions not strictly increasing at index " + std::to_string(i));
  for (int h = 0; h < g.q_heads; ++h)
    for (int i = 0; i < n_queries; ++i) {
      double sum = 0.0;
      for (int64_t k = 0; k < n_keys; ++k) {
        const float a = at(h, i, k);
        if (!std::isfinite(a) || a < 0.0f)
          return InvalidArgument(where + "attention[" + std::to_string(h) + "][" + std::to_string(i) + "][" +
                                 std::to_string(k) + "] is not a finite probability");
        sum += a;
      }
      if (std::fabs(sum - 1.0) > 1e-3)
        return InvalidArgument(where + "attention row (head " + std::to_string(h) + ", query " +
                               std::to_string(i) + ") sums to " + std::to_string(sum) + ", not 1");
    }
  if (token_logprobs != nullptr)
    for (int i = 0; i < n_queries; ++i)
      if (!std::isfinite(token_logprobs[i]) || token_logprobs[i] > 0.0f)
        return InvalidArgument(where + "token_logprobs[" + std::to_string(i) +
                               "] is not a finite log-probability");
  return Status::Ok();
}

std::vector<int64_t> KeepSet::Union() const {
  std::vector<int64_t> out;
  for (const auto& h : per_head) out.insert(out.end(), h.begin(), h.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<int64_t> ProtectedIndexes(const PolicyGeometry& g, const std::vector<int64_t>& positions) {
  const int64_t n = static_cast<int64_t>(positions.size());
  std::vector<int64_t> out;
  const int64_t local_from = std::max<int64_t>(0, n - g.local_tokens);
  for (int64_t i = 0; i < n; ++i)
    if (positions[i] < g.sink_tokens || i >= local_from) out.push_back(i);
  return out;
}

std::vector<int64_t> TopIndexes(const std::vector<float>& scores, const std::vector<int64_t>& candidates,
                                int64_t k) {
  std::vector<int64_t> c = candidates;
  k = std::clamp<int64_t>(k, 0, static_cast<int64_t>(c.size()));
  // Higher score first; ties toward the larger index (the later, more recent key).
  auto better = [&](int64_t a, int64_t b) { return scores[a] != scores[b] ? scores[a] > scores[b] : a > b; };
  std::partial_sort(c.begin(), c.begin() + k, c.end(), better);
  c.resize(k);
  return c;
}

Result<std::vector<int64_t>> KeepTopWithProtected(const PolicyGeometry& g,
                                                  const std::vector<int64_t>& positions,
                                                  const std::vector<float>& scores, int64_t budget) {
  if (scores.size() != positions.size())
    return InvalidArgument("KeepTopWithProtected: " + std::to_string(scores.size()) + " scores for " +
                           std::to_string(positions.size()) + " positions");
  if (budget < 0) return InvalidArgument("budget must be >= 0, got " + std::to_string(budget));
  const int64_t n = static_cast<int64_t>(positions.size());
  if (budget >= n) return positions;
  const std::vector<int64_t> prot = ProtectedIndexes(g, positions);
  if (budget < static_cast<int64_t>(prot.size()))
    return InvalidArgument("budget " + std::to_string(budget) + " is smaller than the " +
                           std::to_string(prot.size()) + " protected keys (sinks " +
                           std::to_string(g.sink_tokens) + " + local window " +
                           std::to_string(g.local_tokens) + ")");
  std::vector<char> is_prot(n, 0);
  for (int64_t i : prot) is_prot[i] = 1;
  std::vector<int64_t> rest;
  rest.reserve(n - prot.size());
  for (int64_t i = 0; i < n; ++i)
    if (!is_prot[i]) rest.push_back(i);
  std::vector<int64_t> chosen = TopIndexes(scores, rest, budget - static_cast<int64_t>(prot.size()));
  chosen.insert(chosen.end(), prot.begin(), prot.end());
  std::sort(chosen.begin(), chosen.end());
  std::vector<int64_t> out(chosen.size());
  for (size_t i = 0; i < chosen.size(); ++i) out[i] = positions[chosen[i]];
  return out;
}

std::vector<std::pair<int64_t, float>> AggregateToChunks(const TokenScores& s, int64_t n_sink,
                                                         int64_t chunk_tokens, uint64_t n_chunks) {
  std::vector<std::pair<int64_t, float>> out;
  if (chunk_tokens < 1) return out;
  for (size_t i = 0; i < s.positions.size(); ++i) {
    const int64_t chunk = ChunkOfPosition(s.positions[i], n_sink, chunk_tokens, n_chunks);
    if (chunk < 0) continue;  // a sink or the local window
    float v = 0.0f;
    for (const auto& head : s.per_head) v += head[i];
    if (out.empty() || out.back().first != chunk) out.emplace_back(chunk, 0.0f);
    out.back().second += v;
  }
  return out;
}

std::vector<float> RemapByPosition(const std::vector<int64_t>& old_positions,
                                   const std::vector<float>& old_values,
                                   const std::vector<int64_t>& new_positions, float fill) {
  std::vector<float> out(new_positions.size(), fill);
  size_t j = 0;
  for (size_t i = 0; i < new_positions.size(); ++i) {
    while (j < old_positions.size() && old_positions[j] < new_positions[i]) ++j;
    if (j < old_positions.size() && old_positions[j] == new_positions[i] && j < old_values.size())
      out[i] = old_values[j];
  }
  return out;
}

}  // namespace kvtier
