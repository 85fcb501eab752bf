// The host-sync counter (offload/device_sync.h): each wrapper counts once per call, the cuda
// hot tier's copies count their waits, a decode step on the cuda tier makes the waits it makes
// today (pinned per layer below: the baseline a device-side step is to drive to 0), a session on
// the cpu tier counts none, and the C API and Python mirrors of SessionCounters keep its fields.
// Waits on a session call's own thread are its host_syncs, a worker thread's meanwhile its
// worker_host_syncs.
// The DeviceSync.* tests that need a device run on the emulated one (make test-gpu-emulated).
#include "offload/device_sync.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/dtype.h"
#include "kvtier/counters.h"
#include "kvtier/kvtier_c.h"
#include "kvtier/session.h"
#include "offload/hot_tier.h"
#include "offload/store_hooks.h"
#include "offload/tiered_store.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "offload/cuda_hot_tier.h"
#include "offload/device_sync_cuda.h"
#include "tests/device_test_util.h"
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
  so.warm_bytes = 256 * so.chunk_bytes();  // every chunk stays warm: no cold reads
  so.device = device;
  return so;
}

std::string Describe(const HostSyncCounts& c) {
  std::string s;
  for (int i = 0; i < kHostSyncKinds; ++i)
    s += std::string(i ? " " : "") + HostSyncKindName(static_cast<HostSyncKind>(i)) + "=" +
         std::to_string(c.by_kind[i]);
  return s;
}

HostSyncCounts Counts(uint64_t stream, uint64_t event, uint64_t device, uint64_t blocking,
                      uint64_t pageable) {
  HostSyncCounts c;
  c.by_kind[static_cast<int>(HostSyncKind::kStream)] = stream;
  c.by_kind[static_cast<int>(HostSyncKind::kEvent)] = event;
  c.by_kind[static_cast<int>(HostSyncKind::kDevice)] = device;
  c.by_kind[static_cast<int>(HostSyncKind::kBlockingCopy)] = blocking;
  c.by_kind[static_cast<int>(HostSyncKind::kPageableCopy)] = pageable;
  return c;
}

bool Same(const HostSyncCounts& a, const HostSyncCounts& b) {
  return std::memcmp(a.by_kind, b.by_kind, sizeof a.by_kind) == 0;
}

// One decode step of every layer: Append one token (host memory) and Attend one query. Returns
// the waits of each Append and each Attend when `appends` / `attends` are given.
// A session over `store` that retrieves 24 tokens a layer (a few of SmallStore's chunks).
Result<std::unique_ptr<Session>> SmallSession(TieredStore* store) {
  SessionOptions so;
  so.retrieval.budget_tokens = 24;
  return Session::Open(store, so);
}

void DecodeStep(Session* s, int64_t p, std::mt19937* rng, std::vector<HostSyncCounts>* appends = nullptr,
                std::vector<HostSyncCounts>* attends = nullptr) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  const size_t kv = static_cast<size_t>(kKvHeads) * kDim, qe = static_cast<size_t>(kQHeads) * kDim;
  ASSERT_TRUE(s->BeginStep(StepKind::kDecode).ok());
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> kf(kv), vf(kv), q(qe), out(qe);
    for (float& x : kf) x = n(*rng);
    for (float& x : vf) x = n(*rng);
    for (float& x : q) x = n(*rng);
    std::vector<uint16_t> k(kv), v(kv);
    FromFloat(DType::kF16, kf.data(), k.data(), kv);
    FromFloat(DType::kF16, vf.data(), v.data(), kv);
    const HostSyncCounts t0 = ReadHostSyncs();
    ASSERT_TRUE(s->Append(l, k.data(), v.data(), 1, DType::kF16).ok());
    const HostSyncCounts t1 = ReadHostSyncs();
    const Status st = s->Attend(l, q.data(), &p, 1, out.data());
    ASSERT_TRUE(st.ok()) << st.ToString();
    const HostSyncCounts t2 = ReadHostSyncs();
    if (appends) appends->push_back(t1.Since(t0));
    if (attends) attends->push_back(t2.Since(t1));
  }
}

TEST(HostSyncCounter, CountsEachKindOnceAndSnapshotsSubtract) {
  const HostSyncCounts before = ReadHostSyncs();
  const uint64_t total_before = HostSyncsTotal();
  for (int i = 0; i < kHostSyncKinds; ++i)
    for (int j = 0; j <= i; ++j) CountHostSync(static_cast<HostSyncKind>(i));
  const HostSyncCounts d = ReadHostSyncs().Since(before);
  EXPECT_TRUE(Same(d, Counts(1, 2, 3, 4, 5))) << Describe(d);
  EXPECT_EQ(d.total(), 15u);
  EXPECT_EQ(HostSyncsTotal() - total_before, 15u);
  EXPECT_EQ(d.of(HostSyncKind::kPageableCopy), 5u);
  EXPECT_STREQ(HostSyncKindName(HostSyncKind::kPageableCopy), "pageable_copy");
}

