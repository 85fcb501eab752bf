// The C API on the cuda hot tier: a store opened through kvtier_store_options_set(...,
// "device", "cuda") appends and attends like one on the cpu tier, output for output; its
// device-pointer calls (kvtier_session_append_device / _attend_device), ordered on an engine's
// stream, give the host-pointer calls' outputs bit for bit; on a cpu tier, with NULL pointers
// or a NULL session the device calls are refused by name. Built into the emulated-GPU run (make
// test-gpu-emulated, Makefile's GPU_EMU_TESTS) and into the host build (the refusals); the device
// cases skip, saying why, where no CUDA device exists.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/kvtier_c.h"
#include "offload/hot_tier.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>
#endif

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

// The device calls on a cpu hot tier: FailedPrecondition naming the "cuda" tier they need,
// and nothing appended (the pointers are host memory here: the tier is refused before any is
// read).
TEST(CApiCuda, DeviceCallsOnACpuTierAreRefusedNamingCuda) {
  CEngine cpu;
  ASSERT_EQ(cpu.Open("cpu"), KVTIER_OK) << cpu.err.message;
  std::vector<float> k(kKvHeads * kHeadDim), v(k.size()), q(kQHeads * kHeadDim), out(q.size());
  ASSERT_EQ(kvtier_session_begin_step(cpu.session, KVTIER_STEP_DECODE, &cpu.err), KVTIER_OK)
      << cpu.err.message;
  EXPECT_EQ(
      kvtier_session_append_device(cpu.session, 0, k.data(), v.data(), 1, KVTIER_F32, nullptr, &cpu.err),
      KVTIER_FAILED_PRECONDITION);
  EXPECT_EQ(cpu.err.code, KVTIER_FAILED_PRECONDITION);
  EXPECT_NE(std::string(cpu.err.message).find("\"cuda\""), std::string::npos) << cpu.err.message;
  EXPECT_NE(std::string(cpu.err.message).find("AppendDevice"), std::string::npos) << cpu.err.message;
  // The host twin appends a token, so that the attend below is refused for the tier alone.
  ASSERT_EQ(kvtier_session_append(cpu.session, 0, k.data(), v.data(), 1, KVTIER_F32, &cpu.err), KVTIER_OK)
      << cpu.err.message;
  int64_t pos = 0;
  out.assign(out.size(), 7.0f);
  EXPECT_EQ(
      kvtier_session_attend_device(cpu.session, 0, q.data(), &pos, 1, out.data(), nullptr, nullptr, &cpu.err),
      KVTIER_FAILED_PRECONDITION);
  EXPECT_EQ(cpu.err.code, KVTIER_FAILED_PRECONDITION);
  EXPECT_NE(std::string(cpu.err.message).find("\"cuda\""), std::string::npos) << cpu.err.message;
  EXPECT_NE(std::string(cpu.err.message).find("AttendDevice"), std::string::npos) << cpu.err.message;
  for (float x : out) ASSERT_EQ(x, 7.0f) << "a refused attend wrote out";
  kvtier_session_counters c;
  ASSERT_EQ(kvtier_session_get_counters(cpu.session, &c, &cpu.err), KVTIER_OK);
  EXPECT_EQ(c.tokens_appended, 1u) << "the refused device append appended";
  EXPECT_EQ(c.attends, 0u);
}

