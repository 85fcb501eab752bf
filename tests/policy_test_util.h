// Helpers shared by the scoring-policy tests that feed hand-written observations:
// a small geometry, an observation built from position lists, and a started policy.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "offload/policy/scoring_policy.h"

namespace kvtier::policy_test {

inline PolicyGeometry Geo(int layers, int q_heads, int kv_heads, int64_t sinks, int64_t local) {
  PolicyGeometry g;
  g.layers = layers;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = 8;
  g.sink_tokens = sinks;
  g.local_tokens = local;
  return g;
}

// One observation; att is [q_heads][queries][keys].
struct Obs {
  int layer = 0;
  std::vector<int64_t> keys, queries;
  std::vector<float> att;
  AttentionObservation View() const {
    AttentionObservation o;
    o.layer = layer;
    o.n_queries = static_cast<int>(queries.size());
    o.n_keys = static_cast<int64_t>(keys.size());
    o.key_positions = keys.data();
    o.query_positions = queries.data();
    o.attention = att.data();
    return o;
  }
};

// Positions [from, to).
inline std::vector<int64_t> Range(int64_t from, int64_t to) {
  std::vector<int64_t> v;
  for (int64_t i = from; i < to; ++i) v.push_back(i);
  return v;
}

inline std::unique_ptr<ScoringPolicy> Make(const std::string& spec) {
  auto r = MakeScoringPolicy(spec);
  EXPECT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

inline std::unique_ptr<ScoringPolicy> Start(const std::string& spec, const PolicyGeometry& g) {
  auto p = Make(spec);
  if (p) {
    EXPECT_TRUE(p->Begin(g).ok());
  }
  return p;
}

inline void Feed(ScoringPolicy* p, const Obs& o) {
  const Status st = p->Observe(o.View());
  ASSERT_TRUE(st.ok()) << st.ToString();
}

}  // namespace kvtier::policy_test
