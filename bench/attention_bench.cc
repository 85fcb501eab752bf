// Benchmarks of the CPU attention kernel (kernels/cpu/attention.h).
//
// Decode (m = 1) over N = 4K / 32K / 128K tokens, geometry q_heads = 8,
// kv_heads = 2, head_dim = 64, fp16 storage:
//   BM_AttentionDecode/<N>/0   the N tokens as one span
//   BM_AttentionDecode/<N>/1   the same N tokens as a ragged list of 32-token
//                              chunks (separate KvSpans over the same buffers)
//   BM_AttentionDecodeMass/<N> one span, with the mass output requested
//   BM_SlotAttentionStep/rotated:<0|1>  a `kvtier run` decode step's layer through the plan's
//                              kernel (kernels::SlotAttention): 64 sinks | 64 chunks of 32 tokens
//                              from a slot pool | 512 local tokens as two runs; rotated:1 rotates
//                              the keys as read (InfLLM positions: sinks and chunks at L0, the
//                              local runs at their own positions), rotated:0 reads them as stored
//   BM_AttentionScattered/<N>  a decode step's retrieved part: 64 chunks of 32 tokens at
//                              random places of the N tokens, other chunks every
//                              iteration, so they come cold from memory as a decode
//                              step's fetched chunks do
// Baselines moving the same number of bytes:
//   BM_Memcpy/<N>              one memcpy of the KV bytes (1 thread)
//   BM_MemcpyParallel/<N>      the same memcpy split across the TBB threads
//
// Counters: bytes_per_second / "GB/s" = KV bytes READ (K + V of every token,
// all kv heads) per second of wall time, for the kernel and the baselines
// alike, so the kernel's figure can be read directly against memcpy bandwidth
// (memcpy additionally writes the same number of bytes).
#include <benchmark/benchmark.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/slot_attention.h"
#include "kernels/dtype.h"

