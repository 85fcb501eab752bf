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
// there unless CountHostSync is called.
//
// Whose wait: a thread inside a HostSyncStepScope runs a step (engine/session.cc opens one
// around each session call it drives); a wait on any other thread (a transfer worker bringing
// chunks in, a landing, a tool's own) is a worker's. Each thread also keeps its own count, so a
// session's share is exact for its own thread: SessionCounters::host_syncs is the waits on the
// call's thread during its calls, SessionCounters::worker_host_syncs the workers' waits
// (process-wide, outside any step scope) during them.
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

/// Waits made on the calling thread since it started (every kind, whatever scope).
uint64_t HostSyncsOnThisThread();
/// Waits made so far on threads that were inside no HostSyncStepScope then: the workers'.
uint64_t WorkerHostSyncsTotal();

/// While one lives, the calling thread runs a step: its waits are not counted as a worker's.
/// Nests (the thread is a worker's again when the outermost scope ends). Not movable.
class HostSyncStepScope {
 public:
  HostSyncStepScope();
  ~HostSyncStepScope();
  HostSyncStepScope(const HostSyncStepScope&) = delete;
  HostSyncStepScope& operator=(const HostSyncStepScope&) = delete;
};

}  // namespace kvtier
