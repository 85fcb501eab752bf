// The device-pointer calls of a Session (AppendDevice, AttendDevice): on the cuda hot tier they
// give the host-pointer calls' outputs and chunks bit for bit, in both position modes, ordered on
// the engine's stream without the host waiting for the appends or the attention; on a host tier,
// with null pointers and after a drop they are refused by name. Built into the emulated-GPU run
// (make test-gpu-emulated, Makefile's GPU_EMU_TESTS); the device cases skip, saying why, where no
// CUDA device exists.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/session_internal.h"
#include "kernels/dtype.h"
#include "kvtier/session.h"
#include "offload/device_sync.h"
#include "offload/tiered_store.h"
#include "tests/device_test_util.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#endif

namespace kvtier {
namespace {

constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kDim = 32;

StoreOptions SmallStore(Device device) {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, DType::kF16};
  so.n_sink = 8;
  so.n_local = 32;
  so.chunk_size = 8;
  so.repr_topk = 2;
  so.hot_bytes = 64 * so.chunk_bytes();
  so.warm_bytes = 256 * so.chunk_bytes();  // every chunk stays warm
  so.device = device;
  return so;
}

TEST(DeviceSession, HostTierRefusesTheDeviceCallsByName) {
  auto store = TieredStore::Open(SmallStore(Device::kCpu));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  SessionOptions o;
  o.retrieval.budget_tokens = 24;
  auto s = Session::Open(store->get(), o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::vector<uint16_t> kv(kKvHeads * kDim);
  std::vector<float> q(kQHeads * kDim), out(q.size());
  const Status a = (*s)->AppendDevice(0, kv.data(), kv.data(), 1, DType::kF16, nullptr);
  EXPECT_EQ(a.code(), StatusCode::kFailedPrecondition) << a.ToString();
  EXPECT_NE(a.message().find("\"cuda\" hot tier"), std::string::npos) << a.ToString();
  EXPECT_NE(a.message().find("AppendDevice"), std::string::npos) << a.ToString();
  int64_t p = 0;
  const Status b = (*s)->AttendDevice(0, q.data(), &p, 1, out.data(), nullptr);
  EXPECT_EQ(b.code(), StatusCode::kFailedPrecondition) << b.ToString();
  EXPECT_NE(b.message().find("AttendDevice"), std::string::npos) << b.ToString();
  EXPECT_EQ((*s)->counters().tokens_appended, 0u);  // nothing was appended
}

#if KVTIER_HAVE_CUDA

using device_test::DeviceArray;
using device_test::HaveDevice;

// One token of every layer: K, V (fp16) and one query (fp32), the same for both sessions.
struct Token {
  std::vector<std::vector<uint16_t>> k, v;  // [layer]
  std::vector<std::vector<float>> q;        // [layer]
};

Token MakeToken(std::mt19937* rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  Token t;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> kf(kKvHeads * kDim), vf(kf.size()), q(kQHeads * kDim);
    for (float& x : kf) x = n(*rng);
    for (float& x : vf) x = n(*rng);
    for (float& x : q) x = n(*rng);
    t.k.emplace_back(kf.size());
    t.v.emplace_back(vf.size());
    FromFloat(DType::kF16, kf.data(), t.k.back().data(), kf.size());
    FromFloat(DType::kF16, vf.data(), t.v.back().data(), vf.size());
    t.q.push_back(std::move(q));
  }
  return t;
}

// Runs the same decode stream through a host-pointer session and a device-pointer session on
// two cuda-tier stores, and checks every layer's output and chunks bit for bit, and that the
// device calls' waits are what their contract says (AppendDevice none; AttendDevice no more
// than its host twin, whose attention waits once for its output).
void RunBothAndCompare(PositionMode positions) {
  auto host_store = TieredStore::Open(SmallStore(Device::kCuda));
  auto dev_store = TieredStore::Open(SmallStore(Device::kCuda));
  ASSERT_TRUE(host_store.ok()) << host_store.status().ToString();
  ASSERT_TRUE(dev_store.ok()) << dev_store.status().ToString();
  SessionOptions o;
  o.retrieval.budget_tokens = 24;
  o.positions = positions;
  auto hs = Session::Open(host_store->get(), o);
  auto ds = Session::Open(dev_store->get(), o);
  ASSERT_TRUE(hs.ok()) << hs.status().ToString();
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  // The device calls' host path, bit for bit with the chunks known at once (the device lane,
  // which decode steps take by default, is compared in tests/engine/device_lane_test.cc).
  ImplOf(**ds).SetDeviceLane(false);

  cudaStream_t engine = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine, cudaStreamNonBlocking), cudaSuccess);
  const size_t kv_bytes = kKvHeads * kDim * sizeof(uint16_t), q_bytes = kQHeads * kDim * sizeof(float);
  // The engine's buffers, reused every step: the ordering on `engine` is what keeps them safe.
  DeviceArray k_dev(kv_bytes), v_dev(kv_bytes), q_dev(q_bytes), out_dev(q_bytes);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 2 * kv_bytes + 2 * q_bytes), cudaSuccess);
  auto* pk = static_cast<uint8_t*>(pinned);
  uint8_t *pv = pk + kv_bytes, *pq = pv + kv_bytes, *pout = pq + q_bytes;

  std::mt19937 rng(positions == PositionMode::kInfLLM ? 23 : 17);
  std::vector<float> host_out(kQHeads * kDim);
  uint64_t append_waits = 0, attend_waits_dev = 0, attend_waits_host = 0, steps_compared = 0;
  uint64_t selected_on_device = 0;  // layer steps whose probe the backend built from q on the device
  for (int64_t p = 0; p < 160; ++p) {
    const Token t = MakeToken(&rng);
    ASSERT_TRUE((*hs)->BeginStep(StepKind::kDecode).ok());
    ASSERT_TRUE((*ds)->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE("position " + std::to_string(p) + ", layer " + std::to_string(l));
      ASSERT_TRUE((*hs)->Append(l, t.k[l].data(), t.v[l].data(), 1, DType::kF16).ok());
      uint64_t w0 = HostSyncsTotal();
      Status st = (*hs)->Attend(l, t.q[l].data(), &p, 1, host_out.data());
      ASSERT_TRUE(st.ok()) << st.ToString();
      attend_waits_host += HostSyncsTotal() - w0;

      // The engine writes K, V and q on its stream and calls at once, without synchronising.
      std::memcpy(pk, t.k[l].data(), kv_bytes);
      std::memcpy(pv, t.v[l].data(), kv_bytes);
      std::memcpy(pq, t.q[l].data(), q_bytes);
      ASSERT_EQ(cudaMemcpyAsync(k_dev.ptr, pk, kv_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(v_dev.ptr, pv, kv_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(q_dev.ptr, pq, q_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      w0 = HostSyncsTotal();
      st = (*ds)->AppendDevice(l, k_dev.ptr, v_dev.ptr, 1, DType::kF16, engine);
      ASSERT_TRUE(st.ok()) << st.ToString();
      append_waits += HostSyncsTotal() - w0;
      w0 = HostSyncsTotal();
      st = (*ds)->AttendDevice(l, static_cast<const float*>(q_dev.ptr), &p, 1,
                               static_cast<float*>(out_dev.ptr), engine);
      ASSERT_TRUE(st.ok()) << st.ToString();
      attend_waits_dev += HostSyncsTotal() - w0;
      // The engine reads the output on its stream; the test then waits for it.
      ASSERT_EQ(cudaMemcpyAsync(pout, out_dev.ptr, q_bytes, cudaMemcpyDeviceToHost, engine), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);
      ASSERT_EQ(0, std::memcmp(pout, host_out.data(), q_bytes))
          << "device output differs from the host call's";
      EXPECT_EQ((*ds)->last_chunks()[l], (*hs)->last_chunks()[l]);
      if (!(*ds)->last_chunks()[l].empty()) ++selected_on_device;
      ++steps_compared;
    }
  }
  EXPECT_EQ(steps_compared, 160u * kLayers);
  EXPECT_GT((*ds)->counters().chunks_attended, 0u);  // retrieval ran: chunks were attended
  EXPECT_EQ((*ds)->counters().chunks_attended, (*hs)->counters().chunks_attended);
  EXPECT_EQ(append_waits, 0u) << "AppendDevice blocked the host";
  // The host call waits for its output, which the device call leaves on the device. The device
  // call waits instead for the backend's check of q where the layer has no chunks to select;
  // where it selects, q stays on the device (rotated there for InfLLM positions) and the call
  // waits at least once less than the host call (a step that seals lands its chunk without a
  // wait there, where the host call may wait for the download).
  EXPECT_GT(selected_on_device, 100u);
  EXPECT_LE(attend_waits_dev + selected_on_device, attend_waits_host);
  cudaFreeHost(pinned);
  cudaStreamDestroy(engine);
}

TEST(DeviceSession, DeviceCallsGiveTheHostCallsOutputsAbsolutePositions) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  RunBothAndCompare(PositionMode::kAbsolute);
}

TEST(DeviceSession, DeviceCallsGiveTheHostCallsOutputsInfLLMPositions) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  RunBothAndCompare(PositionMode::kInfLLM);
}

// A quiet decode layer step through the device calls: AppendDevice waits for nothing; on the
// device calls' host path (the lane off) AttendDevice waits once, for the selection's download
// (the probe is built from q on the device, which never comes down); on the device lane (the
// default) it waits for nothing.
void RunQuietDeviceSteps(bool lane, uint64_t want_waits) {
  auto store = TieredStore::Open(SmallStore(Device::kCuda));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  SessionOptions o;
  o.retrieval.budget_tokens = 24;
  auto s = Session::Open(store->get(), o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ImplOf(**s).SetDeviceLane(lane);
  cudaStream_t engine = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine, cudaStreamNonBlocking), cudaSuccess);
  const size_t kv_bytes = kKvHeads * kDim * sizeof(uint16_t), q_bytes = kQHeads * kDim * sizeof(float);
  DeviceArray k_dev(kv_bytes), v_dev(kv_bytes), q_dev(q_bytes), out_dev(q_bytes);
  std::mt19937 rng(31);
  int quiet = 0;
  for (int64_t p = 0; p < 200; ++p) {
    const Token t = MakeToken(&rng);
    const StoreCounters c0 = (*store)->counters();
    ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
    std::vector<uint64_t> appends, attends;
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_EQ(cudaMemcpy(k_dev.ptr, t.k[l].data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(v_dev.ptr, t.v[l].data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(q_dev.ptr, t.q[l].data(), q_bytes, cudaMemcpyHostToDevice), cudaSuccess);
      uint64_t w0 = HostSyncsTotal();
      ASSERT_TRUE((*s)->AppendDevice(l, k_dev.ptr, v_dev.ptr, 1, DType::kF16, engine).ok());
      appends.push_back(HostSyncsTotal() - w0);
      w0 = HostSyncsTotal();
      const Status st = (*s)->AttendDevice(l, static_cast<const float*>(q_dev.ptr), &p, 1,
                                           static_cast<float*>(out_dev.ptr), engine);
      ASSERT_TRUE(st.ok()) << st.ToString();
      attends.push_back(HostSyncsTotal() - w0);
    }
    const StoreCounters c1 = (*store)->counters();
    for (uint64_t a : appends) EXPECT_EQ(a, 0u) << "position " << p;
    if (p < 120 || c1.chunks_sealed != c0.chunks_sealed || c1.misses != c0.misses || c1.chunks_landing != 0)
      continue;
    ++quiet;
    for (int l = 0; l < kLayers; ++l)
      EXPECT_EQ(attends[l], want_waits) << "quiet step at position " << p << ", layer " << l;
  }
  EXPECT_GE(quiet, 8) << "too few decode steps without a seal or a miss to pin the quiet count";
  EXPECT_TRUE((*s)->WaitForDevice().ok());
  cudaStreamSynchronize(engine);
  cudaStreamDestroy(engine);
}

TEST(DeviceSession, QuietDeviceLayerStepWaitsOnceForTheSelection) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  RunQuietDeviceSteps(/*lane=*/false, 1);
}

