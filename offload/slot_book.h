// SlotBook: which slots of a fixed-size pool are taken, kept apart from the memory the slots
// live in. The CUDA hot tier (offload/cuda_hot_tier.h) cannot touch its slots from the host,
// so its bookkeeping is this device-independent class, tested on any machine
// (tests/offload/cuda_hot_tier_test.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "store/status.h"

namespace kvtier {

class SlotBook {
 public:
  /// `capacity` slots (>= 0), all free; Acquire hands out the lowest free slot first.
  explicit SlotBook(int32_t capacity) : held_(static_cast<size_t>(capacity > 0 ? capacity : 0), 0) {
    free_.reserve(held_.size());
    for (int32_t s = static_cast<int32_t>(held_.size()) - 1; s >= 0; --s) free_.push_back(s);
  }
  int32_t capacity() const { return static_cast<int32_t>(held_.size()); }
  int32_t used() const { return capacity() - static_cast<int32_t>(free_.size()); }

  /// A free slot, or -1 when every slot is taken.
  int32_t Acquire() {
    if (free_.empty()) return -1;
    const int32_t s = free_.back();
    free_.pop_back();
    held_[static_cast<size_t>(s)] = 1;
    return s;
  }

  /// InvalidArgument for a slot outside the pool, FailedPrecondition for one not taken (a
  /// double release would hand the same memory to two chunks); nothing changes then.
  Status Release(int32_t slot) {
    if (slot < 0 || slot >= capacity())
      return InvalidArgument("SlotBook::Release: slot " + std::to_string(slot) + " outside [0, " +
                             std::to_string(capacity()) + ")");
    if (!held_[static_cast<size_t>(slot)])
      return FailedPrecondition("SlotBook::Release: slot " + std::to_string(slot) + " is not taken");
    held_[static_cast<size_t>(slot)] = 0;
    free_.push_back(slot);
    return Status::Ok();
  }

 private:
  std::vector<int32_t> free_;  // a stack; lowest slot on top at the start
  std::vector<uint8_t> held_;  // [capacity] 1 while taken
};

}  // namespace kvtier
