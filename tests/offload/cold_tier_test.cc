// Tests of the cold tier (offload/cold_tier.h) and CRC-32C (store/checksum.h).
#include "offload/cold_tier.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/perf_context.h>
#include <rocksdb/perf_level.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "store/checksum.h"

extern char** environ;

namespace kvtier {
namespace {

namespace fs = std::filesystem;
namespace fmt = cold_tier_format;

// ---- helpers ---------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir();
    if (tmpl.empty() || tmpl.back() != '/') tmpl += '/';
    tmpl += "kvtier_cold_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    char* p = mkdtemp(buf.data());
    if (p == nullptr) {
      ADD_FAILURE() << "mkdtemp failed for " << tmpl;
      return;
    }
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(&s[i], &v, 8);
  }
  for (; i < n; ++i) s[i] = static_cast<char>(rng());
  return s;
}

// fp16 bits of Gaussian noise: what KV looks like (half-compressible).
std::string Fp16Noise(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::string s(n, '\0');
  for (size_t i = 0; i + 2 <= n; i += 2) {
    float f = dist(rng);
    // fp32 -> fp16 by truncation is enough for test data.
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int exp = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
    uint16_t h;
    if (exp <= 0)
      h = static_cast<uint16_t>(sign);
    else if (exp >= 31)
      h = static_cast<uint16_t>(sign | 0x7bffu);
    else
      h = static_cast<uint16_t>(sign | (exp << 10) | ((u >> 13) & 0x3ffu));
    std::memcpy(&s[i], &h, 2);
  }
  return s;
}

// Compressible content: small integers as 16-bit words (lz4 and zstd both shrink it).
std::string Compressible(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = (i % 2) ? '\0' : static_cast<char>(rng() % 4);
  return s;
}

uint64_t SstBytes(const std::string& dir) {
  uint64_t n = 0;
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".sst") n += e.file_size();
  return n;
}

ColdTierOptions Opts(const std::string& path, Compression c = Compression::kLZ4) {
  ColdTierOptions o;
  o.path = path;
  o.compression = c;
  return o;
}

std::unique_ptr<ColdTier> MustOpen(const ColdTierOptions& o) {
  auto r = ColdTier::Open(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return nullptr;
  return std::move(r).value();
}

std::string GetPayload(ColdTier& t, const ChunkKey& k, size_t n, Status* st = nullptr) {
  std::string out(n, '\0');
  Status s = t.GetChunk(k, out.data(), n);
  if (st)
    *st = s;
  else
    EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

bool Contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

// Opens a cold tier directory with RocksDB directly, to inspect or damage values.
class RawDb {
 public:
  explicit RawDb(const std::string& path) {
    rocksdb::DBOptions o;
    rocksdb::ColumnFamilyOptions c;
    c.compression = rocksdb::kNoCompression;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {fmt::kSequenceColumn, c}, {fmt::kMetaColumn, c}, {fmt::kPayloadColumn, c}, {fmt::kBlobColumn, c}};
    rocksdb::Status s = rocksdb::DB::Open(o, path, cfs, &handles_, &db_);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  ~RawDb() {
    if (!db_) return;
    for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    db_->Close().PermitUncheckedError();
    delete db_;
  }
  bool ok() const { return db_ != nullptr; }
  rocksdb::ColumnFamilyHandle* cf(const std::string& name) {
    for (auto* h : handles_)
      if (h->GetName() == name) return h;
    return nullptr;
  }
  std::string Get(const std::string& family, const std::string& key) {
    std::string v;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), cf(family), key, &v);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return v;
  }
  void Put(const std::string& family, const std::string& key, const std::string& value) {
    rocksdb::Status s = db_->Put(rocksdb::WriteOptions(), cf(family), key, value);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  size_t Count(const std::string& family) {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cf(family)));
    size_t n = 0;
    for (it->SeekToFirst(); it->Valid(); it->Next()) ++n;
    return n;
  }

 private:
  rocksdb::DB* db_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
};

// Rewrites one stored value through `edit` (tier must be closed).
template <typename Edit>
void EditRaw(const std::string& path, const std::string& family, const std::string& key, Edit edit) {
  RawDb raw(path);
  ASSERT_TRUE(raw.ok());
  std::string v = raw.Get(family, key);
  ASSERT_FALSE(v.empty());
  edit(v);
  raw.Put(family, key, v);
}

// ---- CRC-32C ----------------------------------------------------------------------------

TEST(Crc32c, StandardVectors) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cSoftware("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  // RFC 3720 (iSCSI) B.4 vectors.
  std::string zeros(32, '\0'), ones(32, '\xff'), inc(32, '\0'), dec(32, '\0');
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<char>(i);
    dec[i] = static_cast<char>(31 - i);
  }
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(dec.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(Crc32cSoftware(dec.data(), 32), 0x113FDB5Cu);
}

TEST(Crc32c, HardwareMatchesSoftwareAndChains) {
  std::string data = RandomBytes(300000, 42);
  // Sizes around the hardware path's stream boundaries (3 x 8192, 3 x 256).
  for (size_t n : {767u, 768u, 769u, 24575u, 24576u, 24577u, 2u * 24576u + 768u + 13u, 262144u + 5u}) {
    for (size_t off : {0u, 1u, 3u, 8u}) {
      ASSERT_EQ(Crc32c(data.data() + off, n), Crc32cSoftware(data.data() + off, n)) << n << " @" << off;
      ASSERT_EQ(Crc32c(data.data() + off, n, 0xdeadbeef), Crc32cSoftware(data.data() + off, n, 0xdeadbeef));
    }
  }
  std::mt19937 rng(7);
  for (int t = 0; t < 300; ++t) {
    size_t off = rng() % 64, n = rng() % 5000;
    if (t % 50 == 0) n = 65536;
    const char* p = data.data() + off;
    uint32_t seed = (t % 3 == 0) ? 0 : static_cast<uint32_t>(rng());
    ASSERT_EQ(Crc32c(p, n, seed), Crc32cSoftware(p, n, seed)) << "off=" << off << " n=" << n;
    size_t cut = n ? rng() % n : 0;
    ASSERT_EQ(Crc32c(p + cut, n - cut, Crc32c(p, cut, seed)), Crc32c(p, n, seed));
  }
  std::cout << "Crc32c uses " << (Crc32cIsHardware() ? "the hardware instruction" : "slice-by-8 tables")
            << "\n";
}

