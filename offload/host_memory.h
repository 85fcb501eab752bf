// Host memory for the warm tier: page-locked (pinned) when a CUDA device is
// present, so H2D copies can run asynchronously at full bandwidth; plain
// 4 KiB-aligned memory otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "store/status.h"

namespace kvtier {

class HostBuffer {
 public:
  enum class Kind { kAligned, kPinned };

  /// Allocates `bytes` (> 0). `want_pinned` asks for cudaHostAlloc; it falls
  /// back to aligned memory when kvtier was built without CUDA or no device is
  /// visible (kind() tells which one you got).
  static Result<std::unique_ptr<HostBuffer>> Allocate(size_t bytes, bool want_pinned);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }
  Kind kind() const { return kind_; }

 private:
  HostBuffer(uint8_t* data, size_t bytes, Kind kind) : data_(data), bytes_(bytes), kind_(kind) {}
  uint8_t* data_;
  size_t bytes_;
  Kind kind_;
};

/// True when kvtier was built with CUDA and at least one device is visible.
bool CudaDevicePresent();
/// Creates the CUDA runtime's primary context when CudaDevicePresent(), so that a caller can
/// measure the process's memory with the runtime in it before kvtier allocates; otherwise
/// does nothing. The first pinned allocation would create it anyway.
void InitDeviceRuntime();

/// A pool of equally sized slots carved out of one HostBuffer. Not
/// thread-safe: the owner (a tier) serialises access under its own lock.
class SlotPool {
 public:
  /// `capacity_bytes / slot_bytes` slots; fewer than one slot is an error
  /// naming `what` (e.g. "warm_bytes").
  static Result<std::unique_ptr<SlotPool>> Create(const char* what, size_t capacity_bytes, size_t slot_bytes,
                                                  bool want_pinned);
  int32_t capacity() const { return capacity_; }
  int32_t used() const { return capacity_ - static_cast<int32_t>(free_.size()); }
  size_t slot_bytes() const { return slot_bytes_; }
  bool full() const { return free_.empty(); }
  /// Returns a free slot index, or -1 when full.
  int32_t Acquire();
  void Release(int32_t slot);
  uint8_t* slot_data(int32_t slot) { return buffer_->data() + static_cast<size_t>(slot) * slot_bytes_; }
  HostBuffer::Kind memory_kind() const { return buffer_->kind(); }

 private:
  SlotPool() = default;
  std::unique_ptr<HostBuffer> buffer_;
  size_t slot_bytes_ = 0;
  int32_t capacity_ = 0;
  std::vector<int32_t> free_;
};

}  // namespace kvtier
