// What the cold tier acknowledged must come back, or opening says which did not:
// the ack manifest (offload/ack_manifest.h) and the check at open (cold_tier.h).
//
// The WAL tests: a short run whose data sits only in RocksDB's
// write-ahead log (*.log: a database closed without a flush keeps it there), then
// bit flips, a zeroed 32 KiB block or a truncation of that file. Without the manifest
// RocksDB reopens each of these without an error, with acknowledged chunks gone.
#include "offload/ack_manifest.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "integration/pattern.h"
#include "offload/cold_tier.h"
#include "offload/tiered_store.h"
#include "tests/crash_layout.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

namespace fs = std::filesystem;

// ---- ChunkRangeSet --------------------------------------------------------------------------

std::vector<ChunkRange> R(std::initializer_list<ChunkRange> r) { return r; }

TEST(ChunkRangeSet, InsertCoalescesAndEraseSplits) {
  ChunkRangeSet s;
  s.Insert({1, 0, 3});
  s.Insert({1, 0, 5});
  s.Insert({1, 0, 4});  // bridges 3 and 5
  s.InsertRange(1, 0, 10, 12);
  s.InsertRange(1, 1, 0, 0);
  EXPECT_EQ(s.Ranges(), R({{1, 0, 3, 5}, {1, 0, 10, 12}, {1, 1, 0, 0}}));
  EXPECT_EQ(s.chunks(), 7u);
  EXPECT_EQ(s.range_count(), 3u);
  s.InsertRange(1, 0, 6, 9);  // touches both neighbours
  EXPECT_EQ(s.Ranges(), R({{1, 0, 3, 12}, {1, 1, 0, 0}}));
  s.EraseRange(1, 0, 5, 6);
  EXPECT_EQ(s.Ranges(), R({{1, 0, 3, 4}, {1, 0, 7, 12}, {1, 1, 0, 0}}));
  EXPECT_TRUE(s.Contains({1, 0, 4}));
  EXPECT_FALSE(s.Contains({1, 0, 5}));
  EXPECT_FALSE(s.Contains({2, 0, 4}));
  s.EraseRange(1, 0, 0, 100);
  EXPECT_EQ(s.Ranges(), R({{1, 1, 0, 0}}));
  s.EraseSequence(1);
  EXPECT_TRUE(s.empty());
  EXPECT_EQ(s.range_count(), 0u);
}

TEST(ChunkRangeSet, TheLargestIndexIsARangeLikeAnyOther) {
  const uint64_t max = ~uint64_t{0};
  ChunkRangeSet s;
  s.Insert({2, 3, max});
  s.Insert({2, 3, max - 1});
  EXPECT_EQ(s.Ranges(), R({{2, 3, max - 1, max}}));
  EXPECT_TRUE(s.Contains({2, 3, max}));
  EXPECT_EQ(ChunkRange({2, 3, max - 1, max}).ToString(),
            "seq=2/layer=3/chunk=18446744073709551614..18446744073709551615");
  s.EraseRange(2, 3, max, max);
  EXPECT_EQ(s.Ranges(), R({{2, 3, max - 1, max - 1}}));
  ChunkRangeSet all;
  all.InsertRange(2, 3, 0, max);
  EXPECT_TRUE(all.Minus(all).empty());
  EXPECT_EQ(all.Minus(s), R({{2, 3, 0, max - 2}, {2, 3, max, max}}));
}

TEST(ChunkRangeSet, MinusIsWhatTheOtherLacks) {
  ChunkRangeSet acked, present;
  acked.InsertRange(1, 0, 0, 99);
  acked.InsertRange(1, 1, 0, 9);
  acked.InsertRange(2, 0, 5, 5);
  present.InsertRange(1, 0, 0, 39);
  present.InsertRange(1, 0, 50, 59);
  present.InsertRange(1, 0, 90, 120);
  present.InsertRange(1, 1, 0, 9);
  present.InsertRange(3, 0, 0, 9);  // present, never acknowledged: not lost
  EXPECT_EQ(acked.Minus(present), R({{1, 0, 40, 49}, {1, 0, 60, 89}, {2, 0, 5, 5}}));
  EXPECT_EQ(CountChunks(acked.Minus(present)), 41u);
  EXPECT_EQ(DescribeRanges(acked.Minus(present), 2),
            "seq=1/layer=0/chunk=40..49, seq=1/layer=0/chunk=60..89, and 1 more ranges");
}

// ---- the manifest file ----------------------------------------------------------------------

std::string ManifestPath(const std::string& dir) { return dir + "/" + AckManifest::kFileName; }

