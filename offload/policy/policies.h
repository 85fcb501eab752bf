// The policy factories, one per policy file, wired together by registry.cc. Each takes the
// parsed factory string (name and key=value parameters) and the original text for messages.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "offload/policy/scoring_policy.h"

namespace kvtier::policies {

using PolicyMaker = Result<std::unique_ptr<ScoringPolicy>> (*)(const FactorySpec& fs,
                                                               const std::string& spec);

// classic.cc: lru, streaming, h2o, snapkv
Result<std::unique_ptr<ScoringPolicy>> MakeLru(const FactorySpec& fs, const std::string& spec);
Result<std::unique_ptr<ScoringPolicy>> MakeStreaming(const FactorySpec& fs, const std::string& spec);
Result<std::unique_ptr<ScoringPolicy>> MakeH2o(const FactorySpec& fs, const std::string& spec);
Result<std::unique_ptr<ScoringPolicy>> MakeSnapKv(const FactorySpec& fs, const std::string& spec);
PolicyInfo LruInfo();
PolicyInfo StreamingInfo();
PolicyInfo H2oInfo();
PolicyInfo SnapKvInfo();

// hitkv.cc: hitkv (and its per-layer-budget variant, hitkv:pyramid=...)
Result<std::unique_ptr<ScoringPolicy>> MakeHitKv(const FactorySpec& fs, const std::string& spec);
PolicyInfo HitKvInfo();
/// P-HitKV's per-layer budgets (PyramidKV's linear schedule); Σ_l = layers * budget. See hitkv.cc.
Result<std::vector<int64_t>> PyramidLayerBudgets(int layers, int64_t budget, double beta,
                                                 int64_t floor_per_layer);

// gkv.cc
Result<std::unique_ptr<ScoringPolicy>> MakeGkv(const FactorySpec& fs, const std::string& spec);
PolicyInfo GkvInfo();

// structkv.cc
Result<std::unique_ptr<ScoringPolicy>> MakeStructKv(const FactorySpec& fs, const std::string& spec);
PolicyInfo StructKvInfo();

// compilerkv.cc
Result<std::unique_ptr<ScoringPolicy>> MakeCompilerKv(const FactorySpec& fs, const std::string& spec);
PolicyInfo CompilerKvInfo();

/// "unknown key 'x' for policy 'gkv' in spec '...' (known: a, b)".
Status UnknownKey(const FactorySpec& fs, const std::string& spec, const std::string& key, const char* known);

}  // namespace kvtier::policies
