// LayerParts: what Session::Gather returns, the spans one layer attends. Internal: its
// spans are the kernels' KvSpan and its pins a FetchHandle, so engines built against the
// installed package use Session::Attend; tools and tests built with the sources use Gather.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kvtier/counters.h"
#include "offload/tiered_store.h"

namespace kvtier {

/// The spans one layer attends, for engines that run their own attention. The chunks
/// stay pinned in hot slots until Release() or destruction. kInfLLM: spans hold the
/// keys as stored (before RoPE); `rope_positions` says where each part's keys belong.
struct LayerParts {
  std::vector<kernels::KvSpan> parts;  ///< sinks, retrieved chunks (best first), local window (oldest first)
  std::vector<int64_t>
      rope_positions;   ///< [parts] kInfLLM: every key of part i at this position, -1 = true positions
  size_t n_chunks = 0;  ///< parts[1 .. n_chunks] are chunks
  std::vector<uint64_t> chunks;  ///< chunk indices attended, as parts[1..n_chunks]
  int64_t local_start = 0;       ///< L0: first position of the local window
  AttendStats stats;
  FetchHandle fetch;  ///< the pins
  void Release() { fetch.Release(); }
};

}  // namespace kvtier