TEST(AckManifest, ReplaysAcksDeletesAndDrops) {
  TempDir dir;
  {
    auto m = AckManifest::Create(dir.path(), false, ChunkRangeSet{}, {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE((*m)->AckChunk({1, 0, i}).ok());
    ASSERT_TRUE((*m)->AckChunk({1, 0, 3}).ok());  // again: nothing appended
    ASSERT_TRUE((*m)->AckChunk({2, 1, 7}).ok());
    ASSERT_TRUE((*m)->DeleteChunk({1, 0, 4}).ok());
    ASSERT_TRUE((*m)->AckSequenceRecord(1, 0xabcd).ok());
    ASSERT_TRUE((*m)->AckSequenceRecord(2, 0x1234).ok());
    ASSERT_TRUE((*m)->DropSequence(2).ok());
    EXPECT_EQ((*m)->file_records(), 1u + 10 + 1 + 1 + 2 + 1);
  }
  auto m = AckManifest::Open(dir.path(), false);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->chunks().Ranges(), R({{1, 0, 0, 3}, {1, 0, 5, 9}}));
  EXPECT_EQ((*m)->sequences(), (std::map<SequenceId, uint32_t>{{1, 0xabcd}}));
  ASSERT_TRUE((*m)->Compact().ok());
  EXPECT_EQ((*m)->file_records(), 1u + 1 + 1 + 2 + 1);  // the drop and the delete stay until pruned
  ASSERT_TRUE((*m)->PruneDrops().ok());
  EXPECT_EQ((*m)->file_records(), 1u + 2 + 1);
  EXPECT_EQ(fs::file_size(ManifestPath(dir.path())), 4 * AckManifest::kRecordBytes);
}

TEST(AckManifest, APartialLastRecordIsCutAndADamagedOneIsCorruption) {
  TempDir dir;
  {
    auto m = AckManifest::Create(dir.path(), false, ChunkRangeSet{}, {});
    ASSERT_TRUE(m.ok());
    for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE((*m)->AckChunk({1, 0, 2 * i}).ok());
  }
  const std::string path = ManifestPath(dir.path());
  {
    std::ofstream f(path, std::ios::binary | std::ios::app);
    f.write("KVAK\x02garbage", 12);  // the kill came in the middle of an append
  }
  {
    auto m = AckManifest::Open(dir.path(), false);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ((*m)->chunks().chunks(), 4u);
    EXPECT_EQ(fs::file_size(path), 5 * AckManifest::kRecordBytes);
    ASSERT_TRUE((*m)->AckChunk({1, 0, 100}).ok());  // appends after the cut, whole
  }
  ASSERT_TRUE(AckManifest::Open(dir.path(), false).ok());
  {
    std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(2 * AckManifest::kRecordBytes + 30);
    f.put('\x55');
  }
  auto m = AckManifest::Open(dir.path(), false);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kCorruption);
  EXPECT_NE(m.status().message().find("record at byte 96 is damaged (checksum mismatch)"), std::string::npos)
      << m.status().ToString();
  EXPECT_EQ(AckManifest::Open(dir.path() + "/nowhere", false).status().code(), StatusCode::kNotFound);
}

TEST(AckManifest, StaysSmallWhileSequencesComeAndGo) {
  TempDir dir;
  auto m = AckManifest::Create(dir.path(), false, ChunkRangeSet{}, {});
  ASSERT_TRUE(m.ok());
  for (SequenceId s = 1; s <= 200; ++s) {
    for (uint64_t i = 0; i < 64; ++i) ASSERT_TRUE((*m)->AckChunk({s, 0, i}).ok());
    if (s > 2) ASSERT_TRUE((*m)->DropSequence(s - 2).ok());
    // The cold tier prunes tombstones once their deletes are flushed (here: every 16 drops).
    if ((*m)->drop_records() >= 16) {
      ASSERT_TRUE((*m)->PruneDrops().ok());
    }
  }
  // Two live sequences: the file is compacted well below the 12,800 acks appended.
  EXPECT_LE((*m)->file_records(), 4 * 4 + 1024 + 1u);
  EXPECT_EQ((*m)->chunks().Ranges(), R({{199, 0, 0, 63}, {200, 0, 0, 63}}));
  auto again = AckManifest::Open(dir.path(), false);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->chunks().Ranges(), (*m)->chunks().Ranges());
}

TEST(AckManifest, DropsAndDeletesOutliveCompactionUntilPruned) {
  TempDir dir;
  {
    auto m = AckManifest::Create(dir.path(), false, ChunkRangeSet{}, {});
    ASSERT_TRUE(m.ok());
    for (uint64_t i = 0; i < 8; ++i) {
      ASSERT_TRUE((*m)->AckChunk({1, 0, i}).ok());
      ASSERT_TRUE((*m)->AckChunk({2, 0, i}).ok());
    }
    ASSERT_TRUE((*m)->AckSequenceRecord(1, 11).ok());
    ASSERT_TRUE((*m)->AckSequenceRecord(3, 33).ok());
    ASSERT_TRUE((*m)->DropSequence(1).ok());
    ASSERT_TRUE((*m)->DropSequence(3).ok());
    ASSERT_TRUE((*m)->AckSequenceRecord(3, 34).ok());  // acknowledged again after its drop
    ASSERT_TRUE((*m)->DeleteChunk({2, 0, 3}).ok());
    ASSERT_TRUE((*m)->DeleteChunk({2, 0, 5}).ok());
    ASSERT_TRUE((*m)->DeleteChunk({2, 0, 6}).ok());
    ASSERT_TRUE((*m)->AckChunk({2, 0, 6}).ok());  // written again: no longer deleted
    ASSERT_TRUE((*m)->Compact().ok());
    EXPECT_EQ((*m)->drop_records(), 2u + 2u);
  }
  for (int round = 0; round < 2; ++round) {
    auto m = AckManifest::Open(dir.path(), false);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ((*m)->chunks().Ranges(), R({{2, 0, 0, 2}, {2, 0, 4, 4}, {2, 0, 6, 7}}));
    EXPECT_EQ((*m)->sequences(), (std::map<SequenceId, uint32_t>{{3, 34}}));
    if (round == 0) {
      EXPECT_EQ((*m)->DroppedSequenceRecords(), std::vector<SequenceId>{1});
      EXPECT_EQ((*m)->DroppedAmong(R({{1, 4, 0, 9}, {2, 0, 3, 3}, {2, 0, 5, 5}, {2, 0, 8, 9}})),
                R({{1, 4, 0, 9}, {2, 0, 3, 3}, {2, 0, 5, 5}}));
      ASSERT_TRUE((*m)->PruneDrops().ok());
    } else {
      EXPECT_TRUE((*m)->DroppedSequenceRecords().empty());
      EXPECT_TRUE((*m)->DroppedAmong(R({{1, 4, 0, 9}, {2, 0, 3, 3}})).empty());
      EXPECT_EQ((*m)->drop_records(), 0u);
    }
  }
}

