// The device chunk table (kernels/cpu/chunk_table.h): the CPU twin's assignment rule case by
// case, its gather, a 64-step scenario whose slot lists must always point at slots holding the
// right chunk's bytes, and the CUDA launchers against the twin (on a device, real or emulated:
// the sources in pinned host memory, mapped, so the gather reads them through UVA).
#include "kernels/cpu/chunk_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tests/device_test_util.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#endif

namespace kvtier::kernels {
namespace {

int64_t FirstPosition(int32_t row) { return int64_t{row} * 64 + 7; }

// A table, its sources and its pool in host memory, and one call's inputs and outputs.
struct HostTable {
  HostTable(int slots_, int layers_, int row_capacity_, int max_rows_, size_t bytes_k = 48,
            size_t bytes_v = 80, uint32_t seed = 1)
      : slots(slots_),
        layers(layers_),
        row_capacity(row_capacity_),
        max_rows(max_rows_),
        chunk_bytes_k(bytes_k),
        chunk_bytes_v(bytes_v) {
    slot_owner.assign(slots, kChunkTableFree);
    slot_stamp.assign(slots, 0);
    row_slot.assign(static_cast<size_t>(layers) * row_capacity, -1);
    std::mt19937 rng(seed);
    source_k.resize(static_cast<size_t>(layers) * row_capacity * chunk_bytes_k);
    source_v.resize(static_cast<size_t>(layers) * row_capacity * chunk_bytes_v);
    for (auto& b : source_k) b = static_cast<uint8_t>(rng());
    for (auto& b : source_v) b = static_cast<uint8_t>(rng());
    src_k.resize(layers);
    src_v.resize(layers);
    for (int l = 0; l < layers; ++l)
      for (int r = 0; r < row_capacity; ++r) {
        src_k[l].push_back(SourceK(l, r));
        src_v[l].push_back(SourceV(l, r));
      }
    for (int r = 0; r < row_capacity; ++r) first_position.push_back(FirstPosition(r));
    pool_k.assign(static_cast<size_t>(slots) * chunk_bytes_k, 0);
    pool_v.assign(static_cast<size_t>(slots) * chunk_bytes_v, 0);
    rows.assign(max_rows, -7);
    slot_list.assign(max_rows, -7);
    slot_first_position.assign(max_rows, -7);
    miss_slot.assign(max_rows, -7);
    miss_row.assign(max_rows, -7);
  }
  const uint8_t* SourceK(int layer, int row) const {
    return source_k.data() + (static_cast<size_t>(layer) * row_capacity + row) * chunk_bytes_k;
  }
  const uint8_t* SourceV(int layer, int row) const {
    return source_v.data() + (static_cast<size_t>(layer) * row_capacity + row) * chunk_bytes_v;
  }
  ChunkTableParams Params(int layer, uint64_t stamp, uint64_t step_first_stamp) {
    ChunkTableParams p;
    p.slots = slots;
    p.layers = layers;
    p.row_capacity = row_capacity;
    p.slot_owner = slot_owner.data();
    p.slot_stamp = slot_stamp.data();
    p.row_slot = row_slot.data();
    p.clock_hand = &clock_hand;
    p.layer = layer;
    p.stamp = stamp;
    p.step_first_stamp = step_first_stamp;
    p.max_rows = max_rows;
    p.rows = rows.data();
    p.n_rows = &n_rows;
    p.src_k = src_k[layer].data();
    p.src_v = src_v[layer].data();
    p.first_position = first_position.data();
    p.slot_list = slot_list.data();
    p.slot_first_position = slot_first_position.data();
    p.n_slots = &n_slots;
    p.miss_slot = miss_slot.data();
    p.miss_row = miss_row.data();
    p.n_misses = &n_misses;
    p.counters = counters;
    p.chunk_bytes_k = chunk_bytes_k;
    p.chunk_bytes_v = chunk_bytes_v;
    p.pool_k = pool_k.data();
    p.pool_v = pool_v.data();
    return p;
  }
  // Assign and gather for one layer's selection (its entries past max_rows are left out, but
  // counted in n_rows); stamps as a step of `layers` layers gives them.
  void Call(int step, int layer, const std::vector<int32_t>& selection) {
    std::copy_n(selection.begin(), std::min<size_t>(selection.size(), max_rows), rows.begin());
    n_rows = static_cast<int32_t>(selection.size());
    const ChunkTableParams p = Params(layer, Stamp(step, layer), Stamp(step, 0));
    ASSERT_EQ(ChunkTableAssign(p), KernelError::kOk);
    ASSERT_EQ(ChunkTableGather(p), KernelError::kOk);
  }
  uint64_t Stamp(int step, int layer) const { return static_cast<uint64_t>(step) * layers + layer + 1; }
  std::vector<int32_t> SlotList() const { return {slot_list.begin(), slot_list.begin() + n_slots}; }
  std::vector<int32_t> Misses() const {  // slot, row, slot, row, ...
    std::vector<int32_t> out;
    for (int i = 0; i < n_misses; ++i) out.insert(out.end(), {miss_slot[i], miss_row[i]});
    return out;
  }
  int32_t Held(int layer, int row) const { return row_slot[static_cast<size_t>(layer) * row_capacity + row]; }
  // Does slot s hold (layer, row)'s K and V bytes?
  bool SlotHolds(int32_t s, int layer, int row) const {
    return std::memcmp(pool_k.data() + static_cast<size_t>(s) * chunk_bytes_k, SourceK(layer, row),
                       chunk_bytes_k) == 0 &&
           std::memcmp(pool_v.data() + static_cast<size_t>(s) * chunk_bytes_v, SourceV(layer, row),
                       chunk_bytes_v) == 0;
  }
  // row_slot[l][r] == s >= 0 iff slot_owner[s] == (l, r).
  ::testing::AssertionResult Consistent() const {
    for (int l = 0; l < layers; ++l)
      for (int r = 0; r < row_capacity; ++r) {
        const int32_t s = Held(l, r);
        if (s >= 0 && (s >= slots || slot_owner[s] != ChunkTableOwner(l, r)))
          return ::testing::AssertionFailure()
                 << "row_slot[" << l << "][" << r << "] = " << s << " not owned";
      }
    for (int s = 0; s < slots; ++s) {
      if (slot_owner[s] == kChunkTableFree) continue;
      const int l = static_cast<int>(static_cast<uint64_t>(slot_owner[s]) >> 32);
      const int r = static_cast<int>(slot_owner[s] & 0xffffffff);
      if (Held(l, r) != s)
        return ::testing::AssertionFailure() << "slot " << s << "'s owner does not point back";
    }
    return ::testing::AssertionSuccess();
  }

