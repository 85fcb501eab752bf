// Cold tier throughput: RocksDB PutChunk / GetChunk of chunk-sized values
// (16 KiB, 64 KiB, 256 KiB) with none / lz4 / zstd, next to a plain memcpy of
// the same bytes and CRC-32C, so ratios can be read off one run.
// bytes_per_second counts payload bytes. Two contents:
//   noise  fp16 Gaussian noise, what KV looks like: sign and exponent bits
//          compress, mantissas do not (zstd alone gets ~0.92, lz4 ~1.0, which
//          RocksDB rejects: it keeps a block raw unless it shrinks by 1/8).
//   q16    Gaussian rounded to a 1/16 grid, in fp16 (int8-like quantized KV):
//          half-compressible (zstd ~0.5, lz4 ~0.87).
//
//   ColdTier/Put/<comp>/<content>/<bytes>
//                                 PutChunk, WAL on (no fsync), cycling over a
//                                 64 MiB key set (overwrites): includes the
//                                 flush/compaction the writes cause (real time).
//   ColdTier/PutSync/lz4/noise/65536  same with sync_writes (fsync per chunk).
//   ColdTier/Get/<comp>/<content>/<bytes>
//                                 GetChunk from SST files (64 MiB written,
//                                 closed, reopened: recovery flushes), random
//                                 order; payload reads bypass the block cache,
//                                 so this is OS page cache + decompress + CRC +
//                                 copy. Counter disk_ratio = SST bytes / payload bytes.
//   Memcpy/<bytes>                memcpy of the same payloads (same buffer pool).
//   Crc32c/<hw|sw>/<bytes>        the checksum alone.
//   ColdTier/Open/<readonly|readwrite>/<wal|tables>
//                                 opening a store of 2,048 acknowledged 16 KiB chunks,
//                                 all in its WAL or all in tables, from a fresh copy of the
//                                 directory each time (the copy is not timed). readonly is
//                                 what every read-write open of an existing store runs first
//                                 (the check that refuses without changing anything), so
//                                 readonly / readwrite is that check's share of an open.
//
// Every database lives under /tmp/kvtier_cold_bench_XXXXXX and is removed
// when its benchmark ends.
#include <benchmark/benchmark.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "offload/cold_tier.h"
#include "store/checksum.h"

namespace kvtier {
namespace {

namespace fs = std::filesystem;

constexpr size_t kWorkingSet = 64u << 20;  // bytes of distinct chunks per benchmark
constexpr int kPool = 16;                  // distinct payload buffers

class BenchDir {
 public:
  BenchDir() {
    char tmpl[] = "/tmp/kvtier_cold_bench_XXXXXX";
    char* p = mkdtemp(tmpl);
    if (p) path_ = p;
  }
  ~BenchDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  uint64_t SstBytes() const {
    uint64_t n = 0;
    std::error_code ec;
    for (auto& e : fs::directory_iterator(path_, ec))
      if (e.path().extension() == ".sst") n += e.file_size(ec);
    return n;
  }

