// PinnedStaging: the host side of a device tier's asynchronous copies. A ring of `entries`
// pinned host buffers, each with an event recorded after the last copy that used it, so that a
// copy to or from an engine's (pageable) memory goes through pinned memory without a host wait
// and can be captured. An entry is reused only once its event has completed; while the device
// keeps within `entries` copies of the host, taking one finds it free, and when it does not, the
// wait is counted (offload/device_sync.h). Buffers grow to the largest copy and stay; they are
// counted pinned memory (offload/device_memory.h).
//
// Not thread-safe: its owner serialises Take / Done / Wait (CudaHotTier under a mutex, the cuda
// attention backend by being one session's). Builds with CUDA only; streams are cudaStream_t
// passed as void*, so that this header needs no CUDA header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "store/status.h"

namespace kvtier {

#if KVTIER_HAVE_CUDA

class PinnedStaging {
 public:
  /// `entries` buffers (at least 1); `owner` prefixes error messages (e.g. "hot tier \"cuda\"").
  PinnedStaging(int entries, std::string owner);
  ~PinnedStaging();
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  /// The next entry, at least `bytes` long, free to overwrite (its earlier copies complete).
  /// `what` names the copy in errors.
  Result<uint8_t*> Take(size_t bytes, const char* what);
  /// Marks the entry Take returned last as used by everything submitted to `stream` so far.
  Status Done(void* stream);
  /// Waits for the entry Take returned last (after Done): its device-to-host copies are in place.
  Status Wait();

 private:
  struct Entry {
    void* host = nullptr;
    size_t bytes = 0;
    void* done = nullptr;  // cudaEvent_t
    bool recorded = false;
  };
  std::vector<Entry> entries_;
  size_t current_;
  std::string owner_;
};

#endif  // KVTIER_HAVE_CUDA

}  // namespace kvtier