// NULL session, pointers and a dtype outside the enum: KVTIER_INVALID_ARGUMENT naming the
// function and what was wrong, checked before the tier (so on any tier).
TEST(CApiCuda, DeviceCallsRefuseNullPointersAndANullSession) {
  CEngine cpu;
  ASSERT_EQ(cpu.Open("cpu"), KVTIER_OK) << cpu.err.message;
  std::vector<float> kv(kKvHeads * kHeadDim), q(kQHeads * kHeadDim), out(q.size());
  int64_t pos = 0;
  kvtier_error err{};
  auto refused = [&](kvtier_code got, const char* fn, const char* what) {
    EXPECT_EQ(got, KVTIER_INVALID_ARGUMENT) << fn << ": " << err.message;
    EXPECT_EQ(err.code, KVTIER_INVALID_ARGUMENT);
    const std::string message = err.message;
    EXPECT_NE(message.find(fn), std::string::npos) << message;
    EXPECT_NE(message.find(what), std::string::npos) << message;
  };
  const char* append = "kvtier_session_append_device";
  const char* attend = "kvtier_session_attend_device";
  refused(kvtier_session_append_device(nullptr, 0, kv.data(), kv.data(), 1, KVTIER_F32, nullptr, &err),
          append, "session must not be NULL");
  refused(kvtier_session_append_device(cpu.session, 0, nullptr, kv.data(), 1, KVTIER_F32, nullptr, &err),
          append, "k and v");
  refused(kvtier_session_append_device(cpu.session, 0, kv.data(), nullptr, 1, KVTIER_F32, nullptr, &err),
          append, "k and v");
  refused(kvtier_session_append_device(cpu.session, 0, kv.data(), kv.data(), 1, static_cast<kvtier_dtype>(9),
                                       nullptr, &err),
          append, "dtype 9");
  refused(kvtier_session_attend_device(nullptr, 0, q.data(), &pos, 1, out.data(), nullptr, nullptr, &err),
          attend, "session must not be NULL");
  refused(kvtier_session_attend_device(cpu.session, 0, nullptr, &pos, 1, out.data(), nullptr, nullptr, &err),
          attend, "q (a device pointer) must not be NULL");
  refused(
      kvtier_session_attend_device(cpu.session, 0, q.data(), nullptr, 1, out.data(), nullptr, nullptr, &err),
      attend, "positions");
  refused(kvtier_session_attend_device(cpu.session, 0, q.data(), &pos, 1, nullptr, nullptr, nullptr, &err),
          attend, "out (a device pointer) must not be NULL");
  // A NULL err is allowed: the code alone comes back.
  EXPECT_EQ(kvtier_session_append_device(nullptr, 0, kv.data(), kv.data(), 1, KVTIER_F32, nullptr, nullptr),
            KVTIER_INVALID_ARGUMENT);
  kvtier_session_counters c;
  ASSERT_EQ(kvtier_session_get_counters(cpu.session, &c, &err), KVTIER_OK);
  EXPECT_EQ(c.tokens_appended, 0u);
}

#if KVTIER_HAVE_CUDA