// ---- options and names ---------------------------------------------------------------------

TEST(ColdTierOptions, CompressionNames) {
  for (Compression c : {Compression::kNone, Compression::kLZ4, Compression::kZSTD}) {
    Compression back;
    ASSERT_TRUE(ParseCompression(CompressionName(c), &back));
    EXPECT_EQ(back, c);
  }
  Compression c = Compression::kNone;
  EXPECT_TRUE(ParseCompression("ZSTD", &c));
  EXPECT_EQ(c, Compression::kZSTD);
  EXPECT_FALSE(ParseCompression("snappy", &c));
  EXPECT_FALSE(ParseCompression("", &c));
}

TEST(ColdTierOptions, ValidateNamesTheBadField) {
  ColdTierOptions o;
  o.path = "/tmp/x";
  EXPECT_TRUE(o.Validate().ok());

  ColdTierOptions no_path;
  Status s = no_path.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "path")) << s.ToString();

  ColdTierOptions wb = o;
  wb.write_buffer_bytes = 1024;
  s = wb.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "write_buffer_bytes")) << s.ToString();
  wb.write_buffer_bytes = size_t{8} << 30;
  EXPECT_FALSE(wb.Validate().ok());

  ColdTierOptions comp = o;
  comp.compression = static_cast<Compression>(9);
  s = comp.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "compression")) << s.ToString();

  auto r = ColdTier::Open(no_path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(ColdTierOpen, PathThatIsAFile) {
  TempDir dir;
  std::string file = dir.Sub("not_a_dir");
  std::ofstream(file) << "hello";
  auto r = ColdTier::Open(Opts(file));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "is a file, not a directory")) << r.status().ToString();
  EXPECT_TRUE(Contains(r.status().message(), file)) << r.status().ToString();
}

TEST(ColdTierOpen, CreatesNestedDirectoryAndLocksIt) {
  TempDir dir;
  std::string path = dir.Sub("a/b/c");
  auto t = MustOpen(Opts(path));
  ASSERT_TRUE(t);
  EXPECT_TRUE(fs::is_directory(path));
  EXPECT_EQ(t->path(), path);
  // A second instance on the same directory fails cleanly (RocksDB's LOCK).
  auto r = ColdTier::Open(Opts(path));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIOError);
  EXPECT_TRUE(Contains(r.status().message(), "cold tier")) << r.status().ToString();
}

// ---- a directory that holds a store -----------------------------------------------------------

constexpr uint64_t kSafetyChunks = 120;
constexpr size_t kSafetyBytes = 8192;

// 120 chunks through a 64 KiB memtable: some in tables (*.sst), the newest only in the WAL.
void WriteStoreWithTablesAndWal(const std::string& path) {
  ColdTierOptions o = Opts(path, Compression::kNone);
  o.write_buffer_bytes = 64 << 10;
  auto t = MustOpen(o);
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->PutSequence(1, "record").ok());
  for (uint64_t i = 0; i < kSafetyChunks; ++i) {
    const std::string p = RandomBytes(kSafetyBytes, i);
    ASSERT_TRUE(t->PutChunk({1, 0, i}, "m", p.data(), p.size()).ok());
  }
}

// Name -> size of every file of the store (not LOCK or LOG*, which any open writes).
std::map<std::string, uint64_t> StoreFileSizes(const std::string& dir) {
  std::map<std::string, uint64_t> out;
  for (auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "LOCK" || name.rfind("LOG", 0) == 0) continue;
    out[name] = e.file_size();
  }
  return out;
}

std::vector<std::string> Manifests(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("MANIFEST-", 0) == 0) out.push_back(e.path().filename().string());
  return out;
}

TEST(ColdTierOpen, AMissingCurrentIsRecoveredNotReplacedByANewStore) {
  TempDir dir;
  WriteStoreWithTablesAndWal(dir.path());
  ASSERT_GT(SstBytes(dir.path()), 0u) << "the test needs tables as well as a WAL";
  const std::vector<std::string> manifests = Manifests(dir.path());
  ASSERT_EQ(manifests.size(), 1u);
  ASSERT_TRUE(fs::remove(dir.Sub("CURRENT")));
  for (int round = 0; round < 2; ++round) {
    auto r = ColdTier::Open(Opts(dir.path(), Compression::kNone));
    ASSERT_TRUE(r.ok()) << "round " << round << ": " << r.status().ToString();
    ColdTier& t = **r;
    EXPECT_EQ(t.recovered_current(), round == 0 ? manifests[0] : "");
    EXPECT_TRUE(t.lost_chunks().empty());
    EXPECT_EQ(t.stored_chunks(), kSafetyChunks);
    EXPECT_EQ(CountChunks(t.AcknowledgedChunks()), kSafetyChunks);
    for (uint64_t i = 0; i < kSafetyChunks; ++i)
      ASSERT_EQ(GetPayload(t, {1, 0, i}, kSafetyBytes), RandomBytes(kSafetyBytes, i)) << "chunk " << i;
  }
}

TEST(ColdTierOpen, AStoreWhoseCurrentCannotBeRecoveredIsRefusedAndKeepsEveryFile) {
  for (const bool second_manifest : {false, true}) {
    SCOPED_TRACE(second_manifest ? "two MANIFESTs" : "no MANIFEST");
    TempDir dir;
    WriteStoreWithTablesAndWal(dir.path());
    const std::vector<std::string> manifests = Manifests(dir.path());
    ASSERT_EQ(manifests.size(), 1u);
    ASSERT_TRUE(fs::remove(dir.Sub("CURRENT")));
    if (second_manifest)
      fs::copy_file(dir.Sub(manifests[0]), dir.Sub("MANIFEST-999999"));
    else
      ASSERT_TRUE(fs::remove(dir.Sub(manifests[0])));
    const std::map<std::string, uint64_t> before = StoreFileSizes(dir.path());
    for (const bool accept : {false, true, false}) {
      ColdTierOptions o = Opts(dir.path(), Compression::kNone);
      o.accept_lost_chunks = accept;
      auto r = ColdTier::Open(o);
      ASSERT_FALSE(r.ok()) << "a store without its CURRENT was opened";
      EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
      EXPECT_TRUE(Contains(r.status().message(), "its CURRENT file is missing")) << r.status().ToString();
      EXPECT_TRUE(Contains(r.status().message(), dir.path())) << r.status().ToString();
      if (second_manifest) {
        EXPECT_TRUE(Contains(r.status().message(), "MANIFEST-999999")) << r.status().ToString();
      }
      EXPECT_EQ(StoreFileSizes(dir.path()), before) << "a refused open changed the store's files";
    }
  }
}