 private:
  std::string path_;
};

enum class Content { kNoise, kQ16 };
const char* ContentName(Content c) { return c == Content::kNoise ? "noise" : "q16"; }

std::vector<std::string> Fp16Pool(size_t bytes, Content content = Content::kNoise) {
  std::vector<std::string> pool;
  std::mt19937_64 rng(1234);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> f(bytes / 2);
  for (int i = 0; i < kPool; ++i) {
    for (float& x : f) {
      x = dist(rng);
      if (content == Content::kQ16) x = std::nearbyint(x * 16.f) / 16.f;
    }
    std::string s(bytes, '\0');
    FromFloat(DType::kF16, f.data(), s.data(), f.size());
    pool.push_back(std::move(s));
  }
  return pool;
}

std::unique_ptr<ColdTier> OpenOrSkip(benchmark::State& state, const std::string& path, Compression c,
                                     bool sync = false) {
  ColdTierOptions o;
  o.path = path;
  o.compression = c;
  o.sync_writes = sync;
  auto r = ColdTier::Open(o);
  if (!r.ok()) {
    state.SkipWithError(r.status().ToString().c_str());
    return nullptr;
  }
  return std::move(r).value();
}

void BM_Put(benchmark::State& state, Compression c, Content content, size_t bytes, bool sync) {
  BenchDir dir;
  auto pool = Fp16Pool(bytes, content);
  auto tier = OpenOrSkip(state, dir.path(), c, sync);
  if (!tier) return;
  const uint64_t keys = std::max<uint64_t>(1, kWorkingSet / bytes);
  const std::string meta(64, 'm');
  uint64_t i = 0;
  for (auto _ : state) {
    ChunkKey k{1, static_cast<uint32_t>(i % 32), i % keys};
    Status s = tier->PutChunk(k, meta, pool[i % kPool].data(), bytes);
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    ++i;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  tier.reset();
}

void BM_Get(benchmark::State& state, Compression c, Content content, size_t bytes) {
  BenchDir dir;
  auto pool = Fp16Pool(bytes, content);
  const uint64_t keys = std::max<uint64_t>(1, kWorkingSet / bytes);
  {
    auto tier = OpenOrSkip(state, dir.path(), c);
    if (!tier) return;
    for (uint64_t i = 0; i < keys; ++i) {
      Status s = tier->PutChunk({1, static_cast<uint32_t>(i % 32), i}, "meta", pool[i % kPool].data(), bytes);
      if (!s.ok()) {
        state.SkipWithError(s.ToString().c_str());
        return;
      }
    }
  }
  auto tier = OpenOrSkip(state, dir.path(), c);  // recovery flushes the memtables to SSTs
  if (!tier) return;
  std::vector<uint64_t> order(keys);
  for (uint64_t i = 0; i < keys; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(99));
  std::string dst(bytes, '\0');
  uint64_t i = 0;
  for (auto _ : state) {
    uint64_t idx = order[i % keys];
    Status s = tier->GetChunk({1, static_cast<uint32_t>(idx % 32), idx}, dst.data(), bytes);
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(dst.data());
    ++i;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  state.counters["disk_ratio"] = static_cast<double>(dir.SstBytes()) / static_cast<double>(keys * bytes);
  // Spot check: what came back is what went in.
  Status s = tier->GetChunk({1, 0, 0}, dst.data(), bytes);
  if (!s.ok() || dst != pool[0]) state.SkipWithError("read back differs from what was written");
}

void BM_Memcpy(benchmark::State& state, size_t bytes) {
  auto pool = Fp16Pool(bytes);
  std::string dst(bytes, '\0');
  uint64_t i = 0;
  for (auto _ : state) {
    std::memcpy(dst.data(), pool[i++ % kPool].data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

void BM_Crc(benchmark::State& state, bool hw, size_t bytes) {
  auto pool = Fp16Pool(bytes);
  uint64_t i = 0;
  for (auto _ : state) {
    const std::string& p = pool[i++ % kPool];
    uint32_t c = hw ? Crc32c(p.data(), bytes) : Crc32cSoftware(p.data(), bytes);
    benchmark::DoNotOptimize(c);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

// A store of 2,048 acknowledged 16 KiB chunks in `dir`: in the WAL (`in_tables` false: the
// tier is destroyed without a flush, as a crash leaves it) or in tables (reopened once).
Status MakeOpenBenchStore(const std::string& dir, bool in_tables) {
  constexpr size_t kBytes = 16u << 10;
  auto pool = Fp16Pool(kBytes);
  {
    ColdTierOptions o;
    o.path = dir;
    KVTIER_ASSIGN_OR_RETURN(auto tier, ColdTier::Open(o));
    KVTIER_RETURN_IF_ERROR(tier->PutSequence(1, "sequence 1"));
    for (uint64_t i = 0; i < 2048; ++i)
      KVTIER_RETURN_IF_ERROR(
          tier->PutChunk({1, static_cast<uint32_t>(i % 32), i / 32}, "meta", pool[i % kPool].data(), kBytes));
  }
  if (in_tables) {
    ColdTierOptions o;
    o.path = dir;
    KVTIER_ASSIGN_OR_RETURN(auto tier, ColdTier::Open(o));  // the open flushes what it replayed
  }
  return Status::Ok();
}

void BM_Open(benchmark::State& state, bool read_only, bool in_tables) {
  BenchDir pristine, work;
  Status st = MakeOpenBenchStore(pristine.path(), in_tables);
  if (!st.ok()) {
    state.SkipWithError(st.ToString().c_str());
    return;
  }
  const std::string dir = work.path() + "/store";
  for (auto _ : state) {
    state.PauseTiming();
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::copy(pristine.path(), dir, fs::copy_options::recursive, ec);
    if (ec) {
      state.SkipWithError(ec.message().c_str());
      break;
    }
    state.ResumeTiming();
    ColdTierOptions o;
    o.path = dir;
    o.read_only = read_only;
    auto tier = ColdTier::Open(o);
    if (!tier.ok() || CountChunks((*tier)->AcknowledgedChunks()) != 2048) {
      state.SkipWithError(tier.ok() ? "not every chunk is acknowledged" : tier.status().ToString().c_str());
      break;
    }
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  const size_t sizes[] = {16u << 10, 64u << 10, 256u << 10};
  const Compression comps[] = {Compression::kNone, Compression::kLZ4, Compression::kZSTD};
  for (size_t b : sizes) {
    const std::string sb = std::to_string(b);
    benchmark::RegisterBenchmark(("Memcpy/" + sb).c_str(), [b](benchmark::State& s) { BM_Memcpy(s, b); });
    benchmark::RegisterBenchmark(("Crc32c/" + std::string(Crc32cIsHardware() ? "hw/" : "sw/") + sb).c_str(),
                                 [b](benchmark::State& s) { BM_Crc(s, true, b); });
    benchmark::RegisterBenchmark(("Crc32c/slice8/" + sb).c_str(),
                                 [b](benchmark::State& s) { BM_Crc(s, false, b); });
    for (Content content : {Content::kNoise, Content::kQ16}) {
      for (Compression c : comps) {
        const std::string name = std::string(CompressionName(c)) + "/" + ContentName(content) + "/" + sb;
        benchmark::RegisterBenchmark(
            ("ColdTier/Put/" + name).c_str(),
            [c, content, b](benchmark::State& s) { BM_Put(s, c, content, b, false); })
            ->UseRealTime()
            ->MinTime(1.0);
        benchmark::RegisterBenchmark(("ColdTier/Get/" + name).c_str(), [c, content, b](benchmark::State& s) {
          BM_Get(s, c, content, b);
        })->UseRealTime();
      }
    }
  }
  for (bool in_tables : {false, true})
    for (bool read_only : {true, false})
      benchmark::RegisterBenchmark(
          ("ColdTier/Open/" + std::string(read_only ? "readonly/" : "readwrite/") +
           (in_tables ? "tables" : "wal"))
              .c_str(),
          [read_only, in_tables](benchmark::State& s) { BM_Open(s, read_only, in_tables); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(
      "ColdTier/PutSync/lz4/noise/65536",
      [](benchmark::State& s) { BM_Put(s, Compression::kLZ4, Content::kNoise, 64u << 10, true); })
      ->UseRealTime()
      ->MinTime(1.0);
  return true;
}();

}  // namespace
}  // namespace kvtier
