// The device lane (engine/device_lane.h): a decode layer step through Session::AttendDevice that
// runs probe -> scores -> Eq. 11 -> Eq. 12 -> top-B -> chunk table -> gather from warm ->
// attention on the device with no host wait. Against a session driven through the host calls
// (Attend) on a store of the same options: the same chunks per layer (read back from the step
// reports, one step late, or by WaitForDevice) and outputs within 1e-4, over decode steps that
// cross seals, in both position modes, f16 and f32, heads sum and max, topk and entropy
// allocators, with steps and layers switched to the host path in between (the allocator's state
// then comes back from the device and goes up again). Quiet lane steps make no host wait. A
// store whose warm tier turns over waits on the lane's fence, moves its epoch and the lane asks
// again; a layer with a chunk only in the cold tier takes the host path, which brings the chunk
// back to warm. Built into the emulated-GPU run (Makefile's GPU_EMU_TESTS); the cases skip,
// saying why, where no CUDA device exists.
#include "engine/device_lane.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/session_internal.h"
#include "kernels/dtype.h"
#include "kvtier/session.h"
#include "offload/device_memory.h"
#include "offload/device_sync.h"
#include "offload/store_hooks.h"
#include "offload/tiered_store.h"
#include "tests/device_test_util.h"
#include "tests/test_util.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#endif

namespace kvtier {
namespace {

constexpr int kLayers = 3, kQHeads = 4, kKvHeads = 2, kDim = 32;

StoreOptions LaneStore(DType dtype, const std::string& data_dir = "", int warm_chunks = 512) {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, dtype};
  so.n_sink = 8;
  so.n_local = 32;
  so.chunk_size = 8;
  so.repr_topk = 2;
  so.hot_bytes = 64 * so.chunk_bytes();
  so.warm_bytes = static_cast<uint64_t>(warm_chunks) * so.chunk_bytes();
  so.device = Device::kCuda;
  if (!data_dir.empty()) {
    so.data_dir = data_dir;
    so.warm_policy = "lru";
  }
  return so;
}

TEST(DeviceLane, OptionsRefuseWhatIsOutOfRangeByName) {
  DeviceLaneOptions o;
  o.layers = 2, o.q_heads = 4, o.kv_heads = 2, o.head_dim = 32, o.chunk_tokens = 8, o.slots = 6,
  o.max_rows = 6;
  EXPECT_TRUE(o.Validate().ok());
  o.max_rows = 7;  // more rows than slots: a layer's grant could overflow the pool
  const Status s = o.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("max_rows"), std::string::npos) << s.ToString();
}

#if KVTIER_HAVE_CUDA

using device_test::DeviceArray;
using device_test::HaveDevice;

struct LaneCase {
  PositionMode positions = PositionMode::kAbsolute;
  DType dtype = DType::kF16;
  std::string alloc = "entropy:min=1,rank=cosine";
  std::string index = "Exact:heads=sum";
  int steps = 120;
  bool flush_each_step = true;  // WaitForDevice after every step, chunks compared every step
  bool switch_to_host = false;  // some steps and layers of the lane session through Attend
  int warm_chunks = 512;        // with fewer, a cold tier under warm (turnover)
  // The lane store holds chunks landing (StoreHooks::hold_landing) for 12 of every 20 steps, so
  // that lane steps score chunks still landing as rows; the host store lands each at once.
  bool hold_landing = false;
  bool defer_cold = false;  // SessionOptions::defer_cold_chunks of the lane session
};

struct LaneResult {
  uint64_t lane_layer_steps = 0, quiet_lane_steps = 0, quiet_waits = 0, seal_lane_steps = 0, seal_waits = 0;
  uint64_t host_layer_steps = 0, cold_layers = 0, fences = 0;
  uint64_t deferred = 0, deferred_layer_steps = 0;  // chunks the lane chose with no warm copy
  // A deferred chunk the lane attended at a later step of its layer: in all, and in a layer step
  // with no deferral (whose output is then checked against the host calls').
  uint64_t returned = 0, returned_exact = 0;
  uint64_t attend_thread_waits = 0;  // on the test's thread, in the lane session's lane layer steps
  uint64_t lane_hot_misses = 0, lane_cold_reads = 0;    // the lane store's: promotions into hot, cold reads
  uint64_t lane_step_syncs = 0, lane_worker_syncs = 0;  // the lane session's two host-sync columns
  uint64_t chunks_attended = 0, landing_rows = 0;
  double max_diff = 0;
};

