// The Exact index's int8 screen (retrieval/exact_index.h) as a decode step runs it: one probe
// against each of 8 layers' indexes in turn, at `kvtier run`'s geometry (2 kv heads of 64, fp16
// keys, 4 representatives a chunk).
//
//   BM_ExactScreen/chunks:<n>    ExactChunkIndex::Screen of the 8 indexes of n chunks each
//                                (1,024 chunks: 32K tokens; 4,096: 128K; 32,768: 1M)
//   BM_ExactScreenInt4/chunks:<n> the same with "Exact:heads=max,screen=int4": the 4-bit
//                                first stage alone (its GB/s counts its own bytes, 320 a chunk
//                                and layer)
//   BM_ExactScreenRead/chunks:<n> the int8 screen's bytes of codes and scales, read and summed on
//                                every core and nothing else: the memory's ceiling for them
//
//   BM_ShortlistRescore/chunks:<n>/gathered:0  ExactChunkIndex::ScoreChunks of 192 chunks a
//                                layer (three times a grant of 64, the shortlist a reused
//                                search rescores), other chunks each iteration
//   BM_ShortlistRescore/chunks:<n>/gathered:1  the same 192 chunks a layer gathered once
//                                (GatherSubset) and scored as a ChunkSubset, as steps that reuse
//                                a search score them
//
// Counters: GB/s = bytes of codes and scales a screen reads (576 a chunk and layer) per second
// of wall time, in both, so the screen's figure reads directly against the ceiling measured
// in the same run.
#include <benchmark/benchmark.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "bench/exact_layers.h"
#include "retrieval/exact_index.h"

namespace {

using kvtier::ChunkScores;
using kvtier::ChunkShape;
using kvtier::ExactChunkIndex;

constexpr int kLayers = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 64;
constexpr int kRepr = 4;

// Codes (one byte an element) and the two fp32 scales of each representative.
double ScreenBytes(size_t chunks) {
  return static_cast<double>(kLayers) * chunks * kKvHeads * kRepr * (kHeadDim + 8);
}

// 4-bit codes (half a byte an element) and the two fp32 scales of each representative.
double Int4ScreenBytes(size_t chunks) {
  return static_cast<double>(kLayers) * chunks * kKvHeads * kRepr * (kHeadDim / 2 + 8);
}

const kvtier::bench::ExactLayers* GetLayers(size_t chunks, const char* spec = "Exact:heads=max") {
  return kvtier::bench::RandomExactLayers(kLayers, ChunkShape{kKvHeads, kHeadDim, kRepr, kvtier::DType::kF16},
                                          chunks, spec);
}

// One decode step's screen over every layer's index of `spec`, reading `bytes` a step.
void RunScreen(benchmark::State& state, const char* spec, double (*bytes)(size_t chunks)) {
  const size_t chunks = static_cast<size_t>(state.range(0));
  const kvtier::bench::ExactLayers* layers = GetLayers(chunks, spec);
  if (layers == nullptr) return state.SkipWithError("building the indexes failed");
  std::vector<ChunkScores> scores(kLayers);
  for (auto _ : state) {
    for (int l = 0; l < kLayers; ++l)
      if (!layers->index[l]->Screen(layers->probe.data(), &scores[l]).ok())
        return state.SkipWithError("Screen failed");
    benchmark::DoNotOptimize(scores.data());
  }
  state.counters["GB/s"] =
      benchmark::Counter(bytes(chunks) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}

void BM_ExactScreen(benchmark::State& state) { RunScreen(state, "Exact:heads=max", ScreenBytes); }

void BM_ExactScreenInt4(benchmark::State& state) {
  RunScreen(state, "Exact:heads=max,screen=int4", Int4ScreenBytes);
}

void BM_ExactScreenRead(benchmark::State& state) {
  const size_t chunks = static_cast<size_t>(state.range(0));
  const size_t words = static_cast<size_t>(ScreenBytes(chunks) / kLayers) / sizeof(uint64_t);
  std::vector<std::vector<uint64_t>> bytes(kLayers, std::vector<uint64_t>(words, 1));
  const int parts = tbb::this_task_arena::max_concurrency();
  std::vector<uint64_t> sums(static_cast<size_t>(parts) * 8);  // a cache line per part
  for (auto _ : state) {
    for (int l = 0; l < kLayers; ++l) {
      const uint64_t* src = bytes[l].data();
      tbb::parallel_for(
          tbb::blocked_range<int>(0, parts, 1),
          [&](const tbb::blocked_range<int>& r) {
            for (int i = r.begin(); i < r.end(); ++i) {
              const size_t a = words * i / parts, b = words * (i + 1) / parts;
              uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
              size_t w = a;
              for (; w + 4 <= b; w += 4) s0 += src[w], s1 += src[w + 1], s2 += src[w + 2], s3 += src[w + 3];
              for (; w < b; ++w) s0 += src[w];
              sums[static_cast<size_t>(i) * 8] += s0 + s1 + s2 + s3;
            }
          },
          tbb::simple_partitioner());
    }
    benchmark::DoNotOptimize(sums.data());
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] =
      benchmark::Counter(ScreenBytes(chunks) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}

void BM_ShortlistRescore(benchmark::State& state) {
  const size_t chunks = static_cast<size_t>(state.range(0));
  const bool gathered = state.range(1) != 0;
  const kvtier::bench::ExactLayers* layers = GetLayers(chunks);
  if (layers == nullptr) return state.SkipWithError("building the indexes failed");
  constexpr size_t kShortlist = 192;
  // Distinct shortlists, so that the caches do not keep one (scattered rows), or one a layer
  // gathered once (what the steps that reuse a search score again and again).
  const size_t lists_a_layer = gathered ? 1 : 64;
  std::mt19937 rng(7);
  std::vector<std::vector<uint64_t>> lists(lists_a_layer * kLayers);
  std::vector<std::unique_ptr<kvtier::ChunkSubset>> subsets(lists.size());
  for (size_t i = 0; i < lists.size(); ++i) {
    std::uniform_int_distribution<uint64_t> pick(0, chunks - 1);
    for (size_t j = 0; j < kShortlist; ++j) lists[i].push_back(pick(rng));
    if (gathered && !layers->index[i % kLayers]->GatherSubset(lists[i], &subsets[i]).ok())
      return state.SkipWithError("GatherSubset failed");
  }
  ChunkScores scores;
  size_t next = 0;
  for (auto _ : state) {
    for (int l = 0; l < kLayers; ++l) {
      const kvtier::Status st =
          gathered ? subsets[next]->Score(layers->probe.data(), &scores)
                   : layers->index[l]->ScoreChunks(layers->probe.data(), lists[next], &scores);
      if (!st.ok()) return state.SkipWithError("scoring failed");
      next = (next + 1) % lists.size();
    }
    benchmark::DoNotOptimize(scores.logit.data());
  }
  state.counters["chunks/s"] = benchmark::Counter(
      static_cast<double>(kLayers * kShortlist) * state.iterations(), benchmark::Counter::kIsRate);
}

BENCHMARK(BM_ExactScreen)
    ->ArgName("chunks")
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(32768)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ExactScreenInt4)
    ->ArgName("chunks")
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(32768)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ExactScreenRead)
    ->ArgName("chunks")
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(32768)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_ShortlistRescore)
    ->ArgNames({"chunks", "gathered"})
    ->ArgsProduct({{4096, 32768}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
