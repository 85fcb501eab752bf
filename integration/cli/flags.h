// The command-line conventions every `kvtier` subcommand shares: a flag table
// (--name value or --name=value, switches, --help; the command line is read by CLI11,
// flags.cc), strict number parsers whose messages name the bad text, and the exit code
// of an error.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "kvtier/session.h"
#include "store/status.h"

namespace kvtier::cli {

// A flag table: each flag has a help line and a setter that validates its text. --help
// prints each flag's default as "(default X)" from the bound variable's value when the flag
// was registered (IntFlag, DoubleFlag, BytesFlag, PathFlag and WithDefault capture it), so
// help texts never spell out a default themselves and cannot drift from the code.
class FlagSet {
 public:
  using Setter = std::function<Status(const std::string&)>;
  /// A setter, and the text of its default ("" = none shown: switches, required flags).
  struct Binding {
    Setter set;
    std::string default_text;
    Binding(Setter s, std::string d) : set(std::move(s)), default_text(std::move(d)) {}
    /// Any setter callable: no default shown.
    template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, Binding> &&
                                                      std::is_invocable_r_v<Status, F&, const std::string&>>>
    Binding(F f) : set(std::move(f)) {}  // NOLINT: implicit by design
    Status operator()(const std::string& s) const { return set(s); }
  };
  void Add(const std::string& name, const std::string& help, Binding bind, bool is_switch = false);
  /// Parses argv; `command` ("run", "infinite") names the subcommand in messages.
  Status Parse(const std::string& command, int argc, char** argv);
  bool help() const { return help_; }
  /// Whether --name appeared on the command line (to tell a user's value from a default).
  bool given(const std::string& name) const { return given_.count(name) > 0; }
  /// The default --help shows for --name ("" = none, or no such flag).
  std::string default_text(const std::string& name) const;
  void PrintHelp(const char* usage) const;

 private:
  struct Flag {
    std::string help;
    Setter set;
    bool is_switch;
    std::string default_text;
  };
  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
  std::set<std::string> given_;
  bool help_ = false;
};

/// The whole text as an integer in [lo, hi].
Status ParseInt(const std::string& s, int64_t lo, int64_t hi, int64_t* out);
/// The whole text as a finite number.
Status ParseDouble(const std::string& s, double* out);
/// A size with an optional K/M/G suffix (powers of 1024, either case): "64M".
Status ParseBytes(const std::string& s, uint64_t* out);
/// Comma-separated items, empty items kept ("a,,b" -> 3 items).
std::vector<std::string> SplitComma(const std::string& s);
/// Comma-separated integers, each in [lo, hi].
Status ParseIntList(const std::string& s, int64_t lo, int64_t hi, std::vector<int64_t>* out);
/// Comma-separated finite numbers.
Status ParseDoubleList(const std::string& s, std::vector<double>* out);

/// A number as --help shows it: the shortest text that reads back as the same value ("3.3",
/// "0.5", "1"); as_float: the same float (a float 3.3f shows as "3.3").
std::string FormatNumber(double v, bool as_float = false);
/// Bytes as --help shows them: with the largest K/M/G suffix that divides them ("16M", "1G", "1000").
std::string FormatBytes(uint64_t v);

/// An integer flag in [lo, hi] bound to *dst; its default is *dst now.
template <typename T>
FlagSet::Binding IntFlag(T* dst, int64_t lo, int64_t hi) {
  return FlagSet::Binding(
      [=](const std::string& s) {
        int64_t v = 0;
        KVTIER_RETURN_IF_ERROR(ParseInt(s, lo, hi, &v));
        *dst = static_cast<T>(v);
        return Status::Ok();
      },
      std::to_string(*dst));
}

/// A finite number bound to *dst; its default is *dst now.
template <typename T>
FlagSet::Binding DoubleFlag(T* dst) {
  return FlagSet::Binding(
      [=](const std::string& s) {
        double v = 0;
        KVTIER_RETURN_IF_ERROR(ParseDouble(s, &v));
        *dst = static_cast<T>(v);
        return Status::Ok();
      },
      FormatNumber(static_cast<double>(*dst), std::is_same_v<T, float>));
}

/// A size (K/M/G suffixes) bound to *dst; its default is *dst now.
inline FlagSet::Binding BytesFlag(uint64_t* dst) {
  return FlagSet::Binding([=](const std::string& s) { return ParseBytes(s, dst); }, FormatBytes(*dst));
}

/// A non-empty path bound to *dst; its default is *dst now (none shown when empty).
inline FlagSet::Binding PathFlag(std::string* dst) {
  return FlagSet::Binding(
      [=](const std::string& s) {
        if (s.empty()) return InvalidArgument("empty path");
        *dst = s;
        return Status::Ok();
      },
      *dst);
}

/// `bind` with `default_text` as its default: for setters that are not one of the above (the
/// text then comes from the variable the setter writes, e.g. WithDefault(o.probe, ...)), and
/// for sentinel defaults that a number would misstate ("every key, = --chunk"). "" = none.
inline FlagSet::Binding WithDefault(std::string default_text, FlagSet::Binding bind) {
  bind.default_text = std::move(default_text);
  return bind;
}

/// Prints "kvtier: error: ..." on stderr; exit code 2 for bad input, 1 otherwise.
int Fail(const Status& st);

/// --preset NAME (kvtier | kvtier-fast | actqkv | infllm, include/kvtier/session.h): found anywhere on the
/// command line and applied to `retrieval` (and to `repr_topk` where the preset fixes it)
/// before any other flag, so the flags that refine it (--alloc, --index, --head-merge, ...)
/// win whatever their order. Registers the flag (its handler only checks the name) so it
/// shows in --help. An unknown name is InvalidArgument listing the presets. With `repr_heads`
/// (a command whose store takes observed queries' mass per query head: kvtier run), "infllm"
/// also sets it to ReprHeads::kQuery, InfLLM's representatives per query head.
Status AddPresetFlag(FlagSet* flags, int argc, char** argv, RetrieverOptions* retrieval, int* repr_topk,
                     ReprHeads* repr_heads = nullptr);

}  // namespace kvtier::cli
