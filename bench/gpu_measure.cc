// kvtier_gpu_bench: the GPU measurements of issue 13, each a ratio against a baseline measured
// in the same run on the same device (scripts/gpu_check.sh runs it; docs/gpu.md records it).
//
//   h2d_<size>     chunk fetch of scattered chunks from pinned host memory into device slots,
//                  by the gather kernel (mapped pinned memory), cudaMemcpyBatchAsync and one
//                  cudaMemcpyAsync per chunk, each against ONE large pinned cudaMemcpyAsync of
//                  the same bytes (target >= 0.8)
//   attention      decode attention over a 2K-token budget (64 sinks + 512 local + 46 slots of
//                  32) at Llama-3-8B geometry (32 layers, 32 q / 8 kv heads, d 128, bf16): the
//                  bytes of K and V it reads per second against device-to-device copy
//                  bandwidth (read + write bytes per second) (target >= 0.5)
//   decode_128k    full attention over 128K tokens (same kernel, same GPU) against the 2K-budget
//                  step, kernel only and with every retrieved chunk fetched (target >= 5)
//   forward_decode the model forward outside attention (integration/model/llama_device.h's launcher
//                  chain: embedding, RMSNorm, Q/K/V/O and MLP GEMMs through cuBLAS fp32, RoPE, K/V
//                  to bf16, SwiGLU, lm_head) for one decode token at Llama-3.2-1B geometry (16
//                  layers, d 2048, 32 q / 8 kv heads of 64, ffn 8192, vocab 128256; fp32 weights,
//                  4.9 GB): weight bytes read per second against device-to-device copy bandwidth
//                  (read + write bytes per second); one token's GEMMs are matrix-vector products,
//                  bound by reading the weights (target >= 0.5)
//   forward_prefill the same chain over a 256-token window: tokens per second against the decode
//                  rate (what batching the window buys; no target)
//   peak_memory    the most device memory in use after any measurement's allocations (cudaMemGetInfo)
//
// Usage: kvtier_gpu_bench OUT_DIR [--reps N]. Prints a table; writes OUT_DIR/gpu_bench.tsv.
// Exit 2 when no CUDA device is visible. Inputs are random (never constants). docs/gpu.md
// records what it printed on a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/kernels.h"

