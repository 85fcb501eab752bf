// The host's blocking waits on the device, counted: one process-wide count per kind of wait,
// relaxed atomics, read as a snapshot. Every source of the library and the tools that blocks
// the host on a CUDA device does it through the wrappers of offload/device_sync_cuda.h, which
// count here (scripts/lint.sh syncs refuses a direct call elsewhere). What counts as a wait:
//   kStream        cudaStreamSynchronize
//   kEvent         cudaEventSynchronize
//   kDevice        cudaDeviceSynchronize
//   kBlockingCopy  a synchronous copy (cudaMemcpy, cudaMemcpyToSymbol, ...)
//   kPageableCopy  an asynchronous copy to or from host memory the caller does not know to be
//                  pinned: device-to-host returns only once the copy is done, host-to-device
//                  once the source is staged (which can wait for earlier copies' staging);
//                  either way the host waits, and a CUDA graph cannot capture it.
// Not counted: asynchronous copies to or from pinned memory and between device buffers,
// launches, event records, event and stream queries, and allocations (cudaFree synchronises
// the device implicitly; it happens when a buffer grows or a sequence is dropped).
//
// The counts live in every build: a build without CUDA compiles them too, and they stay 0
// there unless CountHostSync is called. SessionCounters::host_syncs is a session's share
// (engine/session.cc reads the total before and after each call it drives).
#pragma once

#include <cstdint>

namespace kvtier {

/// Why the host blocked on the device (the list at the top of this file).
enum class HostSyncKind : int { kStream = 0, kEvent, kDevice, kBlockingCopy, kPageableCopy };
inline constexpr int kHostSyncKinds = 5;

/// The name of a kind ("stream", "event", "device", "blocking_copy", "pageable_copy").
const char* HostSyncKindName(HostSyncKind kind);

/// The process's waits since it started, by kind.
struct HostSyncCounts {
  uint64_t by_kind[kHostSyncKinds] = {};
  uint64_t of(HostSyncKind kind) const { return by_kind[static_cast<int>(kind)]; }
  uint64_t total() const;
  /// Kind by kind, this snapshot minus an earlier one.
  HostSyncCounts Since(const HostSyncCounts& earlier) const;
};

/// A snapshot of the counts. Each count is exact; counts taken while other threads wait may be
/// from slightly different moments (relaxed loads, one per kind).
HostSyncCounts ReadHostSyncs();
/// ReadHostSyncs().total(), without the snapshot.
uint64_t HostSyncsTotal();
/// Counts one wait of `kind`. The wrappers of offload/device_sync_cuda.h call it before they
/// call the runtime; a tier that blocks on a device some other way calls it itself.
void CountHostSync(HostSyncKind kind);

}  // namespace kvtier
