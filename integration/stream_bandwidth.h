// The memory's streaming read rate, measured in the process that reports against it: a
// read-and-sum of a buffer several times the last-level cache, on every thread of oneTBB's
// default arena (the threads a kvtier step's kernels run on), nothing else done with the
// bytes. `kvtier run` divides a step's bytes (AttendStats' counts, the fetch's promotions) by
// it: the step's byte floor, the time the step would take if it only streamed its bytes.
#pragma once

#include <cstdint>

#include "store/status.h"

namespace kvtier {

struct StreamBandwidthOptions {
  /// Bytes read per pass; 0 = one and a half times the last-level cache, within [64 MiB,
  /// 1 GiB] (64 MiB where the cache size is unknown). At least 1 MiB otherwise.
  uint64_t buffer_bytes = 0;
  int passes = 3;  ///< timed passes over the filled buffer, in [1, 100]; the median is reported
  Status Validate() const;
};

struct StreamBandwidth {
  double bytes_per_s = 0;       ///< median over the timed passes
  double best_bytes_per_s = 0;  ///< the fastest pass
  uint64_t buffer_bytes = 0;    ///< bytes read per pass
  uint64_t llc_bytes = 0;       ///< the last-level cache the buffer was sized from (0: unknown)
  int threads = 0;              ///< oneTBB's default arena concurrency
  int passes = 0;               ///< timed passes
  double ms = 0;                ///< the whole measurement, allocation and fill included
};

/// The largest data or unified cache of cpu0 (sysfs, then sysconf), in bytes; 0 when unknown.
uint64_t LastLevelCacheBytes();

/// Maps and fills the buffer (on the same threads), then reads it `passes` times, timed.
/// InvalidArgument from Validate; ResourceExhausted when the buffer cannot be allocated.
Result<StreamBandwidth> MeasureStreamBandwidth(const StreamBandwidthOptions& options = {});

}  // namespace kvtier