// CountFields: the most initializers an aggregate accepts, i.e. its number of fields.
struct AnyField {
  template <typename T>
  operator T() const;  // NOLINT: implicit by design
};
template <typename T, typename... A>
constexpr size_t CountFields() {
  if constexpr (requires { T{A{}..., AnyField{}}; }) {
    return CountFields<T, A..., AnyField>();
  } else {
    return sizeof...(A);
  }
}

TEST(HostSyncCounter, CApiMirrorsEverySessionCounter) {
  // A SessionCounters field the C struct lacks (or has twice) fails here: kvtier_c.h's
  // kvtier_session_counters and engine/c_api.cc's fill follow the C++ struct field for field.
  EXPECT_EQ(CountFields<kvtier_session_counters>(), CountFields<SessionCounters>());
  SessionCounters c;
  c.host_syncs = 7;
  kvtier_session_counters cc{};
  cc.host_syncs = c.host_syncs;
  EXPECT_EQ(cc.host_syncs, 7u);
}

// Whose wait: one on a thread inside a step scope (a session call) is the step's, and counted on
// that thread; one on any other thread, or on this one outside every scope, is a worker's.
TEST(HostSyncCounter, WaitsOutsideEveryStepScopeAreTheWorkers) {
  const uint64_t mine0 = HostSyncsOnThisThread(), workers0 = WorkerHostSyncsTotal(),
                 total0 = HostSyncsTotal();
  {
    const HostSyncStepScope step;
    CountHostSync(HostSyncKind::kStream);  // the step's own
    std::thread([] {                       // a worker's, while the step runs
      CountHostSync(HostSyncKind::kEvent);
      CountHostSync(HostSyncKind::kPageableCopy);
    })
        .join();
    {
      const HostSyncStepScope nested;
      CountHostSync(HostSyncKind::kEvent);
    }
    CountHostSync(HostSyncKind::kBlockingCopy);  // still inside the outer scope: the step's
  }
  CountHostSync(HostSyncKind::kDevice);  // no scope now: this thread is a worker's
  EXPECT_EQ(HostSyncsOnThisThread() - mine0, 4u);
  EXPECT_EQ(WorkerHostSyncsTotal() - workers0, 3u);
  EXPECT_EQ(HostSyncsTotal() - total0, 6u);
}

// Every build: a session's call counts the waits on its own thread as its host_syncs and a
// worker thread's waits meanwhile as its worker_host_syncs. The store's landing hook runs inside
// the session's Append (on its thread): it waits once there and once on a thread of its own.
TEST(HostSyncCounter, ASessionCountsAWorkersWaitInItsWorkerColumn) {
  int hook_calls = 0;
  StoreHooks hooks;
  hooks.hold_landing = [&hook_calls] {
    ++hook_calls;
    CountHostSync(HostSyncKind::kEvent);                               // the step's thread
    std::thread([] { CountHostSync(HostSyncKind::kStream); }).join();  // a worker's
    return false;
  };
  auto store = TieredStore::Open(SmallStore(Device::kCpu), hooks);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto s = SmallSession(store->get());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::mt19937 rng(5);
  for (int64_t p = 0; p < 120; ++p) DecodeStep(s->get(), p, &rng);
  ASSERT_GT(hook_calls, 0) << "no Append landed a chunk";
  EXPECT_EQ((*s)->counters().host_syncs, static_cast<uint64_t>(hook_calls));
  EXPECT_EQ((*s)->counters().worker_host_syncs, static_cast<uint64_t>(hook_calls));
}

// Every build: a session on the cpu tier never waits on a device.
TEST(DeviceSync, CpuTierSessionCountsNoHostSyncs) {
  auto store = TieredStore::Open(SmallStore(Device::kCpu));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto s = SmallSession(store->get());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::mt19937 rng(5);
  const HostSyncCounts before = ReadHostSyncs();
  for (int64_t p = 0; p < 120; ++p) DecodeStep(s->get(), p, &rng);
  EXPECT_EQ((*s)->counters().host_syncs, 0u);
  EXPECT_EQ((*s)->counters().worker_host_syncs, 0u);
  EXPECT_EQ(ReadHostSyncs().Since(before).total(), 0u) << Describe(ReadHostSyncs().Since(before));
  EXPECT_GT((*s)->counters().chunks_attended, 0u);  // retrieval ran: the step was not trivial
}