// ---- round trips per compression ------------------------------------------------------------

class ColdTierCompression : public ::testing::TestWithParam<Compression> {};

TEST_P(ColdTierCompression, PayloadRoundTripBitForBit) {
  TempDir dir;
  const std::vector<size_t> sizes = {1, 100, 4096, 16384 + 7, 65536, 262144};
  std::map<ChunkKey, std::string> want;
  uint64_t compressible_bytes = 0, total_bytes = 0;
  {
    auto t = MustOpen(Opts(dir.path(), GetParam()));
    ASSERT_TRUE(t);
    uint64_t idx = 0;
    for (size_t n : sizes) {
      for (int kind = 0; kind < 3; ++kind) {
        ChunkKey k{1, static_cast<uint32_t>(kind), idx++};
        std::string p = kind == 0   ? RandomBytes(n, idx)
                        : kind == 1 ? Fp16Noise(n, idx)
                                    : Compressible(n, idx);
        ASSERT_TRUE(t->PutChunk(k, "meta" + std::to_string(idx), p.data(), p.size()).ok());
        want[k] = p;
        total_bytes += n;
        if (kind == 2) compressible_bytes += n;
      }
    }
    for (auto& [k, p] : want) EXPECT_EQ(GetPayload(*t, k, p.size()), p) << k.ToString();
  }
  // Reopen: recovery flushes the WAL into SST files, compressed where it pays;
  // read again, now through decompression.
  auto t = MustOpen(Opts(dir.path(), GetParam()));
  ASSERT_TRUE(t);
  for (auto& [k, p] : want) EXPECT_EQ(GetPayload(*t, k, p.size()), p) << k.ToString();
  EXPECT_EQ(t->stored_chunks(), want.size());
  EXPECT_EQ(t->stored_payload_bytes(), total_bytes);
  const uint64_t sst = SstBytes(dir.path());
  if (GetParam() == Compression::kNone) {
    EXPECT_GE(sst, total_bytes);
  } else {
    // The compressible third shrinks by well over a quarter, so the total must drop.
    EXPECT_LT(sst, total_bytes - compressible_bytes / 4) << "compression did not engage";
  }
}

INSTANTIATE_TEST_SUITE_P(All, ColdTierCompression,
                         ::testing::Values(Compression::kNone, Compression::kLZ4, Compression::kZSTD),
                         [](const ::testing::TestParamInfo<Compression>& i) {
                           return std::string(CompressionName(i.param));
                         });

TEST(ColdTier, SyncWritesRoundTrip) {
  TempDir dir;
  ColdTierOptions o = Opts(dir.path(), Compression::kZSTD);
  o.sync_writes = true;
  o.block_cache_bytes = 0;  // no block cache at all
  auto t = MustOpen(o);
  ASSERT_TRUE(t);
  std::string p = Fp16Noise(16384, 3);
  ASSERT_TRUE(t->PutChunk({2, 0, 0}, "m", p.data(), p.size()).ok());
  EXPECT_EQ(GetPayload(*t, {2, 0, 0}, p.size()), p);
}

// ---- errors ---------------------------------------------------------------------------------

TEST(ColdTier, MissingAndWrongSize) {
  TempDir dir;
  auto t = MustOpen(Opts(dir.path()));
  ASSERT_TRUE(t);
  std::string buf(100, '\0');
  Status s = t->GetChunk({3, 1, 17}, buf.data(), buf.size());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s.message(), "seq=3/layer=1/chunk=17")) << s.ToString();

  std::string p = RandomBytes(100, 1);
  ASSERT_TRUE(t->PutChunk({3, 1, 17}, "m", p.data(), p.size()).ok());
  std::string small(99, '\0');
  s = t->GetChunk({3, 1, 17}, small.data(), small.size());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "seq=3/layer=1/chunk=17")) << s.ToString();
  std::string big(101, '\0');
  EXPECT_EQ(t->GetChunk({3, 1, 17}, big.data(), big.size()).code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(t->PutChunk({3, 1, 18}, "m", p.data(), 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->PutChunk({3, 1, 18}, "m", nullptr, 10).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->stored_chunks(), 1u);

  auto b = t->GetBlob(3, 1, "sinks");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(b.status().message(), "seq=3/layer=1/name=sinks")) << b.status().ToString();
  EXPECT_EQ(t->PutBlob(3, 1, "", p.data(), p.size()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->PutBlob(3, 1, std::string(2000, 'x'), p.data(), p.size()).code(),
            StatusCode::kInvalidArgument);

  // Deleting what is not there is not an error.
  EXPECT_TRUE(t->DeleteChunk({9, 9, 9}).ok());
  EXPECT_TRUE(t->DeleteSequence(12345).ok());
  EXPECT_EQ(t->stored_chunks(), 1u);
}

// ---- metas and sequences ----------------------------------------------------------------------

TEST(ColdTier, MetaIterationInKeyOrder) {
  TempDir dir;
  auto t = MustOpen(Opts(dir.path()));
  ASSERT_TRUE(t);
  // Values chosen so that little-endian or text keys would sort wrongly.
  std::vector<ChunkKey> keys;
  for (uint32_t layer : {0u, 1u, 2u, 255u, 256u, 70000u})
    for (uint64_t idx : {0ull, 1ull, 9ull, 10ull, 255ull, 256ull, 1ull << 40})
      keys.push_back({5, layer, idx});
  std::vector<ChunkKey> shuffled = keys;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(1));
  std::map<ChunkKey, std::string> want;
  for (const ChunkKey& k : shuffled) {
    std::string meta = "meta:" + k.ToString() + std::string(k.index % 7, '\0');
    std::string p = RandomBytes(64 + k.index % 100, k.layer * 1000 + k.index);
    ASSERT_TRUE(t->PutChunk(k, meta, p.data(), p.size()).ok());
    want[k] = meta;
  }
  // Neighbouring sequences must not leak in.
  std::string p = RandomBytes(64, 0);
  ASSERT_TRUE(t->PutChunk({4, 0xffffffffu, ~0ull}, "before", p.data(), p.size()).ok());
  ASSERT_TRUE(t->PutChunk({6, 0, 0}, "after", p.data(), p.size()).ok());
  // Empty meta record is fine.
  ASSERT_TRUE(t->PutChunk({7, 0, 0}, "", p.data(), p.size()).ok());

  auto check = [&](ColdTier& tier) {
    std::vector<std::pair<ChunkKey, std::string>> got;
    ASSERT_TRUE(tier.ForEachChunkMeta(5,
                                      [&](const ChunkKey& k, std::string_view m) {
                                        got.emplace_back(k, std::string(m));
                                        return Status::Ok();
                                      })
                    .ok());
    ASSERT_EQ(got.size(), want.size());
    size_t i = 0;
    for (auto& [k, m] : want) {
      EXPECT_EQ(got[i].first, k) << i;
      EXPECT_EQ(got[i].second, m) << i;
      ++i;
    }
    int n7 = 0;
    ASSERT_TRUE(tier.ForEachChunkMeta(7,
                                      [&](const ChunkKey&, std::string_view m) {
                                        EXPECT_TRUE(m.empty());
                                        ++n7;
                                        return Status::Ok();
                                      })
                    .ok());
    EXPECT_EQ(n7, 1);
  };
  check(*t);
  // A callback error stops the iteration and comes back.
  int calls = 0;
  Status s = t->ForEachChunkMeta(5, [&](const ChunkKey&, std::string_view) {
    return ++calls == 3 ? FailedPrecondition("stop") : Status::Ok();
  });
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(calls, 3);
  t.reset();
  t = MustOpen(Opts(dir.path()));
  ASSERT_TRUE(t);
  check(*t);
}