  int slots, layers, row_capacity, max_rows;
  size_t chunk_bytes_k, chunk_bytes_v;
  std::vector<int64_t> slot_owner;
  std::vector<uint64_t> slot_stamp;
  std::vector<int32_t> row_slot;
  int32_t clock_hand = 0;
  std::vector<uint8_t> source_k, source_v;
  std::vector<std::vector<const void*>> src_k, src_v;  // [layer][row]
  std::vector<int64_t> first_position;
  std::vector<uint8_t> pool_k, pool_v;
  std::vector<int32_t> rows;
  int32_t n_rows = 0;
  std::vector<int32_t> slot_list;
  std::vector<int64_t> slot_first_position;
  int32_t n_slots = -7;
  std::vector<int32_t> miss_slot, miss_row;
  int32_t n_misses = -7;
  int64_t counters[kChunkTableCounters] = {};
};

using V = std::vector<int32_t>;

TEST(ChunkTable, HitsKeepTheirSlotsAndTakeTheNewStamp) {
  HostTable t(8, 2, 16, 8);
  t.Call(0, 0, {3, 5, 1});
  EXPECT_EQ(t.SlotList(), (V{0, 1, 2}));
  EXPECT_EQ(t.Misses(), (V{0, 3, 1, 5, 2, 1}));
  EXPECT_EQ(t.counters[kChunkTableMisses], 3);
  EXPECT_EQ(t.clock_hand, 3);
  t.Call(1, 0, {5, 7, 3});  // stamp 3: 5 and 3 hit, 7 takes the free slot at the hand
  EXPECT_EQ(t.SlotList(), (V{1, 3, 0}));
  EXPECT_EQ(std::vector<int64_t>(t.slot_first_position.begin(), t.slot_first_position.begin() + 3),
            (std::vector<int64_t>{FirstPosition(5), FirstPosition(7), FirstPosition(3)}));
  EXPECT_EQ(t.Misses(), (V{3, 7}));
  EXPECT_EQ(t.counters[kChunkTableHits], 2);
  EXPECT_EQ(t.counters[kChunkTableMisses], 4);
  EXPECT_EQ(t.slot_stamp[0], 3u);
  EXPECT_EQ(t.slot_stamp[1], 3u);
  EXPECT_EQ(t.slot_stamp[3], 3u);
  EXPECT_EQ(t.slot_stamp[2], 1u) << "row 1, not selected, keeps its old stamp";
  EXPECT_EQ(t.Held(0, 1), 2);
  EXPECT_TRUE(t.Consistent());
}

TEST(ChunkTable, MissesTakeEarlierStepSlotsClockwiseAndEvictTheirOwners) {
  HostTable t(4, 1, 16, 8);
  t.Call(0, 0, {0, 1, 2, 3});
  EXPECT_EQ(t.SlotList(), (V{0, 1, 2, 3}));
  EXPECT_EQ(t.clock_hand, 0);
  t.Call(1, 0, {1, 4});  // 1 hits slot 1; 4 takes slot 0 (stale), not slot 1 (just hit)
  EXPECT_EQ(t.SlotList(), (V{1, 0}));
  EXPECT_EQ(t.Held(0, 0), -1) << "the evicted owner's row_slot entry is reset";
  EXPECT_EQ(t.Held(0, 4), 0);
  EXPECT_EQ(t.clock_hand, 1);
  t.Call(2, 0, {5, 6});  // hand 1: slots 1 and 2, in that order
  EXPECT_EQ(t.SlotList(), (V{1, 2}));
  EXPECT_EQ(t.Held(0, 1), -1);
  EXPECT_EQ(t.Held(0, 2), -1);
  EXPECT_EQ(t.Held(0, 4), 0);
  EXPECT_EQ(t.clock_hand, 3);
  t.Call(3, 0, {7});  // hand 3: slot 3 (row 3, stale)
  EXPECT_EQ(t.SlotList(), (V{3}));
  EXPECT_EQ(t.clock_hand, 0);
  EXPECT_TRUE(t.Consistent());
}

TEST(ChunkTable, NeverGivesASlotTheCallHoldsAndCountsTheOverflow) {
  HostTable t(4, 1, 16, 8);
  t.Call(0, 0, {0, 1});
  // 9 and 8 take the free slots; 7 and 6 overflow, though they come before the hits 0 and 1
  // in the selection: the hits' slots are this call's from the start.
  t.Call(1, 0, {9, 8, 7, 0, 1, 6});
  const V list = t.SlotList();
  EXPECT_EQ(list, (V{2, 3, 0, 1}));
  EXPECT_EQ(std::set<int32_t>(list.begin(), list.end()).size(), list.size());
  EXPECT_EQ(t.counters[kChunkTableOverflow], 2);
  EXPECT_EQ(t.counters[kChunkTableHits], 2);
  EXPECT_EQ(t.counters[kChunkTableMisses], 4);
  EXPECT_EQ(t.Held(0, 7), -1);
  EXPECT_EQ(t.Held(0, 6), -1);
  EXPECT_TRUE(t.Consistent());
}

TEST(ChunkTable, TakesAnEarlierLayersSlotOfTheStepOnlyAfterAFullTurn) {
  HostTable t(4, 2, 16, 8);
  t.Call(0, 0, {0, 1});  // stamp 1: slots 0, 1
  t.Call(0, 1, {0, 1});  // stamp 2: slots 2, 3 (free)
  t.Call(1, 0, {2, 3});  // stamp 3, step from 3: slots 0, 1 (stamps 1 < 3)
  EXPECT_EQ(t.SlotList(), (V{0, 1}));
  t.clock_hand = 0;         // the search of the next call starts at layer 0's slots of this step
  t.Call(1, 1, {5, 6, 7});  // stamp 4: skips slots 0, 1, takes 2, 3; then 7 after a full turn
  EXPECT_EQ(t.SlotList(), (V{2, 3, 0}));
  EXPECT_EQ(t.counters[kChunkTableOverflow], 0);
  EXPECT_EQ(t.Held(0, 2), -1) << "layer 0's row 2 gave its slot to layer 1's row 7";
  EXPECT_EQ(t.Held(0, 3), 1);
  EXPECT_EQ(t.Held(1, 7), 0);
  EXPECT_EQ(t.clock_hand, 1);
  EXPECT_TRUE(t.Consistent());
  t.clock_hand = 0;
  t.Call(1, 1, {8});  // the same stamp again: nothing but its own slots left -> overflow
  EXPECT_EQ(t.SlotList(), (V{1})) << "slot 1 is layer 0's (stamp 3), the only one not of stamp 4";
}

TEST(ChunkTable, SkipsAndCountsRowsWithoutSourceBadRowsRepeatsAndRowsPastTheCapacity) {
  HostTable t(8, 1, 16, 6);
  t.src_k[0][4] = nullptr;
  t.src_v[0][5] = nullptr;
  t.Call(0, 0, {2});
  t.Call(1, 0, {4, 2, -1, 5, 16, 2});  // no source, hit, bad, no source, bad, repeat of a hit
  EXPECT_EQ(t.SlotList(), (V{0}));
  EXPECT_EQ(t.counters[kChunkTableNoSource], 2);
  EXPECT_EQ(t.counters[kChunkTableInvalid], 3);
  EXPECT_EQ(t.counters[kChunkTableHits], 1);
  t.Call(2, 0, {3, 3, 1});  // a repeated miss
  EXPECT_EQ(t.SlotList(), (V{1, 2}));
  EXPECT_EQ(t.counters[kChunkTableInvalid], 4);
  EXPECT_EQ(t.Misses(), (V{1, 3, 2, 1}));
  // A held row needs no source.
  t.src_k[0][3] = nullptr;
  t.Call(3, 0, {3});
  EXPECT_EQ(t.SlotList(), (V{1}));
  // A count past max_rows is clamped; the excess counts as invalid. A negative one lists nothing.
  t.rows = {6, 7, 8, 9, 10, 11};
  t.n_rows = 9;
  ASSERT_EQ(ChunkTableAssign(t.Params(0, t.Stamp(5, 0), t.Stamp(5, 0))), KernelError::kOk);
  EXPECT_EQ(t.n_slots, 6);
  EXPECT_EQ(t.counters[kChunkTableInvalid], 4 + 3);
  t.n_rows = -2;
  ASSERT_EQ(ChunkTableAssign(t.Params(0, t.Stamp(6, 0), t.Stamp(6, 0))), KernelError::kOk);
  EXPECT_EQ(t.n_slots, 0);
  EXPECT_EQ(t.n_misses, 0);
  // Every stamp ends below the listing bit.
  for (uint64_t s : t.slot_stamp) EXPECT_EQ(s & kChunkTableStampBit, 0u);
  EXPECT_TRUE(t.Consistent());
}

TEST(ChunkTable, GatherCopiesExactlyTheMissedChunks) {
  HostTable t(6, 1, 16, 6, 64, 96);
  t.Call(0, 0, {4, 9});
  EXPECT_TRUE(t.SlotHolds(0, 0, 4));
  EXPECT_TRUE(t.SlotHolds(1, 0, 9));
  std::fill(t.pool_k.begin(), t.pool_k.end(), 0xcd);
  std::fill(t.pool_v.begin(), t.pool_v.end(), 0xcd);
  t.Call(1, 0, {9, 11, 4, 2});  // misses 11 -> slot 2, 2 -> slot 3
  EXPECT_EQ(t.Misses(), (V{2, 11, 3, 2}));
  EXPECT_TRUE(t.SlotHolds(2, 0, 11));
  EXPECT_TRUE(t.SlotHolds(3, 0, 2));
  for (int s : {0, 1, 4, 5}) {
    SCOPED_TRACE("slot " + std::to_string(s));
    for (size_t b = 0; b < t.chunk_bytes_k; ++b) ASSERT_EQ(t.pool_k[s * t.chunk_bytes_k + b], 0xcd);
    for (size_t b = 0; b < t.chunk_bytes_v; ++b) ASSERT_EQ(t.pool_v[s * t.chunk_bytes_v + b], 0xcd);
  }
}

TEST(ChunkTable, RefusesBadParams) {
  HostTable t(4, 2, 8, 4);
  t.n_rows = 0;
  const ChunkTableParams good = t.Params(1, 5, 4);
  EXPECT_EQ(ChunkTableAssign(good), KernelError::kOk);
  EXPECT_EQ(ChunkTableGather(good), KernelError::kOk);
  auto assign = [&](auto change) {
    ChunkTableParams p = good;
    change(p);
    return ChunkTableAssign(p);
  };
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.stamp = 0; }), KernelError::kBadShape);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.stamp |= kChunkTableStampBit; }), KernelError::kBadShape);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.step_first_stamp = 6; }), KernelError::kBadShape);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.step_first_stamp = 0; }), KernelError::kBadShape);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.layer = 2; }), KernelError::kBadShape);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.slots = 0; }), KernelError::kBadShape);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.max_rows = -1; }), KernelError::kBadShape);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.row_slot = nullptr; }), KernelError::kNullPointer);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.n_rows = nullptr; }), KernelError::kNullPointer);
  EXPECT_EQ(assign([](ChunkTableParams& p) { p.src_v = nullptr; }), KernelError::kNullPointer);
  ChunkTableParams p = good;
  p.chunk_bytes_v = 0;
  EXPECT_EQ(ChunkTableGather(p), KernelError::kBadShape);
  p = good;
  p.pool_k = nullptr;
  EXPECT_EQ(ChunkTableGather(p), KernelError::kNullPointer);
}

