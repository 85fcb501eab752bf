// Warm tier: storing chunks (Append sealing into warm slabs) and fetching
// them back into hot slots, each against a plain memcpy of the same bytes
// measured in the same iteration. `ratio_vs_memcpy` = kvtier time / memcpy
// time (1.0 = as fast as copying the bytes).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "integration/pattern.h"
#include "offload/tiered_store.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;

StoreOptions BenchOptions(int head_dim) {
  StoreOptions o;
  o.geometry = Geometry{1, 8, 2, head_dim, DType::kF16};
  o.n_sink = 64;
  o.n_local = 512;
  o.chunk_size = 32;
  o.warm_bytes = 1ull << 30;
  o.hot_bytes = 256 * o.chunk_bytes();
  o.data_dir = "";  // warm only: this measures the warm tier, not RocksDB
  return o;
}

void BM_WarmStore(benchmark::State& state) {
  const StoreOptions o = BenchOptions(static_cast<int>(state.range(0)));
  const size_t tb = o.geometry.token_elems() * 2;
  const int tokens = 64 * 1024;
  std::vector<uint8_t> k(tokens * tb), v(tokens * tb), dst(2 * tokens * tb);
  FillPattern(1, 1, 0, 0, 0, tokens, tb, k.data());
  FillPattern(1, 1, 0, 1, 0, tokens, tb, v.data());
  double store_s = 0, copy_s = 0;
  // One store for all iterations, a fresh sequence each time: steady state,
  // warm slabs already faulted in (first-touch page faults are not the tier's cost).
  auto s = TieredStore::Open(o);
  for (auto _ : state) {
    auto seq = (*s)->CreateSequence();
    auto t0 = Clock::now();
    for (int p = 0; p < tokens; p += 256)
      if (!(*s)->Append(*seq, 0, k.data() + p * tb, v.data() + p * tb, 256, DType::kF16).ok())
        state.SkipWithError("append");
    auto t1 = Clock::now();
    std::memcpy(dst.data(), k.data(), k.size());
    std::memcpy(dst.data() + k.size(), v.data(), v.size());
    benchmark::DoNotOptimize(dst.data());
    auto t2 = Clock::now();
    store_s += std::chrono::duration<double>(t1 - t0).count();
    copy_s += std::chrono::duration<double>(t2 - t1).count();
    if (!(*s)->DropSequence(*seq).ok()) state.SkipWithError("drop");
  }
  state.SetBytesProcessed(state.iterations() * 2 * tokens * tb);
  state.counters["ratio_vs_memcpy"] = store_s / copy_s;
}
BENCHMARK(BM_WarmStore)->Arg(64)->Arg(128)->Unit(benchmark::kMillisecond);

void BM_WarmFetch(benchmark::State& state) {
  StoreOptions o = BenchOptions(static_cast<int>(state.range(0)));
  const int fetch = 64;  // a 2048-token budget
  o.hot_bytes = fetch * o.chunk_bytes();
  const size_t tb = o.geometry.token_elems() * 2;
  const int tokens = 64 + 512 + 32 * 1024;
  std::vector<uint8_t> k(tokens * tb), v(tokens * tb);
  FillPattern(1, 1, 0, 0, 0, tokens, tb, k.data());
  FillPattern(1, 1, 0, 1, 0, tokens, tb, v.data());
  auto s = TieredStore::Open(o);
  auto seq = (*s)->CreateSequence();
  if (!(*s)->Append(*seq, 0, k.data(), v.data(), tokens, DType::kF16).ok()) state.SkipWithError("append");
  const uint64_t n_chunks = *(*s)->ChunkCount(*seq, 0);
  std::vector<uint8_t> src(fetch * o.chunk_bytes()), dst(src.size());
  double fetch_s = 0, copy_s = 0;
  uint64_t base = 0;
  for (auto _ : state) {
    std::vector<uint64_t> idx(fetch);
    for (int i = 0; i < fetch; ++i) idx[i] = (base + i * 7) % n_chunks;  // every fetch misses the hot tier
    base += fetch * 7 + 1;
    auto t0 = Clock::now();
    auto h = (*s)->FetchChunks(*seq, 0, idx);
    if (!h.ok() || !h->Wait().ok()) state.SkipWithError("fetch");
    auto t1 = Clock::now();
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::DoNotOptimize(dst.data());
    auto t2 = Clock::now();
    fetch_s += std::chrono::duration<double>(t1 - t0).count();
    copy_s += std::chrono::duration<double>(t2 - t1).count();
  }
  state.SetBytesProcessed(state.iterations() * fetch * o.chunk_bytes());
  state.counters["ratio_vs_memcpy"] = fetch_s / copy_s;
}
BENCHMARK(BM_WarmFetch)->Arg(64)->Arg(128)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvtier
