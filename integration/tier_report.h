// Where fetched chunks came from, and what the remote tier moved: the lines and JSON
// objects `kvtier run`, `stress` and `infinite` add to their reports.
#pragma once

#include <string>

#include "integration/json.h"
#include "offload/tiered_store.h"

namespace kvtier {

/// "fetched chunks by tier: hot 61.2%, warm 20.1%, cold 10.0%, remote 8.7% (of 1234)"
/// and, with a remote tier, a second line with its puts, gets, bytes, misses and errors; when
/// fetches waited for pinned hot slots, a line "pin waits: N (X ms in all), T timed out".
/// Every line starts with `indent` and ends with a newline.
std::string TierTrafficText(const StoreCounters& c, bool remote, const std::string& indent = "");

/// {"fetched_chunks", "hit_rate": {hot, warm, cold, remote}, "bytes": {"remote_put",
/// "remote_get"}, "remote": {puts, gets, not_found, corrupt, errors}, "pins": {waits, wait_us,
/// wait_timeouts, reserved_slots}} as the value of the current key.
void WriteTierTrafficJson(JsonWriter* w, const StoreCounters& c);

}  // namespace kvtier
