// A decode step's search at the trained model's geometry (`kvtier infinite` with
// models/kvtier-tiny.safetensors at 32K: 4 layers, 2 kv heads of 16, fp32 keys, every key of a
// 32-token chunk a representative, about 1,024 chunks a layer), on one thread, the layers in
// turn so that each layer's rows come from the L3 cache as they do between decode steps.
//
//   BM_TinyDecodeScreen/chunks:<n>       ExactChunkIndex::Screen of the 4 indexes (the int8 pass)
//   BM_TinyDecodeRescore/chunks:<n>/rows:<m>  ExactChunkIndex::ScoreChunks of m chunks a layer
//                                        (Best's rescoring: m = n is a layer whose error bound
//                                        rules out nothing, as the model's first layer; 64 of
//                                        64: the four layers' keys fit the L2 cache, the
//                                        kernels' own speed)
//
// Counters: ns/key = wall time per representative key and kv head scored.
#include <benchmark/benchmark.h>
#include <tbb/task_arena.h>

#include <cstdint>
#include <vector>

#include "bench/exact_layers.h"
#include "retrieval/exact_index.h"

namespace {

using kvtier::ChunkScores;
using kvtier::ChunkShape;
using kvtier::ExactChunkIndex;

constexpr int kLayers = 4;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 16;
constexpr int kRepr = 32;

const kvtier::bench::ExactLayers* GetLayers(size_t chunks) {
  return kvtier::bench::RandomExactLayers(kLayers, ChunkShape{kKvHeads, kHeadDim, kRepr, kvtier::DType::kF32},
                                          chunks);
}

void BM_TinyDecodeScreen(benchmark::State& state) {
  const size_t chunks = static_cast<size_t>(state.range(0));
  const kvtier::bench::ExactLayers* layers = GetLayers(chunks);
  if (layers == nullptr) return state.SkipWithError("building the indexes failed");
  tbb::task_arena one(1);
  std::vector<ChunkScores> scores(kLayers);
  for (auto _ : state) {
    one.execute([&] {
      for (int l = 0; l < kLayers; ++l)
        if (!layers->index[l]->Screen(layers->probe.data(), &scores[l]).ok())
          state.SkipWithError("Screen failed");
    });
    benchmark::DoNotOptimize(scores.data());
  }
  state.counters["ns/key"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kLayers * chunks * kRepr * kKvHeads,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_TinyDecodeRescore(benchmark::State& state) {
  const size_t chunks = static_cast<size_t>(state.range(0));
  const size_t rows = static_cast<size_t>(state.range(1));
  const kvtier::bench::ExactLayers* layers = GetLayers(chunks);
  if (layers == nullptr) return state.SkipWithError("building the indexes failed");
  // Every m-th chunk of the layer (m = n: all of them), as scattered as Best's candidates.
  std::vector<uint64_t> list;
  for (size_t i = 0; i < rows; ++i) list.push_back(i * chunks / rows);
  tbb::task_arena one(1);
  ChunkScores scores;
  for (auto _ : state) {
    one.execute([&] {
      for (int l = 0; l < kLayers; ++l)
        if (!layers->index[l]->ScoreChunks(layers->probe.data(), list, &scores).ok())
          state.SkipWithError("ScoreChunks failed");
    });
    benchmark::DoNotOptimize(scores.logit.data());
  }
  state.counters["ns/key"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kLayers * rows * kRepr * kKvHeads,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

BENCHMARK(BM_TinyDecodeScreen)->ArgName("chunks")->Arg(1024)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TinyDecodeRescore)
    ->ArgNames({"chunks", "rows"})
    ->Args({1024, 1024})
    ->Args({1024, 384})
    ->Args({64, 64})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