// ---- the cold tier: damage to the WAL --------------------------------------------------------

constexpr size_t kPayload = 16384;
constexpr uint64_t kChunks = 48;

std::string Payload(const ChunkKey& k) {
  std::string s(kPayload, '\0');
  FillPattern(0xACC, k.seq, k.layer, 0, static_cast<int64_t>(k.index), 1, kPayload,
              reinterpret_cast<uint8_t*>(s.data()));
  return s;
}

ColdTierOptions ColdOpts(const std::string& dir, bool accept = false) {
  ColdTierOptions o;
  o.path = dir;
  o.compression = Compression::kNone;  // the WAL holds the raw batches either way
  o.accept_lost_chunks = accept;
  return o;
}

std::vector<fs::path> WalFiles(const std::string& dir) {
  std::vector<fs::path> out;
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".log") out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// Writes kChunks chunks of sequence 1 (layers 0 and 1 alternating) and a sequence record,
// then closes: RocksDB does not flush at close, so all of it sits in the newest WAL file.
std::vector<ChunkRange> WriteChunksIntoTheWal(const std::string& dir) {
  auto t = ColdTier::Open(ColdOpts(dir));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (!t.ok()) return {};
  EXPECT_TRUE((*t)->PutSequence(1, "record of sequence 1").ok());
  for (uint64_t i = 0; i < kChunks; ++i) {
    const ChunkKey k{1, static_cast<uint32_t>(i % 2), i / 2};
    const std::string p = Payload(k);
    EXPECT_TRUE((*t)->PutChunk(k, "meta", p.data(), p.size()).ok());
  }
  return (*t)->AcknowledgedChunks();
}

enum class Damage { kFlipBits, kZeroBlock, kTruncate };

// Damages the newest WAL file, which must hold at least `data_bytes`, in the middle.
void DamageWal(const std::string& dir, Damage how, uint64_t data_bytes) {
  std::vector<fs::path> wals = WalFiles(dir);
  EXPECT_FALSE(wals.empty()) << "no *.log in " << dir;
  if (wals.empty()) return;
  const fs::path wal = wals.back();
  const uint64_t size = fs::file_size(wal);
  EXPECT_GT(size, data_bytes) << "the chunks are not in " << wal << " alone";
  switch (how) {
    case Damage::kFlipBits: {
      std::fstream f(wal, std::ios::binary | std::ios::in | std::ios::out);
      for (uint64_t off : {size / 2, size / 2 + 4097}) {
        f.seekg(static_cast<std::streamoff>(off));
        const char c = static_cast<char>(f.get());
        f.seekp(static_cast<std::streamoff>(off));
        f.put(static_cast<char>(c ^ 0x21));
      }
      break;
    }
    case Damage::kZeroBlock: {
      const uint64_t block = 32768, at = size / 2 / block * block;
      std::fstream f(wal, std::ios::binary | std::ios::in | std::ios::out);
      f.seekp(static_cast<std::streamoff>(at));
      const std::string zeros(block, '\0');
      f.write(zeros.data(), zeros.size());
      break;
    }
    case Damage::kTruncate:
      fs::resize_file(wal, size / 2);
      break;
  }
}

class WalDamage : public ::testing::TestWithParam<Damage> {};