TEST(ColdTier, MetaIterationNeverReadsPayloads) {
  TempDir dir;
  constexpr int kChunks = 64;
  constexpr size_t kPayload = 64 << 10;  // 4 MiB of payloads in all
  {
    auto t = MustOpen(Opts(dir.path(), Compression::kNone));
    ASSERT_TRUE(t);
    for (int i = 0; i < kChunks; ++i) {
      std::string p = RandomBytes(kPayload, i);
      ASSERT_TRUE(t->PutChunk({1, 0, static_cast<uint64_t>(i)}, std::string("m").append(std::to_string(i)),
                              p.data(), p.size())
                      .ok());
    }
  }
  // Reopen so everything is in SST files (recovery flushes the WAL).
  auto t = MustOpen(Opts(dir.path(), Compression::kNone));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->stored_payload_bytes(), kChunks * kPayload);
  rocksdb::SetPerfLevel(rocksdb::PerfLevel::kEnableCount);
  rocksdb::get_perf_context()->Reset();
  int n = 0;
  ASSERT_TRUE(t->ForEachChunkMeta(1, [&](const ChunkKey&, std::string_view) {
                 ++n;
                 return Status::Ok();
               }).ok());
  uint64_t read_bytes = rocksdb::get_perf_context()->block_read_byte;
  rocksdb::SetPerfLevel(rocksdb::PerfLevel::kDisable);
  EXPECT_EQ(n, kChunks);
  // Metas are a few KiB; one payload alone would be 64 KiB.
  EXPECT_LT(read_bytes, kPayload) << "meta iteration read " << read_bytes << " bytes from disk";

  // And with every payload gone, metas still iterate.
  t.reset();
  {
    RawDb raw(dir.path());
    ASSERT_TRUE(raw.ok());
    for (int i = 0; i < kChunks; ++i)
      raw.Put(fmt::kPayloadColumn, fmt::ChunkKeyBytes({1, 0, static_cast<uint64_t>(i)}), "garbage");
  }
  t = MustOpen(Opts(dir.path(), Compression::kNone));
  ASSERT_TRUE(t);
  n = 0;
  ASSERT_TRUE(t->ForEachChunkMeta(1, [&](const ChunkKey&, std::string_view) {
                 ++n;
                 return Status::Ok();
               }).ok());
  EXPECT_EQ(n, kChunks);
}

TEST(ColdTier, MemoryCountsMemtablesThenTheBlockCache) {
  TempDir dir;
  constexpr int kChunks = 64;
  constexpr size_t kPayload = 64 << 10;  // 4 MiB of payloads in all
  constexpr size_t kMeta = 16 << 10;     // 1 MiB of meta records (representatives, in a store)
  std::vector<ChunkKey> keys;
  for (int i = 0; i < kChunks; ++i) keys.push_back({1, 0, static_cast<uint64_t>(i)});
  const uint64_t empty = [&] {
    auto t = MustOpen(Opts(dir.path(), Compression::kNone));
    if (!t) return ~uint64_t{0};
    const uint64_t before = t->memory_bytes();
    for (int i = 0; i < kChunks; ++i) {
      std::string p = RandomBytes(kPayload, i);
      EXPECT_TRUE(t->PutChunk(keys[i], RandomBytes(kMeta, 1000 + i), p.data(), p.size()).ok());
    }
    // Unflushed, every record sits in a memtable.
    EXPECT_GE(t->memory_bytes(), before + kChunks * (kPayload + kMeta));
    return before;
  }();
  ASSERT_LT(empty, 1u << 20) << "an empty store's memtables, readers and cache";
  // Reopened, the data is in SST files and the memtables are empty again. Payload reads bypass
  // the block cache (the warm tier is the payload cache); meta reads fill it.
  auto t = MustOpen(Opts(dir.path(), Compression::kNone));
  ASSERT_TRUE(t);
  const uint64_t reopened = t->memory_bytes();
  EXPECT_LT(reopened, 1u << 20);
  std::string got(kPayload, '\0');
  for (const ChunkKey& k : keys) ASSERT_TRUE(t->GetChunk(k, got.data(), got.size()).ok());
  EXPECT_LT(t->memory_bytes(), 1u << 20) << "payload reads left blocks in the cache";
  std::vector<std::string> metas;
  std::vector<Status> statuses;
  t->GetChunkMetas(keys, &metas, &statuses);
  for (const Status& st : statuses) ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_GE(t->memory_bytes(), reopened + kChunks * kMeta);
  // Without a block cache nothing stays after the reads.
  t.reset();
  ColdTierOptions no_cache = Opts(dir.path(), Compression::kNone);
  no_cache.block_cache_bytes = 0;
  t = MustOpen(no_cache);
  ASSERT_TRUE(t);
  t->GetChunkMetas(keys, &metas, &statuses);
  for (const Status& st : statuses) ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_LT(t->memory_bytes(), 1u << 20);
}

