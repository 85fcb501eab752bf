// kvtier's device memory, counted: the bytes each owner holds now and the most it held, the
// process's total now and its peak (the most held at once, not the sum of the owners' peaks),
// and the same for pinned host memory. Every source of the library and the tools allocates
// device or pinned memory through the wrappers of offload/device_memory_cuda.h, which count here
// (scripts/lint.sh allocs refuses a direct cudaMalloc, cudaFree, cudaHostAlloc, ... elsewhere).
//
// The counts are the bytes asked of the runtime, not what it rounds them to; nvidia-smi shows
// those plus the context, the libraries' own pools (cuBLAS, CUB's temporary storage when it
// allocates itself: kvtier passes it a workspace) and the allocator's granularity.
//
// The counts live in every build: a build without CUDA compiles them too, and they stay 0
// there. Reads are snapshots of relaxed atomics; updates (allocations, frees) are serialised.
#pragma once

#include <cstdint>

namespace kvtier {

/// Who holds a device allocation.
enum class DeviceMemoryOwner : int {
  kHotTier = 0,         ///< CudaHotTier: the slot pool, the sinks and local regions
  kAttention,           ///< the cuda attention backend: plan workspace, side buffers, rotation table
  kRetrievalMirror,     ///< ReprMirror on "cuda": the Exact index's representatives and norms
  kRetrievalWorkspace,  ///< the cuda retrieval backend's selection workspace
  kModelForward,        ///< the device forward of the model: weights, activations, BLAS workspace
  kEngineArrays,        ///< arrays kvtier allocates for an engine to fill (Python's kvtier.DeviceArray)
};
inline constexpr int kDeviceMemoryOwners = 6;

/// "hot_tier", "attention", "retrieval_mirror", "retrieval_workspace", "model_forward",
/// "engine_arrays".
const char* DeviceMemoryOwnerName(DeviceMemoryOwner owner);

/// A snapshot of the counts, in bytes.
struct DeviceMemoryUse {
  uint64_t current[kDeviceMemoryOwners] = {};
  uint64_t peak[kDeviceMemoryOwners] = {};  ///< each owner's most since the process started (or the reset)
  uint64_t current_total = 0;
  uint64_t peak_total = 0;  ///< the most every owner held at once
  uint64_t pinned_host_current = 0;
  uint64_t pinned_host_peak = 0;
  uint64_t current_of(DeviceMemoryOwner o) const { return current[static_cast<int>(o)]; }
  uint64_t peak_of(DeviceMemoryOwner o) const { return peak[static_cast<int>(o)]; }
};

DeviceMemoryUse ReadDeviceMemory();
/// ReadDeviceMemory().peak_total, without the snapshot.
uint64_t DeviceMemoryPeakBytes();
/// Every peak (each owner's, the total's, the pinned one) becomes what is held now, so that a
/// later read says the most held from here on (a test's or a phase's own peak).
void ResetDeviceMemoryPeaks();

/// Counts `bytes` of device memory `owner` took or gave back by a path other than the wrappers
/// (the wrappers call these). A free never takes an owner below 0.
void CountDeviceAllocation(DeviceMemoryOwner owner, uint64_t bytes);
void CountDeviceFree(DeviceMemoryOwner owner, uint64_t bytes);
/// The same for pinned host memory.
void CountPinnedHostAllocation(uint64_t bytes);
void CountPinnedHostFree(uint64_t bytes);

}  // namespace kvtier