TEST_P(WalDamage, OpenNamesEveryLostAcknowledgedChunkUntilTheLossIsAccepted) {
  TempDir dir;
  const std::vector<ChunkRange> acked = WriteChunksIntoTheWal(dir.path());
  ASSERT_EQ(CountChunks(acked), kChunks);
  DamageWal(dir.path(), GetParam(), kChunks * kPayload);

  auto t = ColdTier::Open(ColdOpts(dir.path()));
  ASSERT_FALSE(t.ok()) << "a damaged WAL was recovered without an error";
  EXPECT_EQ(t.status().code(), StatusCode::kCorruption) << t.status().ToString();
  const std::string msg = t.status().message();
  EXPECT_NE(msg.find("acknowledged chunks are missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("seq=1/layer="), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.path()), std::string::npos) << msg;
  // RocksDB has made its recovery permanent by now; the loss must stay loud.
  auto again = ColdTier::Open(ColdOpts(dir.path()));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().message(), msg);

  // Accepted: it opens, names the same chunks, and everything else is intact.
  auto accepted = ColdTier::Open(ColdOpts(dir.path(), true));
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  const std::vector<ChunkRange> lost = (*accepted)->lost_chunks();
  ASSERT_FALSE(lost.empty());
  for (const ChunkRange& r : lost) EXPECT_NE(msg.find(r.ToString()), std::string::npos) << r.ToString();
  ChunkRangeSet lost_set, now;
  for (const ChunkRange& r : lost) lost_set.InsertRange(r.seq, r.layer, r.first, r.last);
  for (const ChunkRange& r : (*accepted)->AcknowledgedChunks())
    now.InsertRange(r.seq, r.layer, r.first, r.last);
  EXPECT_EQ(now.chunks() + lost_set.chunks(), kChunks);
  std::string got(kPayload, '\0');
  for (const ChunkRange& r : now.Ranges())
    for (uint64_t i = r.first; i <= r.last; ++i) {
      const ChunkKey k{r.seq, r.layer, i};
      ASSERT_TRUE((*accepted)->GetChunk(k, got.data(), got.size()).ok()) << k.ToString();
      EXPECT_EQ(got, Payload(k)) << k.ToString();
    }
  for (const ChunkRange& r : lost)
    EXPECT_EQ((*accepted)->GetChunk({r.seq, r.layer, r.first}, got.data(), got.size()).code(),
              StatusCode::kNotFound);
  accepted->reset();
  EXPECT_TRUE(ColdTier::Open(ColdOpts(dir.path())).ok()) << "the accepted loss is reported again";
}

INSTANTIATE_TEST_SUITE_P(Damages, WalDamage,
                         ::testing::Values(Damage::kFlipBits, Damage::kZeroBlock, Damage::kTruncate),
                         [](const ::testing::TestParamInfo<Damage>& i) {
                           return i.param == Damage::kFlipBits    ? std::string("FlippedBits")
                                  : i.param == Damage::kZeroBlock ? std::string("ZeroedBlock")
                                                                  : std::string("Truncated");
                         });

TEST(WalDamageCold, ALostSequenceRecordUpdateIsNamed) {
  TempDir dir;
  {
    auto t = ColdTier::Open(ColdOpts(dir.path()));
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE((*t)->PutSequence(4, "open").ok());
    ASSERT_TRUE((*t)->PutSequence(9, "open").ok());
  }
  {
    auto t = ColdTier::Open(ColdOpts(dir.path()));  // the records go to an SST at this open
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    std::string pad(200000, 'x');  // push the update well past the WAL's start
    ASSERT_TRUE((*t)->PutBlob(4, 0, "pad", pad.data(), pad.size()).ok());
    ASSERT_TRUE((*t)->PutSequence(4, "closed").ok());
  }
  std::vector<fs::path> wals = WalFiles(dir.path());
  ASSERT_FALSE(wals.empty());
  fs::resize_file(wals.back(), fs::file_size(wals.back()) / 2);
  auto t = ColdTier::Open(ColdOpts(dir.path()));
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("1 acknowledged sequence records are missing or older (sequence 4)"),
            std::string::npos)
      << t.status().ToString();
}

TEST(WalDamageCold, AMissingManifestIsCorruptionUnlessAccepted) {
  TempDir dir;
  WriteChunksIntoTheWal(dir.path());
  ASSERT_TRUE(fs::remove(ManifestPath(dir.path())));
  auto t = ColdTier::Open(ColdOpts(dir.path()));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kCorruption);
  EXPECT_NE(t.status().message().find("is missing, but this store was created with one"), std::string::npos)
      << t.status().ToString();
  auto accepted = ColdTier::Open(ColdOpts(dir.path(), true));
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  EXPECT_EQ(CountChunks((*accepted)->AcknowledgedChunks()), kChunks);  // rebuilt from what is there
}

TEST(WalDamageCold, PresentChunksNobodyAcknowledgedAreAdoptedNotReported) {
  // A store from before the manifest (or a chunk whose write landed as the process
  // died): what is there counts as acknowledged from then on.
  TempDir dir;
  WriteChunksIntoTheWal(dir.path());
  {
    auto m = AckManifest::Create(dir.path(), false, ChunkRangeSet{}, {});  // forgets every chunk
    ASSERT_TRUE(m.ok());
  }
  auto t = ColdTier::Open(ColdOpts(dir.path()));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(CountChunks((*t)->AcknowledgedChunks()), kChunks);
}

// ---- drops whose deletes are lost with the WAL -------------------------------------------------

// Sequences 1 and 2 (8 chunks each, a record, and a blob for 1), reopened once so that all of
// it is in tables; then sequence 1 dropped and chunks 3 and 5 of 2 deleted, which only the
// newest WAL holds; `then` runs after the drops, before the close.
void DropIntoTheWal(const std::string& dir, const std::function<void(ColdTier&)>& then = {}) {
  {
    auto t = ColdTier::Open(ColdOpts(dir));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    for (SequenceId seq : {1, 2}) {
      ASSERT_TRUE((*t)->PutSequence(seq, "record " + std::to_string(seq)).ok());
      for (uint64_t i = 0; i < 8; ++i) {
        const std::string p = Payload({seq, 0, i});
        ASSERT_TRUE((*t)->PutChunk({seq, 0, i}, "meta", p.data(), p.size()).ok());
      }
    }
    ASSERT_TRUE((*t)->PutBlob(1, 0, "sinks", "sss", 3).ok());
  }
  auto t = ColdTier::Open(ColdOpts(dir));  // the WAL goes into tables at this open
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE((*t)->DeleteSequence(1).ok());
  ASSERT_TRUE((*t)->DeleteChunk({2, 0, 3}).ok());
  ASSERT_TRUE((*t)->DeleteChunk({2, 0, 5}).ok());
  if (then) then(**t);
}

std::vector<SequenceId> SequencesOf(ColdTier& t) {
  std::vector<SequenceId> out;
  EXPECT_TRUE(t.ForEachSequence([&](SequenceId seq, std::string_view) {
                 out.push_back(seq);
                 return Status::Ok();
               }).ok());
  return out;
}