namespace {

using kvtier::kernels::KernelError;
namespace kc = kvtier::kernels::cuda;

#define CHECK_CUDA(x)                                                                          \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

#define CHECK_KERNEL(x)                                                                \
  do {                                                                                 \
    const KernelError e_ = (x);                                                        \
    if (e_ != KernelError::kOk) {                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #x,             \
                   kvtier::kernels::KernelErrorString(e_), kc::LastCudaErrorString()); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

// Device memory in use, sampled after each measurement has allocated everything it needs.
size_t g_peak_used = 0;
void NotePeak() {
  size_t free_b = 0, total_b = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  g_peak_used = std::max(g_peak_used, total_b - free_b);
}

struct Row {
  std::string name, method;
  double value, baseline, ratio, target;
  std::string unit;
};

// Median of `reps` timings (ms) of fn() enqueued on stream s, timed with events.
template <class F>
double MedianMs(cudaStream_t s, int reps, F&& fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  fn();  // warm-up
  CHECK_CUDA(cudaStreamSynchronize(s));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a, s));
    fn();
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void MeasureH2D(cudaStream_t s, int reps, std::vector<Row>* rows) {
  const size_t kHostBytes = size_t{512} << 20, kFetchBytes = size_t{64} << 20;
  uint8_t* host = nullptr;
  CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host), kHostBytes, cudaHostAllocMapped));
  std::memset(host, 0x5a, kHostBytes);
  uint8_t* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, kFetchBytes));
  NotePeak();
  // Baseline: one large pinned copy of the fetched bytes.
  const double base_ms = MedianMs(
      s, reps, [&] { CHECK_CUDA(cudaMemcpyAsync(dev, host, kFetchBytes, cudaMemcpyHostToDevice, s)); });
  const double base_gbs = kFetchBytes / base_ms / 1e6;
  std::mt19937 rng(1);
  // 128K: one chunk of 32 tokens at Llama-3-8B geometry (K and V, bf16).
  for (size_t chunk : {size_t{16} << 10, size_t{64} << 10, size_t{128} << 10, size_t{256} << 10,
                       size_t{1} << 20, size_t{2} << 20}) {
    const int n = static_cast<int>(kFetchBytes / chunk);
    const size_t host_chunks = kHostBytes / chunk;
    std::vector<size_t> pick(host_chunks);
    for (size_t i = 0; i < host_chunks; ++i) pick[i] = i;
    std::shuffle(pick.begin(), pick.end(), rng);  // scattered chunks, as retrieval asks for them
    std::vector<uint64_t> src(n), dst(n);
    std::vector<void*> dsts(n);
    std::vector<const void*> srcs(n);
    std::vector<size_t> sizes(n, chunk);
    for (int i = 0; i < n; ++i) {
      void* mapped = nullptr;
      CHECK_CUDA(cudaHostGetDevicePointer(&mapped, host + pick[i] * chunk, 0));
      src[i] = reinterpret_cast<uint64_t>(mapped);
      dsts[i] = dev + static_cast<size_t>(i) * chunk;
      dst[i] = reinterpret_cast<uint64_t>(dsts[i]);
      srcs[i] = host + pick[i] * chunk;
    }
    uint64_t *d_src = nullptr, *d_dst = nullptr;
    CHECK_CUDA(cudaMalloc(&d_src, n * sizeof(uint64_t)));
    CHECK_CUDA(cudaMalloc(&d_dst, n * sizeof(uint64_t)));
    CHECK_CUDA(cudaMemcpy(d_src, src.data(), n * sizeof(uint64_t), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_dst, dst.data(), n * sizeof(uint64_t), cudaMemcpyHostToDevice));
    kc::GatherParams gp;
    gp.n_copies = n;
    gp.bytes = chunk;
    gp.src = d_src;
    gp.dst = d_dst;
    const std::string name = "h2d_" + std::to_string(chunk >> 10) + "K";
    const double gather_ms = MedianMs(s, reps, [&] { CHECK_KERNEL(kc::LaunchGatherCopies(gp, s)); });
    const double batch_ms = MedianMs(
        s, reps, [&] { CHECK_KERNEL(kc::MemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, s)); });
    const double each_ms = MedianMs(s, reps, [&] {
      for (int i = 0; i < n; ++i)
        CHECK_CUDA(cudaMemcpyAsync(dsts[i], srcs[i], chunk, cudaMemcpyHostToDevice, s));
    });
    for (auto [method, ms] : {std::pair<const char*, double>{"gather_kernel", gather_ms},
                              {"memcpy_batch", batch_ms},
                              {"memcpy_each", each_ms}}) {
      const double gbs = kFetchBytes / ms / 1e6;
      rows->push_back({name, method, gbs, base_gbs, gbs / base_gbs, 0.8, "GB/s"});
    }
    CHECK_CUDA(cudaFree(d_src));
    CHECK_CUDA(cudaFree(d_dst));
  }
  CHECK_CUDA(cudaFree(dev));
  CHECK_CUDA(cudaFreeHost(host));
}

// Random inputs for the timed kernels (never constants: they can hide wrong indexing and time
// differently from real data). Values uniform in [-1, 1) times `scale`, by xorshift32, stored as
// T by `store` and copied up through a host buffer.
template <typename T, typename Store>
void FillRandom(T* dev, size_t n, uint32_t seed, float scale, Store store) {
  std::vector<T> host(std::min<size_t>(n, size_t{1} << 24));
  uint32_t x = seed * 2654435761u + 1;
  for (size_t done = 0; done < n; done += host.size()) {
    const size_t m = std::min(host.size(), n - done);
    for (size_t i = 0; i < m; ++i) {
      x ^= x << 13, x ^= x >> 17, x ^= x << 5;
      host[i] = store((static_cast<float>(x) * (2.0f / 4294967296.0f) - 1.0f) * scale);
    }
    CHECK_CUDA(cudaMemcpy(dev + done, host.data(), m * sizeof(T), cudaMemcpyHostToDevice));
  }
}
void FillRandomBf16(void* dev, size_t n, uint32_t seed) {
  FillRandom(static_cast<uint16_t*>(dev), n, seed, 1.0f, [](float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>(bits >> 16);  // bf16 by truncation
  });
}
void FillRandomF32(float* dev, size_t n, uint32_t seed, float scale = 1.0f) {
  FillRandom(dev, n, seed, scale, [](float f) { return f; });
}