// Device memory that frees itself.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess); }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Two cuda-tier C engines fed the same decode steps: `host` through kvtier_session_append /
// _attend, `device` through the _device calls with K/V, q and out in device memory, written and
// read back with cudaMemcpyAsync on the engine's own stream and no synchronisation between the
// writes and the calls. Every layer step's output must be the host call's bit for bit, and so
// must the chunks attended over the run (the device lane's read back by
// kvtier_session_wait_for_device), over enough steps that chunks are sealed out of the local
// window and retrieved.
TEST(CApiCuda, DeviceCallsOnAStreamGiveTheHostCallsOutputsBitForBit) {
  CEngine device;
  const kvtier_code c = device.Open("cuda");
  if (c == KVTIER_UNAVAILABLE && !CheckDevice(Device::kCuda).ok())
    GTEST_SKIP() << "no CUDA device: " << device.err.message;
  ASSERT_EQ(c, KVTIER_OK) << device.err.message;
  CEngine host;
  ASSERT_EQ(host.Open("cuda"), KVTIER_OK) << host.err.message;

  cudaStream_t engine = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine, cudaStreamNonBlocking), cudaSuccess);
  const size_t kv_bytes = kKvHeads * kHeadDim * sizeof(float), q_bytes = kQHeads * kHeadDim * sizeof(float);
  DeviceBuffer k_dev(kv_bytes), v_dev(kv_bytes), q_dev(q_bytes), out_dev(q_bytes);
  void* pinned = nullptr;  // the engine's staging: cudaMemcpyAsync from pageable memory may not be async
  ASSERT_EQ(cudaMallocHost(&pinned, 2 * kv_bytes + 2 * q_bytes), cudaSuccess);
  auto* pk = static_cast<float*>(pinned);
  float *pv = pk + kKvHeads * kHeadDim, *pq = pv + kKvHeads * kHeadDim, *pout = pq + kQHeads * kHeadDim;

  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(kKvHeads * kHeadDim), v(k.size()), q(kQHeads * kHeadDim), want(q.size());
  int compared = 0;
  uint64_t want_chunks = 0;
  for (int64_t t = 0; t < kTokens; ++t) {
    ASSERT_EQ(kvtier_session_begin_step(host.session, KVTIER_STEP_DECODE, &host.err), KVTIER_OK);
    ASSERT_EQ(kvtier_session_begin_step(device.session, KVTIER_STEP_DECODE, &device.err), KVTIER_OK);
    for (int layer = 0; layer < kLayers; ++layer) {
      SCOPED_TRACE("position " + std::to_string(t) + ", layer " + std::to_string(layer));
      for (float& x : k) x = normal(rng);
      for (float& x : v) x = normal(rng);
      for (float& x : q) x = normal(rng);
      kvtier_attend_stats want_stats{}, got_stats{};
      ASSERT_EQ(kvtier_session_append(host.session, layer, k.data(), v.data(), 1, KVTIER_F32, &host.err),
                KVTIER_OK)
          << host.err.message;
      ASSERT_EQ(
          kvtier_session_attend(host.session, layer, q.data(), &t, 1, want.data(), &want_stats, &host.err),
          KVTIER_OK)
          << host.err.message;

      std::memcpy(pk, k.data(), kv_bytes);
      std::memcpy(pv, v.data(), kv_bytes);
      std::memcpy(pq, q.data(), q_bytes);
      ASSERT_EQ(cudaMemcpyAsync(k_dev.ptr, pk, kv_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(v_dev.ptr, pv, kv_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(q_dev.ptr, pq, q_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      ASSERT_EQ(kvtier_session_append_device(device.session, layer, k_dev.ptr, v_dev.ptr, 1, KVTIER_F32,
                                             engine, &device.err),
                KVTIER_OK)
          << device.err.message;
      ASSERT_EQ(
          kvtier_session_attend_device(device.session, layer, static_cast<const float*>(q_dev.ptr), &t, 1,
                                       static_cast<float*>(out_dev.ptr), engine, &got_stats, &device.err),
          KVTIER_OK)
          << device.err.message;
      EXPECT_EQ(device.err.code, KVTIER_OK);
      EXPECT_STREQ(device.err.message, "");
      ASSERT_EQ(cudaMemcpyAsync(pout, out_dev.ptr, q_bytes, cudaMemcpyDeviceToHost, engine), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);
      ASSERT_EQ(std::memcmp(pout, want.data(), q_bytes), 0) << "device output differs from the host call's";
      want_chunks += want_stats.chunks;  // the device lane's are known one step late (counters)
      ++compared;
    }
  }
  EXPECT_EQ(compared, kTokens * kLayers);
  ASSERT_EQ(kvtier_session_wait_for_device(device.session, &device.err), KVTIER_OK) << device.err.message;
  kvtier_session_counters got, want_counters;
  ASSERT_EQ(kvtier_session_get_counters(device.session, &got, &device.err), KVTIER_OK);
  ASSERT_EQ(kvtier_session_get_counters(host.session, &want_counters, &host.err), KVTIER_OK);
  EXPECT_EQ(got.tokens_appended, static_cast<uint64_t>(kTokens) * kLayers);
  EXPECT_GT(got.chunks_attended, 0u) << "no chunk was retrieved: the run never left the local window";
  EXPECT_EQ(got.chunks_attended, want_counters.chunks_attended);
  EXPECT_EQ(got.chunks_attended, want_chunks);
  kvtier_store_counters sc;
  ASSERT_EQ(kvtier_store_get_counters(device.store, &sc, &device.err), KVTIER_OK);
  EXPECT_GT(sc.chunks_sealed, 0u);
  cudaFreeHost(pinned);
  cudaStreamDestroy(engine);
}

#endif  // KVTIER_HAVE_CUDA

}  // namespace
}  // namespace kvtier