TEST(ColdTier, SequenceRecords) {
  TempDir dir;
  auto t = MustOpen(Opts(dir.path()));
  ASSERT_TRUE(t);
  std::map<SequenceId, std::string> want = {
      {1, "one"}, {256, std::string("bin\0ary", 7)}, {2, ""}, {~0ull, "max"}};
  for (auto& [s, r] : want) ASSERT_TRUE(t->PutSequence(s, r).ok());
  ASSERT_TRUE(t->PutSequence(1, "one-v2").ok());
  want[1] = "one-v2";
  auto collect = [](ColdTier& tier) {
    std::vector<std::pair<SequenceId, std::string>> got;
    EXPECT_TRUE(tier.ForEachSequence([&](SequenceId s, std::string_view r) {
                      got.emplace_back(s, std::string(r));
                      return Status::Ok();
                    })
                    .ok());
    return got;
  };
  using Records = std::vector<std::pair<SequenceId, std::string>>;
  auto got = collect(*t);
  ASSERT_EQ(got, Records(want.begin(), want.end()));
  ASSERT_TRUE(t->DeleteSequence(2).ok());
  want.erase(2);
  t.reset();
  t = MustOpen(Opts(dir.path()));
  ASSERT_TRUE(t);
  got = collect(*t);
  EXPECT_EQ(got, Records(want.begin(), want.end()));
}

// ---- blobs ------------------------------------------------------------------------------------

TEST(ColdTier, Blobs) {
  TempDir dir;
  {
    auto t = MustOpen(Opts(dir.path(), Compression::kZSTD));
    ASSERT_TRUE(t);
    std::string sinks = Fp16Noise(8192, 1), window = Fp16Noise(300000, 2);
    ASSERT_TRUE(t->PutBlob(3, 0, "sinks", sinks.data(), sinks.size()).ok());
    ASSERT_TRUE(t->PutBlob(3, 1, "sinks", window.data(), 100).ok());
    ASSERT_TRUE(t->PutBlob(3, 0, "window", window.data(), window.size()).ok());
    ASSERT_TRUE(t->PutBlob(3, 0, "empty", nullptr, 0).ok());
    ASSERT_TRUE(t->PutBlob(3, 0, "sinks2", "x", 1).ok());
    auto r = t->GetBlob(3, 0, "sinks");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(*r, sinks);
    // Overwrite.
    ASSERT_TRUE(t->PutBlob(3, 0, "sinks", "new", 3).ok());
  }
  auto t = MustOpen(Opts(dir.path(), Compression::kZSTD));
  ASSERT_TRUE(t);
  std::string window = Fp16Noise(300000, 2);
  auto r = t->GetBlob(3, 0, "sinks");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, "new");
  r = t->GetBlob(3, 1, "sinks");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, window.substr(0, 100));
  r = t->GetBlob(3, 0, "window");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, window);
  r = t->GetBlob(3, 0, "empty");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->empty());
  r = t->GetBlob(3, 0, "sinks2");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, "x");
  EXPECT_EQ(t->GetBlob(3, 2, "sinks").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t->GetBlob(4, 0, "sinks").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t->GetBlob(3, 0, "sink").status().code(), StatusCode::kNotFound);
}

// ---- delete sequence -----------------------------------------------------------------------------

void FillSequence(ColdTier& t, SequenceId seq, int layers, int chunks, size_t bytes) {
  ASSERT_TRUE(t.PutSequence(seq, "rec" + std::to_string(seq)).ok());
  for (int l = 0; l < layers; ++l) {
    for (int c = 0; c < chunks; ++c) {
      std::string p = RandomBytes(bytes, seq * 1000 + l * 100 + c);
      ASSERT_TRUE(
          t.PutChunk({seq, static_cast<uint32_t>(l), static_cast<uint64_t>(c)}, "m", p.data(), p.size())
              .ok());
    }
    std::string b = RandomBytes(500, seq + l);
    ASSERT_TRUE(t.PutBlob(seq, l, "sinks", b.data(), b.size()).ok());
  }
}

void ExpectSequenceGone(ColdTier& t, SequenceId seq, int layers, int chunks, size_t bytes) {
  int n = 0;
  ASSERT_TRUE(t.ForEachChunkMeta(seq, [&](const ChunkKey&, std::string_view) {
                 ++n;
                 return Status::Ok();
               }).ok());
  EXPECT_EQ(n, 0);
  std::string buf(bytes, '\0');
  for (int l = 0; l < layers; ++l) {
    for (int c = 0; c < chunks; ++c)
      EXPECT_EQ(
          t.GetChunk({seq, static_cast<uint32_t>(l), static_cast<uint64_t>(c)}, buf.data(), bytes).code(),
          StatusCode::kNotFound);
    EXPECT_EQ(t.GetBlob(seq, l, "sinks").status().code(), StatusCode::kNotFound);
  }
  bool seen = false;
  ASSERT_TRUE(t.ForEachSequence([&](SequenceId s, std::string_view) {
                 seen |= (s == seq);
                 return Status::Ok();
               }).ok());
  EXPECT_FALSE(seen);
}

