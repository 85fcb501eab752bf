// ChunkCatalog (offload/store/chunk_catalog.h), tested alone over hand-made chunk records and
// layers: ids, the metadata bytes of records and in-memory representatives (and when those
// are released), what readers see of a layer (LandedEnd, List) and the change feed
// UpdatesSince, with released representatives read back from a ColdTier in a temp dir.
#include "offload/store/chunk_catalog.h"

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "offload/store_records.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using store_internal::Chunk;
using store_internal::LandingChunk;
using store_internal::LayerState;
using store_internal::Sequence;

// One layer, one kv head of 4 channels, fp16, one representative key a head: a chunk's
// representatives are 4 fp16 values, 8 bytes.
StoreOptions Small() {
  StoreOptions o;
  o.geometry = Geometry{1, 2, 1, 4, DType::kF16};
  o.n_sink = 2;
  o.n_local = 4;
  o.chunk_size = 2;
  o.repr_topk = 1;
  return o;
}
constexpr size_t kReprBytes = 8;

std::vector<uint8_t> Repr(std::vector<float> values) {
  std::vector<uint8_t> out(kReprBytes);
  FromFloat(DType::kF16, values.data(), out.data(), values.size());
  return out;
}

struct Fixture {
  StoreOptions options = Small();
  ChunkCatalog catalog{options, options.geometry.token_elems() * 2};
  Sequence seq;
  Fixture() {
    seq.id = 3;
    seq.layers.resize(1);
  }
  LayerState& ls() { return seq.layers[0]; }
  // Chunk `index` of the layer, with representatives `values` (none: released).
  Chunk* Seal(uint64_t index, std::vector<float> values) {
    Chunk* c = catalog.Create(ChunkKey{seq.id, 0, index}, 2 + 2 * static_cast<int64_t>(index),
                              values.empty() ? std::vector<uint8_t>{} : Repr(values));
    if (ls().chunks.size() <= index) ls().chunks.resize(index + 1, nullptr);
    ls().chunks[index] = c;
    return c;
  }
  ~Fixture() {
    for (Chunk* c : ls().chunks)
      if (c != nullptr) catalog.Forget(c);
  }
};

TEST(ChunkCatalog, RecordsGetFreshIdsAndAreFoundUntilForgotten) {
  Fixture f;
  Chunk* a = f.catalog.Create(ChunkKey{3, 0, 0}, 2, Repr({1, 2, 3, 4}));
  Chunk* b = f.catalog.Create(ChunkKey{3, 0, 1}, 4, {});
  auto* attached = new Chunk();
  attached->key = ChunkKey{3, 0, 2};
  f.catalog.Register(attached);
  EXPECT_EQ(a->id, 1u);
  EXPECT_EQ(b->id, 2u);
  EXPECT_EQ(attached->id, 3u);
  EXPECT_EQ(a->key.index, 0u);
  EXPECT_EQ(b->first_token, 4);
  EXPECT_EQ(f.catalog.Find(2), b);
  EXPECT_EQ(f.catalog.by_id().size(), 3u);
  f.catalog.Forget(b);
  EXPECT_EQ(f.catalog.Find(2), nullptr);
  EXPECT_EQ(f.catalog.Find(1), a);
  Chunk* c = f.catalog.Create(ChunkKey{3, 0, 3}, 8, {});
  EXPECT_EQ(c->id, 4u);  // ids are never reused
  f.catalog.Forget(a);
  f.catalog.Forget(attached);
  f.catalog.Forget(c);
  EXPECT_TRUE(f.catalog.by_id().empty());
  EXPECT_EQ(f.catalog.MetadataBytes(), 0u);
}

TEST(ChunkCatalog, MetadataBytesCountRecordsAndTheRepresentativesInMemory) {
  Fixture f;
  Chunk* with = f.catalog.Create(ChunkKey{3, 0, 0}, 2, Repr({1, 2, 3, 4}));
  Chunk* without = f.catalog.Create(ChunkKey{3, 0, 1}, 4, {});
  Chunk* other = f.catalog.Create(ChunkKey{3, 0, 2}, 6, Repr({1, 2, 3, 4}));
  const uint64_t all = f.catalog.MetadataBytes();
  f.catalog.Forget(without);
  const uint64_t record = all - f.catalog.MetadataBytes();
  EXPECT_GT(record, 0u);
  f.catalog.Forget(other);
  EXPECT_EQ(all - f.catalog.MetadataBytes(), 2 * record + kReprBytes);
  EXPECT_EQ(f.catalog.MetadataBytes(), record + kReprBytes);
  f.catalog.Forget(with);
}

