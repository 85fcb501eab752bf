// The device chunk table: which slot of a slot pool holds which (layer, row) chunk, kept in
// memory the decode step's kernels read and write, so that the host is not in the loop of a
// step (ShadowKV's GPU-side diff and gather). This is the CPU twin that defines the CUDA
// launchers LaunchChunkTableAssign and LaunchChunkTableGather (kernels/cuda/kernels.h): same
// params, host pointers here, device pointers there, the same outputs bit for bit.
//
// One call covers one layer of one decode step. ChunkTableAssign diffs the layer's selection
// (rows, best first, their count in memory) against the table and writes the slot list the
// attention kernel reads (SlotAttentionParams::slot_index and slot_first_position), plus the
// misses; ChunkTableGather then copies each missed chunk's K and V from its warm copy (pinned
// host memory, mapped so that a kernel reads it through UVA) into its slot.
//
// The table (every array caller-owned; an empty table is all bytes 0xff in slot_owner and
// row_slot, all zero in slot_stamp and clock_hand, so a memset makes one):
//   slot_owner[slot]            (layer << 32) | row of the chunk it holds, kChunkTableFree if none
//   slot_stamp[slot]            the stamp of the call that last used it (assigned or hit)
//   row_slot[layer][row]        the slot holding (layer, row), -1 if none
//   clock_hand                  the slot the next search for a victim starts at
// Invariant (kept by every call): row_slot[l][r] == s >= 0 iff slot_owner[s] == (l << 32 | r).
//
// Stamps: every call passes its stamp (>= 1, < kChunkTableStampBit, e.g. step * layers +
// layer + 1) and the stamp of its step's first layer (step_first_stamp <= stamp); a step's
// layers get increasing stamps, later steps larger ones. The layers of a step run on one
// stream, each layer's attention before the next layer's call.
//
// Assignment rule (the contract; the twin and the kernel implement exactly this):
//   1. Hits first, as if all at once: every valid row that the table holds for this layer gets
//      `stamp` on its slot (so no miss of this call can take it).
//   2. Then the entries in selection order, each one of:
//      - invalid (counter kInvalid, skipped): row outside [0, row_capacity), or a row already
//        listed by an earlier entry of this call (rows must be unique; the host cannot check
//        device memory);
//      - hit (kHits): the row is held; its slot and first_position[row] are appended to the
//        slot list. A hit needs no source;
//      - no source (kNoSource, skipped): not held and src_k[row] or src_v[row] is null (the
//        chunk has no copy a kernel can read);
//      - miss (kMisses): not held; the victim is, searching clock-wise from clock_hand, the
//        first slot that is free or whose stamp < step_first_stamp (last used by an earlier
//        step); if a full turn finds none, the first slot clock-wise from clock_hand whose stamp
//        is neither `stamp` nor listed by this call (a slot an earlier layer of this step used:
//        safe, since that layer's attention ran before on the same stream). clock_hand moves to
//        the slot after the victim. The victim's old owner (if any) loses its row_slot entry,
//        the victim gets the row, `stamp`, and is appended to the slot list and to the misses;
//      - overflow (kOverflow, skipped): not held and no victim (every slot holds a chunk this
//        call listed or stamped).
//   A slot is never given to a miss if this call already holds it (a hit or an earlier miss).
//   *n_rows outside [0, max_rows] is clamped into it; the entries past max_rows count as
//   invalid. A row_slot entry outside [0, slots), or one whose slot_owner disagrees, is read
//   as "not held"; a clock_hand outside [0, slots) as 0.
//
// Gather: for each miss i < *n_misses, chunk_bytes_k bytes from src_k[miss_row[i]] to pool_k +
// miss_slot[i] * chunk_bytes_k, and the same for V. Slots hold one chunk's half each:
// pool_k/pool_v are [slots, slot_tokens, kv_heads, head_dim] in the storage dtype, so
// chunk_bytes_k = slot_tokens * kv_heads * head_dim * DTypeSize.
//
// The sequential part of the rule (the held-slot lookup, the victim search and the walk over
// the entries) is inline below and compiles for the host and the device (KVTIER_HOST_DEVICE):
// the twin and the kernel's walking thread run the same source. Plain C++17 with no CUDA
// include: nvcc compiles it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/attention.h"  // KernelError
#include "kernels/host_device.h"

namespace kvtier::kernels {

/// slot_owner of a slot that holds no chunk.
inline constexpr int64_t kChunkTableFree = -1;
/// Stamps are below this bit: a call sets it on the slots it lists while it assigns (how it
/// finds repeated rows) and clears it before it returns.
inline constexpr uint64_t kChunkTableStampBit = uint64_t{1} << 63;

/// The counters ChunkTableParams::counters holds, each ADDED to by a call.
enum ChunkTableCounter : int {
  kChunkTableHits = 0,      ///< entries served from the slot already holding the row
  kChunkTableMisses = 1,    ///< entries given a slot (and a gather copy)
  kChunkTableNoSource = 2,  ///< skipped: not held and src_k or src_v null
  kChunkTableInvalid = 3,   ///< skipped: row out of range, repeated, or past max_rows
  kChunkTableOverflow = 4,  ///< skipped: not held and no slot could be taken
  kChunkTableCounters = 5,
};

/// (layer << 32) | row: the slot_owner value of a chunk.
KVTIER_HOST_DEVICE constexpr int64_t ChunkTableOwner(int layer, int32_t row) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 32) |
                              static_cast<uint32_t>(row));
}