void ExpectSequenceIntact(ColdTier& t, SequenceId seq, int layers, int chunks, size_t bytes) {
  int n = 0;
  ASSERT_TRUE(t.ForEachChunkMeta(seq, [&](const ChunkKey&, std::string_view) {
                 ++n;
                 return Status::Ok();
               }).ok());
  EXPECT_EQ(n, layers * chunks);
  for (int l = 0; l < layers; ++l) {
    for (int c = 0; c < chunks; ++c)
      EXPECT_EQ(GetPayload(t, {seq, static_cast<uint32_t>(l), static_cast<uint64_t>(c)}, bytes),
                RandomBytes(bytes, seq * 1000 + l * 100 + c));
    auto b = t.GetBlob(seq, l, "sinks");
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(*b, RandomBytes(500, seq + l));
  }
  std::string rec;
  ASSERT_TRUE(t.ForEachSequence([&](SequenceId s, std::string_view r) {
                 if (s == seq) rec = std::string(r);
                 return Status::Ok();
               }).ok());
  EXPECT_EQ(rec, "rec" + std::to_string(seq));
}

TEST(ColdTier, DeleteSequenceRemovesOnlyThatSequence) {
  TempDir dir;
  constexpr size_t kBytes = 4096;
  const SequenceId kMax = ~0ull;
  {
    auto t = MustOpen(Opts(dir.path()));
    ASSERT_TRUE(t);
    for (SequenceId s : {SequenceId{1}, SequenceId{2}, SequenceId{3}, kMax - 1, kMax})
      FillSequence(*t, s, 3, 4, kBytes);
    EXPECT_EQ(t->stored_chunks(), 5u * 12u);
    ASSERT_TRUE(t->DeleteSequence(2).ok());
    ASSERT_TRUE(t->DeleteSequence(kMax).ok());  // no 8-byte successor: the iterating path
    EXPECT_EQ(t->stored_chunks(), 3u * 12u);
    EXPECT_EQ(t->stored_payload_bytes(), 3u * 12u * kBytes);
    ExpectSequenceGone(*t, 2, 3, 4, kBytes);
    ExpectSequenceGone(*t, kMax, 3, 4, kBytes);
    for (SequenceId s : {SequenceId{1}, SequenceId{3}, kMax - 1}) ExpectSequenceIntact(*t, s, 3, 4, kBytes);
  }
  auto t = MustOpen(Opts(dir.path()));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->stored_chunks(), 3u * 12u);
  EXPECT_EQ(t->stored_payload_bytes(), 3u * 12u * kBytes);
  ExpectSequenceGone(*t, 2, 3, 4, kBytes);
  ExpectSequenceGone(*t, kMax, 3, 4, kBytes);
  for (SequenceId s : {SequenceId{1}, SequenceId{3}, kMax - 1}) ExpectSequenceIntact(*t, s, 3, 4, kBytes);
  // A deleted sequence can be written again.
  FillSequence(*t, 2, 1, 2, kBytes);
  ExpectSequenceIntact(*t, 2, 1, 2, kBytes);
  t.reset();
  RawDb raw(dir.path());
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(raw.Count(fmt::kPayloadColumn), 3u * 12u + 2u);
  EXPECT_EQ(raw.Count(fmt::kMetaColumn), 3u * 12u + 2u);
  EXPECT_EQ(raw.Count(fmt::kBlobColumn), 3u * 3u + 1u);
}

// ---- bookkeeping and reopen -------------------------------------------------------------------------

TEST(ColdTier, StoredBytesBookkeeping) {
  TempDir dir;
  {
    auto t = MustOpen(Opts(dir.path()));
    ASSERT_TRUE(t);
    EXPECT_EQ(t->stored_payload_bytes(), 0u);
    EXPECT_EQ(t->stored_chunks(), 0u);
    std::string a = RandomBytes(1000, 1), b = RandomBytes(3000, 2), c = RandomBytes(7000, 3);
    ASSERT_TRUE(t->PutChunk({1, 0, 0}, "a", a.data(), a.size()).ok());
    ASSERT_TRUE(t->PutChunk({1, 0, 1}, "b", b.data(), b.size()).ok());
    ASSERT_TRUE(t->PutChunk({2, 0, 0}, "c", c.data(), c.size()).ok());
    EXPECT_EQ(t->stored_payload_bytes(), 11000u);
    EXPECT_EQ(t->stored_chunks(), 3u);
    // Overwrite with a different size replaces, not adds.
    ASSERT_TRUE(t->PutChunk({1, 0, 1}, "b2", a.data(), 500).ok());
    EXPECT_EQ(t->stored_payload_bytes(), 8500u);
    EXPECT_EQ(t->stored_chunks(), 3u);
    EXPECT_EQ(GetPayload(*t, {1, 0, 1}, 500), a.substr(0, 500));
    ASSERT_TRUE(t->DeleteChunk({1, 0, 0}).ok());
    ASSERT_TRUE(t->DeleteChunk({1, 0, 0}).ok());  // twice: no double count
    EXPECT_EQ(t->stored_payload_bytes(), 7500u);
    EXPECT_EQ(t->stored_chunks(), 2u);
    std::string buf(1000, '\0');
    EXPECT_EQ(t->GetChunk({1, 0, 0}, buf.data(), buf.size()).code(), StatusCode::kNotFound);
  }
  {
    auto t = MustOpen(Opts(dir.path()));
    ASSERT_TRUE(t);
    EXPECT_EQ(t->stored_payload_bytes(), 7500u);
    EXPECT_EQ(t->stored_chunks(), 2u);
    ASSERT_TRUE(t->DeleteSequence(1).ok());
    EXPECT_EQ(t->stored_payload_bytes(), 7000u);
    EXPECT_EQ(t->stored_chunks(), 1u);
  }
  auto t = MustOpen(Opts(dir.path(), Compression::kZSTD));  // compression may change between opens
  ASSERT_TRUE(t);
  EXPECT_EQ(t->stored_payload_bytes(), 7000u);
  EXPECT_EQ(t->stored_chunks(), 1u);
  EXPECT_EQ(GetPayload(*t, {2, 0, 0}, 7000), RandomBytes(7000, 3));
}

