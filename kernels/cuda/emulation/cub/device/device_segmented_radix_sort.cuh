// Emulation build only: a CPU STAND-IN for cub::DeviceSegmentedRadixSort::SortPairsDescending
// (kernels/cuda/emulation), not CUB. It keeps CUB's contract: a size query with null temporary
// storage, then the sort enqueued on `stream` (a one-thread kernel that reads the offsets and
// keys when the stream reaches it); a stable descending order of the keys' radix order (for
// floats: the sign-flipped bit patterns, so -0.0 sorts below +0.0 as in CUB).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels/cuda/emulation/hip_cpu_compat.h"

namespace cub {
namespace emulation {

// CUB's twiddle: floats become unsigned integers in the same order, so that a radix sort on
// bits orders them; descending is the reverse of that order, stable.
template <typename Key>
uint64_t RadixOrder(Key k) {
  static_assert(std::is_same_v<Key, float> || std::is_same_v<Key, double>, "stand-in sorts float keys");
  using Bits = std::conditional_t<sizeof(Key) == 4, uint32_t, uint64_t>;
  Bits b;
  std::memcpy(&b, &k, sizeof b);
  const Bits sign = Bits{1} << (sizeof(Bits) * 8 - 1);
  return (b & sign) ? static_cast<Bits>(~b) : static_cast<Bits>(b | sign);
}

template <typename Key, typename Value>
void SortSegmentsDescending(const Key* keys_in, Key* keys_out, const Value* values_in, Value* values_out,
                            int n_segments, const int* begin_offsets, const int* end_offsets) {
  std::vector<int> order;
  for (int s = 0; s < n_segments; ++s) {
    const int begin = begin_offsets[s], end = end_offsets[s];
    if (end <= begin) continue;
    order.resize(static_cast<size_t>(end - begin));
    std::iota(order.begin(), order.end(), begin);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return RadixOrder(keys_in[a]) > RadixOrder(keys_in[b]); });
    for (int i = begin; i < end; ++i) {
      keys_out[i] = keys_in[order[static_cast<size_t>(i - begin)]];
      values_out[i] = values_in[order[static_cast<size_t>(i - begin)]];
    }
  }
}

template <typename Key, typename Value>
__global__ void SortKernel(const Key* keys_in, Key* keys_out, const Value* values_in, Value* values_out,
                           int n_segments, const int* begin_offsets, const int* end_offsets) {
  SortSegmentsDescending(keys_in, keys_out, values_in, values_out, n_segments, begin_offsets, end_offsets);
}

}  // namespace emulation

struct DeviceSegmentedRadixSort {
  template <typename Key, typename Value, typename Offsets>
  static cudaError_t SortPairsDescending(void* temp_storage, size_t& temp_storage_bytes, const Key* keys_in,
                                         Key* keys_out, const Value* values_in, Value* values_out,
                                         int num_items, int num_segments, Offsets begin_offsets,
                                         Offsets end_offsets, int begin_bit = 0,
                                         int end_bit = sizeof(Key) * 8, cudaStream_t stream = nullptr) {
    if (begin_bit != 0 || end_bit != static_cast<int>(sizeof(Key) * 8)) return cudaErrorInvalidValue;
    if (temp_storage == nullptr) {
      temp_storage_bytes = 256;  // CUB needs some; the stand-in asks for a token amount
      return cudaSuccess;
    }
    if (num_items < 0 || num_segments < 0) return cudaErrorInvalidValue;
    if (num_segments == 0 || num_items == 0) return cudaSuccess;
    kvtier_emu::Launch(&emulation::SortKernel<Key, Value>, dim3(1), dim3(1), 0, stream, keys_in, keys_out,
                       values_in, values_out, num_segments, static_cast<const int*>(begin_offsets),
                       static_cast<const int*>(end_offsets));
    return cudaSuccess;
  }
};

}  // namespace cub