TEST(ChunkCatalog, RepresentativesAreReleasedOnlyOnceAMetaTierHoldsThemAndNothingElseDoes) {
  Fixture f;
  Chunk* c = f.catalog.Create(ChunkKey{3, 0, 0}, 2, Repr({1, 2, 3, 4}));
  const uint64_t held = f.catalog.MetadataBytes();
  auto expect_kept = [&](const char* why) {
    f.catalog.ReleaseReprIfDurable(c, kTierCold);
    EXPECT_EQ(c->repr.size(), kReprBytes) << why;
    EXPECT_EQ(f.catalog.MetadataBytes(), held) << why;
  };
  c->tiers = kTierWarm | kTierCold;
  expect_kept("not acknowledged");
  c->lower_acked = true;
  c->warm_slot = 0;
  expect_kept("a warm copy");
  c->warm_slot = -1;
  c->tiers = kTierCold;
  c->lower_writing = true;
  expect_kept("being written");
  c->lower_writing = false;
  c->tiers = kTierRemote;
  expect_kept("acknowledged by a tier that reads no metas alone");
  c->tiers = kTierRemote | kTierCold;
  f.catalog.ReleaseReprIfDurable(c, kTierCold);
  EXPECT_TRUE(c->repr.empty());
  EXPECT_EQ(f.catalog.MetadataBytes(), held - kReprBytes);
  f.catalog.ReleaseReprIfDurable(c, kTierCold);  // released already: counted once
  EXPECT_EQ(f.catalog.MetadataBytes(), held - kReprBytes);
  f.catalog.Forget(c);
  EXPECT_EQ(f.catalog.MetadataBytes(), 0u);  // a released chunk takes no representatives with it
}

TEST(ChunkCatalog, LandedEndStopsAtTheOldestChunkStillLandingInAnyOrder) {
  Fixture f;
  for (uint64_t i = 0; i < 4; ++i) f.Seal(i, {1, 2, 3, 4});
  f.ls().chunks[1] = nullptr;  // a hole: not landing, no end
  EXPECT_EQ(ChunkCatalog::LandedEnd(f.ls()), 4u);
  // Chunk 2 still landing, chunk 3 landed before it (another thread landed it first).
  Chunk* two = f.catalog.Find(3);
  two->landing = true;
  f.ls().landing.push_back(LandingChunk{two});
  EXPECT_EQ(ChunkCatalog::LandedEnd(f.ls()), 2u);
  // Chunk 0 claimed by a lander (out of the queue, not landed yet) and chunk 2 queued.
  Chunk* zero = f.ls().chunks[0];
  zero->landing = true;
  f.ls().landers = 1;
  EXPECT_EQ(ChunkCatalog::LandedEnd(f.ls()), 0u);
  zero->landing = false;
  f.ls().landers = 0;
  two->landing = false;
  f.ls().landing.clear();
  EXPECT_EQ(ChunkCatalog::LandedEnd(f.ls()), 4u);
  f.catalog.Forget(f.catalog.Find(2));  // the hole's record
}

TEST(ChunkCatalog, ListSkipsHolesAndLandingChunks) {
  Fixture f;
  for (uint64_t i = 0; i < 4; ++i) f.Seal(i, {1, 2, 3, 4});
  Chunk* hole = f.ls().chunks[1];
  f.ls().chunks[1] = nullptr;
  f.ls().chunks[2]->landing = true;
  f.ls().chunks[3]->tiers = kTierWarm;
  f.ls().chunks[3]->score = 0.25f;
  const std::vector<ChunkInfo> listed = f.catalog.List(f.ls());
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].key.index, 0u);
  EXPECT_EQ(listed[1].key.index, 3u);
  EXPECT_EQ(listed[1].first_token, 8);
  EXPECT_EQ(listed[1].n_tokens, 2);
  EXPECT_EQ(listed[1].tiers, kTierWarm);
  EXPECT_EQ(listed[1].score, 0.25f);
  f.catalog.Forget(hole);
}

TEST(ChunkCatalog, UpdatesSinceRejectsACursorPastTheLayer) {
  Fixture f;
  f.Seal(0, {1, 2, 3, 4});
  StoreSync sync;
  LowerTiers lower;
  std::unique_lock<CountingMutex> lock(sync.mu);
  ChunkUpdate u;
  Status st = f.catalog.UpdatesSince(lock, sync, lower, &f.seq, 0, ChunkCursor{2, 0}, &u, 100);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("cursor {chunks 2, drops 0} is past layer 0 of sequence 3 (1 chunks, 0 drops)"),
            std::string::npos)
      << st.ToString();
  st = f.catalog.UpdatesSince(lock, sync, lower, &f.seq, 0, ChunkCursor{1, 1}, &u, 100);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(f.catalog.UpdatesSince(lock, sync, lower, &f.seq, 0, ChunkCursor{1, 0}, &u, 100).ok());
  EXPECT_TRUE(u.added.empty());
}

