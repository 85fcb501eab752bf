// CUDA graph capture of kvtier's device work (issue 44), on whatever device the build has: the
// real runtime on a GPU, or the emulated device (kernels/cuda/emulation/stream_capture.h), where
// these cases check that capture records instead of running, replays in order with the data of
// replay time, and refuses what CUDA refuses inside a capture. Everything here is the CUDA
// runtime's API; the one emulation-only expectation says why (BlockingCopyIsRefused).
//
// Outputs are filled with a sentinel before each run, so that work that did not run, or ran
// when it should not have, shows. The streams are non-blocking (as kvtier's are) except where a
// case is about the legacy stream.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#endif

namespace kvtier {
namespace {

#if !KVTIER_HAVE_CUDA
TEST(GraphCaptureDevice, NeedsCuda) {
  GTEST_SKIP() << "no CUDA device: this build has no CUDA (KVTIER_CUDA=off or nvcc not found)";
}
#else
namespace cuda = kernels::cuda;
using kernels::KernelError;

constexpr float kSentinel = 12345.0f;

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class GraphCaptureDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0)
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount found none (" << cuda::LastCudaErrorString() << ")";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }

  void TearDown() override {
    for (cudaStream_t s : {stream_, other_}) {
      if (s == nullptr) continue;
      EndAnyCapture(s);
      (void)cudaStreamSynchronize(s);
      (void)cudaStreamDestroy(s);
    }
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    for (void* p : device_) (void)cudaFree(p);
    for (void* p : pinned_) (void)cudaFreeHost(p);
    (void)cudaGetLastError();
  }

  // Ends a capture a failed expectation left open, so that the next case starts clean.
  static void EndAnyCapture(cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &status) != cudaSuccess || status == cudaStreamCaptureStatusNone) return;
    cudaGraph_t graph = nullptr;
    (void)cudaStreamEndCapture(s, &graph);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
  }

  float* DeviceFloats(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(float)), cudaSuccess);
    device_.push_back(p);
    return static_cast<float*>(p);
  }
  float* PinnedFloats(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMallocHost(&p, n * sizeof(float)), cudaSuccess);
    pinned_.push_back(p);
    return static_cast<float*>(p);
  }
  cudaStream_t OtherStream(unsigned flags) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&other_, flags), cudaSuccess);
    return other_;
  }
  cudaEvent_t Event() {
    cudaEvent_t e = nullptr;
    EXPECT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
    events_.push_back(e);
    return e;
  }

  // Blocking transfers outside any capture; the device is idle on return.
  static void Upload(float* d, const std::vector<float>& host) {
    ASSERT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  static std::vector<float> Download(const float* d, size_t n) {
    std::vector<float> host(n);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

  cudaStreamCaptureStatus CaptureStatus(cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusInvalidated;
    EXPECT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
    return status;
  }

  // After a refused call: the capture reports itself invalidated, ending it yields CUDA's error
  // and no graph, and the stream is no longer capturing.
  void ExpectInvalidatedThenEnd(cudaStream_t s) {
    EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusInvalidated);
    cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(uintptr_t{1});  // must come back null
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(graph, nullptr);
    EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusNone);
    (void)cudaGetLastError();  // the refusal was recorded as the last error, as CUDA does
  }

  cudaStream_t stream_ = nullptr;
  cudaStream_t other_ = nullptr;
  std::vector<cudaEvent_t> events_;
  std::vector<void*> device_;
  std::vector<void*> pinned_;
};

// Two attention states to merge (LaunchMergeAttentionStates' inputs), drawn from `seed`.
struct MergeInputs {
  std::vector<float> out_a, lse_a, out_b, lse_b;
  MergeInputs(int rows, int head_dim, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> value(-1.0f, 1.0f), lse(-5.0f, 5.0f);
    for (auto* v : {&out_a, &out_b}) {
      v->resize(static_cast<size_t>(rows) * head_dim);
      for (float& x : *v) x = value(rng);
    }
    for (auto* v : {&lse_a, &lse_b}) {
      v->resize(rows);
      for (float& x : *v) x = lse(rng);
    }
  }
};

