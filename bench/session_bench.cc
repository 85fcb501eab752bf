// The engine API's overhead: one decode step (every layer) through Session::Attend
// against the same step written by hand over the lower-level calls it replaces
// (Retriever::Select, FetchChunks, Wait, GetHotView, spans, kernels::Attention,
// Release), on a second sequence holding the same K/V, in the same iteration.
// `ratio_vs_handwritten` = Session time / hand-written time (1.0 = no overhead).
// The two sequences share one store; the hot slot cache is emptied before each
// side's step so neither is served by chunks the other fetched.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"
#include "kvtier/kvtier.h"
#include "offload/tiered_store.h"
#include "retrieval/retriever.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;

void BM_SessionDecodeStep(benchmark::State& state) {
  const int64_t context = state.range(0);
  StoreOptions so;
  so.geometry = Geometry{8, 8, 2, 64, DType::kF16};
  so.warm_bytes = 2ull << 30;
  so.hot_bytes = 64ull << 20;
  const Geometry& g = so.geometry;
  auto store = TieredStore::Open(so);
  if (!store.ok()) return state.SkipWithError(store.status().ToString().c_str());
  SessionOptions opt;  // the "kvtier" preset, budget 2048
  auto session = Session::Open(store->get(), opt);
  auto seq_b = (*store)->CreateSequence();
  auto retriever = Retriever::Create(store->get(), opt.retrieval);
  if (!session.ok() || !seq_b.ok() || !retriever.ok()) return state.SkipWithError("setup");
  Session& s = **session;

  std::mt19937 rng(7);
  std::normal_distribution<float> noise;
  const size_t kv = g.token_elems(), qe = static_cast<size_t>(g.q_heads) * g.head_dim;
  std::vector<float> kf, vf, q(qe);
  std::vector<uint16_t> kb, vb;
  auto append = [&](int64_t n) -> bool {
    for (int l = 0; l < g.layers; ++l) {
      kf.resize(n * kv);
      vf.resize(n * kv);
      kb.resize(n * kv);
      vb.resize(n * kv);
      for (float& x : kf) x = noise(rng);
      for (float& x : vf) x = noise(rng);
      FromFloat(DType::kF16, kf.data(), kb.data(), kf.size());
      FromFloat(DType::kF16, vf.data(), vb.data(), vf.size());
      if (!s.Append(l, kb.data(), vb.data(), static_cast<int>(n), DType::kF16).ok()) return false;
      if (!(*store)->Append(*seq_b, l, kb.data(), vb.data(), static_cast<int>(n), DType::kF16).ok())
        return false;
    }
    return true;
  };
  for (int64_t p = 0; p < context; p += 1024)
    if (!append(std::min<int64_t>(1024, context - p))) return state.SkipWithError("prefill append");
  int64_t pos = context;
  std::vector<float> out_a(qe), out_b(qe);
  double session_s = 0, hand_s = 0;
  for (auto _ : state) {
    if (!append(1)) return state.SkipWithError("append");
    std::vector<std::vector<float>> qs(g.layers, std::vector<float>(qe));
    for (auto& ql : qs)
      for (float& x : ql) x = noise(rng);
    auto session_step = [&]() -> bool {
      if (!s.BeginStep(StepKind::kDecode).ok()) return false;
      for (int l = 0; l < g.layers; ++l)
        if (!s.Attend(l, qs[l].data(), &pos, 1, out_a.data()).ok()) return false;
      return true;
    };
    auto hand_step = [&]() -> bool {
      (*retriever)->BeginStep();
      for (int l = 0; l < g.layers; ++l) {
        auto sel = (*retriever)->Select(*seq_b, l, qs[l].data(), 1, /*decode=*/true);
        if (!sel.ok()) return false;
        auto h = (*store)->FetchChunks(*seq_b, l, sel->chunks);
        if (!h.ok() || !h->Wait().ok()) return false;
        auto view = GetHotView(**store, *seq_b, l);
        if (!view.ok()) return false;
        std::vector<kernels::KvSpan> parts{view->sinks};
        for (const auto& sp : h->spans()) parts.push_back(sp);
        for (int i = 0; i < view->n_local_spans; ++i) parts.push_back(view->local[i]);
        kernels::AttentionParams p;
        p.q_heads = g.q_heads;
        p.kv_heads = g.kv_heads;
        p.head_dim = g.head_dim;
        p.dtype = g.dtype;
        p.scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
        p.n_queries = 1;
        p.q = qs[l].data();
        p.q_positions = &pos;
        p.parts = parts.data();
        p.n_parts = static_cast<int>(parts.size());
        p.out = out_b.data();
        if (kernels::Attention(p) != kernels::KernelError::kOk) return false;
        h->Release();
      }
      return true;
    };
    // Alternate which side goes first, so neither always finds the other's cache lines.
    for (int side = 0; side < 2; ++side) {
      const bool session_side = (side == 0) == (pos % 2 == 0);
      (*store)->EvictHot();
      const auto t0 = Clock::now();
      if (!(session_side ? session_step() : hand_step())) return state.SkipWithError("step");
      (session_side ? session_s : hand_s) += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    benchmark::DoNotOptimize(out_a.data());
    benchmark::DoNotOptimize(out_b.data());
    ++pos;
  }
  state.counters["session_ms"] = 1e3 * session_s / static_cast<double>(state.iterations());
  state.counters["handwritten_ms"] = 1e3 * hand_s / static_cast<double>(state.iterations());
  state.counters["ratio_vs_handwritten"] = session_s / hand_s;
}
BENCHMARK(BM_SessionDecodeStep)->Arg(32768)->Arg(131072)->Unit(benchmark::kMillisecond)->Iterations(128);

}  // namespace
}  // namespace kvtier
