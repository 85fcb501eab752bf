// Process memory and clock readings for reports (Linux /proc).
#pragma once

#include <cstdint>

namespace kvtier {

/// Peak resident set size of this process in bytes (VmHWM in
/// /proc/self/status); 0 when it cannot be read.
uint64_t PeakRssBytes();
/// Current resident set size in bytes (VmRSS); 0 when it cannot be read.
uint64_t CurrentRssBytes();
/// Resets the peak (VmHWM) to the current RSS by writing "5" to
/// /proc/self/clear_refs; false when that is not permitted or not supported.
bool ResetPeakRss();
/// Seconds on a monotonic clock (std::chrono::steady_clock); only
/// differences are meaningful.
double NowSeconds();

}  // namespace kvtier
