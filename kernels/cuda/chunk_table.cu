// The device chunk table: assignment and gather kernels over ChunkTableParams, whose meaning the
// CPU twin defines (kernels/cpu/chunk_table.h). See kernels/cuda/kernels.h.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/chunk_table.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvtier::kernels::cuda {
namespace {

constexpr int kAssignThreads = 256;
constexpr int kGatherThreads = 256;
// Bytes one gather block moves per pass: four 16-byte vectors per thread.
constexpr size_t kGatherBlockBytes = size_t{kGatherThreads} * 16 * 4;
constexpr int kMaxGridY = 65535;

// ChunkTableOwner, for device code (the header's constexpr function is host code under nvcc).
__device__ int64_t OwnerOf(int layer, int32_t row) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 32) |
                              static_cast<uint32_t>(row));
}

__device__ int32_t HeldSlot(const ChunkTableParams& p, int32_t row) {
  const int32_t s = p.row_slot[static_cast<size_t>(p.layer) * p.row_capacity + row];
  if (s < 0 || s >= p.slots || p.slot_owner[s] != OwnerOf(p.layer, row)) return -1;
  return s;
}

// The twin's TakeVictim: a clock-wise search for a free or earlier-step slot, then for one an
// earlier layer of this step used; moves the hand past the victim.
__device__ int32_t TakeVictim(const ChunkTableParams& p) {
  int32_t hand = *p.clock_hand;
  if (hand < 0 || hand >= p.slots) hand = 0;
  int32_t victim = -1;
  for (int k = 0; k < p.slots && victim < 0; ++k) {
    const int32_t s = (hand + k) % p.slots;
    if (p.slot_owner[s] == kChunkTableFree || p.slot_stamp[s] < p.step_first_stamp) victim = s;
  }
  for (int k = 0; k < p.slots && victim < 0; ++k) {
    const int32_t s = (hand + k) % p.slots;
    const uint64_t t = p.slot_stamp[s];
    if (t != p.stamp && (t & kChunkTableStampBit) == 0) victim = s;
  }
  if (victim >= 0) *p.clock_hand = (victim + 1) % p.slots;
  return victim;
}

// One block. The hits are stamped in parallel; then thread 0 walks the entries in selection
// order (the rule is sequential: each miss's victim depends on the ones before); then the
// block clears the listed mark.
__global__ void __launch_bounds__(kAssignThreads) ChunkTableAssignKernel(const ChunkTableParams p) {
  __shared__ int32_t listed;
  const int32_t asked = *p.n_rows;
  const int n = asked < 0 ? 0 : (asked > p.max_rows ? p.max_rows : asked);
  for (int i = threadIdx.x; i < n; i += kAssignThreads) {
    const int32_t row = p.rows[i];
    if (row < 0 || row >= p.row_capacity) continue;
    // Two entries of one row write the same value.
    if (const int32_t s = HeldSlot(p, row); s >= 0) p.slot_stamp[s] = p.stamp;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t hits = 0, misses = 0, no_source = 0, overflow = 0;
    int64_t invalid = asked > p.max_rows ? static_cast<int64_t>(asked) - p.max_rows : 0;
    int32_t n_slots = 0, n_misses = 0;
    for (int i = 0; i < n; ++i) {
      const int32_t row = p.rows[i];
      if (row < 0 || row >= p.row_capacity) {
        ++invalid;
        continue;
      }
      int32_t s = HeldSlot(p, row);
      if (s >= 0) {
        if ((p.slot_stamp[s] & kChunkTableStampBit) != 0) {
          ++invalid;
          continue;
        }
        ++hits;
      } else {
        if (p.src_k[row] == nullptr || p.src_v[row] == nullptr) {
          ++no_source;
          continue;
        }
        s = TakeVictim(p);
        if (s < 0) {
          ++overflow;
          continue;
        }
        const int64_t old = p.slot_owner[s];
        if (old != kChunkTableFree) {
          const int32_t old_layer = static_cast<int32_t>(static_cast<uint64_t>(old) >> 32);
          const int32_t old_row = static_cast<int32_t>(static_cast<uint64_t>(old) & 0xffffffffu);
          if (old_layer >= 0 && old_layer < p.layers && old_row >= 0 && old_row < p.row_capacity) {
            int32_t* entry = p.row_slot + static_cast<size_t>(old_layer) * p.row_capacity + old_row;
            if (*entry == s) *entry = -1;
          }
        }
        p.slot_owner[s] = OwnerOf(p.layer, row);
        p.row_slot[static_cast<size_t>(p.layer) * p.row_capacity + row] = s;
        p.miss_slot[n_misses] = s;
        p.miss_row[n_misses] = row;
        ++n_misses;
        ++misses;
      }
      p.slot_stamp[s] = p.stamp | kChunkTableStampBit;
      p.slot_list[n_slots] = s;
      p.slot_first_position[n_slots] = p.first_position[row];
      ++n_slots;
    }
    *p.n_slots = n_slots;
    *p.n_misses = n_misses;
    p.counters[kChunkTableHits] += hits;
    p.counters[kChunkTableMisses] += misses;
    p.counters[kChunkTableNoSource] += no_source;
    p.counters[kChunkTableInvalid] += invalid;
    p.counters[kChunkTableOverflow] += overflow;
    listed = n_slots;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < listed; i += kAssignThreads) p.slot_stamp[p.slot_list[i]] = p.stamp;
}