// Returns the decode step time (ms, 32 layers) over the 2K budget.
double MeasureAttention(cudaStream_t s, int reps, std::vector<Row>* rows) {
  constexpr int kLayers = 32, kQ = 32, kKv = 8, kD = 128, kSink = 64, kLocal = 512, kChunk = 32, kSlots = 46,
                kPool = 128;
  const size_t token = static_cast<size_t>(kKv) * kD * 2;  // bf16 bytes of K (or V) per token
  struct Layer {
    void *sink_k, *sink_v, *local_k, *local_v, *pool_k, *pool_v;
  };
  std::vector<Layer> layers(kLayers);
  for (Layer& l : layers) {
    CHECK_CUDA(cudaMalloc(&l.sink_k, kSink * token));
    CHECK_CUDA(cudaMalloc(&l.sink_v, kSink * token));
    CHECK_CUDA(cudaMalloc(&l.local_k, kLocal * token));
    CHECK_CUDA(cudaMalloc(&l.local_v, kLocal * token));
    CHECK_CUDA(cudaMalloc(&l.pool_k, kPool * kChunk * token));
    CHECK_CUDA(cudaMalloc(&l.pool_v, kPool * kChunk * token));
    uint32_t seed = static_cast<uint32_t>(&l - layers.data()) * 8 + 1;
    FillRandomBf16(l.sink_k, kSink * token / 2, seed++);
    FillRandomBf16(l.sink_v, kSink * token / 2, seed++);
    FillRandomBf16(l.local_k, kLocal * token / 2, seed++);
    FillRandomBf16(l.local_v, kLocal * token / 2, seed++);
    FillRandomBf16(l.pool_k, kPool * kChunk * token / 2, seed++);
    FillRandomBf16(l.pool_v, kPool * kChunk * token / 2, seed++);
  }
  std::vector<int32_t> slot_index(kSlots);
  std::vector<int64_t> slot_pos(kSlots);
  std::mt19937 rng(2);
  std::vector<int32_t> all(kPool);
  for (int i = 0; i < kPool; ++i) all[i] = i;
  std::shuffle(all.begin(), all.end(), rng);
  for (int i = 0; i < kSlots; ++i)
    slot_index[i] = all[i], slot_pos[i] = kSink + static_cast<int64_t>(i) * kChunk;
  int32_t* d_index = nullptr;
  int64_t* d_pos = nullptr;
  int64_t* d_qpos = nullptr;
  float *d_q = nullptr, *d_out = nullptr, *d_lse = nullptr;
  CHECK_CUDA(cudaMalloc(&d_index, kSlots * sizeof(int32_t)));
  CHECK_CUDA(cudaMalloc(&d_pos, kSlots * sizeof(int64_t)));
  CHECK_CUDA(cudaMalloc(&d_qpos, sizeof(int64_t)));
  CHECK_CUDA(cudaMalloc(&d_q, kQ * kD * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_out, kQ * kD * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_lse, kQ * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(d_index, slot_index.data(), kSlots * sizeof(int32_t), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_pos, slot_pos.data(), kSlots * sizeof(int64_t), cudaMemcpyHostToDevice));
  const int64_t qpos = 1 << 20;
  CHECK_CUDA(cudaMemcpy(d_qpos, &qpos, sizeof qpos, cudaMemcpyHostToDevice));
  FillRandomF32(d_q, kQ * kD, 3);
  std::vector<kvtier::kernels::SlotAttentionParams> params(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    auto& p = params[l];
    p.q_heads = kQ;
    p.kv_heads = kKv;
    p.head_dim = kD;
    p.dtype = kvtier::DType::kBF16;
    p.n_queries = 1;
    p.q = d_q;
    p.q_positions = d_qpos;
    p.n_dense = 2;
    p.dense[0] = {layers[l].sink_k, layers[l].sink_v, kSink, 0, nullptr};
    p.dense[1] = {layers[l].local_k, layers[l].local_v, kLocal, qpos - kLocal + 1, nullptr};
    p.pool_k = layers[l].pool_k;
    p.pool_v = layers[l].pool_v;
    p.pool_slots = kPool;
    p.slot_tokens = kChunk;
    p.n_slots = kSlots;
    p.slot_index = d_index;
    p.slot_first_position = d_pos;
    p.out = d_out;
    p.lse = d_lse;
  }
  const size_t ws_bytes = kc::SlotAttentionWorkspaceBytes(params[0]);  // the same shape every layer
  void* ws = nullptr;
  if (ws_bytes) CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  CHECK_KERNEL(kc::ClearSlotAttentionWorkspace(ws, ws_bytes, s));  // its arrival counters, once
  NotePeak();
  const double attn_ms = MedianMs(s, reps, [&] {
    for (const auto& p : params) CHECK_KERNEL(kc::LaunchSlotAttention(p, ws, ws_bytes, s));
  });
  if (ws) CHECK_CUDA(cudaFree(ws));
  const double kv_bytes = 2.0 * (kSink + kLocal + kSlots * kChunk) * token * kLayers;  // K and V read
  const double attn_gbs = kv_bytes / attn_ms / 1e6;
  // D2D copy bandwidth: read + write bytes per second of one large copy.
  const size_t copy_bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, copy_bytes));
  CHECK_CUDA(cudaMalloc(&b, copy_bytes));
  const double copy_ms =
      MedianMs(s, reps, [&] { CHECK_CUDA(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, s)); });
  const double copy_gbs = 2.0 * copy_bytes / copy_ms / 1e6;
  rows->push_back({"attention_decode_2k_llama3_8b", "slot_attention", attn_gbs, copy_gbs, attn_gbs / copy_gbs,
                   0.5, "GB/s"});
  rows->push_back({"attention_decode_2k_llama3_8b", "step_ms_32_layers", attn_ms, 0, 0, 0, "ms"});
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  for (Layer& l : layers)
    for (void* p : {l.sink_k, l.sink_v, l.local_k, l.local_v, l.pool_k, l.pool_v}) CHECK_CUDA(cudaFree(p));
  for (void* p : {static_cast<void*>(d_index), static_cast<void*>(d_pos), static_cast<void*>(d_qpos),
                  static_cast<void*>(d_q), static_cast<void*>(d_out), static_cast<void*>(d_lse)})
    CHECK_CUDA(cudaFree(p));
  return attn_ms;
}

