// CPU twin of the device chunk table (kernels/cpu/chunk_table.h states the rule); the CUDA
// kernels in kernels/cuda/chunk_table.cu follow the same steps in the same order.
#include "kernels/cpu/chunk_table.h"

#include <algorithm>
#include <cstring>

namespace kvtier::kernels {
namespace {

// The slot holding (layer, row), or -1: a row_slot entry outside the pool or one whose owner
// disagrees reads as "not held".
int32_t HeldSlot(const ChunkTableParams& p, int32_t row) {
  const int32_t s = p.row_slot[static_cast<size_t>(p.layer) * p.row_capacity + row];
  if (s < 0 || s >= p.slots || p.slot_owner[s] != ChunkTableOwner(p.layer, row)) return -1;
  return s;
}

// The victim for a miss (the rule's two searches), or -1; moves the clock hand past it.
int32_t TakeVictim(const ChunkTableParams& p) {
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

}  // namespace

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
  const auto valid = [&](int32_t row) { return row >= 0 && row < p.row_capacity; };

  // 1. Hits, as if all at once: their slots get this call's stamp, so no miss takes them.
  for (int i = 0; i < n; ++i) {
    const int32_t row = p.rows[i];
    if (!valid(row)) continue;
    if (const int32_t s = HeldSlot(p, row); s >= 0) p.slot_stamp[s] = p.stamp;
  }
  // 2. The entries in selection order. A listed slot carries kChunkTableStampBit until step 3.
  int32_t n_slots = 0, n_misses = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t row = p.rows[i];
    if (!valid(row)) {
      ++count[kChunkTableInvalid];
      continue;
    }
    int32_t s = HeldSlot(p, row);
    if (s >= 0) {
      if ((p.slot_stamp[s] & kChunkTableStampBit) != 0) {  // listed by an earlier entry
        ++count[kChunkTableInvalid];
        continue;
      }
      ++count[kChunkTableHits];
    } else {
      if (p.src_k[row] == nullptr || p.src_v[row] == nullptr) {
        ++count[kChunkTableNoSource];
        continue;
      }
      s = TakeVictim(p);
      if (s < 0) {
        ++count[kChunkTableOverflow];
        continue;
      }
      const int64_t old = p.slot_owner[s];
      if (old != kChunkTableFree) {
        const int32_t old_layer = static_cast<int32_t>(static_cast<uint64_t>(old) >> 32);
        const int32_t old_row = static_cast<int32_t>(static_cast<uint64_t>(old) & 0xffffffffu);
        if (old_layer >= 0 && old_layer < p.layers && old_row >= 0 && old_row < p.row_capacity) {
          int32_t& entry = p.row_slot[static_cast<size_t>(old_layer) * p.row_capacity + old_row];
          if (entry == s) entry = -1;
        }
      }
      p.slot_owner[s] = ChunkTableOwner(p.layer, row);
      p.row_slot[static_cast<size_t>(p.layer) * p.row_capacity + row] = s;
      p.miss_slot[n_misses] = s;
      p.miss_row[n_misses] = row;
      ++n_misses;
      ++count[kChunkTableMisses];
    }
    p.slot_stamp[s] = p.stamp | kChunkTableStampBit;
    p.slot_list[n_slots] = s;
    p.slot_first_position[n_slots] = p.first_position[row];
    ++n_slots;
  }
  // 3. Every listed slot keeps this call's stamp.
  for (int i = 0; i < n_slots; ++i) p.slot_stamp[p.slot_list[i]] = p.stamp;
  *p.n_slots = n_slots;
  *p.n_misses = n_misses;
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