#if KVTIER_HAVE_CUDA

using device_test::HaveDevice;

TEST(DeviceSync, EachWrapperCountsOncePerCallAndCopiesTheBytes) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  namespace ds = device_sync;
  constexpr size_t n = 4096;
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t ev = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  void* dev = nullptr;
  void* dev2 = nullptr;
  void* pinned = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, n), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dev2, n), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned, n), cudaSuccess);
  std::vector<uint8_t> in(n), out(n, 0);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<uint8_t>(i * 13 + 3);

  // Each call alone, with what it must have counted.
  auto expect = [](const char* what, const HostSyncCounts& want, auto&& call) {
    const HostSyncCounts before = ReadHostSyncs();
    EXPECT_EQ(call(), cudaSuccess) << what;
    const HostSyncCounts d = ReadHostSyncs().Since(before);
    EXPECT_TRUE(Same(d, want)) << what << ": " << Describe(d);
  };
  expect("CopyBlocking", Counts(0, 0, 0, 1, 0),
         [&] { return ds::CopyBlocking(dev, in.data(), n, cudaMemcpyHostToDevice); });
  expect("CopyAsync device to device", Counts(0, 0, 0, 0, 0),
         [&] { return ds::CopyAsync(dev2, dev, n, cudaMemcpyDeviceToDevice, s, ds::HostMemory::kPageable); });
  expect("CopyAsync to pinned", Counts(0, 0, 0, 0, 0),
         [&] { return ds::CopyAsync(pinned, dev2, n, cudaMemcpyDeviceToHost, s, ds::HostMemory::kPinned); });
  expect("SyncStream", Counts(1, 0, 0, 0, 0), [&] { return ds::SyncStream(s); });
  EXPECT_EQ(0, std::memcmp(pinned, in.data(), n));
  expect("CopyAsync from pinned", Counts(0, 0, 0, 0, 0),
         [&] { return ds::CopyAsync(dev2, pinned, n, cudaMemcpyHostToDevice, s, ds::HostMemory::kPinned); });
  expect("CopyAsync to pageable", Counts(0, 0, 0, 0, 1), [&] {
    return ds::CopyAsync(out.data(), dev2, n, cudaMemcpyDeviceToHost, s, ds::HostMemory::kPageable);
  });
  expect("CopyAsync from pageable", Counts(0, 0, 0, 0, 1), [&] {
    return ds::CopyAsync(dev, in.data(), n, cudaMemcpyHostToDevice, s, ds::HostMemory::kPageable);
  });
  ASSERT_EQ(cudaEventRecord(ev, s), cudaSuccess);
  expect("SyncEvent", Counts(0, 1, 0, 0, 0), [&] { return ds::SyncEvent(ev); });
  EXPECT_EQ(in, out);
  expect("SyncDevice", Counts(0, 0, 1, 0, 0), [&] { return ds::SyncDevice(); });
  // A failed call was a call: counted all the same.
  expect("SyncStream, twice", Counts(2, 0, 0, 0, 0), [&] {
    const cudaError_t e = ds::SyncStream(s);
    return e == cudaSuccess ? ds::SyncStream(s) : e;
  });
  cudaFreeHost(pinned);
  cudaFree(dev2);
  cudaFree(dev);
  cudaEventDestroy(ev);
  cudaStreamDestroy(s);
}

