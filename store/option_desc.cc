#include "store/option_desc.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace kvtier {

const char* OptionTypeName(OptionType type) {
  switch (type) {
    case OptionType::kInt:
      return "int";
    case OptionType::kBytes:
      return "bytes";
    case OptionType::kBool:
      return "bool";
    case OptionType::kDouble:
      return "double";
    case OptionType::kString:
      return "string";
    case OptionType::kChoice:
      return "choice";
  }
  return "unknown";
}

std::string FormatOptionValue(const OptionValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const auto* d = std::get_if<double>(&v)) {
    if (std::isinf(*d)) return *d > 0 ? "inf" : "-inf";
    // Whole numbers in full ("10000", not "1e+04"), others the shortest text that reads back.
    if (std::trunc(*d) == *d && std::fabs(*d) < 1e15) return std::to_string(static_cast<int64_t>(*d));
    char buf[32];
    for (int digits = 1; digits <= 17; ++digits) {
      std::snprintf(buf, sizeof(buf), "%.*g", digits, *d);
      if (std::strtod(buf, nullptr) == *d) break;
    }
    return buf;
  }
  return std::get<std::string>(v);
}

Status CheckOptionValue(OptionType type, const char* name, int64_t lo, int64_t hi, double dlo, double dhi,
                        bool dlo_open, const char* choices, const OptionValue& v) {
  const std::string opt = std::string("option '") + name + "': ";
  switch (type) {
    case OptionType::kInt:
    case OptionType::kBytes: {
      const auto* i = std::get_if<int64_t>(&v);
      if (i == nullptr) return InvalidArgument(opt + "expected an int");
      if (*i < lo || *i > hi)
        return InvalidArgument(opt + std::to_string(*i) + " is outside [" + std::to_string(lo) + ", " +
                               std::to_string(hi) + "]");
      return Status::Ok();
    }
    case OptionType::kBool:
      if (!std::holds_alternative<bool>(v)) return InvalidArgument(opt + "expected a bool");
      return Status::Ok();
    case OptionType::kDouble: {
      const auto* d = std::get_if<double>(&v);
      if (d == nullptr) return InvalidArgument(opt + "expected a number");
      if (!std::isfinite(*d)) return InvalidArgument(opt + "expected a finite number");
      if (*d < dlo || (dlo_open && *d == dlo) || *d > dhi)
        return InvalidArgument(opt + FormatOptionValue(*d) + " is outside " + (dlo_open ? "(" : "[") +
                               FormatOptionValue(dlo) + ", " + FormatOptionValue(dhi) + "]");
      return Status::Ok();
    }
    case OptionType::kString:
      if (!std::holds_alternative<std::string>(v)) return InvalidArgument(opt + "expected a str");
      return Status::Ok();
    case OptionType::kChoice: {
      const auto* s = std::get_if<std::string>(&v);
      if (s == nullptr) return InvalidArgument(opt + "expected a str");
      const std::string_view all = choices;
      size_t pos = 0;
      while (pos <= all.size()) {
        const size_t bar = all.find('|', pos);
        const std::string_view c =
            all.substr(pos, bar == std::string_view::npos ? std::string_view::npos : bar - pos);
        if (c == *s) return Status::Ok();
        if (bar == std::string_view::npos) break;
        pos = bar + 1;
      }
      return InvalidArgument(opt + "expected " + choices + " (got '" + *s + "')");
    }
  }
  return InvalidArgument(opt + "unknown option type");
}

Result<OptionValue> ParseOptionText(OptionType type, const char* name, std::string_view text) {
  const std::string opt = std::string("option '") + name + "': ";
  const std::string s(text);
  switch (type) {
    case OptionType::kInt:
    case OptionType::kBytes: {
      int64_t scale = 1;
      std::string digits = s;
      if (type == OptionType::kBytes && !digits.empty()) {
        const char suffix = digits.back();
        const int shift = suffix == 'K' || suffix == 'k'   ? 10
                          : suffix == 'M' || suffix == 'm' ? 20
                          : suffix == 'G' || suffix == 'g' ? 30
                                                           : 0;
        if (shift != 0) {
          scale = int64_t{1} << shift;
          digits.pop_back();
        }
      }
      if (digits.empty() || (digits[0] != '-' && (digits[0] < '0' || digits[0] > '9')))
        return InvalidArgument(opt + "'" + s + "' is not an integer");
      errno = 0;
      char* end = nullptr;
      const long long x = std::strtoll(digits.c_str(), &end, 10);
      if (end == nullptr || *end != '\0') return InvalidArgument(opt + "'" + s + "' is not an integer");
      if (errno == ERANGE || x > std::numeric_limits<int64_t>::max() / scale ||
          x < std::numeric_limits<int64_t>::min() / scale)
        return InvalidArgument(opt + "'" + s + "' is too large");
      return OptionValue{static_cast<int64_t>(x) * scale};
    }
    case OptionType::kBool:
      if (s == "true" || s == "1") return OptionValue{true};
      if (s == "false" || s == "0") return OptionValue{false};
      return InvalidArgument(opt + "'" + s + "' is not true|false|1|0");
    case OptionType::kDouble: {
      errno = 0;
      char* end = nullptr;
      const double x = std::strtod(s.c_str(), &end);
      if (s.empty() || end == nullptr || *end != '\0' || errno == ERANGE)
        return InvalidArgument(opt + "'" + s + "' is not a number");
      return OptionValue{x};
    }
    case OptionType::kString:
    case OptionType::kChoice:
      return OptionValue{s};
  }
  return InvalidArgument(opt + "unknown option type");
}

}  // namespace kvtier
