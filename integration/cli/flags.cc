#include "integration/cli/flags.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace kvtier::cli {

void FlagSet::Add(const std::string& name, const std::string& help, Binding bind, bool is_switch) {
  flags_[name] = Flag{help, std::move(bind.set), is_switch, std::move(bind.default_text)};
  order_.push_back(name);
}

std::string FlagSet::default_text(const std::string& name) const {
  auto it = flags_.find(name);
  return it == flags_.end() ? std::string() : it->second.default_text;
}

Status FlagSet::Parse(const std::string& command, int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      help_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0)
      return InvalidArgument("unexpected argument '" + arg + "' for 'kvtier " + command + "' (flags start with --)");
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    bool has_value = false;
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = flags_.find(name);
    if (it == flags_.end()) {
      std::string msg = "unknown flag --";
      msg.append(name).append(" for 'kvtier ").append(command).append("' (see 'kvtier ").append(command).append(" --help')");
      return InvalidArgument(msg);
    }
    if (!has_value) {
      if (it->second.is_switch) value.assign(1, '1');  // not = "1": GCC 12 reports a spurious -Wrestrict
      else if (i + 1 < argc) value = argv[++i];
      else return InvalidArgument("flag --" + name + " needs a value");
    }
    Status st = it->second.set(value);
    if (!st.ok()) return InvalidArgument("--" + name + ": " + st.message());
    given_.insert(name);
  }
  return Status::Ok();
}

void FlagSet::PrintHelp(const char* usage) const {
  std::printf("%s\n\nflags:\n", usage);
  for (const auto& n : order_) {
    const Flag& f = flags_.at(n);
    if (f.default_text.empty()) std::printf("  --%-18s %s\n", n.c_str(), f.help.c_str());
    else std::printf("  --%-18s %s (default %s)\n", n.c_str(), f.help.c_str(), f.default_text.c_str());
  }
}

std::string FormatNumber(double v, bool as_float) {
  char buf[32];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
    const double back = std::strtod(buf, nullptr);
    if (as_float ? static_cast<float>(back) == static_cast<float>(v) : back == v) break;
  }
  return buf;
}

std::string FormatBytes(uint64_t v) {
  const char* suffix = "KMG";
  int i = -1;
  while (i < 2 && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    ++i;
  }
  return std::to_string(v) + (i >= 0 ? std::string(1, suffix[i]) : std::string());
}

Status ParseInt(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno != 0) return InvalidArgument("'" + s + "' is not an integer");
  if (v < lo || v > hi)
    return InvalidArgument(std::to_string(v) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  *out = v;
  return Status::Ok();
}

Status ParseDouble(const std::string& s, double* out) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || !std::isfinite(v)) return InvalidArgument("'" + s + "' is not a number");
  *out = v;
  return Status::Ok();
}

Status ParseBytes(const std::string& s, uint64_t* out) {
  if (s.empty()) return InvalidArgument("empty size");
  uint64_t mult = 1;
  std::string num = s;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? 1ull << 10 : last == 'M' ? 1ull << 20 : 1ull << 30;
    num = s.substr(0, s.size() - 1);
  }
  // Text that is no number with a known suffix names the suffixes; a number out of range
  // keeps ParseInt's message (the range).
  const bool digits = !num.empty() && std::all_of(num.begin(), num.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '+';
  });
  if (!digits)
    return InvalidArgument("'" + s +
                           "' is not a size: a whole number with an optional suffix K, M or G (powers of "
                           "1024, either case), e.g. 512K, 64M, 2G");
  int64_t v = 0;
  KVTIER_RETURN_IF_ERROR(ParseInt(num, 1, int64_t{1} << 50, &v));
  *out = static_cast<uint64_t>(v) * mult;
  return Status::Ok();
}

std::vector<std::string> SplitComma(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t c = s.find(',', pos);
    out.push_back(s.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  return out;
}

Status ParseIntList(const std::string& s, int64_t lo, int64_t hi, std::vector<int64_t>* out) {
  out->clear();
  for (const std::string& item : SplitComma(s)) {
    int64_t v = 0;
    KVTIER_RETURN_IF_ERROR(ParseInt(item, lo, hi, &v));
    out->push_back(v);
  }
  return Status::Ok();
}

Status ParseDoubleList(const std::string& s, std::vector<double>* out) {
  out->clear();
  for (const std::string& item : SplitComma(s)) {
    double v = 0;
    KVTIER_RETURN_IF_ERROR(ParseDouble(item, &v));
    out->push_back(v);
  }
  return Status::Ok();
}

int Fail(const Status& st) {
  std::fprintf(stderr, "kvtier: error: %s\n", st.ToString().c_str());
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

Status AddPresetFlag(FlagSet* flags, int argc, char** argv, RetrieverOptions* retrieval, int* repr_topk) {
  std::string names;
  for (const std::string& n : RetrievalPresetNames()) names += (names.empty() ? "" : " | ") + n;
  flags->Add("preset",
             names + ": retrieval settings under one name (kvtier = kvtier's recommended configuration; "
                     "actqkv, infllm = the papers as written); flags that follow refine it",
             WithDefault(RetrievalPresetNames().front(), [](const std::string& s) {
               return MakeRetrievalPreset(s).status();
             }));
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    std::string name;
    if (a == "--preset" && i + 1 < argc) {
      name = argv[i + 1];
    } else if (a.rfind("--preset=", 0) == 0) {
      name = a.substr(9);
    } else {
      continue;
    }
    auto p = MakeRetrievalPreset(name);
    if (!p.ok()) return InvalidArgument("--preset: " + p.status().message());
    const int budget = retrieval->budget_tokens;
    *retrieval = p->retrieval;
    retrieval->budget_tokens = budget;
    if (p->repr_topk > 0) *repr_topk = p->repr_topk;
  }
  return Status::Ok();
}

}  // namespace kvtier::cli
