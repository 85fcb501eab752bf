#include "store/factory_spec.h"

#include <charconv>
#include <cmath>
#include <system_error>

namespace kvtier {

// ---- factory-string helpers ---------------------------------------------------------

Result<FactorySpec> ParseFactorySpec(const std::string& spec, const char* what) {
  const std::string quoted = std::string(what) + " spec '" + spec + "'";
  if (spec.empty()) return InvalidArgument(std::string("empty ") + what + " spec");
  FactorySpec out;
  const size_t colon = spec.find(':');
  out.name = spec.substr(0, colon);
  if (out.name.empty()) return InvalidArgument(quoted + " has no name before ':'");
  if (colon == std::string::npos) return out;
  const std::string rest = spec.substr(colon + 1);
  if (rest.empty()) return InvalidArgument(quoted + " has ':' but no key=value after it");
  size_t pos = 0;
  while (true) {
    const size_t comma = rest.find(',', pos);
    const std::string item = rest.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      return InvalidArgument("malformed parameter '" + item + "' in " + quoted + " (expected key=value)");
    std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    for (const auto& kv : out.params)
      if (kv.first == key) return InvalidArgument("duplicate key '" + key + "' in " + quoted);
    out.params.emplace_back(std::move(key), std::move(value));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

Result<double> ParseSpecDouble(const std::string& spec, const std::string& key, const std::string& value) {
  double v = 0.0;
  const char* first = value.data();
  const char* last = first + value.size();
  const auto [ptr, ec] = std::from_chars(first, last, v);
  if (value.empty() || ec != std::errc() || ptr != last || !std::isfinite(v))
    return InvalidArgument("bad value '" + value + "' for key '" + key + "' in spec '" + spec +
                           "' (expected a finite number)");
  return v;
}

Result<int> ParseSpecInt(const std::string& spec, const std::string& key, const std::string& value) {
  int v = 0;
  const char* first = value.data();
  const char* last = first + value.size();
  const auto [ptr, ec] = std::from_chars(first, last, v);
  if (value.empty() || ec != std::errc() || ptr != last)
    return InvalidArgument("bad value '" + value + "' for key '" + key + "' in spec '" + spec +
                           "' (expected an integer)");
  return v;
}

std::string FormatSpecDouble(double v) {
  char buf[64];
  const auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), v);  // shortest round-trip form
  return ec == std::errc() ? std::string(buf, ptr) : std::string("nan");
}

}  // namespace kvtier
