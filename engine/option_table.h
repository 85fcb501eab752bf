// The engine options, declared once. Each option of StoreOptions, RetrieverOptions and
// SessionOptions has one row here: its name (the C++ field, the Python keyword argument and
// the C field), its CLI flag, its type, its default, a one-line meaning and its valid range.
// The front ends read the rows instead of naming options by hand: the Python keyword
// arguments (python/src/module.cc) and the CLI option flags with their --help
// (integration/cli/option_flags.h). The rest is checked against the rows by
// tests/engine/option_table_test.cc: the structs' defaults, their field counts (a new field
// fails the test until it has a row or is listed as no option), the C API's defaults, the
// Python stubs and docs/options.md's option tables.
//
// A row reads and writes its field through `get` and `set`. SetOption checks a value
// against the row (type, range, choices) before it writes, and its InvalidArgument names
// the option: "option 'n_sink': -1 is outside [0, 1048576]".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvtier/session.h"
#include "offload/tiered_store.h"
#include "retrieval/retriever.h"
#include "store/status.h"

namespace kvtier {

/// How an option's value is spelled; each front end maps it to its own type.
enum class OptionType {
  kInt,     ///< an integer in [lo, hi]
  kBytes,   ///< a size in bytes in [lo, hi] (the CLI takes K/M/G suffixes)
  kBool,    ///< true | false
  kDouble,  ///< a finite number (lo/hi unused; the struct's Validate checks the rest)
  kString,  ///< free text: a path, a factory spec, a URL ("" allowed)
  kChoice,  ///< one of `choices`, '|'-separated
};
/// "int", "bytes", "bool", "double", "string", "choice".
const char* OptionTypeName(OptionType type);

/// An option's value: int64_t for kInt and kBytes, bool, double, std::string for kString and
/// kChoice.
using OptionValue = std::variant<int64_t, bool, double, std::string>;

/// One option of `Options` (StoreOptions, RetrieverOptions or SessionOptions).
template <typename Options>
struct OptionDesc {
  const char* name;   ///< field, Python keyword argument and C field: "n_sink"
  const char* field;  ///< the member it sets, "." for nesting: "geometry.layers"
  const char* flag;   ///< CLI flag without "--" ("sink"); "" = no CLI flag
  OptionType type;
  const char* default_text;  ///< FormatOptionValue of the struct's default: "64", "lz4", ""
  const char* meaning;       ///< one line, as --help and the README show it
  int64_t lo = 0, hi = 0;    ///< kInt, kBytes: the valid range
  const char* choices = "";  ///< kChoice: "none|lz4|zstd"
  OptionValue (*get)(const Options&) = nullptr;
  /// Writes a value SetOption has already checked against the row; a Status for what the row
  /// cannot say (a choice that does not parse).
  Status (*set)(Options*, const OptionValue&) = nullptr;
};

using StoreOptionDesc = OptionDesc<StoreOptions>;
using RetrieverOptionDesc = OptionDesc<RetrieverOptions>;
using SessionOptionDesc = OptionDesc<SessionOptions>;

/// The rows, in the order the README lists them.
const std::vector<StoreOptionDesc>& StoreOptionTable();
const std::vector<RetrieverOptionDesc>& RetrieverOptionTable();
/// SessionOptions' own fields; its `retrieval` member is RetrieverOptionTable's (the Python
/// keyword arguments probe, alloc, index and budget_tokens set it, over the preset).
const std::vector<SessionOptionDesc>& SessionOptionTable();

/// Fields of the structs that are no option a user sets by name (callbacks, test hooks, a
/// nested options struct): each with why. With the rows, they account for every field.
struct NotAnOption {
  const char* field;
  const char* why;
};
const std::vector<NotAnOption>& StoreOptionsNotOptions();
const std::vector<NotAnOption>& SessionOptionsNotOptions();

/// The row named `name`, or null.
template <typename Options>
const OptionDesc<Options>* FindOption(const std::vector<OptionDesc<Options>>& table, std::string_view name) {
  for (const auto& d : table)
    if (name == d.name) return &d;
  return nullptr;
}

/// A value as the table's default_text spells it: integers in decimal, "true"/"false", the
/// shortest text that reads back as the same double, strings as they are.
std::string FormatOptionValue(const OptionValue& v);

/// Checks `v` against the row's type (an integer is taken for a double), range and choices;
/// InvalidArgument naming the option ("option 'chunk_size': 0 is outside [1, 65536]").
Status CheckOptionValue(OptionType type, const char* name, int64_t lo, int64_t hi, const char* choices,
                        const OptionValue& v);

/// Checks `v` (CheckOptionValue) and writes it; errors name the option.
template <typename Options>
Status SetOption(const OptionDesc<Options>& d, Options* o, OptionValue v) {
  if (d.type == OptionType::kDouble && std::holds_alternative<int64_t>(v))
    v = static_cast<double>(std::get<int64_t>(v));
  KVTIER_RETURN_IF_ERROR(CheckOptionValue(d.type, d.name, d.lo, d.hi, d.choices, v));
  Status st = d.set(o, v);
  if (!st.ok()) return Status(st.code(), std::string("option '") + d.name + "': " + st.message());
  return Status::Ok();
}

}  // namespace kvtier
