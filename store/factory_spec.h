// Factory strings: "name" or "name:key=value,...", the one syntax every pluggable part
// (probe builders, budget allocators, scoring policies) is built from.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "store/status.h"

namespace kvtier {

// ---- factory-string helpers, shared by every factory (probe, budget, index, scoring policy) ----

/// "name" or "name:key=value,key=value", split. Keys keep their order; a duplicate key,
/// an empty name, key or value, or an item without '=' is InvalidArgument naming it.
/// `what` ("probe", "budget allocator") prefixes the messages.
struct FactorySpec {
  std::string name;
  std::vector<std::pair<std::string, std::string>> params;
};
Result<FactorySpec> ParseFactorySpec(const std::string& spec, const char* what);
/// Strict parses of a parameter value (the whole text, finite for doubles); InvalidArgument
/// naming `key` and the spec otherwise.
Result<double> ParseSpecDouble(const std::string& spec, const std::string& key, const std::string& value);
Result<int> ParseSpecInt(const std::string& spec, const std::string& key, const std::string& value);
/// Shortest text that parses back to the same double ("1e-06", "0.5").
std::string FormatSpecDouble(double v);

}  // namespace kvtier