// Full attention over a 128K context on the same GPU (the same kernel over one dense part of
// every token) against the 2K-budget step, kernel time only and with the worst-case fetch (every
// retrieved chunk a miss, at the best measured H2D rate for 128 KiB chunks). One layer's 128K KV
// (512 MiB) is attended 32 times: far beyond L2, so each pass streams it from HBM as 32 layers
// would. At 1M the KV (128 GiB) does not fit: that row says so, and the budget step is the same.
void MeasureFullVsBudget(cudaStream_t s, int reps, double budget_ms, const std::vector<Row>& h2d,
                         std::vector<Row>* rows) {
  constexpr int kLayers = 32, kQ = 32, kKv = 8, kD = 128, kCtx = 131072, kChunk = 32, kSlots = 46;
  const size_t token = static_cast<size_t>(kKv) * kD * 2;
  void *k = nullptr, *v = nullptr;
  CHECK_CUDA(cudaMalloc(&k, kCtx * token));
  CHECK_CUDA(cudaMalloc(&v, kCtx * token));
  FillRandomBf16(k, kCtx * token / 2, 101);
  FillRandomBf16(v, kCtx * token / 2, 102);
  int64_t* d_qpos = nullptr;
  float *d_q = nullptr, *d_out = nullptr;
  CHECK_CUDA(cudaMalloc(&d_qpos, sizeof(int64_t)));
  CHECK_CUDA(cudaMalloc(&d_q, kQ * kD * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_out, kQ * kD * sizeof(float)));
  const int64_t qpos = kCtx - 1;
  CHECK_CUDA(cudaMemcpy(d_qpos, &qpos, sizeof qpos, cudaMemcpyHostToDevice));
  FillRandomF32(d_q, kQ * kD, 4);
  kvtier::kernels::SlotAttentionParams p;
  p.q_heads = kQ;
  p.kv_heads = kKv;
  p.head_dim = kD;
  p.dtype = kvtier::DType::kBF16;
  p.n_queries = 1;
  p.q = d_q;
  p.q_positions = d_qpos;
  p.n_dense = 1;
  p.dense[0] = {k, v, kCtx, 0, nullptr};
  p.out = d_out;
  const size_t ws_bytes = kc::SlotAttentionWorkspaceBytes(p);
  void* ws = nullptr;
  if (ws_bytes) CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  CHECK_KERNEL(kc::ClearSlotAttentionWorkspace(ws, ws_bytes, s));  // its arrival counters, once
  NotePeak();
  const double full_ms = MedianMs(s, reps, [&] {
    for (int l = 0; l < kLayers; ++l) CHECK_KERNEL(kc::LaunchSlotAttention(p, ws, ws_bytes, s));
  });
  double best_gbs = 0.0;
  for (const Row& r : h2d)
    if (r.name == "h2d_128K") best_gbs = std::max(best_gbs, r.value);
  const double fetch_ms = best_gbs > 0.0 ? 2.0 * kSlots * kChunk * token * kLayers / best_gbs / 1e6 : 0.0;
  rows->push_back(
      {"decode_128k_full_vs_budget", "kernel_only", full_ms, budget_ms, full_ms / budget_ms, 5.0, "ms"});
  rows->push_back({"decode_128k_full_vs_budget", "every_chunk_missed", full_ms, budget_ms + fetch_ms,
                   full_ms / (budget_ms + fetch_ms), 5.0, "ms"});
  rows->push_back({"decode_1m_full", "kv_does_not_fit", 2.0 * 1048576.0 * token * kLayers / 1073741824.0, 0,
                   0, 0, "GiB"});
  if (ws) CHECK_CUDA(cudaFree(ws));
  for (void* ptr : {k, v, static_cast<void*>(d_qpos), static_cast<void*>(d_q), static_cast<void*>(d_out)})
    CHECK_CUDA(cudaFree(ptr));
}