TEST(DeviceSync, CudaHotTierCopiesCountTheirWaits) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  const size_t slot = 4096;
  auto made = CudaHotTier::Create(2 * slot, slot);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  CudaHotTier& t = **made;
  std::vector<uint8_t> host(slot, 1);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, slot), cudaSuccess);
  uint8_t* a = t.slot_data(t.AcquireSlot());
  uint8_t* b = t.slot_data(t.AcquireSlot());
  auto expect = [](const char* what, const HostSyncCounts& want, auto&& call) {
    const HostSyncCounts before = ReadHostSyncs();
    const Status st = call();
    EXPECT_TRUE(st.ok()) << what << ": " << st.ToString();
    const HostSyncCounts d = ReadHostSyncs().Since(before);
    EXPECT_TRUE(Same(d, want)) << what << ": " << Describe(d);
  };
  // Upload and Download: a copy from or to memory not known to be pinned, then the event wait.
  expect("Upload", Counts(0, 1, 0, 0, 1), [&] { return t.Upload(a, host.data(), slot); });
  expect("Download", Counts(0, 1, 0, 0, 1), [&] { return t.Download(host.data(), a, slot); });
  // UploadOrdered: staged, asynchronous, no wait; the source may change at once. More uploads
  // than the staging ring has buffers, each overwriting its source right after the call, must
  // all land (the ring reuses a buffer only once its copy is done).
  std::vector<uint8_t> src(slot / 4), want(slot, 0), got(slot, 0);
  for (int i = 0; i < 3 * CudaHotTier::kStagingBuffers; ++i) {
    const size_t at = static_cast<size_t>(i % 4) * src.size();
    for (size_t j = 0; j < src.size(); ++j) src[j] = static_cast<uint8_t>(i * 7 + j);
    if (i < CudaHotTier::kStagingBuffers) {  // fresh buffers: never a wait
      expect("UploadOrdered", Counts(0, 0, 0, 0, 0),
             [&] { return t.UploadOrdered(b + at, src.data(), src.size()); });
    } else {  // back to back, the ring may catch up with the stream: at most its buffer's event wait
      const HostSyncCounts before = ReadHostSyncs();
      ASSERT_TRUE(t.UploadOrdered(b + at, src.data(), src.size()).ok());
      const HostSyncCounts d = ReadHostSyncs().Since(before);
      EXPECT_LE(d.total(), 1u) << Describe(d);
      EXPECT_EQ(d.total(), d.of(HostSyncKind::kEvent)) << Describe(d);
    }
    std::copy(src.begin(), src.end(), want.begin() + static_cast<std::ptrdiff_t>(at));
    std::fill(src.begin(), src.end(), uint8_t{0xEE});  // the caller reuses its buffer at once
  }
  ASSERT_TRUE(t.Download(got.data(), b, slot).ok());  // ordered after the uploads on the stream
  EXPECT_EQ(got, want);
  // From the pinned warm tier: one event wait for the batch.
  const HotTier::UploadOp ups[] = {{a, pinned, slot / 2},
                                   {b, static_cast<uint8_t*>(pinned) + slot / 2, slot / 2}};
  expect("UploadBatch", Counts(0, 1, 0, 0, 0), [&] { return t.UploadBatch(ups, 2); });
  expect("CopyWithin", Counts(0, 1, 0, 0, 0), [&] { return t.CopyWithin(b, a, slot); });
  // A sealed chunk's download: no wait until the ticket is waited.
  const HotTier::DownloadOp downs[] = {{pinned, b, slot}};
  Result<TransferTicket> ticket = TransferTicket{0};
  expect("DownloadBatchAsync", Counts(0, 0, 0, 0, 0), [&] {
    ticket = t.DownloadBatchAsync(downs, 1);
    return ticket.status();
  });
  ASSERT_TRUE(ticket.ok());
  expect("WaitTransfer", Counts(0, 1, 0, 0, 0), [&] { return t.WaitTransfer(*ticket); });
  cudaFreeHost(pinned);
}

// The waits a decode step of the host-pointer calls makes on the cuda tier, pinned per layer
// (the device-pointer calls are tests/engine/device_session_test.cc's). A quiet layer step (no
// chunk sealed or landed, every retrieved chunk already hot) on host K/V and host q:
//   Append (the K and V of one token into the local ring, HotTier::UploadOrdered each):
//     staged in pinned memory and copied asynchronously                                  0
//   Attend:
//     retrieval (device_scorer.cc): the stream wait after the selection's download        1
//     attention (attention_backend.cc): the plan staged in pinned memory (no wait), the
//       output copied down through pinned memory and waited for                          1
// = 2 per layer. A step that seals a chunk adds the landing's event wait and the index
// mirror's upload (a copy per head and array, and a stream wait); one that misses adds the
// fetch's event wait (warm chunks) or a pageable copy and an event wait per cold chunk.
TEST(DeviceSync, DecodeStepOnTheCudaTierMakesTwoWaitsPerQuietLayer) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  auto store = TieredStore::Open(SmallStore(Device::kCuda));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto s = SmallSession(store->get());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::mt19937 rng(11);
  for (int64_t p = 0; p < 120; ++p) DecodeStep(s->get(), p, &rng);  // chunks to retrieve from
  const HostSyncCounts append_waits = Counts(0, 0, 0, 0, 0);
  const HostSyncCounts attend_waits = Counts(1, 1, 0, 0, 0);
  const uint64_t session0 = (*s)->counters().host_syncs, worker0 = (*s)->counters().worker_host_syncs;
  const HostSyncCounts process0 = ReadHostSyncs();
  int quiet = 0;
  for (int64_t p = 120; p < 184; ++p) {
    const StoreCounters c0 = (*store)->counters();
    std::vector<HostSyncCounts> appends, attends;
    DecodeStep(s->get(), p, &rng, &appends, &attends);
    const StoreCounters c1 = (*store)->counters();
    ASSERT_EQ(appends.size(), static_cast<size_t>(kLayers));
    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE("position " + std::to_string(p) + ", layer " + std::to_string(l));
      EXPECT_TRUE(Same(appends[l], append_waits)) << Describe(appends[l]);
      // Never fewer than a quiet step's: every wait above happens in every decode layer step.
      EXPECT_GE(attends[l].of(HostSyncKind::kStream), 1u) << Describe(attends[l]);
      EXPECT_GE(attends[l].of(HostSyncKind::kEvent), 1u) << Describe(attends[l]);
    }
    if (c1.chunks_sealed != c0.chunks_sealed || c1.misses != c0.misses || c1.chunks_landing != 0) continue;
    ++quiet;
    for (int l = 0; l < kLayers; ++l)
      EXPECT_TRUE(Same(attends[l], attend_waits))
          << "quiet step at position " << p << ", layer " << l << ": " << Describe(attends[l]);
  }
  EXPECT_GE(quiet, 8) << "too few decode steps without a seal or a miss to pin the quiet count";
  // The session's two counts are the process's: nothing else waited meanwhile, and its fetches'
  // workers finished within the calls that waited for them.
  EXPECT_EQ((*s)->counters().host_syncs + (*s)->counters().worker_host_syncs - session0 - worker0,
            ReadHostSyncs().Since(process0).total());
  EXPECT_GE((*s)->counters().host_syncs - session0, 64u * 2u * kLayers);
}

