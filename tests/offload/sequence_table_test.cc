// SequenceTable (offload/store/sequence_table.h), tested alone over a host tier and hand-made
// Sequence records: the checks a call's (sequence, layer) goes through, ids, and the hot bytes
// of the layers' regions as sequences come and go.
#include "offload/store/sequence_table.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "offload/store/layer_regions.h"

namespace kvtier {
namespace {

using store_internal::Sequence;
using store_records::SeqState;

StoreOptions Small() {
  StoreOptions o;
  o.geometry = Geometry{2, 2, 1, 4, DType::kF16};  // 2 layers, 8 bytes a token (K or V)
  o.n_sink = 2;
  o.n_local = 4;
  o.chunk_size = 2;
  return o;
}

struct Fixture {
  StoreOptions options = Small();
  size_t tok = options.geometry.token_elems() * 2;
  std::unique_ptr<HotTier> hot = *MakeHotTier(Device::kCpu, 4 * options.chunk_bytes(), options.chunk_bytes());
  SequenceTable table{options, tok, hot.get()};

  // A sequence in `state` whose layers hold their regions (or none: a recovered unclosed one).
  std::unique_ptr<Sequence> NewSequence(SeqState state, bool regions) {
    auto s = std::make_unique<Sequence>();
    s->state = state;
    s->layers.resize(options.geometry.layers);
    if (regions)
      for (auto& ls : s->layers)
        EXPECT_TRUE(store_internal::AllocateLayerRegions(options, tok, hot.get(), &ls).ok());
    return s;
  }
};

void ExpectError(const Status& st, StatusCode code, const std::string& names) {
  EXPECT_EQ(st.code(), code) << st.ToString();
  EXPECT_NE(st.message().find(names), std::string::npos) << st.ToString();
}

TEST(SequenceTable, CheckNamesTheUnknownSequenceTheLayerAndTheClosedSequence) {
  Fixture f;
  const SequenceId open = f.table.Add(f.NewSequence(SeqState::kOpen, true));
  const SequenceId closed = f.table.Add(f.NewSequence(SeqState::kClosed, true));
  const SequenceId unclosed = f.table.Add(f.NewSequence(SeqState::kRecovered, false));
  Sequence* s = nullptr;
  ExpectError(f.table.Check(99, 0, false, &s), StatusCode::kNotFound, "sequence 99 does not exist");
  EXPECT_EQ(s, nullptr);
  ExpectError(f.table.Check(open, 2, false, &s), StatusCode::kInvalidArgument,
              "layer 2 is out of range [0, 2)");
  ExpectError(f.table.Check(open, -1, true, &s), StatusCode::kInvalidArgument, "layer -1");
  ExpectError(f.table.Check(closed, 0, true, &s), StatusCode::kFailedPrecondition,
              "sequence " + std::to_string(closed) + " is closed");
  ExpectError(f.table.Check(unclosed, 1, true, &s), StatusCode::kFailedPrecondition,
              "sequence " + std::to_string(unclosed) + " was not closed before the store stopped");
  EXPECT_EQ(s, nullptr);  // no failed check hands a sequence out
  // Reads of closed and recovered sequences pass; writes of open ones too.
  ASSERT_TRUE(f.table.Check(closed, 1, false, &s).ok());
  EXPECT_EQ(s->id, closed);
  ASSERT_TRUE(f.table.Check(unclosed, 0, false, &s).ok());
  EXPECT_EQ(s->id, unclosed);
  ASSERT_TRUE(f.table.Check(open, 1, true, &s).ok());
  EXPECT_EQ(s->id, open);
  EXPECT_EQ(f.table.Find(open), s);
  EXPECT_EQ(f.table.Find(99), nullptr);
}

TEST(SequenceTable, AddGivesAscendingIdsAndCountsRegionBytes) {
  Fixture f;
  const uint64_t per_layer = store_internal::LayerRegionBytes(f.options, f.tok);
  EXPECT_EQ(f.table.next_id(), 1u);
  EXPECT_EQ(f.table.region_bytes(), 0u);
  const SequenceId a = f.table.Add(f.NewSequence(SeqState::kOpen, true));
  const SequenceId b = f.table.Add(f.NewSequence(SeqState::kOpen, true));
  EXPECT_EQ(a, 1u);
  EXPECT_EQ(b, 2u);
  EXPECT_EQ(f.table.next_id(), 3u);
  EXPECT_EQ(f.table.Find(b)->id, b);  // the record carries the id it got
  EXPECT_EQ(f.table.region_bytes(), 2 * 2 * per_layer);
}

TEST(SequenceTable, ErasingARecoveredUnclosedSequenceDoesNotUnderflowRegionBytes) {
  Fixture f;
  const uint64_t per_layer = store_internal::LayerRegionBytes(f.options, f.tok);
  // Recovery hands over an unclosed sequence whose layers hold no regions (no region bytes).
  SequenceTable::Map recovered;
  auto r = f.NewSequence(SeqState::kRecovered, false);
  r->id = 7;
  recovered[7] = std::move(r);
  f.table.Adopt(std::move(recovered), 8, 0);
  const SequenceId c = f.table.Add(f.NewSequence(SeqState::kOpen, true));
  EXPECT_EQ(c, 8u);
  EXPECT_EQ(f.table.region_bytes(), 2 * per_layer);
  f.table.Erase(7);
  EXPECT_EQ(f.table.Find(7), nullptr);
  EXPECT_EQ(f.table.region_bytes(), 2 * per_layer);  // only what c holds: nothing taken for 7
  f.table.Erase(c);
  EXPECT_EQ(f.table.region_bytes(), 0u);
  f.table.Erase(c);  // unknown now: nothing
  EXPECT_EQ(f.table.region_bytes(), 0u);
}

TEST(SequenceTable, EraseReturnsTheRegionsToTheHotTier) {
  Fixture f;
  const uint64_t per_layer = store_internal::LayerRegionBytes(f.options, f.tok);
  const SequenceId a = f.table.Add(f.NewSequence(SeqState::kOpen, true));
  const SequenceId b = f.table.Add(f.NewSequence(SeqState::kClosed, true));
  EXPECT_EQ(f.table.region_bytes(), 4 * per_layer);
  f.table.Erase(a);
  EXPECT_EQ(f.table.Find(a), nullptr);
  EXPECT_EQ(f.table.region_bytes(), 2 * per_layer);
  EXPECT_EQ(f.table.Ids(), (std::vector<SequenceId>{b}));
  Sequence* s = nullptr;
  EXPECT_EQ(f.table.Check(a, 0, false, &s).code(), StatusCode::kNotFound);
}

TEST(SequenceTable, IdsAreSorted) {
  Fixture f;
  SequenceTable::Map recovered;
  for (SequenceId id : {40u, 3u, 17u}) {
    auto s = f.NewSequence(SeqState::kRecovered, false);
    s->id = id;
    recovered[id] = std::move(s);
  }
  f.table.Adopt(std::move(recovered), 41, 0);
  const SequenceId added = f.table.Add(f.NewSequence(SeqState::kOpen, true));
  EXPECT_EQ(added, 41u);
  EXPECT_EQ(f.table.Ids(), (std::vector<SequenceId>{3, 17, 40, 41}));
}

}  // namespace
}  // namespace kvtier