TEST(ChunkCatalog, UpdatesSinceBatchesTheLandedChunksInFp32WithTheDrops) {
  Fixture f;
  f.Seal(0, {1, 2, 3, 4});
  Chunk* dropped = f.Seal(1, {5, 6, 7, 8});
  f.Seal(2, {0.5f, -1, 2, 0});
  f.Seal(3, {-2, 4, 8, 16});
  Chunk* landing = f.Seal(4, {9, 9, 9, 9});
  f.ls().chunks[1] = nullptr;  // dropped
  f.catalog.Forget(dropped);
  f.ls().dropped = {1};
  landing->landing = true;
  f.ls().landing.push_back(LandingChunk{landing});
  StoreSync sync;
  LowerTiers lower;
  std::unique_lock<CountingMutex> lock(sync.mu);
  ChunkUpdate u;
  ASSERT_TRUE(f.catalog.UpdatesSince(lock, sync, lower, &f.seq, 0, ChunkCursor{}, &u, 2).ok());
  EXPECT_EQ(u.added, (std::vector<uint64_t>{0, 2}));  // the hole is passed over, not counted
  EXPECT_EQ(u.repr, (std::vector<float>{1, 2, 3, 4, 0.5f, -1, 2, 0}));
  EXPECT_EQ(u.dropped, (std::vector<uint64_t>{1}));
  EXPECT_EQ(u.next.chunks, 3u);
  EXPECT_EQ(u.next.drops, 1u);
  EXPECT_FALSE(u.complete);
  EXPECT_EQ(u.pending, 1u);  // chunk 3; chunk 4 is still landing
  const ChunkCursor next = u.next;
  ASSERT_TRUE(f.catalog.UpdatesSince(lock, sync, lower, &f.seq, 0, next, &u, 2).ok());
  EXPECT_EQ(u.since.chunks, 3u);
  EXPECT_EQ(u.added, (std::vector<uint64_t>{3}));
  EXPECT_EQ(u.repr, (std::vector<float>{-2, 4, 8, 16}));
  EXPECT_TRUE(u.dropped.empty());
  EXPECT_TRUE(u.complete);
  EXPECT_EQ(u.pending, 0u);
  EXPECT_EQ(u.next.chunks, 4u);
  // Once landed, the next call hands chunk 4 over.
  landing->landing = false;
  f.ls().landing.clear();
  ASSERT_TRUE(f.catalog.UpdatesSince(lock, sync, lower, &f.seq, 0, u.next, &u, 2).ok());
  EXPECT_EQ(u.added, (std::vector<uint64_t>{4}));
  EXPECT_EQ(u.next.chunks, 5u);
}

TEST(ChunkCatalog, UpdatesSinceReadsReleasedRepresentativesBackFromTheColdTier) {
  Fixture f;
  TempDir dir;
  ColdTierOptions co;
  co.path = dir.path();
  auto cold = ColdTier::Open(co);
  ASSERT_TRUE(cold.ok()) << cold.status().ToString();
  ColdTier* cold_tier = cold->get();
  LowerTiers lower;
  lower.AddCold(std::move(*cold));
  f.Seal(0, {1, 2, 3, 4});
  Chunk* released = f.Seal(1, {});
  Chunk* lost = f.Seal(2, {});
  const std::vector<uint8_t> repr = Repr({0.5f, 1.5f, -3, 64});
  const std::string meta =
      store_records::EncodeChunkMeta(released->first_token, repr.data(), repr.size(), 0.0f);
  const std::string payload(f.options.chunk_bytes(), 'x');
  ASSERT_TRUE(cold_tier->PutChunk(released->key, meta, payload.data(), payload.size()).ok());
  StoreSync sync;
  std::unique_lock<CountingMutex> lock(sync.mu);
  ChunkUpdate u;
  // Chunk 2 has no meta record anywhere: the call fails naming it.
  Status st = f.catalog.UpdatesSince(lock, sync, lower, &f.seq, 0, ChunkCursor{}, &u, 100);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(lost->key.ToString()), std::string::npos) << st.ToString();
  EXPECT_TRUE(lock.owns_lock());
  EXPECT_EQ(f.seq.busy, 0);
  ASSERT_TRUE(f.catalog.UpdatesSince(lock, sync, lower, &f.seq, 0, ChunkCursor{}, &u, 2).ok());
  EXPECT_TRUE(lock.owns_lock());
  EXPECT_EQ(f.seq.busy, 0);
  EXPECT_EQ(u.added, (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(u.repr, (std::vector<float>{1, 2, 3, 4, 0.5f, 1.5f, -3, 64}));
  EXPECT_TRUE(released->repr.empty());  // read back for the reader, not held again
}

}  // namespace
}  // namespace kvtier