TEST_F(GraphCaptureDevice, ReplaysMemsetKernelAndCopyWithReplayTimeInputs) {
  const int rows = 6, head_dim = 64;
  const size_t n = static_cast<size_t>(rows) * head_dim, pad = 32;
  float *a = DeviceFloats(n), *al = DeviceFloats(rows), *b = DeviceFloats(n), *bl = DeviceFloats(rows);
  float *out = DeviceFloats(n), *lse = DeviceFloats(rows), *copy = DeviceFloats(n + pad);
  float *eager_out = DeviceFloats(n), *eager_lse = DeviceFloats(rows);
  auto upload_inputs = [&](const MergeInputs& in) {
    Upload(a, in.out_a);
    Upload(al, in.lse_a);
    Upload(b, in.out_b);
    Upload(bl, in.lse_b);
  };
  auto fill_outputs = [&] {
    Upload(out, std::vector<float>(n, kSentinel));
    Upload(lse, std::vector<float>(rows, kSentinel));
    Upload(copy, std::vector<float>(n + pad, kSentinel));
  };
  upload_inputs(MergeInputs(rows, head_dim, 1));
  fill_outputs();

  ASSERT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusNone);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaMemsetAsync(copy, 0, (n + pad) * sizeof(float), stream_), cudaSuccess);
  EXPECT_EQ(cuda::LaunchMergeAttentionStates(rows, head_dim, a, al, b, bl, out, lse, stream_),
            KernelError::kOk)
      << cuda::LastCudaErrorString();
  EXPECT_EQ(cudaMemcpyAsync(copy, out, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_), cudaSuccess);
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusActive);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_NE(graph, nullptr);
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusNone);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  // Nothing ran while capturing.
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Download(out, n), std::vector<float>(n, kSentinel)) << "the kernel ran during the capture";
  EXPECT_EQ(Download(lse, rows), std::vector<float>(rows, kSentinel)) << "the kernel ran during the capture";
  EXPECT_EQ(Download(copy, n + pad), std::vector<float>(n + pad, kSentinel))
      << "the memset or the copy ran during the capture";

  std::vector<float> previous;
  for (uint32_t seed : {2u, 3u}) {
    SCOPED_TRACE("inputs of seed " + std::to_string(seed));
    upload_inputs(MergeInputs(rows, head_dim, seed));
    // The eager run on the same inputs: the reference.
    ASSERT_EQ(cuda::LaunchMergeAttentionStates(rows, head_dim, a, al, b, bl, eager_out, eager_lse, stream_),
              KernelError::kOk);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const std::vector<float> want_out = Download(eager_out, n), want_lse = Download(eager_lse, rows);

    fill_outputs();
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const std::vector<float> got_copy = Download(copy, n + pad);
    EXPECT_TRUE(SameBits(Download(out, n), want_out))
        << "the replayed kernel's output differs from the eager run";
    EXPECT_TRUE(SameBits(Download(lse, rows), want_lse))
        << "the replayed kernel's lse differs from the eager run";
    EXPECT_TRUE(SameBits(std::vector<float>(got_copy.begin(), got_copy.begin() + n), want_out))
        << "the replayed device-to-device copy did not follow the kernel";
    EXPECT_EQ(std::vector<float>(got_copy.begin() + n, got_copy.end()), std::vector<float>(pad, 0.0f))
        << "the replayed memset did not run";
    EXPECT_FALSE(SameBits(want_out, previous)) << "new inputs, same output: the test shows nothing";
    previous = want_out;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST_F(GraphCaptureDevice, PinnedAsyncCopiesAreRecordedAndReadAtReplay) {
  const size_t n = 1000;
  float *host_in = PinnedFloats(n), *host_out = PinnedFloats(n), *d = DeviceFloats(n);
  std::fill(host_in, host_in + n, 1.0f);
  std::fill(host_out, host_out + n, kSentinel);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(d, host_in, n * sizeof(float), cudaMemcpyHostToDevice, stream_), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(host_out, d, n * sizeof(float), cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(host_out[0], kSentinel) << "a copy ran during the capture";
  for (float value : {2.5f, -7.0f}) {
    for (size_t i = 0; i < n; ++i) host_in[i] = value + static_cast<float>(i);
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (size_t i = 0; i < n; i += 97)
      ASSERT_EQ(host_out[i], value + static_cast<float>(i)) << "element " << i;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST_F(GraphCaptureDevice, SynchronisingTheCapturingStreamIsRefused) {
  float* d = DeviceFloats(64);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(d, 0, 64 * sizeof(float), stream_), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaErrorStreamCaptureUnsupported);
  // An invalidated capture takes no more work until it ends.
  EXPECT_EQ(cudaMemsetAsync(d, 0, 64 * sizeof(float), stream_), cudaErrorStreamCaptureInvalidated);
  ExpectInvalidatedThenEnd(stream_);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << "the stream is usable once the capture ended";
}

TEST_F(GraphCaptureDevice, SynchronisingTheDeviceIsRefused) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidatedThenEnd(stream_);
}

TEST_F(GraphCaptureDevice, QueryingAnEventRecordedInTheCaptureIsRefused) {
  // The event stands for a position in the capture, not for work that will complete (CUDA names
  // cudaEventQuery as the example; cudaEventSynchronize is refused the same way here).
  const cudaEvent_t e = Event();
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(e, stream_), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(e), cudaErrorCapturedEvent);
  (void)cudaGetLastError();
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(stream_, &graph);
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
}

TEST_F(GraphCaptureDevice, AllocationIsRefusedInGlobalModeAllowedInRelaxed) {
  void* p = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&p, 256), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidatedThenEnd(stream_);

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&p, 256), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidatedThenEnd(stream_);

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&p, 256), cudaSuccess) << "Relaxed mode allows potentially unsafe calls";
  device_.push_back(p);
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusActive);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// A wait on a stream outside the capture is a potentially unsafe call: refused on the capturing
// thread unless its capture is Relaxed, and on another thread only while a Global capture is live.
TEST_F(GraphCaptureDevice, UnrelatedWaitsFollowTheCaptureMode) {
  const cudaStream_t unrelated = OtherStream(cudaStreamNonBlocking);
  auto wait_on_another_thread = [unrelated] {
    cudaError_t e = cudaSuccess;
    std::thread([&] {
      e = cudaStreamSynchronize(unrelated);
      (void)cudaGetLastError();
    }).join();
    return e;
  };
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(wait_on_another_thread(), cudaSuccess) << "a thread-local capture ignores other threads";
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaStreamSynchronize(unrelated), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidatedThenEnd(stream_);

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(wait_on_another_thread(), cudaErrorStreamCaptureUnsupported)
      << "a global capture forbids it anywhere";
  ExpectInvalidatedThenEnd(stream_);

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(unrelated), cudaSuccess);
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusActive);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST_F(GraphCaptureDevice, BlockingCopyIsRefused) {
  float* d = DeviceFloats(64);
  std::vector<float> host(64, 1.0f);
  // A blocking cudaMemcpy runs on the legacy stream, which a capture in a blocking stream makes
  // unusable (the programming guide: "any attempted use of the legacy stream is invalid").
  const cudaStream_t blocking = OtherStream(cudaStreamDefault);
  ASSERT_EQ(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), 64 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorStreamCaptureImplicit);
  ExpectInvalidatedThenEnd(blocking);
