// StoreOptions in a JSON report: one member per option row (engine/option_table.h), named as
// the row, so a report's "config" holds every store option and cannot miss a new one.
#pragma once

#include "integration/json.h"
#include "kvtier/options.h"

namespace kvtier {

/// Writes every StoreOptionTable() row of `o` as a member of the object open in *w: ints
/// and sizes as numbers, bools, choices and strings as text; `remote` with its password
/// redacted (RedactRemoteSpec).
void WriteStoreOptionsJson(JsonWriter* w, const StoreOptions& o);

}  // namespace kvtier
