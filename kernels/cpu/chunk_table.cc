// CPU twin of the device chunk table (kernels/cpu/chunk_table.h states the rule); the CUDA
// kernels in kernels/cuda/chunk_table.cu follow the same steps in the same order.
#include "kernels/cpu/chunk_table.h"

#include <algorithm>
#include <cstring>

namespace kvtier::kernels {

KernelError CheckChunkTableAssignParams(const ChunkTableParams& p) {
  if (p.slots <= 0 || p.layers <= 0 || p.row_capacity <= 0 || p.max_rows < 0) return KernelError::kBadShape;
  if (p.layer < 0 || p.layer >= p.layers) return KernelError::kBadShape;
  if (p.stamp == 0 || (p.stamp & kChunkTableStampBit) != 0) return KernelError::kBadShape;
  if (p.step_first_stamp == 0 || p.step_first_stamp > p.stamp) return KernelError::kBadShape;
  if (!p.slot_owner || !p.slot_stamp || !p.row_slot || !p.clock_hand || !p.n_rows || !p.n_slots ||
      !p.n_misses || !p.counters)
    return KernelError::kNullPointer;
  if (p.max_rows > 0 && (!p.rows || !p.src_k || !p.src_v || !p.first_position || !p.slot_list ||
                         !p.slot_first_position || !p.miss_slot || !p.miss_row))
    return KernelError::kNullPointer;
  return KernelError::kOk;
}

KernelError CheckChunkTableGatherParams(const ChunkTableParams& p) {
  if (p.slots <= 0 || p.row_capacity <= 0 || p.max_rows < 0 || p.chunk_bytes_k == 0 || p.chunk_bytes_v == 0)
    return KernelError::kBadShape;
  if (!p.n_misses) return KernelError::kNullPointer;
  if (p.max_rows > 0 && (!p.miss_slot || !p.miss_row || !p.src_k || !p.src_v || !p.pool_k || !p.pool_v))
    return KernelError::kNullPointer;
  return KernelError::kOk;
}

KernelError ChunkTableAssign(const ChunkTableParams& p) {
  if (const KernelError e = CheckChunkTableAssignParams(p); e != KernelError::kOk) return e;
  const int32_t asked = *p.n_rows;
  const int n = std::clamp(asked, 0, p.max_rows);
  int64_t count[kChunkTableCounters] = {};
  count[kChunkTableInvalid] = asked > p.max_rows ? static_cast<int64_t>(asked) - p.max_rows : 0;
  // 1. Hits, as if all at once: their slots get this call's stamp, so no miss takes them.
  for (int i = 0; i < n; ++i) {
    const int32_t row = p.rows[i];
    if (row < 0 || row >= p.row_capacity) continue;
    if (const int32_t s = ChunkTableHeldSlot(p, row); s >= 0) p.slot_stamp[s] = p.stamp;
  }
  // 2. The entries in selection order. A listed slot carries kChunkTableStampBit until step 3.
  const int32_t n_slots = ChunkTableWalkEntries(p, n, count);
  // 3. Every listed slot keeps this call's stamp.
  for (int i = 0; i < n_slots; ++i) p.slot_stamp[p.slot_list[i]] = p.stamp;
  for (int c = 0; c < kChunkTableCounters; ++c) p.counters[c] += count[c];
  return KernelError::kOk;
}

KernelError ChunkTableGather(const ChunkTableParams& p) {
  if (const KernelError e = CheckChunkTableGatherParams(p); e != KernelError::kOk) return e;
  const int n = std::clamp(*p.n_misses, 0, p.max_rows);
  for (int i = 0; i < n; ++i) {
    const int32_t s = p.miss_slot[i], row = p.miss_row[i];
    if (s < 0 || s >= p.slots || row < 0 || row >= p.row_capacity) continue;
    if (p.src_k[row] != nullptr)
      std::memcpy(static_cast<char*>(p.pool_k) + static_cast<size_t>(s) * p.chunk_bytes_k, p.src_k[row],
                  p.chunk_bytes_k);
    if (p.src_v[row] != nullptr)
      std::memcpy(static_cast<char*>(p.pool_v) + static_cast<size_t>(s) * p.chunk_bytes_v, p.src_v[row],
                  p.chunk_bytes_v);
  }
  return KernelError::kOk;
}

}  // namespace kvtier::kernels