/// One call (one layer of one step). Pointers are host memory for the twin and device memory
/// (or mapped pinned host memory) for the CUDA launchers; every count marked "in memory" is read
/// there, never by the host.
struct ChunkTableParams {
  // ---- the table (read and written) ----
  int slots = 0;                   ///< slots in the pool, > 0
  int layers = 0;                  ///< > 0
  int row_capacity = 0;            ///< rows per layer, > 0
  int64_t* slot_owner = nullptr;   ///< [slots] ChunkTableOwner of the held chunk, kChunkTableFree if none
  uint64_t* slot_stamp = nullptr;  ///< [slots] stamp of the slot's last use
  int32_t* row_slot = nullptr;     ///< [layers, row_capacity] slot holding (layer, row), -1 if none
  int32_t* clock_hand = nullptr;   ///< [1] where the next victim search starts
  // ---- this call ----
  int layer = 0;                            ///< 0 .. layers - 1
  uint64_t stamp = 0;                       ///< 1 .. kChunkTableStampBit - 1, increasing call after call
  uint64_t step_first_stamp = 0;            ///< stamp of this step's first layer, 1 .. stamp
  int max_rows = 0;                         ///< capacity of rows and of every per-entry output, >= 0
  const int32_t* rows = nullptr;            ///< [max_rows] the selection, best first
  const int32_t* n_rows = nullptr;          ///< [1] entries used in rows (in memory)
  const void* const* src_k = nullptr;       ///< [row_capacity] device-readable K of each row's chunk, or null
  const void* const* src_v = nullptr;       ///< [row_capacity] the same for V
  const int64_t* first_position = nullptr;  ///< [row_capacity] absolute position of each row's token 0
  // ---- outputs ----
  int32_t* slot_list = nullptr;            ///< [max_rows] slot of each served entry, selection order
  int64_t* slot_first_position = nullptr;  ///< [max_rows] first_position of each served entry
  int32_t* n_slots = nullptr;              ///< [1] entries written to slot_list
  int32_t* miss_slot = nullptr;            ///< [max_rows] slot of each miss, selection order
  int32_t* miss_row = nullptr;             ///< [max_rows] row of each miss
  int32_t* n_misses = nullptr;             ///< [1] entries written to miss_slot / miss_row
  int64_t* counters = nullptr;             ///< [kChunkTableCounters] ADDED to (ChunkTableCounter)
  // ---- gather ----
  size_t chunk_bytes_k = 0;  ///< bytes of one chunk's K (one slot of pool_k), > 0
  size_t chunk_bytes_v = 0;  ///< bytes of one chunk's V, > 0
  void* pool_k = nullptr;    ///< [slots, chunk_bytes_k]
  void* pool_v = nullptr;    ///< [slots, chunk_bytes_v]
};

/// The slot holding (p.layer, row), or -1: a row_slot entry outside the pool or one whose owner
/// disagrees reads as "not held". `row` must be in [0, row_capacity).
KVTIER_HOST_DEVICE inline int32_t ChunkTableHeldSlot(const ChunkTableParams& p, int32_t row) {
  const int32_t s = p.row_slot[static_cast<size_t>(p.layer) * p.row_capacity + row];
  if (s < 0 || s >= p.slots || p.slot_owner[s] != ChunkTableOwner(p.layer, row)) return -1;
  return s;
}

/// The victim for a miss (the rule's two clock-wise searches), or -1; moves the clock hand past it.
KVTIER_HOST_DEVICE inline int32_t ChunkTableTakeVictim(const ChunkTableParams& p) {
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

/// Step 2 of the rule, after step 1 stamped the hits: walks the first `n` entries in selection
/// order, writes the slot list, the misses, *n_slots and *n_misses, marks each listed slot with
/// kChunkTableStampBit (step 3 clears it) and adds what it saw to `count` (zeroed by the caller,
/// kChunkTableCounters entries). Returns the entries listed.
KVTIER_HOST_DEVICE inline int32_t ChunkTableWalkEntries(const ChunkTableParams& p, int n, int64_t* count) {
  int32_t n_slots = 0, n_misses = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t row = p.rows[i];
    if (row < 0 || row >= p.row_capacity) {
      ++count[kChunkTableInvalid];
      continue;
    }
    int32_t s = ChunkTableHeldSlot(p, row);
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
      s = ChunkTableTakeVictim(p);
      if (s < 0) {
        ++count[kChunkTableOverflow];
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
  *p.n_slots = n_slots;
  *p.n_misses = n_misses;
  return n_slots;
}

/// Host checks of what ChunkTableAssign / LaunchChunkTableAssign read or write, short of reading
/// memory: sizes, stamps, the layer, null pointers (kBadShape, kNullPointer).
KernelError CheckChunkTableAssignParams(const ChunkTableParams& p);
/// The same for the gather: slots, max_rows, chunk sizes, pools, sources, the miss list.
KernelError CheckChunkTableGatherParams(const ChunkTableParams& p);

/// CPU twin of the assignment (the rule at the top of this file).
KernelError ChunkTableAssign(const ChunkTableParams& p);
/// CPU twin of the gather: one memcpy per miss and half. A miss_slot outside [0, slots), a
/// miss_row outside [0, row_capacity) or a null source is skipped, as the kernel skips it;
/// *n_misses is clamped into [0, max_rows]. The sources must not change between the assignment
/// and the gather (the assignment's misses all had both).
KernelError ChunkTableGather(const ChunkTableParams& p);

}  // namespace kvtier::kernels