void ExpectDropsHold(ColdTier& t) {
  EXPECT_EQ(SequencesOf(t), std::vector<SequenceId>{2});
  EXPECT_EQ(t.AcknowledgedChunks(), R({{2, 0, 0, 2}, {2, 0, 4, 4}, {2, 0, 6, 7}}));
  EXPECT_EQ(t.stored_chunks(), 6u);
  std::string got(kPayload, '\0');
  for (const ChunkKey& k : {ChunkKey{1, 0, 0}, ChunkKey{1, 0, 7}, ChunkKey{2, 0, 3}, ChunkKey{2, 0, 5}})
    EXPECT_EQ(t.GetChunk(k, got.data(), got.size()).code(), StatusCode::kNotFound)
        << k.ToString() << " came back";
  EXPECT_EQ(t.GetBlob(1, 0, "sinks").status().code(), StatusCode::kNotFound);
  for (const ChunkRange& r : t.AcknowledgedChunks())
    for (uint64_t i = r.first; i <= r.last; ++i) {
      ASSERT_TRUE(t.GetChunk({r.seq, r.layer, i}, got.data(), got.size()).ok());
      EXPECT_EQ(got, Payload({r.seq, r.layer, i}));
    }
}

TEST(WalDamageCold, DropsStayDroppedWhenTheirWalIsLost) {
  TempDir dir;
  DropIntoTheWal(dir.path());
  std::vector<fs::path> wals = WalFiles(dir.path());
  ASSERT_FALSE(wals.empty());
  ASSERT_TRUE(fs::remove(wals.back()));
  {
    auto t = ColdTier::Open(ColdOpts(dir.path()));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ExpectDropsHold(**t);
    EXPECT_EQ((*t)->redropped_sequences(), std::vector<SequenceId>{1});
    EXPECT_EQ((*t)->redropped_chunks(), R({{1, 0, 0, 7}, {2, 0, 3, 3}, {2, 0, 5, 5}}));
  }
  // Done again and flushed at that open: losing the newest WAL once more changes nothing.
  wals = WalFiles(dir.path());
  if (!wals.empty()) {
    ASSERT_TRUE(fs::remove(wals.back()));
  }
  auto t = ColdTier::Open(ColdOpts(dir.path()));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ExpectDropsHold(**t);
  EXPECT_TRUE((*t)->redropped_chunks().empty());
  EXPECT_TRUE((*t)->redropped_sequences().empty());
}

TEST(WalDamageCold, AcceptingALossNeverAdoptsDroppedData) {
  TempDir dir;
  DropIntoTheWal(dir.path(), [](ColdTier& t) {
    const std::string p = Payload({2, 0, 8});
    ASSERT_TRUE(t.PutChunk({2, 0, 8}, "meta", p.data(), p.size()).ok());  // lost with the WAL below
  });
  std::vector<fs::path> wals = WalFiles(dir.path());
  ASSERT_FALSE(wals.empty());
  ASSERT_TRUE(fs::remove(wals.back()));
  auto t = ColdTier::Open(ColdOpts(dir.path()));
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("1 acknowledged chunks are missing (seq=2/layer=0/chunk=8)"),
            std::string::npos)
      << t.status().ToString();
  for (const bool accept : {true, false}) {
    auto opened = ColdTier::Open(ColdOpts(dir.path(), accept));
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    if (accept) {
      EXPECT_EQ((*opened)->lost_chunks(), R({{2, 0, 8, 8}}));
    }
    ExpectDropsHold(**opened);
  }
}

TEST(WalDamageCold, ManyDropsArePrunedOnceFlushedAndStayDropped) {
  TempDir dir;
  constexpr uint64_t kDeletes = 4100;  // past the 4096 tombstones that make a drop flush and prune
  {
    auto t = ColdTier::Open(ColdOpts(dir.path()));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    const std::string p(64, 'p');
    for (uint64_t i = 0; i < kDeletes; ++i)
      ASSERT_TRUE((*t)->PutChunk({1, 0, 2 * i}, "m", p.data(), p.size()).ok());
    for (uint64_t i = 0; i < kDeletes; ++i) ASSERT_TRUE((*t)->DeleteChunk({1, 0, 2 * i}).ok());
    EXPECT_EQ((*t)->stored_chunks(), 0u);
  }
  EXPECT_LT(fs::file_size(ManifestPath(dir.path())), 1024 * AckManifest::kRecordBytes);
  std::vector<fs::path> wals = WalFiles(dir.path());
  ASSERT_FALSE(wals.empty());
  ASSERT_TRUE(fs::remove(wals.back()));
  auto t = ColdTier::Open(ColdOpts(dir.path()));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->stored_chunks(), 0u);
  EXPECT_TRUE((*t)->AcknowledgedChunks().empty());
}

// ---- the whole store, and the CLI ------------------------------------------------------------

// Appends tokens to two layers of one sequence with write-through; returns the acknowledged
// chunks. The store is destroyed without CloseSequence, as a crash would leave it.
std::vector<ChunkRange> FillStore(const std::string& dir, SequenceId* seq) {
  StoreOptions o = CrashTestOptions(dir);
  auto store = TieredStore::Open(o);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  if (!store.ok()) return {};
  *seq = *(*store)->CreateSequence();
  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  const int64_t n = o.n_sink + o.n_local + o.chunk_size + 40 * o.chunk_size;  // seals chunks 0..39
  std::vector<uint8_t> k(n * tb), v(n * tb);
  for (int l = 0; l < o.geometry.layers; ++l) {
    FillPattern(kCrashSalt, *seq, l, 0, 0, n, tb, k.data());
    FillPattern(kCrashSalt, *seq, l, 1, 0, n, tb, v.data());
    EXPECT_TRUE((*store)->Append(*seq, l, k.data(), v.data(), static_cast<int>(n), o.geometry.dtype).ok());
  }
  EXPECT_TRUE((*store)->WaitForDurable().ok());
  return (*store)->lower_tiers().AcknowledgedChunks();
}

