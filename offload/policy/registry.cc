// The factory table: every scoring policy by name. A policy file adds its row here.
#include <string>
#include <vector>

#include "offload/policy/policies.h"

namespace kvtier {
namespace policies {

Status UnknownKey(const FactorySpec& fs, const std::string& spec, const std::string& key, const char* known) {
  return InvalidArgument("unknown key '" + key + "' for policy '" + fs.name + "' in spec '" + spec +
                         "' (known: " + known + ")");
}

namespace {
struct Entry {
  const char* name;
  PolicyMaker make;
  PolicyInfo (*info)();
};
// Stable order: the classic baselines first, then the papers.
const std::vector<Entry> kPolicies = {
    {"lru", &MakeLru, &LruInfo},
    {"streaming", &MakeStreaming, &StreamingInfo},
    {"h2o", &MakeH2o, &H2oInfo},
    {"snapkv", &MakeSnapKv, &SnapKvInfo},
    {"hitkv", &MakeHitKv, &HitKvInfo},
    {"gkv", &MakeGkv, &GkvInfo},
    {"structkv", &MakeStructKv, &StructKvInfo},
    {"compilerkv", &MakeCompilerKv, &CompilerKvInfo},
};
}  // namespace
}  // namespace policies

std::vector<PolicyInfo> ListScoringPolicies() {
  std::vector<PolicyInfo> out;
  for (const auto& e : policies::kPolicies) out.push_back(e.info());
  return out;
}

Result<std::unique_ptr<ScoringPolicy>> MakeScoringPolicy(const std::string& spec) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "policy"));
  std::string known;
  for (const auto& e : policies::kPolicies) {
    if (fs.name == e.name) return e.make(fs, spec);
    known += (known.empty() ? "" : ", ") + std::string(e.name);
  }
  return InvalidArgument("unknown policy '" + fs.name + "' in spec '" + spec + "' (known: " + known + ")");
}

}  // namespace kvtier