TEST(ColdTier, ConcurrentWritersKeepExactCounts) {
  TempDir dir;
  auto t = MustOpen(Opts(dir.path()));
  ASSERT_TRUE(t);
  constexpr int kThreads = 8, kOps = 300;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937 rng(th);
      std::string p = RandomBytes(4096, th);
      for (int i = 0; i < kOps; ++i) {
        // Contended keys: all threads hit the same 32 chunks of two sequences.
        ChunkKey k{1 + rng() % 2, 0, rng() % 16};
        size_t n = 1 + rng() % p.size();
        Status s = (rng() % 4 == 0) ? t->DeleteChunk(k) : t->PutChunk(k, std::to_string(n), p.data(), n);
        if (th == 0 && i == kOps / 2) s = t->DeleteSequence(2);
        if (!s.ok()) failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  // The meta record of each chunk holds its size: the truth to compare against.
  uint64_t bytes = 0, n = 0;
  for (SequenceId s : {1, 2}) {
    ASSERT_TRUE(t->ForEachChunkMeta(s, [&](const ChunkKey&, std::string_view m) {
                   ++n;
                   bytes += std::stoull(std::string(m));
                   return Status::Ok();
                 }).ok());
  }
  EXPECT_GT(n, 0u);
  EXPECT_EQ(t->stored_chunks(), n);
  EXPECT_EQ(t->stored_payload_bytes(), bytes);
  t.reset();
  t = MustOpen(Opts(dir.path()));  // recount from the metas
  ASSERT_TRUE(t);
  EXPECT_EQ(t->stored_chunks(), n);
  EXPECT_EQ(t->stored_payload_bytes(), bytes);
}

TEST(ColdTier, ReopenKeepsEverything) {
  TempDir dir;
  constexpr size_t kBytes = 16384;
  {
    auto t = MustOpen(Opts(dir.path(), Compression::kZSTD));
    ASSERT_TRUE(t);
    FillSequence(*t, 10, 2, 5, kBytes);
    FillSequence(*t, 11, 1, 3, kBytes);
  }
  for (int round = 0; round < 2; ++round) {
    auto t = MustOpen(Opts(dir.path(), Compression::kZSTD));
    ASSERT_TRUE(t);
    EXPECT_EQ(t->stored_chunks(), 13u);
    EXPECT_EQ(t->stored_payload_bytes(), 13u * kBytes);
    ExpectSequenceIntact(*t, 10, 2, 5, kBytes);
    ExpectSequenceIntact(*t, 11, 1, 3, kBytes);
  }
}

// ---- corruption ---------------------------------------------------------------------------------------

class ColdTierCorruption : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = MustOpen(Opts(dir_.path()));
    ASSERT_TRUE(t);
    payload_ = RandomBytes(20000, 5);
    ASSERT_TRUE(t->PutChunk(key_, "meta-bytes", payload_.data(), payload_.size()).ok());
    ASSERT_TRUE(t->PutChunk({3, 1, 18}, "other", payload_.data(), payload_.size()).ok());
    ASSERT_TRUE(t->PutBlob(3, 1, "sinks", payload_.data(), 1000).ok());
    ASSERT_TRUE(t->PutSequence(3, "record").ok());
  }
  // Damages the stored value, reopens the tier and returns it.
  template <typename Edit>
  std::unique_ptr<ColdTier> Damage(const std::string& family, const std::string& key, Edit edit) {
    EditRaw(dir_.path(), family, key, edit);
    return MustOpen(Opts(dir_.path()));
  }
  Status ReadPayload(ColdTier& t) {
    std::string buf(payload_.size(), '\0');
    return t.GetChunk(key_, buf.data(), buf.size());
  }
  static void ExpectCorruption(const Status& s, const std::string& names, const std::string& what) {
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), names)) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), what)) << s.ToString();
  }

  TempDir dir_;
  ChunkKey key_{3, 1, 17};
  std::string payload_;
};

TEST_F(ColdTierCorruption, FlippedPayloadByte) {
  auto t =
      Damage(fmt::kPayloadColumn, fmt::ChunkKeyBytes(key_), [](std::string& v) { v[v.size() / 2] ^= 0x10; });
  ASSERT_TRUE(t);
  ExpectCorruption(ReadPayload(*t), "cold tier: chunk seq=3/layer=1/chunk=17 payload", "checksum mismatch");
  // The neighbour is unaffected.
  EXPECT_EQ(GetPayload(*t, {3, 1, 18}, payload_.size()), payload_);
}

TEST_F(ColdTierCorruption, FlippedHeaderByteIsCaught) {
  // The CRC covers the header too: a flip in the reserved bytes is caught.
  auto t = Damage(fmt::kPayloadColumn, fmt::ChunkKeyBytes(key_), [](std::string& v) { v[6] ^= 1; });
  ASSERT_TRUE(t);
  ExpectCorruption(ReadPayload(*t), "seq=3/layer=1/chunk=17", "checksum mismatch");
}

TEST_F(ColdTierCorruption, ShortValue) {
  auto t = Damage(fmt::kPayloadColumn, fmt::ChunkKeyBytes(key_), [](std::string& v) { v.resize(10); });
  ASSERT_TRUE(t);
  ExpectCorruption(ReadPayload(*t), "seq=3/layer=1/chunk=17", "too short");
}

TEST_F(ColdTierCorruption, BadMagic) {
  auto t = Damage(fmt::kPayloadColumn, fmt::ChunkKeyBytes(key_), [](std::string& v) { v[0] ^= 0xff; });
  ASSERT_TRUE(t);
  ExpectCorruption(ReadPayload(*t), "seq=3/layer=1/chunk=17", "bad magic");
}

TEST_F(ColdTierCorruption, TruncatedBody) {
  auto t = Damage(fmt::kPayloadColumn, fmt::ChunkKeyBytes(key_), [](std::string& v) { v.pop_back(); });
  ASSERT_TRUE(t);
  ExpectCorruption(ReadPayload(*t), "seq=3/layer=1/chunk=17", "length mismatch");
}