TEST(WalDamageStore, OpenFailsNamingTheLostChunksAndAcceptingLeavesHoles) {
  TempDir dir;
  SequenceId seq = 0;
  const std::vector<ChunkRange> acked = FillStore(dir.path(), &seq);
  ASSERT_EQ(acked, R({{seq, 0, 0, 39}, {seq, 1, 0, 39}}));
  StoreOptions o = CrashTestOptions(dir.path());
  DamageWal(dir.path(), Damage::kTruncate, 80 * o.chunk_bytes());
  auto store = TieredStore::Open(o);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kCorruption);
  EXPECT_NE(store.status().message().find("seq=" + std::to_string(seq) + "/layer="), std::string::npos)
      << store.status().ToString();

  o.accept_lost_chunks = true;
  store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const std::vector<ChunkRange> lost = (*store)->lower_tiers().LostChunks();
  ASSERT_FALSE(lost.empty());
  EXPECT_EQ(CountChunks(lost) + CountChunks((*store)->lower_tiers().AcknowledgedChunks()), 80u);
  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  const size_t half = static_cast<size_t>(o.chunk_size) * tb;
  std::vector<uint8_t> k(half), v(half), ek(half), ev(half);
  for (const ChunkRange& r : (*store)->lower_tiers().AcknowledgedChunks())
    for (uint64_t i = r.first; i <= r.last; ++i) {
      const int64_t first = o.n_sink + static_cast<int64_t>(i) * o.chunk_size;
      Status st = (*store)->ReadTokens(r.seq, r.layer, first, first + o.chunk_size, k.data(), v.data());
      ASSERT_TRUE(st.ok()) << st.ToString();
      FillPattern(kCrashSalt, r.seq, r.layer, 0, first, o.chunk_size, tb, ek.data());
      FillPattern(kCrashSalt, r.seq, r.layer, 1, first, o.chunk_size, tb, ev.data());
      EXPECT_EQ(k, ek);
      EXPECT_EQ(v, ev);
    }
  for (const ChunkRange& r : lost) {
    const int64_t first = o.n_sink + static_cast<int64_t>(r.first) * o.chunk_size;
    Status st = (*store)->ReadTokens(r.seq, r.layer, first, first + o.chunk_size, k.data(), v.data());
    // A lost chunk in the middle is a hole; past the last chunk present it is past the end.
    EXPECT_TRUE(st.code() == StatusCode::kNotFound || st.code() == StatusCode::kInvalidArgument)
        << st.ToString();
  }
}

int RunCli(const std::string& args, std::string* out) {
  const std::string cmd = std::string(KVTIER_BINARY_DIR) + "/kvtier " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  const int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Issue 24, defect 2, through the whole store and `kvtier check`: a DropSequence and a
// DropChunks that returned OK, then the WAL holding their deletes is lost.
TEST(WalDamageStore, DropsThatReturnedOkStayDroppedWhenTheWalIsLost) {
  TempDir dir;
  StoreOptions o = CrashTestOptions(dir.path());
  SequenceId a = 0, b = 0;
  {
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    a = *(*store)->CreateSequence();
    b = *(*store)->CreateSequence();
    const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
    const int64_t n = o.n_sink + o.n_local + o.chunk_size + 8 * o.chunk_size;  // seals chunks 0..7
    std::vector<uint8_t> k(n * tb), v(n * tb);
    for (SequenceId seq : {a, b})
      for (int l = 0; l < o.geometry.layers; ++l) {
        FillPattern(kCrashSalt, seq, l, 0, 0, n, tb, k.data());
        FillPattern(kCrashSalt, seq, l, 1, 0, n, tb, v.data());
        ASSERT_TRUE((*store)->Append(seq, l, k.data(), v.data(), static_cast<int>(n), o.geometry.dtype).ok());
      }
    ASSERT_TRUE((*store)->WaitForDurable().ok());
  }
  {
    auto store = TieredStore::Open(o);  // the WAL goes into tables at this open
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    ASSERT_TRUE((*store)->DropSequence(a).ok());
    ASSERT_TRUE((*store)->DropChunks(b, 0, {3, 5}).ok());
  }
  std::vector<fs::path> wals = WalFiles(dir.path());
  ASSERT_FALSE(wals.empty());
  ASSERT_TRUE(fs::remove(wals.back()));

  std::string out;
  ASSERT_EQ(RunCli("check --data-dir " + dir.path(), &out), 0) << out;
  EXPECT_EQ(out.find("sequence " + std::to_string(a) + ":"), std::string::npos)
      << "dropped sequence listed:\n"
      << out;
  EXPECT_NE(out.find("present again"), std::string::npos) << out;
  EXPECT_NE(out.find("the next read-write open deletes them again"), std::string::npos) << out;
  EXPECT_NE(out.find("seq=" + std::to_string(b) + "/layer=0/chunk=0..2, seq=" + std::to_string(b) +
                     "/layer=0/chunk=4, seq=" + std::to_string(b) + "/layer=0/chunk=6..7"),
            std::string::npos)
      << out;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->ListSequences(), std::vector<SequenceId>{b});
  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  std::vector<uint8_t> k(o.chunk_size * tb), v(o.chunk_size * tb);
  for (uint64_t idx : {3, 5}) {
    const int64_t first = o.n_sink + static_cast<int64_t>(idx) * o.chunk_size;
    EXPECT_EQ((*store)->ReadTokens(b, 0, first, first + o.chunk_size, k.data(), v.data()).code(),
              StatusCode::kNotFound)
        << "dropped chunk " << idx << " came back";
  }
  EXPECT_TRUE((*store)->ReadTokens(b, 0, o.n_sink, o.n_sink + o.chunk_size, k.data(), v.data()).ok());
}