// The selection of (step, layer) in the scenarios: a window that drifts with the step plus a
// few rows drawn at random, best first in random order, now and then a row without a source.
std::vector<int32_t> Selection(std::mt19937& rng, int step, int row_capacity, int count) {
  std::vector<int32_t> rows;
  const int base = (step / 3) % (row_capacity - 4);
  for (int r = base; r < base + 4; ++r) rows.push_back(r);
  while (static_cast<int>(rows.size()) < count) {
    const int32_t r = static_cast<int32_t>(rng() % row_capacity);
    if (std::find(rows.begin(), rows.end(), r) == rows.end()) rows.push_back(r);
  }
  std::shuffle(rows.begin(), rows.end(), rng);
  return rows;
}

TEST(ChunkTable, SlotListsPointAtTheRightChunksOverManySteps) {
  // A pool larger than a step's selections (up to 40 chunks), as a cuda tier sizes it.
  constexpr int kSteps = 64, kLayers = 4, kRows = 40, kSlots = 48;
  HostTable t(kSlots, kLayers, kRows, 10);
  std::mt19937 rng(7);
  for (int l = 0; l < kLayers; ++l) t.src_k[l][(l * 11 + 5) % kRows] = nullptr;  // no warm copy
  int64_t served = 0;
  for (int step = 0; step < kSteps; ++step)
    for (int layer = 0; layer < kLayers; ++layer) {
      SCOPED_TRACE("step " + std::to_string(step) + " layer " + std::to_string(layer));
      const std::vector<int32_t> selection = Selection(rng, step, kRows, 6 + static_cast<int>(rng() % 5));
      int64_t held_before = 0;
      for (int32_t r : selection) held_before += t.Held(layer, r) >= 0;
      int64_t before[kChunkTableCounters];
      std::copy(std::begin(t.counters), std::end(t.counters), before);
      t.Call(step, layer, selection);
      EXPECT_EQ(t.counters[kChunkTableHits] - before[kChunkTableHits], held_before);
      int64_t accounted = 0;
      for (int c = 0; c < kChunkTableCounters; ++c) accounted += t.counters[c] - before[c];
      EXPECT_EQ(accounted, static_cast<int64_t>(selection.size()));
      EXPECT_EQ(t.counters[kChunkTableOverflow], 0);
      // The slot list follows the selection's order, without the skipped rows, and each slot
      // holds its row's bytes and position.
      size_t at = 0;
      for (int i = 0; i < t.n_slots; ++i) {
        const int32_t s = t.slot_list[i];
        ASSERT_TRUE(s >= 0 && s < kSlots);
        const int64_t owner = t.slot_owner[s];
        ASSERT_EQ(owner >> 32, layer);
        const int32_t row = static_cast<int32_t>(owner & 0xffffffff);
        while (at < selection.size() && selection[at] != row) ++at;
        ASSERT_LT(at, selection.size())
            << "slot " << s << " holds row " << row << ", out of order or unselected";
        ++at;
        EXPECT_TRUE(t.SlotHolds(s, layer, row)) << "slot " << s << " row " << row;
        EXPECT_EQ(t.slot_first_position[i], FirstPosition(row));
        EXPECT_EQ(t.slot_stamp[s], t.Stamp(step, layer));
      }
      const V list = t.SlotList();
      EXPECT_EQ(std::set<int32_t>(list.begin(), list.end()).size(), list.size());
      ASSERT_TRUE(t.Consistent());
      served += t.n_slots;
    }
  EXPECT_GT(t.counters[kChunkTableHits], served / 4) << "the drifting window should hit";
  std::printf("chunk table scenario: %lld served, %lld hits, %lld misses\n", static_cast<long long>(served),
              static_cast<long long>(t.counters[kChunkTableHits]),
              static_cast<long long>(t.counters[kChunkTableMisses]));
  EXPECT_GT(t.counters[kChunkTableNoSource], 0);
}

