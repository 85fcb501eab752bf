// The engine options, declared once. Each option of StoreOptions, RetrieverOptions and
// SessionOptions has one row (store/option_desc.h): its name (the C++ field, the Python
// keyword argument and the C API's name), its CLI flag, its type, a one-line meaning and its
// valid range or choices. Its default is the struct's in-class initializer, read from a
// default-constructed struct (OptionDefault), so no row restates it.
//
// The rows live beside the Validate that checks their ranges: StoreOptionTable in
// offload/store_option_table.h, RetrieverOptionTable in retrieval/retriever_option_table.h,
// SessionOptionTable here. Everything else follows from them: the Python keyword arguments
// and stubs (python/src/module.cc), the CLI flags and their --help
// (integration/cli/option_flags.h), the C API's kvtier_*_options_set (engine/c_api.cc) and
// docs/options.md (OptionsMarkdown). tests/engine/option_table_test.cc checks each against
// the rows, and that every field of the structs has a row or is listed as no option.
//
// SetOption checks a value against the row (type, range, choices) before it writes, and its
// InvalidArgument names the option: "option 'n_sink': -1 is outside [0, 1048576]".
#pragma once

#include <string>
#include <vector>

#include "kvtier/session.h"
#include "offload/store_option_table.h"
#include "retrieval/retriever_option_table.h"
#include "store/option_desc.h"

namespace kvtier {

using SessionOptionDesc = OptionDesc<SessionOptions>;

/// SessionOptions' own fields; its `retrieval` member is RetrieverOptionTable's (the Python
/// keyword arguments probe, alloc, index and budget_tokens set it, over the preset).
const std::vector<SessionOptionDesc>& SessionOptionTable();
/// SessionOptions' fields that are no option a user sets by name, each with why.
const std::vector<NotAnOption>& SessionOptionsNotOptions();

/// A row's default: its field in a default-constructed struct (SessionOptions{}.retrieval for
/// the retriever's rows, as a session gets them).
template <typename Options>
OptionValue OptionDefault(const OptionDesc<Options>& d) {
  return d.get(Options{});
}

/// docs/options.md's two tables (store options, then session options: the retriever's rows
/// and the session's), as the test compares them with the file: "| `name` | default |
/// meaning |" rows under a header row, sizes in MiB or GiB, strings quoted, '|' escaped.
std::string StoreOptionsMarkdown();
std::string SessionOptionsMarkdown();

}  // namespace kvtier
