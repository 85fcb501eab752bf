// The C API on the cuda hot tier: a store opened through kvtier_store_options_set(...,
// "device", "cuda") appends and attends like one on the cpu tier, output for output. Built
// into the emulated-GPU run (make test-gpu-emulated, Makefile's GPU_EMU_TESTS); skipped,
// saying why, where no CUDA device exists.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/kvtier_c.h"
#include "offload/hot_tier.h"

namespace kvtier {
namespace {

constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 16, kTokens = 96;

// A store over `device` and a session on it, both by name, as a C engine sets them.
struct CEngine {
  kvtier_store* store = nullptr;
  kvtier_session* session = nullptr;
  kvtier_error err{};

  kvtier_code Open(const char* device) {
    kvtier_store_options so = kvtier_store_options_default();
    const std::vector<std::pair<const char*, std::string>> store_options = {
        {"layers", std::to_string(kLayers)},
        {"q_heads", std::to_string(kQHeads)},
        {"kv_heads", std::to_string(kKvHeads)},
        {"head_dim", std::to_string(kHeadDim)},
        {"dtype", "float32"},
        {"n_sink", "4"},
        {"n_local", "16"},
        {"chunk_size", "8"},
        {"hot_bytes", "64K"},
        {"warm_bytes", "4M"},
        {"device", device},
    };
    for (const auto& [name, value] : store_options) {
      const kvtier_code c = kvtier_store_options_set(&so, name, value.c_str(), &err);
      if (c != KVTIER_OK) return c;
    }
    const kvtier_code c = kvtier_store_open(&so, &store, &err);
    if (c != KVTIER_OK) return c;
    kvtier_session_options o = kvtier_session_options_default();
    if (kvtier_session_options_set(&o, "budget_tokens", "32", &err) != KVTIER_OK) return err.code;
    return kvtier_session_open(store, &o, &session, &err);
  }

  ~CEngine() {
    kvtier_session_destroy(session);
    if (store != nullptr) kvtier_store_close(store, &err);
  }
};

// Decode steps over kTokens tokens: each appends one token's K/V per layer and attends one
// query at its position; the outputs of every step and layer, in order.
std::vector<float> RunSteps(CEngine* e) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(kKvHeads * kHeadDim), v(k.size()), q(kQHeads * kHeadDim), out(q.size()), all;
  for (int64_t t = 0; t < kTokens; ++t) {
    EXPECT_EQ(kvtier_session_begin_step(e->session, KVTIER_STEP_DECODE, &e->err), KVTIER_OK)
        << e->err.message;
    for (int layer = 0; layer < kLayers; ++layer) {
      for (float& x : k) x = normal(rng);
      for (float& x : v) x = normal(rng);
      for (float& x : q) x = normal(rng);
      EXPECT_EQ(kvtier_session_append(e->session, layer, k.data(), v.data(), 1, KVTIER_F32, &e->err),
                KVTIER_OK)
          << e->err.message;
      EXPECT_EQ(kvtier_session_attend(e->session, layer, q.data(), &t, 1, out.data(), nullptr, &e->err),
                KVTIER_OK)
          << e->err.message;
      all.insert(all.end(), out.begin(), out.end());
    }
  }
  return all;
}

TEST(CApiCuda, OpensACudaTierThatAttendsAsTheCpuOne) {
  CEngine gpu;
  const kvtier_code c = gpu.Open("cuda");
  if (c == KVTIER_UNAVAILABLE && !CheckDevice(Device::kCuda).ok())
    GTEST_SKIP() << "no CUDA device: " << gpu.err.message;
  ASSERT_EQ(c, KVTIER_OK) << gpu.err.message;
  CEngine cpu;
  ASSERT_EQ(cpu.Open("cpu"), KVTIER_OK) << cpu.err.message;

  const std::vector<float> want = RunSteps(&cpu), got = RunSteps(&gpu);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    ASSERT_NEAR(got[i], want[i], 1e-4f)
        << "output " << i << " (step " << i / (kLayers * kQHeads * kHeadDim) << ")";
  }
  kvtier_store_counters counters;
  ASSERT_EQ(kvtier_store_get_counters(gpu.store, &counters, &gpu.err), KVTIER_OK);
  EXPECT_GT(counters.chunks_sealed, 0u);
}

TEST(CApiCuda, ACudaTierWithoutADeviceIsUnavailable) {
  if (CheckDevice(Device::kCuda).ok())
    GTEST_SKIP() << "a CUDA device is present: covered by OpensACudaTier...";
  CEngine gpu;
  EXPECT_EQ(gpu.Open("cuda"), KVTIER_UNAVAILABLE) << gpu.err.message;
  EXPECT_NE(std::string(gpu.err.message).find("device"), std::string::npos) << gpu.err.message;
}

}  // namespace
}  // namespace kvtier