namespace {

using kvtier::DType;
using kvtier::kernels::AttentionParams;
using kvtier::kernels::KernelError;
using kvtier::kernels::KvSpan;

constexpr int kQHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 64;
constexpr DType kDType = DType::kF16;
constexpr int kChunk = 32;

size_t KvBytes(int64_t n) {
  return static_cast<size_t>(n) * kKvHeads * kHeadDim * kvtier::DTypeSize(kDType) * 2;
}

// KV for N tokens, built once per N and shared by the benchmarks.
struct Kv {
  std::vector<uint16_t> k, v;  // [N, kv_heads, head_dim] fp16
};

const Kv& GetKv(int64_t n) {
  static std::map<int64_t, std::unique_ptr<Kv>> cache;
  auto& slot = cache[n];
  if (!slot) {
    slot = std::make_unique<Kv>();
    const size_t elems = static_cast<size_t>(n) * kKvHeads * kHeadDim;
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> tmp(elems);
    for (auto& x : tmp) x = u(rng);
    slot->k.resize(elems);
    kvtier::FromFloat(kDType, tmp.data(), slot->k.data(), elems);
    for (auto& x : tmp) x = u(rng);
    slot->v.resize(elems);
    kvtier::FromFloat(kDType, tmp.data(), slot->v.data(), elems);
  }
  return *slot;
}

std::vector<KvSpan> MakeSpans(const Kv& kv, int64_t n, bool chunked, std::vector<float>* mass) {
  std::vector<KvSpan> spans;
  const size_t row = static_cast<size_t>(kKvHeads) * kHeadDim;
  const int64_t step = chunked ? kChunk : n;
  for (int64_t t = 0; t < n; t += step) {
    KvSpan s;
    s.k = kv.k.data() + t * row;
    s.v = kv.v.data() + t * row;
    s.n_tokens = static_cast<int>(std::min<int64_t>(step, n - t));
    s.first_position = t;
    spans.push_back(s);
  }
  if (mass) {
    mass->assign(static_cast<size_t>(n) * kKvHeads, 0.0f);  // one span: [kv_heads, n]
    spans[0].mass = mass->data();
  }
  return spans;
}

void RunDecode(benchmark::State& state, bool chunked, bool with_mass) {
  const int64_t n = state.range(0);
  const Kv& kv = GetKv(n);
  std::vector<float> mass;
  const std::vector<KvSpan> spans = MakeSpans(kv, n, chunked, with_mass ? &mass : nullptr);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(kQHeads * kHeadDim), out(kQHeads * kHeadDim), lse(kQHeads);
  for (auto& x : q) x = u(rng);
  const int64_t qpos = n;
  AttentionParams p;
  p.q_heads = kQHeads;
  p.kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.dtype = kDType;
  p.scale = 0.125f;
  p.n_queries = 1;
  p.q = q.data();
  p.q_positions = &qpos;
  p.parts = spans.data();
  p.n_parts = static_cast<int>(spans.size());
  p.out = out.data();
  p.lse = lse.data();
  for (auto _ : state) {
    const KernelError e = kvtier::kernels::Attention(p);
    if (e != KernelError::kOk) {
      state.SkipWithError(kvtier::kernels::KernelErrorString(e));
      break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(KvBytes(n));
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["parts"] = static_cast<double>(spans.size());
  state.counters["threads"] = tbb::this_task_arena::max_concurrency();
  state.counters["ns_per_token"] =
      benchmark::Counter(static_cast<double>(n) * state.iterations() / 1e9,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_AttentionDecode(benchmark::State& state) { RunDecode(state, state.range(1) != 0, false); }

// ns_per_token here against BM_AttentionDecode/<N>/0's is what reading scattered, cold
// chunks costs the kernel beyond streaming one span.
void BM_AttentionScattered(benchmark::State& state) {
  const int64_t n = state.range(0);
  constexpr int kChunks = 64;
  const Kv& kv = GetKv(n);
  const size_t row = static_cast<size_t>(kKvHeads) * kHeadDim;
  std::mt19937 rng(2);
  std::uniform_int_distribution<int64_t> pick(0, n / kChunk - 1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(kQHeads * kHeadDim), out(kQHeads * kHeadDim), lse(kQHeads);
  for (auto& x : q) x = u(rng);
  const int64_t qpos = n;
  std::vector<KvSpan> spans(kChunks);
  AttentionParams p;
  p.q_heads = kQHeads;
  p.kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.dtype = kDType;
  p.scale = 0.125f;
  p.n_queries = 1;
  p.q = q.data();
  p.q_positions = &qpos;
  p.parts = spans.data();
  p.n_parts = kChunks;
  p.out = out.data();
  p.lse = lse.data();
  for (auto _ : state) {
    state.PauseTiming();
    for (KvSpan& s : spans) {
      const int64_t t = pick(rng) * kChunk;
      s = KvSpan{kv.k.data() + t * row, kv.v.data() + t * row, kChunk, t, nullptr};
    }
    state.ResumeTiming();
    const KernelError e = kvtier::kernels::Attention(p);
    if (e != KernelError::kOk) {
      state.SkipWithError(kvtier::kernels::KernelErrorString(e));
      break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double tokens = static_cast<double>(kChunks) * kChunk;
  state.counters["ns_per_token"] = benchmark::Counter(
      tokens * state.iterations() / 1e9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
void BM_AttentionDecodeMass(benchmark::State& state) { RunDecode(state, false, true); }

void BM_SlotAttentionStep(benchmark::State& state) {
  const bool rotated = state.range(0) != 0;
  constexpr int kSinks = 64, kChunks = 64, kLocal = 512, kPoolSlots = 128;
  const int64_t pool_tokens = static_cast<int64_t>(kPoolSlots) * kChunk;
  const Kv& kv = GetKv(pool_tokens + kSinks + kLocal);  // pool | sinks | local
  const size_t row = static_cast<size_t>(kKvHeads) * kHeadDim;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(kQHeads * kHeadDim), out(kQHeads * kHeadDim);
  for (auto& x : q) x = u(rng);
  // The chunks: every other slot of the pool, at positions after the sinks.
  std::vector<int32_t> slot_index(kChunks);
  std::vector<int64_t> slot_first(kChunks);
  for (int i = 0; i < kChunks; ++i) {
    slot_index[static_cast<size_t>(i)] = 2 * i;
    slot_first[static_cast<size_t>(i)] = kSinks + static_cast<int64_t>(i) * kChunk;
  }
  const int64_t l0 = 100000, qpos = l0 + kLocal - 1;  // the local window far past the chunks
  const std::vector<double> inv_freq = kvtier::kernels::RopeInvFreq(kHeadDim, 500000.0);
  kvtier::kernels::SlotAttentionParams p;
  p.q_heads = kQHeads;
  p.kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.dtype = kDType;
  p.n_queries = 1;
  p.q = q.data();
  p.q_positions = &qpos;
  const uint16_t* sinks_k = kv.k.data() + pool_tokens * row;
  const uint16_t* sinks_v = kv.v.data() + pool_tokens * row;
  const uint16_t* local_k = sinks_k + kSinks * row;
  const uint16_t* local_v = sinks_v + kSinks * row;
  p.dense[0] = {sinks_k, sinks_v, kSinks, 0, nullptr};
  p.dense[1] = {local_k + 200 * row, local_v + 200 * row, kLocal - 200, l0, nullptr};  // a wrapped ring
  p.dense[2] = {local_k, local_v, 200, l0 + kLocal - 200, nullptr};
  p.n_dense = 3;
  p.n_leading_dense = 1;
  p.pool_k = kv.k.data();
  p.pool_v = kv.v.data();
  p.pool_slots = kPoolSlots;
  p.slot_tokens = kChunk;
  p.n_slots = kChunks;
  p.slot_index = slot_index.data();
  p.slot_first_position = slot_first.data();
  p.out = out.data();
  if (rotated) {
    p.rope_inv_freq = inv_freq.data();
    p.dense[0].rope_position = l0;
    p.slot_rope_position = l0;
  }
  for (auto _ : state) {
    const KernelError e = kvtier::kernels::SlotAttention(p);
    if (e != KernelError::kOk) {
      state.SkipWithError(kvtier::kernels::KernelErrorString(e));
      break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double tokens = kSinks + static_cast<double>(kChunks) * kChunk + kLocal;
  state.counters["ns_per_token"] = benchmark::Counter(
      tokens * state.iterations() / 1e9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void RunMemcpy(benchmark::State& state, bool parallel) {
  const int64_t n = state.range(0);
  const Kv& kv = GetKv(n);
  // Copy K then V (the bytes the kernel reads) into one destination.
  const size_t half = KvBytes(n) / 2;
  std::vector<uint8_t> dst(2 * half);
  std::memset(dst.data(), 1, dst.size());  // fault the pages in before timing
  const auto* ks = reinterpret_cast<const uint8_t*>(kv.k.data());
  const auto* vs = reinterpret_cast<const uint8_t*>(kv.v.data());
  const int parts = parallel ? tbb::this_task_arena::max_concurrency() : 1;
  for (auto _ : state) {
    if (!parallel) {
      std::memcpy(dst.data(), ks, half);
      std::memcpy(dst.data() + half, vs, half);
    } else {
      tbb::parallel_for(
          tbb::blocked_range<int>(0, 2 * parts, 1),
          [&](const tbb::blocked_range<int>& r) {
            for (int i = r.begin(); i < r.end(); ++i) {
              const uint8_t* src = i < parts ? ks : vs;
              const int j = i % parts;
              const size_t a = half * j / parts, b = half * (j + 1) / parts;
              std::memcpy(dst.data() + (i < parts ? 0 : half) + a, src + a, b - a);
            }
          },
          tbb::simple_partitioner());
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(KvBytes(n));
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["threads"] = parts;
}

// The bytes the kernel reads (K then V), read and summed on every core and nothing else done
// with them: the memory system's ceiling for a pass over the KV. A kernel reading below it at
// a context that does not fit the caches is bound by its arithmetic, not by memory.
void BM_ReadParallel(benchmark::State& state) {
  const int64_t n = state.range(0);
  const Kv& kv = GetKv(n);
  const size_t words = KvBytes(n) / 2 / sizeof(uint64_t);  // per K or V
  const auto* ks = reinterpret_cast<const uint64_t*>(kv.k.data());
  const auto* vs = reinterpret_cast<const uint64_t*>(kv.v.data());
  const int parts = tbb::this_task_arena::max_concurrency();
  std::vector<uint64_t> sums(static_cast<size_t>(2 * parts) * 8);  // a cache line per part
  for (auto _ : state) {
    tbb::parallel_for(
        tbb::blocked_range<int>(0, 2 * parts, 1),
        [&](const tbb::blocked_range<int>& r) {
          for (int i = r.begin(); i < r.end(); ++i) {
            const uint64_t* src = i < parts ? ks : vs;
            const int j = i % parts;
            const size_t a = words * j / parts, b = words * (j + 1) / parts;
            uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            size_t w = a;
            for (; w + 4 <= b; w += 4) s0 += src[w], s1 += src[w + 1], s2 += src[w + 2], s3 += src[w + 3];
            for (; w < b; ++w) s0 += src[w];
            sums[static_cast<size_t>(i) * 8] = s0 + s1 + s2 + s3;
          }
        },
        tbb::simple_partitioner());
    benchmark::DoNotOptimize(sums.data());
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(KvBytes(n));
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["threads"] = parts;
}

void BM_Memcpy(benchmark::State& state) { RunMemcpy(state, false); }
void BM_MemcpyParallel(benchmark::State& state) { RunMemcpy(state, true); }

// kStep: the tokens a `kvtier run` decode step attends a layer (64 sinks, 2,048 retrieved, 512 local).
constexpr int64_t kStep = 2624, k4K = 4096, k32K = 32768, k128K = 131072;

BENCHMARK(BM_AttentionDecode)
    ->ArgNames({"N", "chunked"})
    ->ArgsProduct({{kStep, k4K, k32K, k128K}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SlotAttentionStep)
    ->ArgName("rotated")
    ->Arg(0)
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AttentionScattered)
    ->ArgName("N")
    ->Arg(k128K)
    ->Arg(8 * k128K)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ReadParallel)->ArgName("N")->Arg(k4K)->Arg(k128K)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AttentionDecodeMass)
    ->ArgName("N")
    ->Arg(k4K)
    ->Arg(k32K)
    ->Arg(k128K)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Memcpy)->ArgName("N")->Arg(k4K)->Arg(k32K)->Arg(k128K)->UseRealTime()->Unit(
    benchmark::kMicrosecond);
BENCHMARK(BM_MemcpyParallel)
    ->ArgName("N")
    ->Arg(k4K)
    ->Arg(k32K)
    ->Arg(k128K)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