// Copies [begin, end) of one chunk half: 16-byte vectors when the size and both addresses allow.
__device__ void CopySpan(const char* src, char* dst, size_t bytes, size_t begin, size_t end) {
  if (end > bytes) end = bytes;
  const bool vec16 =
      bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0;
  if (vec16) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (size_t j = begin / 16 + threadIdx.x; j < end / 16; j += kGatherThreads) d4[j] = s4[j];
  } else {
    for (size_t j = begin + threadIdx.x; j < end; j += kGatherThreads) dst[j] = src[j];
  }
}

// Grid (max_rows, parts of a chunk, K | V). Blocks past *n_misses exit; each block copies its
// parts of the miss's half, kGatherBlockBytes apart by gridDim.y.
__global__ void __launch_bounds__(kGatherThreads) ChunkTableGatherKernel(const ChunkTableParams p) {
  const int32_t count = *p.n_misses;
  const int i = blockIdx.x;
  if (i >= count || i >= p.max_rows) return;
  const int32_t s = p.miss_slot[i], row = p.miss_row[i];
  if (s < 0 || s >= p.slots || row < 0 || row >= p.row_capacity) return;
  const bool is_v = blockIdx.z == 1;
  const char* src = static_cast<const char*>(is_v ? p.src_v[row] : p.src_k[row]);
  if (src == nullptr) return;
  const size_t bytes = is_v ? p.chunk_bytes_v : p.chunk_bytes_k;
  char* dst = static_cast<char*>(is_v ? p.pool_v : p.pool_k) + static_cast<size_t>(s) * bytes;
  for (size_t begin = blockIdx.y * kGatherBlockBytes; begin < bytes; begin += gridDim.y * kGatherBlockBytes)
    CopySpan(src, dst, bytes, begin, begin + kGatherBlockBytes);
}

}  // namespace

KernelError LaunchChunkTableAssign(const ChunkTableParams& p, Stream stream) {
  if (const KernelError e = CheckChunkTableAssignParams(p); e != KernelError::kOk) return e;
  LaunchKernel(&ChunkTableAssignKernel, 1, kAssignThreads, 0, static_cast<cudaStream_t>(stream), p);
  return CheckLaunch();
}

KernelError LaunchChunkTableGather(const ChunkTableParams& p, Stream stream) {
  if (const KernelError e = CheckChunkTableGatherParams(p); e != KernelError::kOk) return e;
  if (p.max_rows == 0) return KernelError::kOk;
  const size_t largest = p.chunk_bytes_k > p.chunk_bytes_v ? p.chunk_bytes_k : p.chunk_bytes_v;
  const size_t parts = (largest + kGatherBlockBytes - 1) / kGatherBlockBytes;
  const dim3 grid(p.max_rows, parts < kMaxGridY ? static_cast<unsigned>(parts) : kMaxGridY, 2);
  LaunchKernel(&ChunkTableGatherKernel, grid, kGatherThreads, 0, static_cast<cudaStream_t>(stream), p);
  return CheckLaunch();
}

}  // namespace kvtier::kernels::cuda
