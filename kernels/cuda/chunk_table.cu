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
    if (const int32_t s = ChunkTableHeldSlot(p, row); s >= 0) p.slot_stamp[s] = p.stamp;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t count[kChunkTableCounters] = {};
    count[kChunkTableInvalid] = asked > p.max_rows ? static_cast<int64_t>(asked) - p.max_rows : 0;
    listed = ChunkTableWalkEntries(p, n, count);
    for (int c = 0; c < kChunkTableCounters; ++c) p.counters[c] += count[c];
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