TEST_F(ColdTierCorruption, MetaInPayloadSlot) {
  std::string meta_value;
  {
    RawDb raw(dir_.path());
    ASSERT_TRUE(raw.ok());
    meta_value = raw.Get(fmt::kMetaColumn, fmt::ChunkKeyBytes(key_));
  }
  auto t = Damage(fmt::kPayloadColumn, fmt::ChunkKeyBytes(key_), [&](std::string& v) { v = meta_value; });
  ASSERT_TRUE(t);
  ExpectCorruption(ReadPayload(*t), "seq=3/layer=1/chunk=17", "chunk meta");
}

TEST_F(ColdTierCorruption, FlippedMetaByte) {
  auto t = Damage(fmt::kMetaColumn, fmt::ChunkKeyBytes(key_), [](std::string& v) { v.back() ^= 0x01; });
  ASSERT_TRUE(t);
  Status s = t->ForEachChunkMeta(3, [](const ChunkKey&, std::string_view) { return Status::Ok(); });
  ExpectCorruption(s, "cold tier: chunk seq=3/layer=1/chunk=17 meta", "checksum mismatch");
  // The payload itself is fine and the corrupt meta is left out of the counts.
  EXPECT_TRUE(ReadPayload(*t).ok());
  EXPECT_EQ(t->stored_chunks(), 1u);
}

TEST_F(ColdTierCorruption, FlippedBlobByte) {
  auto t = Damage(fmt::kBlobColumn, fmt::BlobKey(3, 1, "sinks"), [](std::string& v) { v[40] ^= 0x80; });
  ASSERT_TRUE(t);
  auto r = t->GetBlob(3, 1, "sinks");
  ASSERT_FALSE(r.ok());
  ExpectCorruption(r.status(), "cold tier: blob seq=3/layer=1/name=sinks", "checksum mismatch");
}

TEST_F(ColdTierCorruption, FlippedSequenceRecordByte) {
  auto t = Damage(fmt::kSequenceColumn, fmt::SequenceKey(3), [](std::string& v) { v.back() ^= 0x01; });
  ASSERT_TRUE(t);
  Status s = t->ForEachSequence([](SequenceId, std::string_view) { return Status::Ok(); });
  ExpectCorruption(s, "sequence 3 record", "checksum mismatch");
}

// ---- durability: SIGKILL after acknowledgement ------------------------------------------------------

constexpr size_t kKillPayload = 16384;
constexpr SequenceId kKillSeq = 7;

// Runs only as the child of SigkillKeepsAcknowledgedChunks (re-executed test
// binary): writes chunks and reports each acknowledged index on a pipe.
TEST(ColdTierChild, WriteUntilKilled) {
  const char* dir = std::getenv("KVTIER_COLD_CHILD_DIR");
  const char* fd_s = std::getenv("KVTIER_COLD_CHILD_FD");
  if (dir == nullptr || fd_s == nullptr) GTEST_SKIP() << "helper for ColdTierDurability";
  int fd = std::atoi(fd_s);
  auto t = MustOpen(Opts(dir));
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i < 100000; ++i) {
    std::string p = RandomBytes(kKillPayload, i);
    ChunkKey k{kKillSeq, static_cast<uint32_t>(i % 4), i};
    ASSERT_TRUE(t->PutChunk(k, std::string("m").append(std::to_string(i)), p.data(), p.size()).ok());
    ASSERT_EQ(write(fd, &i, sizeof i), static_cast<ssize_t>(sizeof i));
  }
}

TEST(ColdTierDurability, SigkillKeepsAcknowledgedChunks) {
  TempDir dir;
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  // Environment for the child, built before fork (exec only after it).
  std::vector<std::string> env_store;
  for (char** e = environ; *e; ++e) env_store.emplace_back(*e);
  env_store.push_back("KVTIER_COLD_CHILD_DIR=" + dir.path());
  env_store.push_back("KVTIER_COLD_CHILD_FD=" + std::to_string(fds[1]));
  std::vector<char*> envp;
  for (auto& s : env_store) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string filter = "--gtest_filter=ColdTierChild.WriteUntilKilled";
  char exe[] = "/proc/self/exe";
  char* argv[] = {exe, filter.data(), nullptr};

  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(fds[0]);
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
      dup2(devnull, 1);
      dup2(devnull, 2);
    }
    execve("/proc/self/exe", argv, envp.data());
    _exit(127);
  }
  close(fds[1]);
  uint64_t max_acked = 0, acked = 0;
  auto read_ack = [&](int timeout_ms) {
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) return false;
    uint64_t i;
    ssize_t r = read(fds[0], &i, sizeof i);
    if (r != static_cast<ssize_t>(sizeof i)) return false;
    EXPECT_EQ(i, acked);  // acknowledgements arrive in order
    max_acked = i;
    ++acked;
    return true;
  };
  while (acked < 300 && read_ack(30000)) {
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  while (read_ack(0)) {
  }  // acks written just before the kill
  close(fds[0]);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child exited early, status " << status;
  ASSERT_GE(acked, 300u);

  auto t = MustOpen(Opts(dir.path()));
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i <= max_acked; ++i) {
    Status s;
    std::string got = GetPayload(*t, {kKillSeq, static_cast<uint32_t>(i % 4), i}, kKillPayload, &s);
    ASSERT_TRUE(s.ok()) << "acknowledged chunk " << i << ": " << s.ToString();
    ASSERT_EQ(got, RandomBytes(kKillPayload, i)) << i;
  }
  // Whatever else made it is whole, and metas and payloads agree.
  uint64_t metas = 0;
  ASSERT_TRUE(t->ForEachChunkMeta(kKillSeq, [&](const ChunkKey& k, std::string_view m) {
                 ++metas;
                 EXPECT_EQ(m, std::string("m").append(std::to_string(k.index)));
                 Status s;
                 std::string got = GetPayload(*t, k, kKillPayload, &s);
                 EXPECT_TRUE(s.ok()) << s.ToString();
                 EXPECT_EQ(got, RandomBytes(kKillPayload, k.index));
                 return Status::Ok();
               }).ok());
  EXPECT_GE(metas, acked);
  EXPECT_LE(metas, acked + 1);  // at most the one in flight
  EXPECT_EQ(t->stored_chunks(), metas);
  EXPECT_EQ(t->stored_payload_bytes(), metas * kKillPayload);
}

}  // namespace
}  // namespace kvtier