#if KVTIER_HAVE_CUDA
using device_test::DeviceArena;
using device_test::Get;

TEST(ChunkTable, DeviceMatchesTheTwinOverManySteps) {
  if (cuda::DeviceCount() == 0)
    GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount found none (" << cuda::LastCudaErrorString() << ")";
  // A pool that holds a step's usual selections (4 or 5 rows a layer, so rows hit), and now and
  // then one layer asking for more rows than the pool has (the same-step fallback, then the
  // overflow); chunk halves of 16-byte multiples (vector copies) and not (byte copies).
  constexpr int kSteps = 64, kLayers = 4, kRows = 48, kSlots = 20, kMaxRows = 28;
  for (const auto [bytes_k, bytes_v] : {std::pair<size_t, size_t>{4096, 20480}, {72, 200}}) {
    SCOPED_TRACE("chunk bytes " + std::to_string(bytes_k) + "/" + std::to_string(bytes_v));
    HostTable twin(kSlots, kLayers, kRows, kMaxRows, bytes_k, bytes_v, 3);
    DeviceArena arena;
    // The sources in pinned host memory, mapped: the device reads them through these pointers.
    auto* pinned_k = static_cast<uint8_t*>(arena.Pinned(twin.source_k.size()));
    auto* pinned_v = static_cast<uint8_t*>(arena.Pinned(twin.source_v.size()));
    ASSERT_TRUE(pinned_k && pinned_v);
    std::memcpy(pinned_k, twin.source_k.data(), twin.source_k.size());
    std::memcpy(pinned_v, twin.source_v.data(), twin.source_v.size());
    void *mapped_k = nullptr, *mapped_v = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(&mapped_k, pinned_k, 0), cudaSuccess);
    ASSERT_EQ(cudaHostGetDevicePointer(&mapped_v, pinned_v, 0), cudaSuccess);
    std::vector<const void**> dev_src_k(kLayers), dev_src_v(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      twin.src_k[l][(l * 7 + 3) % kRows] = nullptr;
      std::vector<const void*> k(kRows), v(kRows);
      for (int r = 0; r < kRows; ++r) {
        const size_t chunk = static_cast<size_t>(l) * kRows + r;
        k[r] = twin.src_k[l][r] ? static_cast<const uint8_t*>(mapped_k) + chunk * bytes_k : nullptr;
        v[r] = static_cast<const uint8_t*>(mapped_v) + chunk * bytes_v;
      }
      dev_src_k[l] = arena.Put(k);
      dev_src_v[l] = arena.Put(v);
    }
    // The device table starts as the twin's (empty), its outputs as the twin's poison.
    int64_t* owner = arena.Put(twin.slot_owner);
    uint64_t* stamp = arena.Put(twin.slot_stamp);
    int32_t* row_slot = arena.Put(twin.row_slot);
    int32_t* hand = arena.Put(&twin.clock_hand, 1);
    int32_t* rows = arena.Put(twin.rows);
    int32_t* n_rows = arena.Put(&twin.n_rows, 1);
    const int64_t* first_position = arena.Put(twin.first_position);
    int32_t* slot_list = arena.Put(twin.slot_list);
    int64_t* slot_first_position = arena.Put(twin.slot_first_position);
    int32_t* n_slots = arena.Put(&twin.n_slots, 1);
    int32_t* miss_slot = arena.Put(twin.miss_slot);
    int32_t* miss_row = arena.Put(twin.miss_row);
    int32_t* n_misses = arena.Put(&twin.n_misses, 1);
    int64_t* counters = arena.Put(twin.counters, kChunkTableCounters);
    uint8_t* pool_k = arena.Put(twin.pool_k);
    uint8_t* pool_v = arena.Put(twin.pool_v);
    for (const void* d : {static_cast<const void*>(owner), static_cast<const void*>(stamp),
                          static_cast<const void*>(row_slot), static_cast<const void*>(hand),
                          static_cast<const void*>(rows), static_cast<const void*>(n_rows),
                          static_cast<const void*>(first_position), static_cast<const void*>(slot_list),
                          static_cast<const void*>(slot_first_position), static_cast<const void*>(n_slots),
                          static_cast<const void*>(miss_slot), static_cast<const void*>(miss_row),
                          static_cast<const void*>(n_misses), static_cast<const void*>(counters),
                          static_cast<const void*>(pool_k), static_cast<const void*>(pool_v)})
      ASSERT_NE(d, nullptr);
    std::mt19937 rng(11);
    int same_step_takes = 0;  // misses given a slot an earlier layer of the step used
    for (int step = 0; step < kSteps; ++step)
      for (int layer = 0; layer < kLayers; ++layer) {
        SCOPED_TRACE("step " + std::to_string(step) + " layer " + std::to_string(layer));
        const bool wide = step % 7 == 3 && layer == (step / 7) % kLayers;
        const bool past_capacity = step % 11 == 6 && layer == 1;  // n_rows > max_rows
        std::vector<int32_t> selection =
            Selection(rng, step, kRows, wide ? 24 : (past_capacity ? 30 : 4 + static_cast<int>(rng() % 2)));
        if (step % 9 == 4) selection.insert(selection.begin() + 1, {-3, selection[0], kRows});  // bad rows
        const std::vector<uint64_t> stamps_before = twin.slot_stamp;
        twin.Call(step, layer, selection);
        for (int i = 0; i < twin.n_misses; ++i)
          same_step_takes += stamps_before[twin.miss_slot[i]] >= twin.Stamp(step, 0);
        ChunkTableParams p = twin.Params(layer, twin.Stamp(step, layer), twin.Stamp(step, 0));
        p.slot_owner = owner;
        p.slot_stamp = stamp;
        p.row_slot = row_slot;
        p.clock_hand = hand;
        p.rows = rows;
        p.n_rows = n_rows;
        p.src_k = dev_src_k[layer];
        p.src_v = dev_src_v[layer];
        p.first_position = first_position;
        p.slot_list = slot_list;
        p.slot_first_position = slot_first_position;
        p.n_slots = n_slots;
        p.miss_slot = miss_slot;
        p.miss_row = miss_row;
        p.n_misses = n_misses;
        p.counters = counters;
        p.pool_k = pool_k;
        p.pool_v = pool_v;
        ASSERT_EQ(cudaMemcpy(rows, twin.rows.data(), kMaxRows * sizeof(int32_t), cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(n_rows, &twin.n_rows, sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cuda::LaunchChunkTableAssign(p, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
        ASSERT_EQ(cuda::LaunchChunkTableGather(p, nullptr), KernelError::kOk) << cuda::LastCudaErrorString();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the kernels failed";
        ASSERT_EQ(Get(owner, kSlots), twin.slot_owner);
        ASSERT_EQ(Get(stamp, kSlots), twin.slot_stamp);
        ASSERT_EQ(Get(row_slot, twin.row_slot.size()), twin.row_slot);
        ASSERT_EQ(Get(hand, 1)[0], twin.clock_hand);
        ASSERT_EQ(Get(n_slots, 1)[0], twin.n_slots);
        ASSERT_EQ(Get(n_misses, 1)[0], twin.n_misses);
        ASSERT_EQ(Get(slot_list, kMaxRows), twin.slot_list);
        ASSERT_EQ(Get(slot_first_position, kMaxRows), twin.slot_first_position);
        ASSERT_EQ(Get(miss_slot, kMaxRows), twin.miss_slot);
        ASSERT_EQ(Get(miss_row, kMaxRows), twin.miss_row);
        ASSERT_EQ(Get(counters, kChunkTableCounters),
                  std::vector<int64_t>(std::begin(twin.counters), std::end(twin.counters)));
        ASSERT_TRUE(Get(pool_k, twin.pool_k.size()) == twin.pool_k) << "K pool bytes differ";
        ASSERT_TRUE(Get(pool_v, twin.pool_v.size()) == twin.pool_v) << "V pool bytes differ";
      }
    // The scenario reached every branch of the rule.
    for (int c = 0; c < kChunkTableCounters; ++c) EXPECT_GT(twin.counters[c], 0) << "counter " << c;
    EXPECT_GT(same_step_takes, 0);
    std::printf(
        "chunk table on the device: hits %lld, misses %lld, no source %lld, invalid %lld, overflow %lld, "
        "same-step takes %d\n",
        static_cast<long long>(twin.counters[0]), static_cast<long long>(twin.counters[1]),
        static_cast<long long>(twin.counters[2]), static_cast<long long>(twin.counters[3]),
        static_cast<long long>(twin.counters[4]), same_step_takes);
  }
}
#else
TEST(ChunkTable, DeviceMatchesTheTwinOverManySteps) {
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off or nvcc not found)";
}
#endif

}  // namespace
}  // namespace kvtier::kernels