#if defined(KVTIER_GPU_EMULATION)
  // Emulation only: with the capture in a non-blocking stream, the emulation refuses the blocking
  // copy as a potentially unsafe call; which error the real runtime gives there (if any) is not
  // documented, so this expectation is the emulation's rule, not checked against CUDA.
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), 64 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorStreamCaptureUnsupported);
  ExpectInvalidatedThenEnd(stream_);
#endif
}

TEST_F(GraphCaptureDevice, PageableAsyncCopyIsRefused) {
  float* d = DeviceFloats(64);
  std::vector<float> pageable(64, 1.0f);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(d, pageable.data(), 64 * sizeof(float), cudaMemcpyHostToDevice, stream_),
            cudaErrorStreamCaptureUnsupported);
  ExpectInvalidatedThenEnd(stream_);

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(pageable.data(), d, 64 * sizeof(float), cudaMemcpyDeviceToHost, stream_),
            cudaErrorStreamCaptureUnsupported);
  ExpectInvalidatedThenEnd(stream_);
  EXPECT_EQ(pageable[0], 1.0f);
}

TEST_F(GraphCaptureDevice, ForkAndJoinThroughEventsReplayInOrder) {
  const size_t n = 256;
  float *first = DeviceFloats(n), *branch = DeviceFloats(n), *joined = DeviceFloats(n);
  for (float* p : {first, branch, joined}) Upload(p, std::vector<float>(n, kSentinel));
  const cudaStream_t side = OtherStream(cudaStreamNonBlocking);
  const cudaEvent_t fork = Event(), join = Event();

  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(first, 0x11, n * sizeof(float), stream_), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(fork, stream_), cudaSuccess);
  EXPECT_EQ(CaptureStatus(side), cudaStreamCaptureStatusNone);
  EXPECT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
  EXPECT_EQ(CaptureStatus(side), cudaStreamCaptureStatusActive)
      << "waiting on a captured event joins the capture";
  // The branch reads what the origin wrote before the fork, the origin what the branch wrote.
  EXPECT_EQ(cudaMemcpyAsync(branch, first, n * sizeof(float), cudaMemcpyDeviceToDevice, side), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(join, side), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(stream_, join, 0), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(joined, branch, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
            cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  EXPECT_EQ(CaptureStatus(side), cudaStreamCaptureStatusNone) << "the joined stream leaves with the capture";
  EXPECT_EQ(Download(first, n), std::vector<float>(n, kSentinel)) << "the origin ran during the capture";
  EXPECT_EQ(Download(branch, n), std::vector<float>(n, kSentinel)) << "the branch ran during the capture";

  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  float memset_value;
  const uint32_t bits = 0x11111111u;
  std::memcpy(&memset_value, &bits, sizeof bits);
  EXPECT_EQ(Download(joined, n), std::vector<float>(n, memset_value))
      << "the joined copy missed the branch's work";
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST_F(GraphCaptureDevice, EndingWithAnUnjoinedForkFails) {
  float* d = DeviceFloats(64);
  const cudaStream_t side = OtherStream(cudaStreamNonBlocking);
  const cudaEvent_t fork = Event();
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(fork, stream_), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(d, 0, 64 * sizeof(float), side), cudaSuccess);
  cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(uintptr_t{1});
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureUnjoined);
  EXPECT_EQ(graph, nullptr);
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusNone);
  (void)cudaGetLastError();
}

TEST_F(GraphCaptureDevice, IsCapturingReportsEachState) {
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusNone);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(CaptureStatus(stream_), cudaStreamCaptureStatusInvalidated);
  ExpectInvalidatedThenEnd(stream_);

  // The legacy stream, queried while a blocking stream captures: an error, no invalidation.
  const cudaStream_t blocking = OtherStream(cudaStreamDefault);
  ASSERT_EQ(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal), cudaSuccess);
  cudaStreamCaptureStatus legacy = cudaStreamCaptureStatusNone;
  EXPECT_EQ(cudaStreamIsCapturing(nullptr, &legacy), cudaErrorStreamCaptureImplicit);
  (void)cudaGetLastError();
  EXPECT_EQ(CaptureStatus(blocking), cudaStreamCaptureStatusActive);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(blocking, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_STREQ(cudaGetErrorName(cudaErrorStreamCaptureInvalidated), "cudaErrorStreamCaptureInvalidated");
}
#endif  // KVTIER_HAVE_CUDA

}  // namespace
}  // namespace kvtier