TEST(WalDamageStore, KvtierCheckPrintsTheLostChunks) {
  SequenceId seq = 0;
  std::string out;
  {
    TempDir whole;
    FillStore(whole.path(), &seq);
    ASSERT_EQ(RunCli("check --data-dir " + whole.path() + " --verify", &out), 0) << out;
    EXPECT_NE(out.find("80 acknowledged chunks in 2 ranges, all present; 80 read back and verified"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("seq=" + std::to_string(seq) + "/layer=1/chunk=0..39"), std::string::npos) << out;
  }
  TempDir dir;
  FillStore(dir.path(), &seq);
  DamageWal(dir.path(), Damage::kTruncate, 80 * CrashTestOptions(dir.path()).chunk_bytes());
  out.clear();
  EXPECT_EQ(RunCli("check --data-dir " + dir.path(), &out), 1) << out;
  EXPECT_NE(out.find("kvtier: error: Corruption: cold tier: "), std::string::npos) << out;
  EXPECT_NE(out.find("acknowledged chunks are missing (seq=" + std::to_string(seq) + "/layer="),
            std::string::npos)
      << out;
  out.clear();
  ASSERT_EQ(RunCli("check --data-dir " + dir.path() + " --accept-lost", &out), 0) << out;
  EXPECT_NE(out.find("lost and accepted: "), std::string::npos) << out;
  out.clear();
  ASSERT_EQ(RunCli("check --data-dir " + dir.path() + " --verify", &out), 0) << out;
  EXPECT_EQ(out.find("lost and accepted"), std::string::npos) << out;
}

// Issue 46, point 1: a refused open (kvtier check, TieredStore::Open) touches nothing, and
// --accept-lost lists what it forgets before forgetting it.
TEST(WalDamageStore, ARefusedOpenLeavesEveryFileAsItWas) {
  SequenceId seq = 0;
  TempDir dir;
  FillStore(dir.path(), &seq);
  DamageWal(dir.path(), Damage::kFlipBits, 80 * CrashTestOptions(dir.path()).chunk_bytes());
  const auto before = DirectorySnapshot(dir.path());
  std::string out;
  EXPECT_EQ(RunCli("check --data-dir " + dir.path(), &out), 1) << out;
  EXPECT_NE(out.find("acknowledged chunks are missing"), std::string::npos) << out;
  EXPECT_NE(out.find("Nothing in the directory was changed"), std::string::npos) << out;
  EXPECT_EQ(DirectorySnapshot(dir.path()), before) << "kvtier check changed the directory";
  auto store = TieredStore::Open(CrashTestOptions(dir.path()));
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(DirectorySnapshot(dir.path()), before) << "a refused open changed the directory";

  // The damaged directory as it was, so a user can hand it to RocksDB's repair; --accept-lost
  // then lists what it forgets before forgetting it.
  out.clear();
  ASSERT_EQ(RunCli("check --data-dir " + dir.path() + " --accept-lost", &out), 0) << out;
  const size_t listed = out.find("forgetting for good"), accepted = out.find("lost and accepted");
  ASSERT_NE(listed, std::string::npos) << out;
  EXPECT_LT(listed, accepted) << out;
  out.clear();
  EXPECT_EQ(RunCli("check --data-dir " + dir.path() + " --verify", &out), 0) << out;
}

// The acknowledged chunks a read-only open of `dir` finds missing (what kvtier check lists).
uint64_t MissingAcks(const std::string& dir) {
  ColdTierOptions co;
  co.path = dir;
  co.read_only = true;
  co.list_missing = true;
  auto cold = ColdTier::Open(co);
  EXPECT_TRUE(cold.ok()) << cold.status().ToString();
  return cold.ok() ? CountChunks((*cold)->lost_chunks()) : ~0ull;
}

// Issue 46, point 1: bits flipped in the middle of the only WAL of a store whose data is all
// in that WAL (no table yet). An open keeps the log's prefix up to the damaged record; RocksDB's
// repair also replays past it, and kvtier repair keeps what it replays for every family. What
// is still missing is named, and --accept-lost goes on without it.
TEST(WalDamageStore, RepairSalvagesPastAFlippedBitAndNamesWhatIsStillMissing) {
  SequenceId seq = 0;
  TempDir dir;
  FillStore(dir.path(), &seq);
  DamageWal(dir.path(), Damage::kFlipBits, 80 * CrashTestOptions(dir.path()).chunk_bytes());
  StoreOptions o = CrashTestOptions(dir.path());
  const uint64_t missing_before = MissingAcks(dir.path());
  ASSERT_GT(missing_before, 8u) << "the damage must cost the open more than the damaged records";
  const auto before = DirectorySnapshot(dir.path());

  std::string out;
  EXPECT_EQ(RunCli("repair --data-dir " + dir.path(), &out), 2) << out;
  EXPECT_NE(out.find("--into NEW"), std::string::npos) << out;
  EXPECT_EQ(DirectorySnapshot(dir.path()), before) << "repair without consent changed the directory";

  out.clear();
  const int code = RunCli("repair --data-dir " + dir.path() + " --in-place", &out);
  const uint64_t missing_after = MissingAcks(dir.path());
  // A damaged fragment costs the records with a fragment in its 32 KiB log block.
  const uint64_t per_block = 32768 / o.chunk_bytes() + 2;
  EXPECT_LT(missing_after, missing_before) << out;
  EXPECT_LE(missing_after, 2 * per_block) << "two flipped bytes cost at most two blocks\n" << out;
  EXPECT_NE(out.find("salvaged " + std::to_string(missing_before - missing_after) + " of the " +
                     std::to_string(missing_before) + " missing before"),
            std::string::npos)
      << out;
  if (missing_after == 0) {
    EXPECT_EQ(code, 0) << out;
  } else {
    EXPECT_EQ(code, 1) << out;
    EXPECT_NE(out.find("still missing " + std::to_string(missing_after) + " chunks"), std::string::npos)
        << out;
    EXPECT_NE(out.find("--accept-lost"), std::string::npos) << out;
    out.clear();
    ASSERT_EQ(RunCli("check --data-dir " + dir.path() + " --accept-lost", &out), 0) << out;
    EXPECT_NE(out.find("forgetting for good " + std::to_string(missing_after) + " chunks"), std::string::npos)
        << out;
  }
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(CountChunks((*store)->lower_tiers().AcknowledgedChunks()), 80u - missing_after);
  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  std::vector<uint8_t> k(o.chunk_size * tb), v(o.chunk_size * tb), ek(k.size()), ev(v.size());
  for (const ChunkRange& r : (*store)->lower_tiers().AcknowledgedChunks())
    for (uint64_t i = r.first; i <= r.last; ++i) {
      const int64_t first = o.n_sink + static_cast<int64_t>(i) * o.chunk_size;
      ASSERT_TRUE((*store)->ReadTokens(r.seq, r.layer, first, first + o.chunk_size, k.data(), v.data()).ok());
      FillPattern(kCrashSalt, r.seq, r.layer, 0, first, o.chunk_size, tb, ek.data());
      FillPattern(kCrashSalt, r.seq, r.layer, 1, first, o.chunk_size, tb, ev.data());
      EXPECT_EQ(k, ek) << "chunk " << i << " of layer " << r.layer;
      EXPECT_EQ(v, ev) << "chunk " << i << " of layer " << r.layer;
    }
}

// kvtier repair changes nothing where it has nothing to do or no consent to do it.
TEST(WalDamageStore, RepairRefusesWithoutTouchingAnything) {
  SequenceId seq = 0;
  TempDir dir, other;
  FillStore(dir.path(), &seq);
  const auto before = DirectorySnapshot(dir.path());
  std::string out;
  EXPECT_EQ(RunCli("repair --data-dir " + dir.path() + " --in-place", &out), 0) << out;
  EXPECT_NE(out.find("nothing to repair, nothing was changed"), std::string::npos) << out;
  EXPECT_EQ(DirectorySnapshot(dir.path()), before);

  DamageWal(dir.path(), Damage::kTruncate, 80 * CrashTestOptions(dir.path()).chunk_bytes());
  const auto damaged = DirectorySnapshot(dir.path());
  out.clear();
  EXPECT_EQ(RunCli("repair --data-dir " + dir.path() + " --into " + other.path(), &out), 2) << out;
  EXPECT_NE(out.find("exists; name a directory that does not"), std::string::npos) << out;
  out.clear();
  EXPECT_EQ(RunCli("repair --data-dir " + dir.path() + " --in-place --into " + other.path() + "/x", &out), 2)
      << out;
  EXPECT_NE(out.find("exactly one of"), std::string::npos) << out;
  EXPECT_EQ(DirectorySnapshot(dir.path()), damaged);
  EXPECT_TRUE(DirectorySnapshot(other.path()).empty());

  out.clear();
  EXPECT_EQ(RunCli("repair --data-dir " + other.path() + " --in-place", &out), 1) << out;
  EXPECT_NE(out.find("holds no kvtier store"), std::string::npos) << out;
  EXPECT_TRUE(DirectorySnapshot(other.path()).empty());
}

// Issue 46, point 6: --accept-lost with no store record refuses and keeps the manifest.
TEST(WalDamageStore, AcceptLostWithoutAStoreRecordRefusesAndKeepsTheManifest) {
  SequenceId seq = 0;
  TempDir dir;
  FillStore(dir.path(), &seq);
  // The whole WAL gone: the store record and every chunk with it.
  for (const fs::path& w : WalFiles(dir.path())) ASSERT_TRUE(fs::remove(w));
  const auto before = DirectorySnapshot(dir.path());
  std::string out;
  EXPECT_EQ(RunCli("check --data-dir " + dir.path() + " --accept-lost", &out), 1) << out;
  EXPECT_NE(out.find("nothing to go on with"), std::string::npos) << out;
  EXPECT_EQ(DirectorySnapshot(dir.path()), before) << "--accept-lost changed the directory before refusing";
  out.clear();
  EXPECT_EQ(RunCli("check --data-dir " + dir.path(), &out), 1) << out;
  EXPECT_NE(out.find("acknowledged chunks are missing"), std::string::npos) << out;
}

// Issue 46, point 8: check on a directory that holds no store creates nothing there, and an
// unrelated app.log does not make a directory a store.
TEST(WalDamageStore, CheckOfADirectoryWithoutAStoreCreatesNothing) {
  TempDir dir;
  { std::ofstream(dir.path() + "/app.log") << "an application's log\n"; }
  const auto before = DirectorySnapshot(dir.path());
  std::string out;
  EXPECT_EQ(RunCli("check --data-dir " + dir.path(), &out), 1) << out;
  EXPECT_NE(out.find("holds no kvtier store"), std::string::npos) << out;
  EXPECT_EQ(out.find("CURRENT file is missing"), std::string::npos) << out;
  EXPECT_EQ(DirectorySnapshot(dir.path()), before);
  auto store = TieredStore::Open(CrashTestOptions(dir.path()));
  EXPECT_TRUE(store.ok()) << store.status().ToString();
}

}  // namespace
}  // namespace kvtier
