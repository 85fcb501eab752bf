// The CLI flags of the engine options: each one's name, --help text and valid range come
// from the option table (engine/option_table.h), so the flags cannot drift from the
// options, the Python keyword arguments or the README. Job flags (--context, --seed, ...)
// are no options and stay with their commands.
#pragma once

#include <string>

#include "engine/option_table.h"
#include "integration/cli/flags.h"

namespace kvtier::cli {

/// The row of `table` named `name`; a missing row is a bug in the caller (it aborts).
template <typename Options>
const OptionDesc<Options>& OptionRow(const std::vector<OptionDesc<Options>>& table, std::string_view name) {
  const OptionDesc<Options>* d = FindOption(table, name);
  if (d == nullptr) std::abort();
  return *d;
}

/// A row's --help text: its meaning, plus the spelling a flag of its type takes.
template <typename Options>
std::string OptionHelp(const OptionDesc<Options>& d) {
  std::string help = d.meaning;
  if (d.type == OptionType::kChoice) help += ": " + std::string(d.choices);
  if (d.type == OptionType::kBytes) help += " (K/M/G suffixes)";
  return help;
}

/// The flag of row `d` bound to its option in *o: parsed by the row's type and range, and
/// written with SetOption; --help shows the value in *o now as the default. A kBool row is
/// a switch (register it with is_switch = true: AddOptionFlag does).
template <typename Options>
FlagSet::Binding OptionBinding(const OptionDesc<Options>& d, Options* o) {
  const OptionDesc<Options>* row = &d;
  FlagSet::Setter set = [row, o](const std::string& s) -> Status {
    OptionValue v;
    switch (row->type) {
      case OptionType::kInt: {
        int64_t x = 0;
        KVTIER_RETURN_IF_ERROR(ParseInt(s, row->lo, row->hi, &x));
        v = x;
        break;
      }
      case OptionType::kBytes: {
        uint64_t x = 0;
        KVTIER_RETURN_IF_ERROR(ParseBytes(s, &x));
        if (x > static_cast<uint64_t>(row->hi)) return InvalidArgument("'" + s + "' is too large");
        v = static_cast<int64_t>(x);
        break;
      }
      case OptionType::kBool:
        v = s != "0";
        break;
      case OptionType::kDouble: {
        double x = 0;
        KVTIER_RETURN_IF_ERROR(ParseDouble(s, &x));
        v = x;
        break;
      }
      case OptionType::kString:
        if (s.empty()) return InvalidArgument("empty value");
        v = s;
        break;
      case OptionType::kChoice:
        v = s;
        if (!CheckOptionValue(*row, v).ok())
          return InvalidArgument("unknown " + std::string(row->name) + " '" + s + "' (" + row->choices + ")");
        break;
    }
    Status st = SetOption(*row, o, std::move(v));
    if (!st.ok()) {
      // The flag names itself: drop SetOption's "option 'name': ".
      const std::string prefix = std::string("option '") + row->name + "': ";
      std::string m = st.message();
      if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
      return Status(st.code(), m);
    }
    return Status::Ok();
  };
  std::string shown;
  const OptionValue now = d.get(*o);
  switch (d.type) {
    case OptionType::kBool:
      break;  // a switch: no default shown
    case OptionType::kBytes:
      shown = FormatBytes(static_cast<uint64_t>(std::get<int64_t>(now)));
      break;
    case OptionType::kDouble:
      shown = FormatNumber(std::get<double>(now));
      break;
    default:
      shown = FormatOptionValue(now);
      break;
  }
  return FlagSet::Binding(std::move(set), std::move(shown));
}

/// Registers row `d`'s flag (d.flag) bound to *o.
template <typename Options>
void AddOptionFlag(FlagSet* f, const OptionDesc<Options>& d, Options* o) {
  f->Add(d.flag, OptionHelp(d), OptionBinding(d, o), d.type == OptionType::kBool);
}

/// Registers the flag of row `name` of `table` bound to *o.
template <typename Options>
void AddOptionFlag(FlagSet* f, const std::vector<OptionDesc<Options>>& table, std::string_view name,
                   Options* o) {
  AddOptionFlag(f, OptionRow(table, name), o);
}

}  // namespace kvtier::cli