TEST(DeviceSession, QuietDeviceLayerStepOnTheLaneWaitsForNothing) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  RunQuietDeviceSteps(/*lane=*/true, 0);
}

TEST(DeviceSession, RefusesNullPointersAndADroppedSequence) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  auto store = TieredStore::Open(SmallStore(Device::kCuda));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  SessionOptions o;
  o.retrieval.budget_tokens = 24;
  auto s = Session::Open(store->get(), o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  DeviceArray kv(kKvHeads * kDim * sizeof(uint16_t)), q(kQHeads * kDim * sizeof(float));
  const Status null_k = (*s)->AppendDevice(0, nullptr, kv.ptr, 1, DType::kF16, nullptr);
  EXPECT_EQ(null_k.code(), StatusCode::kInvalidArgument) << null_k.ToString();
  const Status wrong_dtype = (*s)->AppendDevice(0, kv.ptr, kv.ptr, 1, DType::kF32, nullptr);
  EXPECT_EQ(wrong_dtype.code(), StatusCode::kInvalidArgument) << wrong_dtype.ToString();
  ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
  ASSERT_TRUE((*s)->AppendDevice(0, kv.ptr, kv.ptr, 1, DType::kF16, nullptr).ok());
  int64_t p = 0;
  const Status null_out = (*s)->AttendDevice(0, static_cast<const float*>(q.ptr), &p, 1, nullptr, nullptr);
  EXPECT_EQ(null_out.code(), StatusCode::kInvalidArgument) << null_out.ToString();
  const Status bad_m =
      (*s)->AttendDevice(0, static_cast<const float*>(q.ptr), &p, 0, static_cast<float*>(q.ptr), nullptr);
  EXPECT_EQ(bad_m.code(), StatusCode::kInvalidArgument) << bad_m.ToString();
  int64_t wrong = 5;  // the layer holds position 0 only
  const Status bad_pos =
      (*s)->AttendDevice(0, static_cast<const float*>(q.ptr), &wrong, 1, static_cast<float*>(q.ptr), nullptr);
  EXPECT_EQ(bad_pos.code(), StatusCode::kInvalidArgument) << bad_pos.ToString();
  EXPECT_NE(bad_pos.message().find("AttendDevice"), std::string::npos) << bad_pos.ToString();
  // A NaN query is found where it is (the retrieval backend's check of a decode query that
  // stays on the device) and refused by name, as Attend refuses it.
  std::vector<float> nan_q(kQHeads * kDim, 0.0f);
  nan_q[3] = std::nanf("");
  ASSERT_EQ(cudaMemcpy(q.ptr, nan_q.data(), nan_q.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  DeviceArray out(kQHeads * kDim * sizeof(float));
  const Status nan =
      (*s)->AttendDevice(0, static_cast<const float*>(q.ptr), &p, 1, static_cast<float*>(out.ptr), nullptr);
  EXPECT_EQ(nan.code(), StatusCode::kInvalidArgument) << nan.ToString();
  EXPECT_NE(nan.message().find("Session::AttendDevice: layer 0: q[0][0][3] is not finite"), std::string::npos)
      << nan.ToString();
  ASSERT_TRUE((*s)->Drop().ok());
  const Status dropped = (*s)->AppendDevice(0, kv.ptr, kv.ptr, 1, DType::kF16, nullptr);
  EXPECT_EQ(dropped.code(), StatusCode::kFailedPrecondition) << dropped.ToString();
  const Status dropped2 =
      (*s)->AttendDevice(0, static_cast<const float*>(q.ptr), &p, 1, static_cast<float*>(out.ptr), nullptr);
  EXPECT_EQ(dropped2.code(), StatusCode::kFailedPrecondition) << dropped2.ToString();
}

#endif  // KVTIER_HAVE_CUDA

}  // namespace
}  // namespace kvtier
