// One option of an options struct (StoreOptions, RetrieverOptions, SessionOptions), declared
// once as a row: its name, CLI flag, type, one-line meaning and valid range or choices, and
// how to read and write its field. The default is the struct's in-class initializer: a
// row reads it from a default-constructed struct and never restates it.
//
// Each layer keeps its struct's rows beside its Validate (StoreOptionTable in
// offload/store_option_table.h, RetrieverOptionTable in retrieval/retriever_option_table.h,
// SessionOptionTable in engine/option_table.h), and each Validate checks every row's range
// with CheckOptionRanges before the checks that relate options to each other. The front
// ends (CLI flags, Python keyword arguments, the C API's setters, docs/options.md) read the
// same rows through engine/option_table.h.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "store/status.h"

namespace kvtier {

/// How an option's value is spelled; each front end maps it to its own type.
enum class OptionType {
  kInt,     ///< an integer in [lo, hi]
  kBytes,   ///< a size in bytes in [lo, hi] (text takes K/M/G suffixes)
  kBool,    ///< true | false
  kDouble,  ///< a finite number in [dlo, dhi] ((dlo, dhi] when dlo_open)
  kString,  ///< free text: a path, a factory spec, a URL ("" allowed)
  kChoice,  ///< one of `choices`, '|'-separated
};
/// "int", "bytes", "bool", "double", "string", "choice".
const char* OptionTypeName(OptionType type);

/// An option's value: int64_t for kInt and kBytes, bool, double, std::string for kString and
/// kChoice.
using OptionValue = std::variant<int64_t, bool, double, std::string>;

/// One option of `Options`. Rows are written with designated initializers; the KVTIER_OPT_*
/// macros below fill `get` and `set` for a plain member.
template <typename Options>
struct OptionDesc {
  const char* name = "";   ///< field, Python keyword argument and C API name: "n_sink"
  const char* field = "";  ///< the member it sets, "." for nesting: "geometry.layers"
  const char* flag = "";   ///< CLI flag without "--" ("sink"); "" = no CLI flag
  OptionType type = OptionType::kInt;
  const char* meaning = "";                               ///< one line, as --help and docs/options.md show it
  int64_t lo = 0, hi = 0;                                 ///< kInt, kBytes: the valid range
  double dlo = -std::numeric_limits<double>::infinity();  ///< kDouble: the valid range
  double dhi = std::numeric_limits<double>::infinity();
  bool dlo_open = false;     ///< kDouble: dlo itself is outside the range
  const char* choices = "";  ///< kChoice: "none|lz4|zstd" (every spelling a parser accepts)
  OptionValue (*get)(const Options&) = nullptr;
  /// Writes a value SetOption has already checked against the row; a Status for what the row
  /// cannot say (a choice that does not parse).
  Status (*set)(Options*, const OptionValue&) = nullptr;
};

/// The row named `name`, or null.
template <typename Options>
const OptionDesc<Options>* FindOption(const std::vector<OptionDesc<Options>>& table, std::string_view name) {
  for (const auto& d : table)
    if (name == d.name) return &d;
  return nullptr;
}

/// A value as text: integers in decimal, "true"/"false", whole doubles in full ("10000"),
/// other doubles the shortest text that reads back as the same double, strings as they are.
std::string FormatOptionValue(const OptionValue& v);

/// Checks `v` against the row's type, range and choices; InvalidArgument naming the option
/// ("option 'chunk_size': 0 is outside [1, 65536]").
template <typename Options>
Status CheckOptionValue(const OptionDesc<Options>& d, const OptionValue& v);
Status CheckOptionValue(OptionType type, const char* name, int64_t lo, int64_t hi, double dlo, double dhi,
                        bool dlo_open, const char* choices, const OptionValue& v);

template <typename Options>
Status CheckOptionValue(const OptionDesc<Options>& d, const OptionValue& v) {
  return CheckOptionValue(d.type, d.name, d.lo, d.hi, d.dlo, d.dhi, d.dlo_open, d.choices, v);
}

/// Checks `v` (an integer is taken for a double) and writes it; errors name the option.
template <typename Options>
Status SetOption(const OptionDesc<Options>& d, Options* o, OptionValue v) {
  if (d.type == OptionType::kDouble && std::holds_alternative<int64_t>(v))
    v = static_cast<double>(std::get<int64_t>(v));
  KVTIER_RETURN_IF_ERROR(CheckOptionValue(d, v));
  Status st = d.set(o, v);
  if (!st.ok()) return Status(st.code(), std::string("option '") + d.name + "': " + st.message());
  return Status::Ok();
}

/// Text as the row's type reads it: an integer (kInt), an integer with an optional K, M or G
/// suffix (kBytes, powers of 1024), true|false|1|0 (kBool), a number (kDouble), the text
/// itself (kString, kChoice). InvalidArgument naming the option when it does not parse; the
/// range is SetOption's to check.
template <typename Options>
Result<OptionValue> ParseOptionText(const OptionDesc<Options>& d, std::string_view text);
Result<OptionValue> ParseOptionText(OptionType type, const char* name, std::string_view text);

template <typename Options>
Result<OptionValue> ParseOptionText(const OptionDesc<Options>& d, std::string_view text) {
  return ParseOptionText(d.type, d.name, text);
}

/// Checks every row's field of `o` against the row (CheckOptionValue): the per-option part
/// of a Validate. The first value out of range is InvalidArgument naming the option.
template <typename Options>
Status CheckOptionRanges(const std::vector<OptionDesc<Options>>& table, const Options& o) {
  for (const auto& d : table) KVTIER_RETURN_IF_ERROR(CheckOptionValue(d, d.get(o)));
  return Status::Ok();
}

/// Fields of a struct that are no option a user sets by name (callbacks, test hooks, a
/// nested options struct), each with why. With the rows, they account for every field.
struct NotAnOption {
  const char* field;
  const char* why;
};

}  // namespace kvtier

// get/set of one plain member (an integer type, bool, double, std::string), for a row's
// designated initializers: {.name = "n_sink", ..., KVTIER_OPT_INT(StoreOptions, n_sink)}.
#define KVTIER_OPT_INT(T, m)                                                            \
  .get = [](const T& o) -> ::kvtier::OptionValue { return static_cast<int64_t>(o.m); }, \
  .set = [](T* o, const ::kvtier::OptionValue& v) -> ::kvtier::Status {                 \
    o->m = static_cast<std::remove_reference_t<decltype(o->m)>>(std::get<int64_t>(v));  \
    return ::kvtier::Status::Ok();                                                      \
  }
#define KVTIER_OPT_BOOL(T, m)                                           \
  .get = [](const T& o) -> ::kvtier::OptionValue { return o.m; },       \
  .set = [](T* o, const ::kvtier::OptionValue& v) -> ::kvtier::Status { \
    o->m = std::get<bool>(v);                                           \
    return ::kvtier::Status::Ok();                                      \
  }
#define KVTIER_OPT_DOUBLE(T, m)                                         \
  .get = [](const T& o) -> ::kvtier::OptionValue { return o.m; },       \
  .set = [](T* o, const ::kvtier::OptionValue& v) -> ::kvtier::Status { \
    o->m = std::get<double>(v);                                         \
    return ::kvtier::Status::Ok();                                      \
  }
#define KVTIER_OPT_STRING(T, m)                                         \
  .get = [](const T& o) -> ::kvtier::OptionValue { return o.m; },       \
  .set = [](T* o, const ::kvtier::OptionValue& v) -> ::kvtier::Status { \
    o->m = std::get<std::string>(v);                                    \
    return ::kvtier::Status::Ok();                                      \
  }
