#include "integration/cli/flags.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

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
  const std::string see = " for 'kvtier " + command + "' (see 'kvtier " + command + " --help')";
  // CLI11 reads the command line: --name value, --name=value, switches, -h/--help. The
  // values stay text (no CLI11 types or validators): each flag's setter parses its own, in
  // command-line order, so that its message ("--context: 'abc' is not an integer") and the
  // exit code (Fail: 2) are those of every other bad input. --help is ours (PrintHelp): the
  // "(default X)" of each flag comes from the flag table, which tests and docs read.
  CLI::App app;
  app.set_help_flag();
  app.allow_extras();  // unknown flags and stray words: reported below, with the command's name
  std::map<const CLI::Option*, std::string> names;
  CLI::Option* help = nullptr;
  try {
    for (const std::string& n : order_) {
      const Flag& f = flags_.at(n);
      CLI::Option* o = f.is_switch ? app.add_flag("--" + n) : app.add_option("--" + n);
      // Every occurrence kept (parse_order() lists each): each is set in turn, the last wins.
      o->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
      if (!f.is_switch) o->expected(1);
      names[o] = n;
    }
    help = app.add_flag("-h,--help");
  } catch (const CLI::ConstructionError& e) {  // a name CLI11 refuses: a bug in the table, not the input
    return Internal("flag table of 'kvtier " + command + "': " + e.what());
  }

  // Adapter: CLI11 reads "--name=" (an empty value) as "--name" alone and takes the next word
  // as its value; ours hands "" to the setter (which refuses it: "empty path"). Split in two,
  // "--name" "", CLI11 sees the empty value.
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    const auto flag = a.size() > 3 && a.rfind("--", 0) == 0 && a.back() == '='
                          ? flags_.find(a.substr(2, a.size() - 3))
                          : flags_.end();
    if (flag != flags_.end() && !flag->second.is_switch) {
      a.pop_back();
      args.push_back(std::move(a));
      args.emplace_back();
    } else {
      args.push_back(std::move(a));
    }
  }
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11's vector form: last argument first
  try {
    app.parse(reversed);
  } catch (const CLI::ArgumentMismatch&) {
    // A flag that takes a value was the last word (CLI11 takes any next word as the value).
    const std::string last = args.empty() ? "" : args.back();
    return InvalidArgument("flag " + last + " needs a value");
  } catch (const CLI::ParseError& e) {
    return InvalidArgument(std::string(e.what()) + see);
  }
  help_ = help->count() > 0;
  // The first word CLI11 did not take: an unknown flag, or a word that is no flag's value.
  if (const std::vector<std::string> extra = app.remaining(); !extra.empty()) {
    const std::string& arg = extra.front();
    if (arg.rfind("--", 0) != 0)
      return InvalidArgument("unexpected argument '" + arg + "' for 'kvtier " + command +
                             "' (flags start with --)");
    return InvalidArgument("unknown flag --" + arg.substr(2, arg.find('=') - 2) + see);
  }
  std::map<const CLI::Option*, size_t> next;  // each flag's next value in results()
  for (const CLI::Option* o : app.parse_order()) {
    if (o == help) continue;
    const std::string& name = names.at(o);
    const Flag& f = flags_.at(name);
    std::string value = o->results().at(next[o]++);
    // A bare switch: CLI11 records "true"; ours hands "1" (--name=0 gives "0").
    if (f.is_switch && value == "true")
      value.assign(1, '1');  // not = "1": GCC 12 reports a spurious -Wrestrict
    Status st = f.set(value);
    if (!st.ok()) return InvalidArgument("--" + name + ": " + st.message());
    given_.insert(name);
  }
  return Status::Ok();
}

void FlagSet::PrintHelp(const char* usage) const {
  std::printf("%s\n\nflags:\n", usage);
  for (const auto& n : order_) {
    const Flag& f = flags_.at(n);
    if (f.default_text.empty())
      std::printf("  --%-18s %s\n", n.c_str(), f.help.c_str());
    else
      std::printf("  --%-18s %s (default %s)\n", n.c_str(), f.help.c_str(), f.default_text.c_str());
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
    return InvalidArgument(std::to_string(v) + " is outside [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "]");
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
  KVTIER_RETURN_IF_ERROR(ParseInt(num, 0, int64_t{1} << 50, &v));  // 0: the rows' ranges decide
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

Status AddPresetFlag(FlagSet* flags, int argc, char** argv, RetrieverOptions* retrieval, int* repr_topk,
                     ReprHeads* repr_heads) {
  std::string names;
  for (const std::string& n : RetrievalPresetNames()) names += (names.empty() ? "" : " | ") + n;
  flags->Add("preset",
             names +
                 ": retrieval settings under one name (kvtier = kvtier's recommended configuration; "
                 "kvtier-fast = it searched less often, not exact; actqkv, infllm = the papers as written); "
                 "flags that follow refine it",
             WithDefault(RetrievalPresetNames().front(),
                         [](const std::string& s) { return MakeRetrievalPreset(s).status(); }));
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
    // InfLLM keeps representatives per query head; the preset's other settings are session.h's.
    if (repr_heads != nullptr) *repr_heads = name == "infllm" ? ReprHeads::kQuery : ReprHeads::kKv;
  }
  return Status::Ok();
}

}  // namespace kvtier::cli