void RunLaneAgainstHostCalls(const LaneCase& c, LaneResult* r) {
  TempDir host_dir, lane_dir;
  const bool lower = c.warm_chunks < 512;
  auto host_store = TieredStore::Open(LaneStore(c.dtype, lower ? host_dir.path() : "", c.warm_chunks));
  bool hold = false;
  StoreHooks hooks;
  if (c.hold_landing) hooks.hold_landing = [&hold] { return hold; };
  auto lane_store = TieredStore::Open(LaneStore(c.dtype, lower ? lane_dir.path() : "", c.warm_chunks), hooks);
  ASSERT_TRUE(host_store.ok()) << host_store.status().ToString();
  ASSERT_TRUE(lane_store.ok()) << lane_store.status().ToString();
  SessionOptions o;
  o.retrieval.budget_tokens = 24;  // k = 3 chunks a layer
  o.retrieval.alloc = c.alloc;
  o.retrieval.index = c.index;
  o.positions = c.positions;
  auto hs = Session::Open(host_store->get(), o);
  o.defer_cold_chunks = c.defer_cold;
  auto ls = Session::Open(lane_store->get(), o);
  ASSERT_TRUE(hs.ok()) << hs.status().ToString();
  ASSERT_TRUE(ls.ok()) << ls.status().ToString();
  SessionImpl& lane = ImplOf(**ls);

  cudaStream_t engine = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine, cudaStreamNonBlocking), cudaSuccess);
  const size_t ds = DTypeSize(c.dtype);
  const size_t kv_bytes = kKvHeads * kDim * ds, q_floats = kQHeads * kDim, q_bytes = q_floats * sizeof(float);
  DeviceArray k_dev(kv_bytes * kLayers), v_dev(kv_bytes * kLayers), q_dev(q_bytes * kLayers),
      out_dev(q_bytes * kLayers);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, kLayers * (2 * kv_bytes + 2 * q_bytes)), cudaSuccess);
  auto* pk = static_cast<uint8_t*>(pinned);
  uint8_t *pv = pk + kLayers * kv_bytes, *pq = pv + kLayers * kv_bytes, *pout = pq + kLayers * q_bytes;

  std::mt19937 rng(c.positions == PositionMode::kInfLLM ? 31 : 29);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> host_out(q_floats * kLayers), lane_out(q_floats * kLayers);
  uint64_t seals_seen = 0;  // chunks sealed by the lane store so far, landed or landing
  std::vector<std::set<uint64_t>> pending(kLayers);  // by layer: chunks deferred, not attended since
  for (int64_t p = 0; p < c.steps; ++p) {
    hold = p % 20 < 12;
    ASSERT_TRUE((*hs)->BeginStep(StepKind::kDecode).ok());
    ASSERT_TRUE((*ls)->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE("position " + std::to_string(p) + ", layer " + std::to_string(l));
      std::vector<float> kf(kKvHeads * kDim), vf(kf.size()), q(q_floats);
      for (float& x : kf) x = nd(rng);
      for (float& x : vf) x = nd(rng);
      for (float& x : q) x = nd(rng) * (p % 7 == 0 ? 3.0f : 1.0f);
      uint8_t* k = pk + l * kv_bytes;
      uint8_t* v = pv + l * kv_bytes;
      FromFloat(c.dtype, kf.data(), k, kf.size());
      FromFloat(c.dtype, vf.data(), v, vf.size());
      std::memcpy(pq + l * q_bytes, q.data(), q_bytes);
      ASSERT_TRUE((*hs)->Append(l, k, v, 1, c.dtype).ok());
      Status st = (*hs)->Attend(l, q.data(), &p, 1, host_out.data() + l * q_floats);
      ASSERT_TRUE(st.ok()) << st.ToString();

      // The lane session: the engine writes K, V and q on its stream and calls at once.
      uint8_t* kd = static_cast<uint8_t*>(k_dev.ptr) + l * kv_bytes;
      uint8_t* vd = static_cast<uint8_t*>(v_dev.ptr) + l * kv_bytes;
      auto* qd = reinterpret_cast<float*>(static_cast<uint8_t*>(q_dev.ptr) + l * q_bytes);
      auto* od = reinterpret_cast<float*>(static_cast<uint8_t*>(out_dev.ptr) + l * q_bytes);
      ASSERT_EQ(cudaMemcpyAsync(kd, k, kv_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(vd, v, kv_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(qd, pq + l * q_bytes, q_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      st = (*ls)->AppendDevice(l, kd, vd, 1, c.dtype, engine);
      ASSERT_TRUE(st.ok()) << st.ToString();
      const bool host_here = c.switch_to_host && (p % 10 == 3 || (p % 10 == 6 && l == 1));
      const uint64_t lane_before = lane.lane_layer_steps();
      const uint64_t w0 = HostSyncsTotal();
      uint64_t thread_waits = 0;  // on this thread, in the lane session's AttendDevice
      if (host_here) {            // the same decode layer through the host call: the host path
        ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);
        st = (*ls)->Attend(l, q.data(), &p, 1, lane_out.data() + l * q_floats);
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_EQ(
            cudaMemcpyAsync(od, lane_out.data() + l * q_floats, q_bytes, cudaMemcpyHostToDevice, engine),
            cudaSuccess);
      } else {
        const uint64_t t0 = HostSyncsOnThisThread();
        st = (*ls)->AttendDevice(l, qd, &p, 1, od, engine);
        thread_waits = HostSyncsOnThisThread() - t0;
        ASSERT_TRUE(st.ok()) << st.ToString();
      }
      const uint64_t waits = HostSyncsTotal() - w0;
      // A step whose Append sealed a chunk (landing or landed since).
      const StoreCounters sc = (*lane_store)->counters();
      const bool sealed = sc.chunks_sealed + sc.chunks_landing != seals_seen;
      seals_seen = sc.chunks_sealed + sc.chunks_landing;
      if (lane.lane_layer_steps() > lane_before) {
        ++r->lane_layer_steps;
        r->attend_thread_waits += thread_waits;
        if (sealed) {
          ++r->seal_lane_steps;
          r->seal_waits += waits;
        } else {
          ++r->quiet_lane_steps;
          r->quiet_waits += waits;
        }
      } else {
        ++r->host_layer_steps;
      }
    }
    // The engine reads the outputs on its stream; the test then waits for them.
    ASSERT_EQ(cudaMemcpyAsync(pout, out_dev.ptr, kLayers * q_bytes, cudaMemcpyDeviceToHost, engine),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);
    // A layer whose chosen chunks included one with no warm copy (not in the lane's pool either)
    // attended without it (deferred): its chunks are the host's less those, its output differs.
    std::vector<bool> deferred_here(kLayers, false);
    if (c.flush_each_step) {
      const Status st = (*ls)->WaitForDevice();
      ASSERT_TRUE(st.ok()) << st.ToString();
      for (int l = 0; l < kLayers; ++l) {
        const std::vector<uint64_t>& lc = (*ls)->last_chunks()[l];
        const std::vector<uint64_t>& hc = (*hs)->last_chunks()[l];
        for (uint64_t id : lc)
          if (pending[static_cast<size_t>(l)].erase(id) > 0) {
            ++r->returned;
            if (lc == hc) ++r->returned_exact;
          }
        if (lc == hc) continue;
        for (uint64_t id : hc)
          if (std::find(lc.begin(), lc.end(), id) == lc.end()) pending[static_cast<size_t>(l)].insert(id);
        for (uint64_t id : lc)
          ASSERT_NE(std::find(hc.begin(), hc.end(), id), hc.end())
              << "position " << p << ", layer " << l << ": the lane attended chunk " << id
              << " the host did not";
        deferred_here[static_cast<size_t>(l)] = true;
        ++r->deferred_layer_steps;
      }
    }
    for (size_t i = 0; i < q_floats * kLayers; ++i) {
      if (deferred_here[i / q_floats]) continue;
      float x = 0;
      std::memcpy(&x, pout + i * sizeof(float), sizeof x);
      const double d = std::fabs(static_cast<double>(x) - host_out[i]);
      r->max_diff = std::max(r->max_diff, d);
      ASSERT_LE(d, 1e-4) << "position " << p << ", layer " << i / q_floats << ", element " << i % q_floats
                         << ": lane " << x << ", host " << host_out[i];
    }
  }
  const Status st = (*ls)->WaitForDevice();
  ASSERT_TRUE(st.ok()) << st.ToString();
  r->deferred = (*ls)->counters().chunks_deferred;
  if (r->deferred == 0)
    for (int l = 0; l < kLayers; ++l)
      EXPECT_EQ((*ls)->last_chunks()[l], (*hs)->last_chunks()[l]) << "layer " << l;
  // The same choice: what the lane attended and what it deferred are what the host attended.
  EXPECT_EQ((*ls)->counters().chunks_attended + r->deferred, (*hs)->counters().chunks_attended);
  if (r->deferred == 0) EXPECT_EQ((*ls)->counters().max_layer_chunks, (*hs)->counters().max_layer_chunks);
  EXPECT_EQ(lane.lane_reports_read(), lane.lane_layer_steps()) << "every lane layer's report was read";
  r->chunks_attended = (*ls)->counters().chunks_attended;
  r->cold_layers = lane.lane_unprepared_layers();
  r->landing_rows = lane.lane_landing_rows();
  r->fences = (*lane_store)->counters().warm_reader_fences;
  r->lane_hot_misses = (*lane_store)->counters().misses;
  r->lane_cold_reads = (*lane_store)->counters().cold_reads;
  r->lane_step_syncs = (*ls)->counters().host_syncs;
  r->lane_worker_syncs = (*ls)->counters().worker_host_syncs;
  cudaFreeHost(pinned);
  cudaStreamDestroy(engine);
}

void ExpectLaneRan(const LaneResult& r, int steps) {
  // Every decode layer step with chunks ran on the lane: the first chunk lands at token 48
  // (8 sinks, a ring of 32 + 8 local tokens), and the steps before it have nothing to select.
  EXPECT_EQ(r.lane_layer_steps, static_cast<uint64_t>(steps - 48) * kLayers);
  EXPECT_GT(r.chunks_attended, 0u);
  EXPECT_GT(r.seal_lane_steps, 0u) << "no lane step crossed a seal";
  EXPECT_EQ(r.quiet_waits, 0u) << "a quiet lane layer step waited on the host";
}

#define SKIP_WITHOUT_DEVICE() \
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString()

TEST(DeviceLane, EntropyHeadsSumAbsoluteF16GivesTheHostCallsChunksAndOutputs) {
  SKIP_WITHOUT_DEVICE();
  LaneCase c;
  c.hold_landing = true;
  LaneResult r;
  RunLaneAgainstHostCalls(c, &r);
  ExpectLaneRan(r, c.steps);
  EXPECT_GT(r.landing_rows, 0u) << "no lane step scored a chunk still landing";
  std::printf(
      "lane layer steps %llu (quiet %llu: %llu waits; with a seal %llu: %llu waits), max |diff| %.3g\n",
      static_cast<unsigned long long>(r.lane_layer_steps),
      static_cast<unsigned long long>(r.quiet_lane_steps), static_cast<unsigned long long>(r.quiet_waits),
      static_cast<unsigned long long>(r.seal_lane_steps), static_cast<unsigned long long>(r.seal_waits),
      r.max_diff);
}

TEST(DeviceLane, EntropyHeadsMaxInfLLMF32GivesTheHostCallsChunksAndOutputs) {
  SKIP_WITHOUT_DEVICE();
  LaneCase c;
  c.positions = PositionMode::kInfLLM;
  c.dtype = DType::kF32;
  c.alloc = "entropy:min=1,rank=logit";
  c.index = "Exact:heads=max";
  c.hold_landing = true;
  LaneResult r;
  RunLaneAgainstHostCalls(c, &r);
  ExpectLaneRan(r, c.steps);
  EXPECT_GT(r.landing_rows, 0u) << "no lane step scored a chunk still landing";
}

TEST(DeviceLane, TopKHeadsMaxAbsoluteF32GivesTheHostCallsChunksAndOutputs) {
  SKIP_WITHOUT_DEVICE();
  LaneCase c;
  c.dtype = DType::kF32;
  c.alloc = "topk";
  c.index = "Exact:heads=max";
  c.hold_landing = true;
  LaneResult r;
  RunLaneAgainstHostCalls(c, &r);
  ExpectLaneRan(r, c.steps);
}

TEST(DeviceLane, TopKHeadsSumInfLLMF16GivesTheHostCallsChunksAndOutputs) {
  SKIP_WITHOUT_DEVICE();
  LaneCase c;
  c.positions = PositionMode::kInfLLM;
  c.alloc = "topk";
  LaneResult r;
  RunLaneAgainstHostCalls(c, &r);
  ExpectLaneRan(r, c.steps);
}

// Steps and single layers of the lane session through the host call: Eq. 12's state comes back
// from the device (one wait at the switch) and goes up again, and the flow stays the host's.
TEST(DeviceLane, SwitchingBetweenLaneAndHostPathKeepsOneEq12Flow) {
  SKIP_WITHOUT_DEVICE();
  LaneCase c;
  c.switch_to_host = true;
  LaneResult r;
  RunLaneAgainstHostCalls(c, &r);
  EXPECT_GT(r.host_layer_steps, static_cast<uint64_t>(c.steps / 10) * kLayers);
  EXPECT_GT(r.lane_layer_steps, static_cast<uint64_t>(c.steps));
  EXPECT_EQ(r.quiet_waits, 0u);
}

// Reports read one step late, without WaitForDevice each step: no lane step waits for anything,
// neither a quiet one nor one that seals a chunk (chunks landing are scored on the device, and
// land later without a wait), and the chunks and counters still match once the last report is
// read.
TEST(DeviceLane, LaneStepsMakeNoHostWaitAcrossSealsWithReportsReadOneStepLate) {
  SKIP_WITHOUT_DEVICE();
  LaneCase c;
  c.steps = 160;
  c.flush_each_step = false;
  c.hold_landing = true;
  LaneResult r;
  RunLaneAgainstHostCalls(c, &r);
  ExpectLaneRan(r, c.steps);
  EXPECT_GT(r.quiet_lane_steps, 100u);
  EXPECT_GE(r.seal_lane_steps, 16u);
  EXPECT_EQ(r.seal_waits, 0u) << "a lane step that sealed a chunk waited on the host";
  EXPECT_GT(r.landing_rows, 0u) << "no lane step scored a chunk still landing";
  std::printf(
      "host syncs: quiet lane layer steps %llu -> %llu waits; lane layer steps with a seal %llu -> %llu "
      "waits (%.2f each); rows of chunks still landing scored %llu\n",
      static_cast<unsigned long long>(r.quiet_lane_steps), static_cast<unsigned long long>(r.quiet_waits),
      static_cast<unsigned long long>(r.seal_lane_steps), static_cast<unsigned long long>(r.seal_waits),
      r.seal_lane_steps ? static_cast<double>(r.seal_waits) / r.seal_lane_steps : 0.0,
      static_cast<unsigned long long>(r.landing_rows));
}

// Warm holds 24 chunks of the ~60 the run seals, over a cold tier: warm turns over, the store
// waits on the lane's fence and moves the epoch, the lane asks for the addresses again, and a
// layer with a chunk only in the cold tier takes the host path (whose fetch reads it back).
// Outputs and chunks stay the host calls'.
TEST(DeviceLane, WarmTurnoverWaitsOnTheFenceAndTheLaneAsksAgain) {
  SKIP_WITHOUT_DEVICE();
  LaneCase c;
  c.steps = 200;
  c.warm_chunks = 24;
  LaneResult r;
  RunLaneAgainstHostCalls(c, &r);
  EXPECT_GT(r.fences, 0u) << "warm never turned over an exposed slot";
  EXPECT_GT(r.lane_layer_steps, 0u);
  EXPECT_GT(r.cold_layers, 0u) << "no layer had a chunk only in the cold tier";
  EXPECT_EQ(r.deferred, 0u);
  EXPECT_EQ(r.deferred_layer_steps, 0u);
  std::printf("warm turnover: fences %llu, cold layers (host path) %llu, lane layer steps %llu\n",
              static_cast<unsigned long long>(r.fences), static_cast<unsigned long long>(r.cold_layers),
              static_cast<unsigned long long>(r.lane_layer_steps));
}

// The same with defer_cold_chunks: a chosen chunk only in the cold tier (and not in the lane's
// pool) is deferred: the layer attends without it, the session's warm-only fetch
// (TieredStore::FetchToWarm) brings it back to warm on a transfer worker, and a later step
// attends it from its warm copy. Every layer step runs on the lane; the layers with no deferral
// give the host calls' outputs, the others attend the host's chunks less the deferred. No
// deferred chunk goes into a hot slot (the lane store counts no hot miss: no upload), and the
// lane's AttendDevice calls wait for nothing on the test's thread.
TEST(DeviceLane, WarmTurnoverDefersColdChunksOnTheLane) {
  SKIP_WITHOUT_DEVICE();
  LaneCase c;
  c.steps = 200;
  c.warm_chunks = 24;
  c.defer_cold = true;
  LaneResult r;
  RunLaneAgainstHostCalls(c, &r);
  EXPECT_GT(r.fences, 0u) << "warm never turned over an exposed slot";
  // Every decode layer step with chunks ran on the lane (the fence's waits and the deferred
  // chunks' fetches make host waits here: warm turns over).
  EXPECT_EQ(r.lane_layer_steps, static_cast<uint64_t>(c.steps - 48) * kLayers);
  EXPECT_EQ(r.cold_layers, 0u);
  EXPECT_GT(r.deferred, 0u) << "no chosen chunk was only in the cold tier";
  EXPECT_LT(r.deferred_layer_steps, r.lane_layer_steps / 2) << "deferred chunks did not come back to warm";
  EXPECT_GT(r.returned_exact, 0u) << "no deferred chunk was attended later, in a step equal to the host's";
  EXPECT_GT(r.lane_cold_reads, 0u) << "no deferred chunk was read back from the cold tier";
  EXPECT_EQ(r.lane_hot_misses, 0u) << "deferred chunks were promoted into hot slots (uploaded)";
  EXPECT_EQ(r.attend_thread_waits, 0u) << "a lane AttendDevice call waited on the step's thread";
  std::printf(
      "warm turnover: fences %llu, lane layer steps %llu, %llu of them with deferred chunks (%llu chunks "
      "deferred, %llu attended later, %llu of them in a step equal to the host's), the rest the host calls' "
      "outputs (max |diff| %.3g); cold reads %llu, hot misses %llu; host syncs: step %llu, workers %llu\n",
      static_cast<unsigned long long>(r.fences), static_cast<unsigned long long>(r.lane_layer_steps),
      static_cast<unsigned long long>(r.deferred_layer_steps), static_cast<unsigned long long>(r.deferred),
      static_cast<unsigned long long>(r.returned), static_cast<unsigned long long>(r.returned_exact),
      r.max_diff, static_cast<unsigned long long>(r.lane_cold_reads),
      static_cast<unsigned long long>(r.lane_hot_misses), static_cast<unsigned long long>(r.lane_step_syncs),
      static_cast<unsigned long long>(r.lane_worker_syncs));
}

// A query holding NaN on the lane: the call returns (the device checks q, nothing waits; the
// step's output means nothing), and the report's reader refuses it by name one step late
// (WaitForDevice here); the steps after it run on the lane again.
TEST(DeviceLane, ANonFiniteQueryIsRefusedByNameOneStepLate) {
  SKIP_WITHOUT_DEVICE();
  auto store = TieredStore::Open(LaneStore(DType::kF16));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  SessionOptions o;
  o.retrieval.budget_tokens = 24;
  auto s = Session::Open(store->get(), o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  cudaStream_t engine = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine, cudaStreamNonBlocking), cudaSuccess);
  const size_t kv_bytes = kKvHeads * kDim * sizeof(uint16_t), q_bytes = kQHeads * kDim * sizeof(float);
  DeviceArray k_dev(kv_bytes), v_dev(kv_bytes), q_dev(q_bytes), out_dev(q_bytes);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> kf(kKvHeads * kDim), q(kQHeads * kDim);
  std::vector<uint16_t> kh(kf.size());
  const uint64_t lane0 = ImplOf(**s).lane_layer_steps();
  for (int64_t p = 0; p < 64; ++p) {
    ASSERT_TRUE((*s)->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      for (float& x : kf) x = nd(rng);
      for (float& x : q) x = nd(rng);
      const bool poison = p == 60 && l == 1;
      if (poison) q[2 * kDim + 5] = std::nanf("");
      FromFloat(DType::kF16, kf.data(), kh.data(), kf.size());
      ASSERT_EQ(cudaMemcpy(k_dev.ptr, kh.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(v_dev.ptr, kh.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(q_dev.ptr, q.data(), q_bytes, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE((*s)->AppendDevice(l, k_dev.ptr, v_dev.ptr, 1, DType::kF16, engine).ok());
      const uint64_t lane_before = ImplOf(**s).lane_layer_steps();
      const Status st = (*s)->AttendDevice(l, static_cast<const float*>(q_dev.ptr), &p, 1,
                                           static_cast<float*>(out_dev.ptr), engine);
      ASSERT_TRUE(st.ok()) << st.ToString();
      if (!poison) continue;
      ASSERT_GT(ImplOf(**s).lane_layer_steps(), lane_before) << "the poisoned layer did not run on the lane";
      ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);
      const Status late = (*s)->WaitForDevice();
      EXPECT_EQ(late.code(), StatusCode::kInvalidArgument) << late.ToString();
      EXPECT_NE(late.message().find("layer 1: q[0][2][5] is not finite"), std::string::npos)
          << late.ToString();
      EXPECT_NE(late.message().find("one step late"), std::string::npos) << late.ToString();
      EXPECT_TRUE((*s)->WaitForDevice().ok()) << "the report was read once";
    }
  }
  EXPECT_TRUE((*s)->WaitForDevice().ok());
  EXPECT_GT(ImplOf(**s).lane_layer_steps(), lane0 + 40);
  cudaStreamSynchronize(engine);
  cudaStreamDestroy(engine);
}

// A decode step between seals, every layer's AppendDevice and AttendDevice on the engine's
// stream, captured into a CUDA graph and launched: its outputs are the host calls' (and so the
// eager lane's), and launching the graph again gives them again (the same step replayed: the
// ring's writes and the chain's choices repeat). The capture is Relaxed (kvtier's pinned staging
// queries its events to recycle entries, which Global mode refuses); a pageable copy or a sync of
// a capturing stream would still fail it, and the step makes no counted host wait and no device
// allocation while captured. The session then goes on eagerly.
TEST(DeviceLane, ACapturedDecodeStepReplaysEqualToTheEagerOne) {
  SKIP_WITHOUT_DEVICE();
  auto host_store = TieredStore::Open(LaneStore(DType::kF16));
  auto lane_store = TieredStore::Open(LaneStore(DType::kF16));
  ASSERT_TRUE(host_store.ok() && lane_store.ok());
  SessionOptions o;
  o.retrieval.budget_tokens = 24;
  auto hs = Session::Open(host_store->get(), o);
  auto ls = Session::Open(lane_store->get(), o);
  ASSERT_TRUE(hs.ok() && ls.ok());
  SessionImpl& lane = ImplOf(**ls);
  cudaStream_t engine = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine, cudaStreamNonBlocking), cudaSuccess);
  const size_t kv_bytes = kKvHeads * kDim * sizeof(uint16_t), q_floats = kQHeads * kDim,
               q_bytes = q_floats * sizeof(float);
  DeviceArray k_dev(kv_bytes * kLayers), v_dev(kv_bytes * kLayers), q_dev(q_bytes * kLayers),
      out_dev(q_bytes * kLayers);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, kLayers * (2 * kv_bytes + 2 * q_bytes)), cudaSuccess);
  auto* pk = static_cast<uint8_t*>(pinned);
  uint8_t *pv = pk + kLayers * kv_bytes, *pq = pv + kLayers * kv_bytes, *pout = pq + kLayers * q_bytes;
  std::mt19937 rng(41);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> host_out(q_floats * kLayers);
  // The step captured: between seals (the ring seals at 48, 56, 64, 72, ...) with chunks indexed.
  const int64_t captured = 69;
  int captures = 0;
  for (int64_t p = 0; p < 80; ++p) {
    SCOPED_TRACE("position " + std::to_string(p));
    ASSERT_TRUE((*hs)->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> kf(kKvHeads * kDim), vf(kf.size()), q(q_floats);
      for (float& x : kf) x = nd(rng);
      for (float& x : vf) x = nd(rng);
      for (float& x : q) x = nd(rng);
      FromFloat(DType::kF16, kf.data(), pk + l * kv_bytes, kf.size());
      FromFloat(DType::kF16, vf.data(), pv + l * kv_bytes, vf.size());
      std::memcpy(pq + l * q_bytes, q.data(), q_bytes);
      ASSERT_TRUE((*hs)->Append(l, pk + l * kv_bytes, pv + l * kv_bytes, 1, DType::kF16).ok());
      ASSERT_TRUE((*hs)->Attend(l, q.data(), &p, 1, host_out.data() + l * q_floats).ok());
    }
    const bool capture = p == captured;
    if (capture) {
      // The lane's reports of earlier steps are read first: a full ring would wait (refused here).
      ASSERT_TRUE((*ls)->WaitForDevice().ok());
      ASSERT_EQ(cudaStreamBeginCapture(engine, cudaStreamCaptureModeRelaxed), cudaSuccess);
    }
    const uint64_t syncs0 = HostSyncsTotal(), device_bytes0 = ReadDeviceMemory().current_total;
    const uint64_t lane_before = lane.lane_layer_steps();
    ASSERT_TRUE((*ls)->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < kLayers; ++l) {
      uint8_t* kd = static_cast<uint8_t*>(k_dev.ptr) + l * kv_bytes;
      uint8_t* vd = static_cast<uint8_t*>(v_dev.ptr) + l * kv_bytes;
      auto* qd = reinterpret_cast<float*>(static_cast<uint8_t*>(q_dev.ptr) + l * q_bytes);
      auto* od = reinterpret_cast<float*>(static_cast<uint8_t*>(out_dev.ptr) + l * q_bytes);
      ASSERT_EQ(cudaMemcpyAsync(kd, pk + l * kv_bytes, kv_bytes, cudaMemcpyHostToDevice, engine),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(vd, pv + l * kv_bytes, kv_bytes, cudaMemcpyHostToDevice, engine),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(qd, pq + l * q_bytes, q_bytes, cudaMemcpyHostToDevice, engine), cudaSuccess);
      Status st = (*ls)->AppendDevice(l, kd, vd, 1, DType::kF16, engine);
      ASSERT_TRUE(st.ok()) << st.ToString();
      st = (*ls)->AttendDevice(l, qd, &p, 1, od, engine);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    ASSERT_EQ(cudaMemcpyAsync(pout, out_dev.ptr, kLayers * q_bytes, cudaMemcpyDeviceToHost, engine),
              cudaSuccess);
    auto expect_host_outputs = [&](const char* what) {
      for (size_t i = 0; i < q_floats * kLayers; ++i) {
        float x = 0;
        std::memcpy(&x, pout + i * sizeof(float), sizeof x);
        ASSERT_NEAR(x, host_out[i], 1e-4)
            << what << ": layer " << i / q_floats << ", element " << i % q_floats;
      }
    };
    if (capture) {
      EXPECT_EQ(lane.lane_layer_steps(), lane_before + kLayers)
          << "the captured step did not run on the lane";
      EXPECT_EQ(HostSyncsTotal(), syncs0) << "the captured step waited on the host";
      EXPECT_EQ(ReadDeviceMemory().current_total, device_bytes0)
          << "the captured step allocated device memory";
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamEndCapture(engine, &graph), cudaSuccess) << "the step could not be captured";
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      std::memset(pout, 0, kLayers * q_bytes);
      ASSERT_EQ(cudaGraphLaunch(exec, engine), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);
      expect_host_outputs("the captured step, launched");
      std::memset(pout, 0, kLayers * q_bytes);
      ASSERT_EQ(cudaGraphLaunch(exec, engine), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);
      expect_host_outputs("the captured step, launched again");
      ASSERT_TRUE((*ls)->WaitForDevice().ok());
      for (int l = 0; l < kLayers; ++l)
        EXPECT_EQ((*ls)->last_chunks()[l], (*hs)->last_chunks()[l]) << "layer " << l;
      EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
      EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
      ++captures;
    } else {
      ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);
      expect_host_outputs("eager");
    }
  }
  EXPECT_EQ(captures, 1);
  ASSERT_TRUE((*ls)->WaitForDevice().ok());
  cudaFreeHost(pinned);
  cudaStreamDestroy(engine);
}

#else

TEST(DeviceLane, NeedsACudaDevice) {
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off)";
}

#endif  // KVTIER_HAVE_CUDA

}  // namespace
}  // namespace kvtier
