// Remote tier throughput (Redis, offload/remote_tier.h) against the local RocksDB cold
// tier, on chunks of 16 KiB (kvtier run's default chunk: 32 tokens x 2 kv heads x 64 x
// fp16, K and V), in batches of 32 (one pipelined round trip per node), so ratios can be
// read off one run. scripts/remote_bench.sh starts the server, sets KVTIER_BENCH_REDIS,
// runs redis-benchmark on the same server with the same value size and pipeline depth,
// and prints every ratio.
//
//   RemoteTier/Put/<bytes>   PutChunks of 32 chunks (framing + CRC-32C + SET), items = chunks
//   RemoteTier/Get/<bytes>   GetChunks of 32 chunks out of 2048 written (GET + verify + copy)
//   LocalColdTier/Put/<bytes>, LocalColdTier/Get/<bytes>
//                            the same chunks through ColdTier (RocksDB, lz4 as the store's
//                            default, WAL on, no fsync), 32 per iteration, one at a time
//                            (ColdTier has no batch API; RocksDB is in-process)
//
// Without KVTIER_BENCH_REDIS the remote benchmarks skip with a message.
#include <benchmark/benchmark.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "offload/cold_tier.h"
#include "offload/remote_tier.h"

namespace kvtier {
namespace {

constexpr int kBatch = 32;
constexpr uint64_t kKeys = 2048;

std::vector<std::vector<uint8_t>> Payloads(size_t bytes) {
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint8_t>> p(8, std::vector<uint8_t>(bytes));
  for (auto& v : p)
    for (auto& b : v) b = static_cast<uint8_t>(rng());
  return p;
}

std::unique_ptr<RemoteTier> OpenRemote(benchmark::State& state) {
  const char* spec = std::getenv("KVTIER_BENCH_REDIS");
  if (spec == nullptr) {
    state.SkipWithError("set KVTIER_BENCH_REDIS=redis://host:port (scripts/remote_bench.sh does)");
    return nullptr;
  }
  auto o = ParseRemoteSpec(std::string(spec) + (std::strchr(spec, '?') ? "&" : "?") + "ns=bench");
  if (!o.ok()) {
    state.SkipWithError(o.status().ToString().c_str());
    return nullptr;
  }
  auto t = RemoteTier::Open(*o);
  if (!t.ok()) {
    state.SkipWithError(t.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*t);
}

void BM_RemotePut(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  auto tier = OpenRemote(state);
  if (!tier) return;
  const auto payloads = Payloads(bytes);
  uint64_t next = 0;
  std::vector<RemoteTier::Put> puts(kBatch);
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i, ++next) {
      puts[i].key = ChunkKey{1, 0, next % kKeys};
      puts[i].meta = "meta";
      puts[i].payload = payloads[next % payloads.size()].data();
      puts[i].payload_bytes = bytes;
    }
    Status st = tier->PutChunks(&puts);
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
  state.SetBytesProcessed(state.iterations() * kBatch * static_cast<int64_t>(bytes));
}

void BM_RemoteGet(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  auto tier = OpenRemote(state);
  if (!tier) return;
  const auto payloads = Payloads(bytes);
  for (uint64_t i = 0; i < kKeys; ++i)
    if (!tier->PutChunk({2, 0, i}, "meta", payloads[i % payloads.size()].data(), bytes).ok()) {
      state.SkipWithError("populating the keys failed");
      return;
    }
  std::vector<std::vector<uint8_t>> out(kBatch, std::vector<uint8_t>(bytes));
  std::vector<RemoteTier::Get> gets(kBatch);
  std::mt19937_64 rng(3);
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) {
      gets[i].ref.key = ChunkKey{2, 0, rng() % kKeys};
      gets[i].dst = out[i].data();
      gets[i].payload_bytes = bytes;
    }
    Status st = tier->GetChunks(&gets);
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
  state.SetBytesProcessed(state.iterations() * kBatch * static_cast<int64_t>(bytes));
}

struct ColdBench {
  std::string dir;
  std::unique_ptr<ColdTier> cold;
  explicit ColdBench(benchmark::State& state) {
    char tmpl[] = "/tmp/kvtier_remote_bench_XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      state.SkipWithError("mkdtemp failed");
      return;
    }
    dir = tmpl;
    ColdTierOptions o;
    o.path = dir;
    auto c = ColdTier::Open(o);
    if (!c.ok()) {
      state.SkipWithError(c.status().ToString().c_str());
      return;
    }
    cold = std::move(*c);
  }
  ~ColdBench() {
    cold.reset();
    std::error_code ec;
    if (!dir.empty()) std::filesystem::remove_all(dir, ec);
  }
};

void BM_LocalColdPut(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  ColdBench b(state);
  if (!b.cold) return;
  const auto payloads = Payloads(bytes);
  uint64_t next = 0;
  for (auto _ : state)
    for (int i = 0; i < kBatch; ++i, ++next)
      if (!b.cold->PutChunk({1, 0, next % kKeys}, "meta", payloads[next % payloads.size()].data(), bytes)
               .ok()) {
        state.SkipWithError("PutChunk failed");
        return;
      }
  state.SetItemsProcessed(state.iterations() * kBatch);
  state.SetBytesProcessed(state.iterations() * kBatch * static_cast<int64_t>(bytes));
}

void BM_LocalColdGet(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  ColdBench b(state);
  if (!b.cold) return;
  const auto payloads = Payloads(bytes);
  for (uint64_t i = 0; i < kKeys; ++i)
    if (!b.cold->PutChunk({2, 0, i}, "meta", payloads[i % payloads.size()].data(), bytes).ok()) {
      state.SkipWithError("populating the keys failed");
      return;
    }
  std::vector<uint8_t> out(bytes);
  std::mt19937_64 rng(3);
  for (auto _ : state)
    for (int i = 0; i < kBatch; ++i)
      if (!b.cold->GetChunk({2, 0, rng() % kKeys}, out.data(), bytes).ok()) {
        state.SkipWithError("GetChunk failed");
        return;
      }
  state.SetItemsProcessed(state.iterations() * kBatch);
  state.SetBytesProcessed(state.iterations() * kBatch * static_cast<int64_t>(bytes));
}

BENCHMARK(BM_RemotePut)->Name("RemoteTier/Put")->Arg(16384)->UseRealTime();
BENCHMARK(BM_RemoteGet)->Name("RemoteTier/Get")->Arg(16384)->UseRealTime();
BENCHMARK(BM_LocalColdPut)->Name("LocalColdTier/Put")->Arg(16384)->UseRealTime();
BENCHMARK(BM_LocalColdGet)->Name("LocalColdTier/Get")->Arg(16384)->UseRealTime();

}  // namespace
}  // namespace kvtier
