// The command-line conventions every `kvtier` subcommand shares: a flag table
// (--name value or --name=value, switches, --help), strict number parsers whose
// messages name the bad text, and the exit code of an error.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "store/status.h"

namespace kvtier::cli {

// A flag table: each flag has a help line and a setter that validates its text.
class FlagSet {
 public:
  using Setter = std::function<Status(const std::string&)>;
  void Add(const std::string& name, const std::string& help, Setter set, bool is_switch = false);
  /// Parses argv; `command` ("run", "infinite") names the subcommand in messages.
  Status Parse(const std::string& command, int argc, char** argv);
  bool help() const { return help_; }
  /// Whether --name appeared on the command line (to tell a user's value from a default).
  bool given(const std::string& name) const { return given_.count(name) > 0; }
  void PrintHelp(const char* usage) const;

 private:
  struct Flag {
    std::string help;
    Setter set;
    bool is_switch;
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

template <typename T>
FlagSet::Setter IntFlag(T* dst, int64_t lo, int64_t hi) {
  return [=](const std::string& s) {
    int64_t v = 0;
    KVTIER_RETURN_IF_ERROR(ParseInt(s, lo, hi, &v));
    *dst = static_cast<T>(v);
    return Status::Ok();
  };
}

template <typename T>
FlagSet::Setter DoubleFlag(T* dst) {
  return [=](const std::string& s) {
    double v = 0;
    KVTIER_RETURN_IF_ERROR(ParseDouble(s, &v));
    *dst = static_cast<T>(v);
    return Status::Ok();
  };
}

inline FlagSet::Setter BytesFlag(uint64_t* dst) {
  return [=](const std::string& s) { return ParseBytes(s, dst); };
}

/// A non-empty path.
inline FlagSet::Setter PathFlag(std::string* dst) {
  return [=](const std::string& s) {
    if (s.empty()) return InvalidArgument("empty path");
    *dst = s;
    return Status::Ok();
  };
}

/// Prints "kvtier: error: ..." on stderr; exit code 2 for bad input, 1 otherwise.
int Fail(const Status& st);

}  // namespace kvtier::cli
