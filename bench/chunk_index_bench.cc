// Benchmarks of retrieval/chunk_index.h: Search latency per index kind.
//
//   BM_ChunkIndexSearch/dim:<dim>/n:<n>/kind:<kind>
//     dim  128 (2 kv heads x 64) or 1024 (8 kv heads x 128)
//     n    4K, 32K, 256K chunks
//     kind 0 = "Flat" (exact, the baseline), 1 = "HNSW32" (ef_search 64),
//          2 = "IVF<nlist>,Flat" with nprobe 16, nlist = 64 / 256 / 1024 for
//              4K / 32K / 256K so that FAISS's 39 x nlist training set fits
//     k = 64 for every search.
//   The 256K x 1024 HNSW32 and IVF1024 cases need KVTIER_BENCH_LARGE=1 (their
//   builds take tens of minutes on two cores); Flat at 256K x 1024 always runs.
//
// Data: chunk vectors (per-head unit norm, as ChunkVector makes them) drawn
// around n / 100 random centres with noise 1.3 x the centres' scale (about
// 37% of a vector's variance is its cluster; the same model as the HNSW
// recall test); probes are fresh draws around the same centres. Each (dim, n) data set and its indexes
// are built once (AddBatch) and shared by the three kinds; building is not
// timed by the benchmark (see the build_s counter).
//
// Counters, all measured in the same run:
//   recall@64  |returned ∩ Flat's top 64| / 64, mean over the probe set
//   x_flat     this kind's time per search / Flat's time per search, both
//              timed by their benchmark loops over the same probes
//
//   BM_ChunkIndexScoreAll/<dim>/<n>: ScoreAll (every chunk's exact score, for
//   the entropy cut-off) on the same data; x_flat against Flat's Search.
//   build_s    seconds to add the n vectors (IVF: including k-means training)
//   index_MiB  FaissVectorIndex::memory_bytes() (flat copy + FAISS structure)
#include <benchmark/benchmark.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "retrieval/faiss_index.h"

