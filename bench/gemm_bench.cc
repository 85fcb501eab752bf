// kernels::Gemm against OpenBLAS's sgemm, both on one core, at the shapes of the trained
// model's forward (models/kvtier-tiny: d_model 128, 8 query and 2 kv heads of 16, FFN 256):
//   BM_GemmVsOpenBlas/<m>/<k>/<n_out>   y[m, n_out] = x[m, k] . W[n_out, k]^T
// m 64 is a prefill window (`kvtier infinite`'s default), m 1 a decode step. Every iteration
// runs both, one after the other, on the same inputs, so the ratio is a same-run ratio that
// survives a noisy machine. Counters: kvtier_GFLOPs and openblas_GFLOPs (2 m k n_out per
// call over the time of the calls), and openblas_over_kvtier, the ratio of their rates
// (1.0: kvtier's GEMM is as fast as OpenBLAS's; the floor of `kvtier infinite` uses
// OpenBLAS's rate).
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/forward.h"

namespace {

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void BM_GemmVsOpenBlas(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), k = static_cast<int>(state.range(1)),
            n = static_cast<int>(state.range(2));
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(m) * k), w(static_cast<size_t>(n) * k),
      y(static_cast<size_t>(m) * n);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = 0.1f * normal(rng);
  kvtier::kernels::GemmParams p;
  p.m = m;
  p.k = k;
  p.n_out = n;
  p.x = x.data();
  p.w = w.data();
  p.y = y.data();
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  tbb::task_arena one(1);  // Gemm splits rows across TBB threads past 2^18 multiply-adds
  // Repetitions per timed block, so that each block lasts well above the clock's resolution.
  const int reps = std::max(1, static_cast<int>((1 << 22) / (static_cast<int64_t>(m) * k * n)));
  double kv_s = 0, blas_s = 0;
  int64_t calls = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    one.execute([&] {
      for (int r = 0; r < reps; ++r) benchmark::DoNotOptimize(kvtier::kernels::Gemm(p));
    });
    const auto t1 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x.data(), k, w.data(), k, 0.0f,
                  y.data(), n);
    const auto t2 = std::chrono::steady_clock::now();
    benchmark::ClobberMemory();
    kv_s += Seconds(t0, t1);
    blas_s += Seconds(t1, t2);
    calls += reps;
  }
  openblas_set_num_threads(blas_threads);
  const double flops = 2.0 * m * k * n * static_cast<double>(calls);
  state.counters["kvtier_GFLOPs"] = flops / kv_s / 1e9;
  state.counters["openblas_GFLOPs"] = flops / blas_s / 1e9;
  state.counters["openblas_over_kvtier"] = kv_s / blas_s;
}

BENCHMARK(BM_GemmVsOpenBlas)
    ->Args({64, 128, 256})  // FFN gate and up
    ->Args({64, 256, 128})  // FFN down
    ->Args({64, 128, 128})  // q and o projections
    ->Args({64, 128, 32})   // k and v projections
    ->Args({1, 128, 256})   // decode: FFN gate and up
    ->Args({1, 256, 128})   // decode: FFN down
    ->Unit(benchmark::kMicrosecond);

}  // namespace
