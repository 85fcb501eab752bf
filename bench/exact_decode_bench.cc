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
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "retrieval/exact_index.h"

namespace {

using kvtier::ChunkScores;
using kvtier::ChunkShape;
using kvtier::ExactChunkIndex;
using kvtier::ExactIndexOptions;

constexpr int kLayers = 4;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 16;
constexpr int kRepr = 32;

struct Layers {
  std::vector<std::unique_ptr<ExactChunkIndex>> index;
  std::vector<float> probe;
};

const Layers* GetLayers(size_t chunks) {
  static std::map<size_t, std::unique_ptr<Layers>> cache;
  auto& slot = cache[chunks];
  if (slot) return slot.get();
  auto layers = std::make_unique<Layers>();
  const ChunkShape shape{kKvHeads, kHeadDim, kRepr, kvtier::DType::kF32};
  auto options = ExactIndexOptions::Parse("Exact:heads=max");
  if (!options.ok()) return nullptr;
  std::mt19937 rng(static_cast<uint32_t>(chunks));
  std::normal_distribution<float> normal;
  std::vector<uint64_t> ids(chunks);
  for (size_t i = 0; i < chunks; ++i) ids[i] = i;
  for (int l = 0; l < kLayers; ++l) {
    auto index = ExactChunkIndex::Create(shape, *options);
    if (!index.ok()) return nullptr;
    const kvtier::Status st = (*index)->Add(ids, [&](uint64_t, float* repr) {
      for (size_t i = 0; i < shape.repr_floats(); ++i) repr[i] = normal(rng);
      return kvtier::Status::Ok();
    });
    if (!st.ok()) return nullptr;
    layers->index.push_back(std::move(*index));
  }
  layers->probe.resize(static_cast<size_t>(shape.dim()));
  for (float& x : layers->probe) x = normal(rng);
  slot = std::move(layers);
  return slot.get();
}

void BM_TinyDecodeScreen(benchmark::State& state) {
  const size_t chunks = static_cast<size_t>(state.range(0));
  const Layers* layers = GetLayers(chunks);
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
  const Layers* layers = GetLayers(chunks);
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