// The device forward's launcher chain outside attention (LlamaDeviceForward::Forward without
// the Session calls: Append and Attend are measured by the rows above), on random weights of
// scale 0.02 (activations stay finite over 16 layers).
void MeasureForward(cudaStream_t s, int reps, std::vector<Row>* rows) {
  constexpr int kLayers = 16, kD = 2048, kQ = 32, kKv = 8, kHd = 64, kF = 8192, kVocab = 128256,
                kWindow = 256;
  constexpr size_t qd = size_t{kQ} * kHd, kvd = size_t{kKv} * kHd;
  const size_t per_layer = 2 * kD + qd * kD * 2 + kvd * kD * 2 + size_t{3} * kF * kD;  // floats
  const size_t weight_floats = size_t{2} * kVocab * kD + kD + kLayers * per_layer;
  float* w = nullptr;
  CHECK_CUDA(cudaMalloc(&w, weight_floats * sizeof(float)));
  FillRandomF32(w, weight_floats, 5, 0.02f);
  const float* embed = w;
  const float* lm_head = embed + size_t{kVocab} * kD;
  const float* final_norm = lm_head + size_t{kVocab} * kD;
  const float* layer0 = final_norm + kD;
  // Activations for the largest window.
  const size_t m = kWindow;
  float *x, *h, *q, *k, *v, *att, *gate, *up, *logits;
  uint16_t *k16, *v16;
  int32_t* tokens;
  int64_t* positions;
  double* inv_freq;
  CHECK_CUDA(cudaMalloc(&x, m * kD * 4));
  CHECK_CUDA(cudaMalloc(&h, m * kD * 4));
  CHECK_CUDA(cudaMalloc(&q, m * qd * 4));
  CHECK_CUDA(cudaMalloc(&k, m * kvd * 4));
  CHECK_CUDA(cudaMalloc(&v, m * kvd * 4));
  CHECK_CUDA(cudaMalloc(&att, m * qd * 4));
  CHECK_CUDA(cudaMalloc(&gate, m * kF * 4));
  CHECK_CUDA(cudaMalloc(&up, m * kF * 4));
  CHECK_CUDA(cudaMalloc(&logits, m * kVocab * 4));
  CHECK_CUDA(cudaMalloc(&k16, m * kvd * 2));
  CHECK_CUDA(cudaMalloc(&v16, m * kvd * 2));
  CHECK_CUDA(cudaMalloc(&tokens, m * 4));
  CHECK_CUDA(cudaMalloc(&positions, m * 8));
  CHECK_CUDA(cudaMalloc(&inv_freq, kHd / 2 * 8));
  CHECK_CUDA(cudaMemset(att, 0, m * qd * 4));  // attention is not run: its output stays zero
  CHECK_CUDA(cudaMemset(tokens, 0, m * 4));
  CHECK_CUDA(cudaMemset(positions, 0, m * 8));
  CHECK_CUDA(cudaMemset(inv_freq, 0, kHd / 2 * 8));
  kc::BlasHandle blas = nullptr;
  CHECK_KERNEL(kc::CreateBlasHandle(&blas));
  void* blas_ws = nullptr;
  CHECK_CUDA(cudaMalloc(&blas_ws, kc::GemmWorkspaceBytes()));
  NotePeak();

  auto forward = [&](int n) {
    auto gemm = [&](const float* in, int kin, const float* wt, int out, float* y, bool acc) {
      kvtier::kernels::GemmParams p;
      p.m = n;
      p.k = kin;
      p.n_out = out;
      p.x = in;
      p.w = wt;
      p.y = y;
      p.accumulate = acc;
      CHECK_KERNEL(kc::LaunchGemm(p, blas, blas_ws, kc::GemmWorkspaceBytes(), s));
    };
    auto rms = [&](const float* in, const float* wt, float* out) {
      kvtier::kernels::RmsNormParams p;
      p.m = n;
      p.d = kD;
      p.eps = 1e-5;
      p.x = in;
      p.w = wt;
      p.out = out;
      CHECK_KERNEL(kc::LaunchRmsNorm(p, s));
    };
    auto rope = [&](float* io, int heads) {
      kc::RopeParams p;
      p.m = n;
      p.heads = heads;
      p.head_dim = kHd;
      p.x = io;
      p.positions = positions;
      p.inv_freq = inv_freq;
      CHECK_KERNEL(kc::LaunchRope(p, s));
    };
    auto convert = [&](const float* src, uint16_t* dst) {
      kvtier::kernels::ConvertToStoreParams p;
      p.n = static_cast<size_t>(n) * kvd;
      p.dtype = kvtier::DType::kBF16;
      p.src = src;
      p.dst = dst;
      CHECK_KERNEL(kc::LaunchConvertToStore(p, s));
    };
    kvtier::kernels::EmbeddingParams e;
    e.m = n;
    e.d = kD;
    e.vocab = kVocab;
    e.tokens = tokens;
    e.table = embed;
    e.out = x;
    CHECK_KERNEL(kc::LaunchEmbedding(e, s));
    for (int l = 0; l < kLayers; ++l) {
      const float* L = layer0 + l * per_layer;
      const float *attn_norm = L, *wq = attn_norm + kD, *wk = wq + qd * kD, *wv = wk + kvd * kD,
                  *wo = wv + kvd * kD, *mlp_norm = wo + kD * qd, *w_gate = mlp_norm + kD,
                  *w_up = w_gate + size_t{kF} * kD, *w_down = w_up + size_t{kF} * kD;
      rms(x, attn_norm, h);
      gemm(h, kD, wq, qd, q, false);
      gemm(h, kD, wk, kvd, k, false);
      gemm(h, kD, wv, kvd, v, false);
      rope(q, kQ);
      rope(k, kKv);
      convert(k, k16);
      convert(v, v16);
      gemm(att, qd, wo, kD, x, true);
      rms(x, mlp_norm, h);
      gemm(h, kD, w_gate, kF, gate, false);
      gemm(h, kD, w_up, kF, up, false);
      kvtier::kernels::SwiGluParams sg;
      sg.n = static_cast<size_t>(n) * kF;
      sg.gate = gate;
      sg.up = up;
      CHECK_KERNEL(kc::LaunchSwiGlu(sg, s));
      gemm(gate, kF, w_down, kD, x, true);
    }
    rms(x, final_norm, h);
    gemm(h, kD, lm_head, kVocab, logits, false);
  };
  const double decode_ms = MedianMs(s, reps, [&] { forward(1); });
  const double prefill_ms = MedianMs(s, reps, [&] { forward(kWindow); });
  // Weight bytes a token reads: everything but the embedding table (one row of it).
  const double weight_bytes = static_cast<double>(weight_floats - size_t{kVocab} * kD) * 4;
  const double forward_gbs = weight_bytes / decode_ms / 1e6;
  const size_t copy_bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, copy_bytes));
  CHECK_CUDA(cudaMalloc(&b, copy_bytes));
  const double copy_ms =
      MedianMs(s, reps, [&] { CHECK_CUDA(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, s)); });
  const double copy_gbs = 2.0 * copy_bytes / copy_ms / 1e6;
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  rows->push_back({"forward_decode_llama32_1b", "weights_read", forward_gbs, copy_gbs, forward_gbs / copy_gbs,
                   0.5, "GB/s"});
  rows->push_back({"forward_decode_llama32_1b", "token_ms_16_layers", decode_ms, 0, 0, 0, "ms"});
  const double decode_tps = 1e3 / decode_ms, prefill_tps = kWindow * 1e3 / prefill_ms;
  rows->push_back({"forward_prefill_llama32_1b", "window_256_tokens_s", prefill_tps, decode_tps,
                   prefill_tps / decode_tps, 0, "tokens/s"});
  kc::DestroyBlasHandle(blas);
  CHECK_CUDA(cudaFree(blas_ws));
  for (void* p : {static_cast<void*>(x), static_cast<void*>(h), static_cast<void*>(q), static_cast<void*>(k),
                  static_cast<void*>(v), static_cast<void*>(att), static_cast<void*>(gate),
                  static_cast<void*>(up), static_cast<void*>(logits), static_cast<void*>(k16),
                  static_cast<void*>(v16), static_cast<void*>(tokens), static_cast<void*>(positions),
                  static_cast<void*>(inv_freq), static_cast<void*>(w)})
    CHECK_CUDA(cudaFree(p));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR [--reps N]\n", argv[0]);
    return 64;
  }
  const std::string out_dir = argv[1];
  int reps = 20;
  for (int i = 2; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(1, std::atoi(argv[i + 1]));
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) {
    std::fprintf(stderr, "cannot create %s: %s\n", out_dir.c_str(), ec.message().c_str());
    return 1;
  }
  if (kc::DeviceCount() == 0) {
    std::fprintf(stderr, "no CUDA device: %s\n", kc::LastCudaErrorString());
    return 2;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<Row> rows;
  MeasureH2D(s, reps, &rows);
  const std::vector<Row> h2d = rows;
  const double budget_ms = MeasureAttention(s, reps, &rows);
  MeasureFullVsBudget(s, reps, budget_ms, h2d, &rows);
  MeasureForward(s, reps, &rows);
  size_t free_b = 0, total_b = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  rows.push_back({"peak_memory", "max_cudaMemGetInfo_used", g_peak_used / 1048576.0, total_b / 1048576.0,
                  static_cast<double>(g_peak_used) / total_b, 0, "MiB"});
  std::printf("device: %s (sm_%d%d), reps %d\n", prop.name, prop.major, prop.minor, reps);
  std::printf("%-32s %-20s %12s %12s %8s %8s\n", "measure", "method", "value", "baseline", "ratio", "target");
  const std::string tsv = out_dir + "/gpu_bench.tsv";
  FILE* f = std::fopen(tsv.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", tsv.c_str());
    return 1;
  }
  std::fprintf(f, "measure\tmethod\tvalue\tbaseline\tratio\ttarget\tunit\tdevice\n");
  for (const Row& r : rows) {
    std::printf("%-32s %-20s %12.3f %12.3f %8.3f %8.2f %s\n", r.name.c_str(), r.method.c_str(), r.value,
                r.baseline, r.ratio, r.target, r.unit.c_str());
    std::fprintf(f, "%s\t%s\t%.6g\t%.6g\t%.6g\t%.3g\t%s\t%s\n", r.name.c_str(), r.method.c_str(), r.value,
                 r.baseline, r.ratio, r.target, r.unit.c_str(), prop.name);
  }
  std::fclose(f);
  CHECK_CUDA(cudaStreamDestroy(s));
  return 0;
}