// The C API hands the session's count over as it is: a C engine on the cuda tier sees the waits
// its calls made, on the cpu tier none.
TEST(DeviceSync, CApiSessionCountersCarryTheHostSyncs) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  for (const char* device : {"cpu", "cuda"}) {
    SCOPED_TRACE(device);
    kvtier_error err{};
    kvtier_store_options so = kvtier_store_options_default();
    for (const auto& [name, value] : std::vector<std::pair<const char*, const char*>>{{"layers", "2"},
                                                                                      {"q_heads", "4"},
                                                                                      {"kv_heads", "2"},
                                                                                      {"head_dim", "16"},
                                                                                      {"dtype", "float32"},
                                                                                      {"n_sink", "4"},
                                                                                      {"n_local", "16"},
                                                                                      {"chunk_size", "8"},
                                                                                      {"hot_bytes", "64K"},
                                                                                      {"warm_bytes", "4M"},
                                                                                      {"device", device}})
      ASSERT_EQ(kvtier_store_options_set(&so, name, value, &err), KVTIER_OK) << name << ": " << err.message;
    kvtier_store* store = nullptr;
    ASSERT_EQ(kvtier_store_open(&so, &store, &err), KVTIER_OK) << err.message;
    kvtier_session_options o = kvtier_session_options_default();
    ASSERT_EQ(kvtier_session_options_set(&o, "budget_tokens", "32", &err), KVTIER_OK) << err.message;
    kvtier_session* session = nullptr;
    ASSERT_EQ(kvtier_session_open(store, &o, &session, &err), KVTIER_OK) << err.message;
    std::vector<float> k(2 * 16, 0.5f), v(k.size(), 0.25f), q(4 * 16, 1.0f), out(q.size());
    const uint64_t before = HostSyncsTotal();
    for (int64_t t = 0; t < 24; ++t) {
      ASSERT_EQ(kvtier_session_begin_step(session, KVTIER_STEP_DECODE, &err), KVTIER_OK) << err.message;
      for (int layer = 0; layer < 2; ++layer) {
        ASSERT_EQ(kvtier_session_append(session, layer, k.data(), v.data(), 1, KVTIER_F32, &err), KVTIER_OK)
            << err.message;
        ASSERT_EQ(kvtier_session_attend(session, layer, q.data(), &t, 1, out.data(), nullptr, &err),
                  KVTIER_OK)
            << err.message;
      }
    }
    const uint64_t made = HostSyncsTotal() - before;
    kvtier_session_counters c{};
    ASSERT_EQ(kvtier_session_get_counters(session, &c, &err), KVTIER_OK) << err.message;
    EXPECT_EQ(c.host_syncs + c.worker_host_syncs, made);
    if (std::string(device) == "cuda")
      EXPECT_GE(c.host_syncs, 24u * 2u);  // at least the attention output's wait a layer step
    else
      EXPECT_EQ(c.host_syncs, 0u);
    kvtier_session_destroy(session);
    ASSERT_EQ(kvtier_store_close(store, &err), KVTIER_OK) << err.message;
  }
}

#endif  // KVTIER_HAVE_CUDA

}  // namespace
}  // namespace kvtier
