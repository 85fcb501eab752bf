// What engine/c_api.cc copies into the C API's structs, for the tests that check each C mirror
// against its C++ struct field by field (tests/engine/option_table_test.cc).
#pragma once

#include "kvtier/counters.h"
#include "kvtier/kvtier_c.h"

namespace kvtier {

/// Fills every field of `out` from the StoreCounters field of the same name
/// (kvtier_store_get_counters' copy).
void StoreCountersToC(const StoreCounters& c, kvtier_store_counters* out);

}  // namespace kvtier