namespace {

using kvtier::FaissIndexOptions;
using kvtier::FaissVectorIndex;
using Clock = std::chrono::steady_clock;

constexpr int kK = 64;
constexpr size_t kPerCentre = 100;  // chunks per centre on average (n / 100 centres)
constexpr float kNoise = 1.3f;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int HeadDim(int dim) { return dim == 128 ? 64 : 128; }

// Rows [n, dim] around shared centres; blocks drawn in parallel, each with its
// own seeded generator so the data does not depend on the thread count.
std::vector<float> Draw(const std::vector<float>& centres, size_t n, int dim, uint32_t seed) {
  const int D = HeadDim(dim), H = dim / D;
  std::vector<float> out(n * dim);
  constexpr size_t kBlock = 1024;
  tbb::parallel_for(tbb::blocked_range<size_t>(0, (n + kBlock - 1) / kBlock), [&](const auto& r) {
    for (size_t blk = r.begin(); blk < r.end(); ++blk) {
      std::mt19937 rng(seed * 1000003u + static_cast<uint32_t>(blk));
      std::normal_distribution<float> g(0.0f, 1.0f);
      std::uniform_int_distribution<size_t> pick(0, centres.size() / dim - 1);
      for (size_t i = blk * kBlock; i < std::min(n, (blk + 1) * kBlock); ++i) {
        const float* c = centres.data() + pick(rng) * dim;
        float* v = out.data() + i * dim;
        for (int j = 0; j < dim; ++j) v[j] = c[j] + kNoise * g(rng);
        FaissVectorIndex::ProbeVector(v, H, D, v);
      }
    }
  });
  return out;
}

struct Built {
  std::unique_ptr<FaissVectorIndex> index;
  double build_s = 0, recall = 0;
};

// One (dim, n) data set, its Flat ground truth, and the indexes built so far.
struct DataSet {
  int dim = 0;
  size_t n = 0;
  size_t queries = 0;
  std::vector<float> vecs, probes;
  std::vector<uint64_t> ids;
  std::vector<std::set<uint64_t>> truth;  // Flat's top 64 per probe
  double flat_s_per_search = 0;           // Flat, timed while computing the truth
  double flat_loop_s = 0;                 // Flat, timed by its benchmark loop
  std::map<int, Built> kinds;
};

std::string Factory(int kind, size_t n) {
  if (kind == 0) return "Flat";
  if (kind == 1) return "HNSW32";
  const int nlist = n <= 4096 ? 64 : n <= 32768 ? 256 : 1024;
  return "IVF" + std::to_string(nlist) + ",Flat";
}

Built& Get(DataSet& ds, int kind) {
  auto it = ds.kinds.find(kind);
  if (it != ds.kinds.end()) return it->second;
  FaissIndexOptions o;
  o.factory = Factory(kind, ds.n);
  o.ivf_nprobe = 16;
  o.hnsw_ef_search = 64;
  auto created = FaissVectorIndex::Create(ds.dim, o);
  if (!created.ok()) {
    std::fprintf(stderr, "FaissVectorIndex::Create: %s\n", created.status().ToString().c_str());
    std::abort();
  }
  Built b;
  b.index = std::move(created).value();
  const auto t0 = Clock::now();
  kvtier::Status st = b.index->AddBatch(ds.n, ds.ids.data(), ds.vecs.data());
  b.build_s = Seconds(t0, Clock::now());
  if (!st.ok()) {
    std::fprintf(stderr, "AddBatch: %s\n", st.ToString().c_str());
    std::abort();
  }
  std::vector<uint64_t> got;
  size_t hit = 0;
  if (kind == 0) {  // Flat is the ground truth; time it while at it
    ds.truth.assign(ds.queries, {});
    const auto t1 = Clock::now();
    for (size_t q = 0; q < ds.queries; ++q) {
      b.index->Search(ds.probes.data() + q * ds.dim, kK, &got, nullptr).IgnoreError();
      ds.truth[q].insert(got.begin(), got.end());
    }
    ds.flat_s_per_search = Seconds(t1, Clock::now()) / static_cast<double>(ds.queries);
  }
  for (size_t q = 0; q < ds.queries; ++q) {
    b.index->Search(ds.probes.data() + q * ds.dim, kK, &got, nullptr).IgnoreError();
    for (uint64_t id : got) hit += ds.truth[q].count(id);
  }
  b.recall = static_cast<double>(hit) / static_cast<double>(ds.queries * kK);
  return ds.kinds.emplace(kind, std::move(b)).first->second;
}

// Only the current (dim, n) is kept: the 256K x 1024 set alone is ~1 GiB of
// vectors plus ~2 GiB per index kind.
DataSet& GetDataSet(int dim, size_t n) {
  static std::unique_ptr<DataSet> current;
  if (current && current->dim == dim && current->n == n) return *current;
  current.reset();
  auto ds = std::make_unique<DataSet>();
  ds->dim = dim;
  ds->n = n;
  ds->queries =
      static_cast<size_t>(dim) * n >= (size_t{1} << 27) ? 32 : 64;  // Flat truth costs n*dim per probe
  std::vector<float> centres(std::max<size_t>(1, n / kPerCentre) * dim);
  std::mt19937 rng(static_cast<uint32_t>(dim));
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (float& c : centres) c = g(rng);
  ds->vecs = Draw(centres, n, dim, 1);
  ds->probes = Draw(centres, ds->queries, dim, 2);
  ds->ids.resize(n);
  std::iota(ds->ids.begin(), ds->ids.end(), uint64_t{0});
  current = std::move(ds);
  Get(*current, 0);  // ground truth and the Flat baseline first
  return *current;
}

// Time per call of fn(q) over the probes, in the benchmark loop.
template <typename Fn>
double Loop(benchmark::State& state, const DataSet& ds, Fn fn) {
  size_t q = 0;
  const auto t0 = Clock::now();
  for (auto _ : state) {
    fn(ds.probes.data() + (q % ds.queries) * ds.dim);
    ++q;
  }
  return Seconds(t0, Clock::now()) / static_cast<double>(std::max<size_t>(q, 1));
}

// x_flat divides by the Flat benchmark's own loop time when it ran (it runs
// first for each data set), else by Flat's time while computing the truth.
double FlatSeconds(const DataSet& ds) { return ds.flat_loop_s > 0 ? ds.flat_loop_s : ds.flat_s_per_search; }

void BM_ChunkIndexSearch(benchmark::State& state, int dim, size_t n, int kind) {
  DataSet& ds = GetDataSet(dim, n);
  Built& b = Get(ds, kind);
  std::vector<uint64_t> ids;
  std::vector<float> scores;
  const double per_search = Loop(state, ds, [&](const float* probe) {
    b.index->Search(probe, kK, &ids, &scores).IgnoreError();
    benchmark::DoNotOptimize(ids.data());
  });
  if (kind == 0) ds.flat_loop_s = per_search;
  state.SetLabel(b.index->factory());
  state.counters["recall@64"] = b.recall;
  state.counters["x_flat"] = per_search / FlatSeconds(ds);
  state.counters["build_s"] = b.build_s;
  state.counters["index_MiB"] = static_cast<double>(b.index->memory_bytes()) / (1 << 20);
}

// ScoreAll (every chunk's exact score, what the entropy cut-off needs) over
// the Flat index's copy: TBB-parallel native dot products, no top-k.
void BM_ChunkIndexScoreAll(benchmark::State& state, int dim, size_t n) {
  DataSet& ds = GetDataSet(dim, n);
  Built& b = Get(ds, 0);
  std::vector<uint64_t> ids;
  std::vector<float> scores;
  const double per_call = Loop(state, ds, [&](const float* probe) {
    b.index->ScoreAll(probe, &ids, &scores).IgnoreError();
    benchmark::DoNotOptimize(scores.data());
  });
  state.counters["x_flat"] = per_call / FlatSeconds(ds);
}

// Registered per data set, Search kinds then ScoreAll, so each (dim, n) is
// generated and indexed once. Building HNSW32 / IVF1024 over 256K x 1024
// takes tens of minutes on a 2-core machine (HNSW32 over 256K x 128 alone
// took ~3 min there), so those two run only with KVTIER_BENCH_LARGE=1.
// Per-call times range from tens of microseconds to ~0.2 s (Flat, 256K x
// 1024); the short minimum time keeps the large cases to a few iterations.
const bool kRegistered = [] {
  const char* large = std::getenv("KVTIER_BENCH_LARGE");
  const bool all = large != nullptr && std::string(large) != "0" && std::string(large) != "";
  for (int dim : {128, 1024})
    for (size_t n : {size_t{4096}, size_t{32768}, size_t{262144}}) {
      const std::string shape = "/dim:" + std::to_string(dim) + "/n:" + std::to_string(n);
      for (int kind : {0, 1, 2}) {
        if (!all && kind != 0 && n >= 262144 && dim >= 1024) continue;
        benchmark::RegisterBenchmark(
            ("BM_ChunkIndexSearch" + shape + "/kind:" + std::to_string(kind)).c_str(), BM_ChunkIndexSearch,
            dim, n, kind)
            ->Unit(benchmark::kMicrosecond)
            ->MinTime(0.2)
            ->UseRealTime();
      }
      benchmark::RegisterBenchmark(("BM_ChunkIndexScoreAll" + shape).c_str(), BM_ChunkIndexScoreAll, dim, n)
          ->Unit(benchmark::kMicrosecond)
          ->MinTime(0.2)
          ->UseRealTime();
    }
  return true;
}();

}  // namespace
