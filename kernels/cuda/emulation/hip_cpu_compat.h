// The CUDA runtime as kvtier's CUDA sources use it, on the HIP CPU Runtime (AMD HIP-CPU, MIT;
// ../shared/third_party/hip-cpu, never copied into this tree). Only the emulation build
// (-DKVTIER_GPU_EMULATION=<hip-cpu path>) puts this folder on the include path, where its
// cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, cublas_v2.h and cub/ headers stand in for the
// toolkit's, so that kernels/cuda/*.cu and the CUDA-side C++ compile unchanged with the host
// compiler and execute on the CPU: blocks in parallel on oneTBB, a block's threads as fibers.
//
// What this layer adds to HIP-CPU, and why:
// - CUDA names for HIP's runtime calls, types and constants (aliases and forwarding functions).
// - Warp-synchronous execution with 32-lane warps. HIP-CPU's own shuffles use warpSize 64 and
//   a block-wide barrier that only works when every thread of the block passes the same number
//   of barriers, and its __shfl with width < 64 reads the wrong lane above lane `width`. A CUDA
//   kernel may shuffle in one warp while another warp of the block does something else (our
//   attention kernel does: warps own different numbers of keys). So the shuffles and
//   __syncthreads below are a small scheduler of their own over HIP-CPU's fibers: a warp
//   barrier waits for the 32 lanes of its warp, a block barrier for every thread not yet
//   exited, and every wait is a loop that yields to another fiber until it is released, so a
//   fiber may be resumed at any time. A wait that no fiber can end (a shuffle some lane of the
//   warp never reaches, which is undefined behaviour in CUDA) aborts with the kernel's block
//   and thread instead of hanging.
// - Launch(kernel, grid, block, smem, stream, args...): what common.cuh's LaunchKernel calls
//   in place of <<<...>>>. It runs each thread inside RunBlockThread, which keeps HIP-CPU's
//   end-of-block protocol intact (see there).
// - The fp32 intrinsics with the IEEE rounding CUDA gives them (never contracted into an FMA),
//   bf16 as the project's own bit conversions (kernels/cuda/store_convert.h).
// - CUDA graphs by stream capture (state and rules: stream_capture.h): cudaStreamBeginCapture /
//   EndCapture / IsCapturing, cudaThreadExchangeStreamCaptureMode, cudaGraphInstantiate / Launch
//   / Destroy, cudaGraphExecDestroy. While a stream captures, launches (Launch's arguments kept by
//   value), cudaMemcpyAsync, cudaMemcpyBatchAsync and cudaMemsetAsync submitted to it are
//   recorded, not run; event records and waits carry the fork/join pattern (a stream that waits
//   on an event recorded in a capture joins it; ending with a fork not joined back fails as in
//   CUDA). Refused with CUDA's error, invalidating the capture: a synchronisation or query of a
//   capturing stream, of an event recorded in one, of the device; per the capture mode, the
//   potentially unsafe calls: cudaMalloc / cudaFree / cudaHostAlloc / cudaMallocHost /
//   cudaFreeHost, blocking cudaMemcpy / cudaMemset, waits on and queries of any other stream or
//   event; an asynchronous copy to or from pageable host memory (any address outside the
//   cudaMalloc'd and pinned allocations, which are tracked for that); the legacy stream while a
//   blocking stream captures. cudaGraphLaunch replays the recorded work in recording order on the
//   given stream; kernels read their captured pointers' data at replay time.
// What it cannot show: speed, the GPU memory model and its races, PCIe/NVLink transfers,
// __expf's approximation error (it is std::exp here), cuBLAS and CUB themselves (stand-ins); of
// graphs: concurrency between a graph's branches (a replay is one ordered sequence), the cost of
// a launch, node types other than those above (host nodes, memory nodes, conditional nodes),
// graph updates, and calls the real runtime refuses that the rules above do not name.
#pragma once

#if !defined(KVTIER_GPU_EMULATION)
#error "kernels/cuda/emulation is the HIP-CPU build's stand-in for the CUDA headers only"
#endif

#include <hip/hip_runtime.h>
#include <math.h>  // isfinite, expf, ... in the global namespace, where device code calls them
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cuda/emulation/stream_capture.h"
#include "kernels/cuda/store_convert.h"

// HIP-CPU marks kernels and device functions __attribute__((simd)), which makes GCC build vector
// clones of every one (slow to compile, and refused for struct parameters). Plain functions here.
#undef __global__
#undef __device__
#define __global__
#define __device__

// The toolkit version whose API paths the sources take (kernels/cuda/transfer.cu picks the
// CUDA 13 cudaMemcpyBatchAsync signature from it).
#ifndef CUDART_VERSION
#define CUDART_VERSION 13000
#endif

// ---- runtime types, constants and calls ------------------------------------------------------
using cudaError_t = hipError_t;
using cudaStream_t = hipStream_t;
using cudaEvent_t = hipEvent_t;
using cudaMemcpyKind = hipMemcpyKind;
using cudaDeviceProp = hipDeviceProp_t;

inline constexpr cudaError_t cudaSuccess = hipSuccess;
inline constexpr cudaError_t cudaErrorNotReady = hipErrorNotReady;
inline constexpr cudaError_t cudaErrorNoDevice = hipErrorNoDevice;
inline constexpr cudaError_t cudaErrorInvalidValue = hipErrorInvalidValue;
inline constexpr cudaError_t cudaErrorMemoryAllocation = hipErrorOutOfMemory;
inline constexpr cudaError_t cudaErrorInvalidResourceHandle = hipErrorInvalidHandle;
inline constexpr cudaError_t cudaErrorIllegalState = kvtier_emu::capture::kIllegalState;
inline constexpr cudaError_t cudaErrorStreamCaptureUnsupported = kvtier_emu::capture::kUnsupported;
inline constexpr cudaError_t cudaErrorStreamCaptureInvalidated = kvtier_emu::capture::kInvalidated;
inline constexpr cudaError_t cudaErrorStreamCaptureMerge = kvtier_emu::capture::kMerge;
inline constexpr cudaError_t cudaErrorStreamCaptureUnmatched = kvtier_emu::capture::kUnmatched;
inline constexpr cudaError_t cudaErrorStreamCaptureUnjoined = kvtier_emu::capture::kUnjoined;
inline constexpr cudaError_t cudaErrorStreamCaptureIsolation = kvtier_emu::capture::kIsolation;
inline constexpr cudaError_t cudaErrorStreamCaptureImplicit = kvtier_emu::capture::kImplicit;
inline constexpr cudaError_t cudaErrorCapturedEvent = kvtier_emu::capture::kCapturedEvent;
inline constexpr cudaError_t cudaErrorStreamCaptureWrongThread = kvtier_emu::capture::kWrongThread;
inline constexpr cudaMemcpyKind cudaMemcpyHostToHost = hipMemcpyHostToHost;
inline constexpr cudaMemcpyKind cudaMemcpyHostToDevice = hipMemcpyHostToDevice;
inline constexpr cudaMemcpyKind cudaMemcpyDeviceToHost = hipMemcpyDeviceToHost;
inline constexpr cudaMemcpyKind cudaMemcpyDeviceToDevice = hipMemcpyDeviceToDevice;
inline constexpr cudaMemcpyKind cudaMemcpyDefault = hipMemcpyDefault;
inline constexpr unsigned cudaStreamDefault = hipStreamDefault;
inline constexpr unsigned cudaStreamNonBlocking = hipStreamNonBlocking;
inline constexpr unsigned cudaEventDefault = hipEventDefault;
inline constexpr unsigned cudaEventDisableTiming = hipEventDisableTiming;
inline constexpr auto cudaHostAllocDefault = hipHostMallocDefault;
inline constexpr auto cudaHostAllocPortable = hipHostMallocPortable;
inline constexpr auto cudaHostAllocMapped = hipHostMallocMapped;

inline const char* cudaGetErrorName(cudaError_t e) {
  const char* capture = kvtier_emu::capture::ErrorName(e);
  return capture != nullptr ? capture : hipGetErrorName(e);
}
inline const char* cudaGetErrorString(cudaError_t e) {
  const char* capture = kvtier_emu::capture::ErrorString(e);
  return capture != nullptr ? capture : hipGetErrorString(e);
}
inline cudaError_t cudaGetLastError() { return hipGetLastError(); }
inline cudaError_t cudaPeekAtLastError() { return hipPeekAtLastError(); }
inline cudaError_t cudaGetDeviceCount(int* n) { return hipGetDeviceCount(n); }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  return hipGetDeviceProperties(p, device);
}
inline cudaError_t cudaSetDevice(int device) { return hipSetDevice(device); }
inline cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t e = kvtier_emu::capture::BeforeDeviceWait(); e != cudaSuccess) return e;
  return hipDeviceSynchronize();
}
inline cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  return hipMemGetInfo(free_bytes, total);
}

// Allocation and freeing are refused inside a capture (stream_capture.h: unsafe calls); the
// allocations are noted so that a capture can tell device, pinned and pageable memory apart.
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (const cudaError_t e = kvtier_emu::capture::BeforeUnsafeCall(); e != cudaSuccess) return e;
  const cudaError_t e = hipMalloc(p, bytes);
  if (e == cudaSuccess) kvtier_emu::capture::NoteAllocation(kvtier_emu::capture::Memory::kDevice, *p, bytes);
  return e;
}
template <typename T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFree(void* p) {
  if (const cudaError_t e = kvtier_emu::capture::BeforeUnsafeCall(); e != cudaSuccess) return e;
  kvtier_emu::capture::ForgetAllocation(kvtier_emu::capture::Memory::kDevice, p);
  return hipFree(p);
}
inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags) {
  if (const cudaError_t e = kvtier_emu::capture::BeforeUnsafeCall(); e != cudaSuccess) return e;
  const cudaError_t e = hipHostMalloc(p, bytes, static_cast<hipHostMallocKind>(flags));
  if (e == cudaSuccess) kvtier_emu::capture::NoteAllocation(kvtier_emu::capture::Memory::kPinned, *p, bytes);
  return e;
}
template <typename T>
inline cudaError_t cudaHostAlloc(T** p, size_t bytes, unsigned flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(p), bytes, flags);
}
inline cudaError_t cudaMallocHost(void** p, size_t bytes) {
  return cudaHostAlloc(p, bytes, cudaHostAllocDefault);
}
template <typename T>
inline cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFreeHost(void* p) {
  if (const cudaError_t e = kvtier_emu::capture::BeforeUnsafeCall(); e != cudaSuccess) return e;
  kvtier_emu::capture::ForgetAllocation(kvtier_emu::capture::Memory::kPinned, p);
  return hipHostFree(p);
}
inline cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned flags) {
  return hipHostGetDevicePointer(device, host, flags);
}
template <typename T>
inline cudaError_t cudaHostGetDevicePointer(T** device, void* host, unsigned flags) {
  return hipHostGetDevicePointer(reinterpret_cast<void**>(device), host, flags);
}

// The blocking copy and memset are refused inside a capture; the asynchronous ones are recorded
// on a capturing stream, a copy only when neither side is pageable host memory.
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t e = kvtier_emu::capture::BeforeBlockingCopy(); e != cudaSuccess) return e;
  return hipMemcpy(dst, src, bytes, kind);
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t s = nullptr) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  return kvtier_emu::capture::Submit(
      s, [=](cudaStream_t on) { (void)hipMemcpyAsync(dst, src, bytes, kind, on); }, {dst, src});
}
inline cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (const cudaError_t e = kvtier_emu::capture::BeforeBlockingCopy(); e != cudaSuccess) return e;
  return hipMemset(dst, value, bytes);
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t s = nullptr) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr) return cudaErrorInvalidValue;
  return kvtier_emu::capture::Submit(s,
                                     [=](cudaStream_t on) { (void)hipMemsetAsync(dst, value, bytes, on); });
}

inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return hipStreamCreate(s); }
// Non-blocking streams are noted: the legacy stream conflicts with a capture in the others only.
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  const cudaError_t e = hipStreamCreateWithFlags(s, static_cast<hipStreamFlags>(flags));
  if (e == cudaSuccess) kvtier_emu::capture::NoteStream(*s, (flags & cudaStreamNonBlocking) != 0);
  return e;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  kvtier_emu::capture::ForgetStream(s);
  return hipStreamDestroy(s);
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (const cudaError_t e = kvtier_emu::capture::BeforeStreamWait(s); e != cudaSuccess) return e;
  return hipStreamSynchronize(s);
}
inline cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (const cudaError_t e = kvtier_emu::capture::BeforeStreamWait(s); e != cudaSuccess) return e;
  return hipStreamQuery(s);
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0) {
  return kvtier_emu::capture::WaitEvent(s, e, flags);
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return hipEventCreate(e); }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  return hipEventCreateWithFlags(e, static_cast<hipEventFlags>(flags));
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  kvtier_emu::capture::ForgetEvent(e);
  return hipEventDestroy(e);
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) {
  return kvtier_emu::capture::RecordEvent(e, s);
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (const cudaError_t err = kvtier_emu::capture::BeforeEventWait(e); err != cudaSuccess) return err;
  return hipEventSynchronize(e);
}
// HIP-CPU has no hipEventQuery: the event's completion is a std::future, polled here.
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (e == nullptr) return hipErrorInvalidHandle;
  if (const cudaError_t err = kvtier_emu::capture::BeforeEventWait(e); err != cudaSuccess) return err;
  const auto& done = is_done(*e);         // HIP-CPU's friend function, found by argument lookup
  if (!done.valid()) return cudaSuccess;  // never recorded: CUDA reports it complete
  return done.wait_for(std::chrono::seconds(0)) == std::future_status::ready ? cudaSuccess
                                                                             : cudaErrorNotReady;
}
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  return hipEventElapsedTime(ms, a, b);
}

// cudaMemcpyBatchAsync (CUDA 13 signature) as what it promises: the copies in stream order on
// `s`. HIP has no batch copy, so it is one asynchronous copy per entry on the same stream. Like
// the driver, it refuses the legacy default stream (cuMemcpyBatchAsync does).
enum cudaMemcpySrcAccessOrder {
  cudaMemcpySrcAccessOrderInvalid = 0,
  cudaMemcpySrcAccessOrderStream = 1,
  cudaMemcpySrcAccessOrderDuringApiCall = 2,
  cudaMemcpySrcAccessOrderAny = 3
};
enum cudaMemcpyFlags { cudaMemcpyFlagDefault = 0, cudaMemcpyFlagPreferOverlapWithCompute = 1 };
struct cudaMemcpyAttributes {
  cudaMemcpySrcAccessOrder srcAccessOrder;
  unsigned flags;
};
inline cudaError_t cudaMemcpyBatchAsync(const void* const* dsts, const void* const* srcs, const size_t* sizes,
                                        size_t count, const cudaMemcpyAttributes* attrs,
                                        const size_t* attr_index, size_t n_attrs, cudaStream_t s) {
  if (count > 0 && (dsts == nullptr || srcs == nullptr || sizes == nullptr)) return cudaErrorInvalidValue;
  if (n_attrs == 0 || attrs == nullptr || attr_index == nullptr || attr_index[0] != 0)
    return cudaErrorInvalidValue;
  if (s == nullptr) return cudaErrorInvalidValue;
  for (size_t i = 0; i < count; ++i)
    if (const cudaError_t e =
            cudaMemcpyAsync(const_cast<void*>(dsts[i]), srcs[i], sizes[i], cudaMemcpyDefault, s);
        e != cudaSuccess)
      return e;
  return cudaSuccess;
}

// ---- CUDA graphs: stream capture and replay (kernels/cuda/emulation/stream_capture.h) --------
// A graph is the work a capture recorded, in recording order; an executable graph is a copy of
// it. Launching one enqueues that work on the stream, in that order, as ordinary asynchronous
// work (a later synchronisation waits for it); the recorded kernel arguments are the values
// captured, so pointers are fixed and the data behind them is read when the replay runs.
// Launching into a capturing stream records the whole replay as one node of that capture.
struct CUgraph_st {
  std::shared_ptr<const std::vector<kvtier_emu::capture::Node>> nodes;
};
struct CUgraphExec_st {
  std::shared_ptr<const std::vector<kvtier_emu::capture::Node>> nodes;
};
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraphExec_st*;

inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  return kvtier_emu::capture::Begin(s, mode);
}
/// On any error *graph is null; the capture has ended unless the error is cudaErrorIllegalState
/// (no capture), cudaErrorStreamCaptureUnmatched or cudaErrorStreamCaptureWrongThread.
inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  if (graph == nullptr) return kvtier_emu::capture::Fail(cudaErrorInvalidValue);
  *graph = nullptr;
  std::vector<kvtier_emu::capture::Node> nodes;
  if (const cudaError_t e = kvtier_emu::capture::End(s, &nodes); e != cudaSuccess) return e;
  *graph = new CUgraph_st{std::make_shared<const std::vector<kvtier_emu::capture::Node>>(std::move(nodes))};
  return cudaSuccess;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  return kvtier_emu::capture::Status(s, status);
}
inline cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (mode == nullptr || (*mode != cudaStreamCaptureModeGlobal && *mode != cudaStreamCaptureModeThreadLocal &&
                          *mode != cudaStreamCaptureModeRelaxed))
    return kvtier_emu::capture::Fail(cudaErrorInvalidValue);
  std::swap(*mode, kvtier_emu::capture::ThreadMode());
  return cudaSuccess;
}
/// CUDA 12+'s three-argument form; no instantiation flag changes what the emulation replays.
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                        unsigned long long flags = 0) {
  (void)flags;
  if (exec == nullptr || graph == nullptr) return kvtier_emu::capture::Fail(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  if (exec == nullptr) return kvtier_emu::capture::Fail(cudaErrorInvalidValue);
  return kvtier_emu::capture::Submit(s, [nodes = exec->nodes](cudaStream_t on) {
    for (const kvtier_emu::capture::Node& node : *nodes) node(on);
  });
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  if (exec == nullptr) return kvtier_emu::capture::Fail(cudaErrorInvalidValue);
  delete exec;  // replays already enqueued hold their own reference to the work
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (graph == nullptr) return kvtier_emu::capture::Fail(cudaErrorInvalidValue);
  delete graph;
  return cudaSuccess;
}

// ---- fp16 / bf16 -----------------------------------------------------------------------------
static_assert(sizeof(__half) == 2, "HIP-CPU's __half must be the 2-byte f16 the store holds");

/// The bf16 the store holds: its bits, converted with the project's own functions.
struct __nv_bfloat16 {
  uint16_t x;
};
__host__ __device__ inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
__host__ __device__ inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return __nv_bfloat16{kvtier::kernels::Bf16BitsFromF32Bits(u)};
}

// ---- device arithmetic -----------------------------------------------------------------------
// The _rn intrinsics are IEEE operations that nvcc never contracts into an FMA; the empty asm
// makes each operand and result opaque, so the host compiler cannot contract them either.
namespace kvtier_emu {
inline float Opaque(float x) {
#if defined(__x86_64__)
  asm("" : "+x"(x));
#else
  asm("" : "+r"(x));
#endif
  return x;
}
}  // namespace kvtier_emu
inline float __fadd_rn(float a, float b) {
  return kvtier_emu::Opaque(kvtier_emu::Opaque(a) + kvtier_emu::Opaque(b));
}
inline float __fmul_rn(float a, float b) {
  return kvtier_emu::Opaque(kvtier_emu::Opaque(a) * kvtier_emu::Opaque(b));
}
inline float __fdiv_rn(float a, float b) {
  return kvtier_emu::Opaque(kvtier_emu::Opaque(a) / kvtier_emu::Opaque(b));
}
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __expf(float x) { return std::exp(x); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline int max(int a, int b) { return a < b ? b : a; }
inline unsigned max(unsigned a, unsigned b) { return a < b ? b : a; }
inline long long max(long long a, long long b) { return a < b ? b : a; }
inline long max(long a, long b) { return a < b ? b : a; }
inline unsigned long max(unsigned long a, unsigned long b) { return a < b ? b : a; }

// ---- warp and block synchronisation ------------------------------------------------------------
namespace kvtier_emu {

inline constexpr int kWarpSize = 32;  // CUDA's, not HIP-CPU's warpSize (64)
inline constexpr int kMaxBlockThreads = 1024;
inline constexpr int kMaxWarps = kMaxBlockThreads / kWarpSize;

/// The synchronisation state of the block running on this OS thread (HIP-CPU runs one block at
/// a time per thread, its threads as fibers of that thread).
struct BlockState {
  uint64_t block_seq = 0;                       // blocks started on this OS thread
  uint64_t finished_in[kMaxBlockThreads] = {};  // per thread: the block_seq it finished
  int threads = 0;
  int exited = 0;
  int block_arrived = 0;
  uint64_t block_generation = 0;
  int warp_arrived[kMaxWarps] = {};
  uint64_t warp_generation[kMaxWarps] = {};
  uint64_t idle_yields = 0;                    // yields since the last arrival anywhere in the block
  const hip::detail::Fiber* fibers = nullptr;  // HIP-CPU's fibers of this OS thread, one per thread rank
  // Shuffle exchange, double-buffered by the warp's generation parity: a lane can be at most
  // one shuffle ahead of the slowest lane of its warp, so two buffers never collide.
  uint64_t exchange[2][kMaxBlockThreads] = {};
};

inline BlockState& State() {
  thread_local BlockState state;
  return state;
}

inline int BlockThreads() { return static_cast<int>(blockDim.x * blockDim.y * blockDim.z); }
/// threadIdx as one number: HIP-CPU's fiber id, from which it derives threadIdx itself.
inline int ThreadRank() { return static_cast<int>(hip::detail::Fiber::this_fiber().id()); }

[[noreturn]] inline void Deadlock(const char* what) {
  char msg[200];
  const int n =
      std::snprintf(msg, sizeof msg,
                    "kvtier GPU emulation: %s can never complete in block (%u,%u,%u), thread %d: some "
                    "thread of its warp or block never reaches it (undefined behaviour in CUDA)\n",
                    what, static_cast<unsigned>(blockIdx.x), static_cast<unsigned>(blockIdx.y),
                    static_cast<unsigned>(blockIdx.z), ThreadRank());
  if (n > 0) (void)!::write(2, msg, static_cast<size_t>(n));
  std::abort();
}

/// Hands the OS thread to fiber `to` of this block; returns when some fiber yields back.
inline void YieldTo(int to, const char* waiting_for) {
  BlockState& st = State();
  if (++st.idle_yields > static_cast<uint64_t>(4 * st.threads + 4 * kWarpSize)) Deadlock(waiting_for);
  hip::detail::this_tile::has_barrier = true;  // HIP-CPU: this block runs as fibers
  hip::detail::Fiber::yield(st.fibers[to]);
}

inline void NoteProgress() { State().idle_yields = 0; }

/// Releases a block barrier when every thread still running has arrived (an exited thread
/// counts as arrived, as on the hardware).
inline void MaybeReleaseBlock(BlockState& st) {
  if (st.block_arrived > 0 && st.block_arrived + st.exited == st.threads) {
    st.block_arrived = 0;
    ++st.block_generation;
  }
}

/// __syncthreads().
inline void SyncThreads() {
  BlockState& st = State();
  if (st.threads <= 1) return;
  const uint64_t generation = st.block_generation;
  ++st.block_arrived;
  NoteProgress();
  MaybeReleaseBlock(st);
  const int next = (ThreadRank() + 1) % st.threads;
  while (st.block_generation == generation) YieldTo(next, "__syncthreads()");
}

/// Waits for the lanes of this thread's warp (the 32 consecutive thread ranks; fewer in a
/// block's last, partial warp).
inline void SyncWarp() {
  BlockState& st = State();
  if (st.threads <= 1) return;
  const int rank = ThreadRank(), warp = rank / kWarpSize, first = warp * kWarpSize;
  const int lanes = std::min(kWarpSize, st.threads - first);
  const uint64_t generation = st.warp_generation[warp];
  NoteProgress();
  if (++st.warp_arrived[warp] == lanes) {
    st.warp_arrived[warp] = 0;
    ++st.warp_generation[warp];
    return;
  }
  const int last = first + lanes - 1;
  int next = rank == last ? first : rank + 1;
  while (st.warp_generation[warp] == generation) {
    YieldTo(next, "a warp shuffle");
    next = next == last ? first : next + 1;
  }
}

/// A width-`width` shuffle of CUDA: lane l of each `width`-lane segment reads the value that
/// lane src_of(l) of the same segment passed. Every lane of the warp must call it.
template <typename T, typename SourceLane>
inline T Shuffle(T value, int width, SourceLane src_of) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>, "a register-sized value");
  BlockState& st = State();
  if (st.threads <= 1) return value;
  const int rank = ThreadRank(), warp = rank / kWarpSize, lane = rank % kWarpSize;
  uint64_t(&slots)[kMaxBlockThreads] = st.exchange[st.warp_generation[warp] & 1];
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  slots[rank] = bits;
  SyncWarp();
  const int segment = lane / width * width;
  const int src = src_of(lane - segment);  // -1: keep own value
  if (src < 0) return value;
  T out;
  std::memcpy(&out, &slots[warp * kWarpSize + segment + src], sizeof(T));
  return out;
}

/// Runs one thread of a block: HIP-CPU's fiber protocol expects every thread of a block to pass
/// the same sequence of its barriers and, at the end, hands control around the ring of fibers,
/// re-entering a finished thread's kernel (for the next block). Here a thread that finishes waits
/// until all have finished, so the ring passes through returns only; a re-entry within the same
/// block (recognised by block_seq) returns at once.
template <typename Body>
inline void RunBlockThread(const Body& body) {
  BlockState& st = State();
  const int threads = BlockThreads(), rank = ThreadRank();
  if (threads > kMaxBlockThreads) Deadlock("a block of more than 1024 threads");
  if (rank == 0) {  // HIP-CPU starts every block with thread 0 on the OS thread's own stack
    ++st.block_seq;
    st.threads = threads;
    st.exited = 0;
    st.block_arrived = 0;
    st.idle_yields = 0;
    std::fill(st.warp_arrived, st.warp_arrived + kMaxWarps, 0);
    // Creates the block's fibers (HIP-CPU reserves room for 1024, so the array stays put).
    if (threads > 1) st.fibers = hip::detail::Tile::fibers().data();
  } else if (st.finished_in[rank] == st.block_seq) {
    return;
  }
  body();
  st.finished_in[rank] = st.block_seq;
  if (threads <= 1) return;
  ++st.exited;
  NoteProgress();
  MaybeReleaseBlock(st);
  const int next = (rank + 1) % threads;
  while (st.exited < threads) YieldTo(next, "the end of the block");
}

/// kernel<<<grid, block, smem, stream>>>(args...) on HIP-CPU. The arguments are converted to the
/// kernel's parameter types and kept by value, so a launch recorded in a capture
/// (stream_capture.h) replays with the values it was given. A launch a capture refuses runs
/// nothing and leaves its error for cudaGetLastError, as a refused <<<...>>> does.
template <typename... Params, typename... Args>
inline void Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, hipStream_t stream,
                   Args&&... args) {
  const auto enqueue =
      [kernel, grid, block, smem,
       params = std::make_tuple(std::decay_t<Params>(std::forward<Args>(args))...)](hipStream_t on) {
        hip::detail::launch(
            grid, block, static_cast<std::uint32_t>(smem), on,
            [kernel](auto&&... xs) noexcept { RunBlockThread([&] { kernel(xs...); }); }, params);
      };
  (void)capture::Submit(stream, enqueue);
}

}  // namespace kvtier_emu

// CUDA's warp intrinsics on 32-lane warps (the mask must name the whole warp: every caller in
// kvtier passes 0xffffffff, and a partial mask is not emulated).
template <typename T>
inline T __shfl_sync(unsigned /*mask*/, T value, int src_lane, int width = kvtier_emu::kWarpSize) {
  return kvtier_emu::Shuffle(value, width, [&](int) { return src_lane & (width - 1); });
}
template <typename T>
inline T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask, int width = kvtier_emu::kWarpSize) {
  return kvtier_emu::Shuffle(value, width, [&](int lane) {
    const int src = lane ^ lane_mask;
    return src < width ? src : -1;  // CUDA: a lane of a later segment reads its own value
  });
}
template <typename T>
inline T __shfl_down_sync(unsigned /*mask*/, T value, unsigned delta, int width = kvtier_emu::kWarpSize) {
  return kvtier_emu::Shuffle(value, width, [&](int lane) {
    const int src = lane + static_cast<int>(delta);
    return src < width ? src : -1;
  });
}
template <typename T>
inline T __shfl_up_sync(unsigned /*mask*/, T value, unsigned delta, int width = kvtier_emu::kWarpSize) {
  return kvtier_emu::Shuffle(value, width, [&](int lane) {
    const int src = lane - static_cast<int>(delta);
    return src >= 0 ? src : -1;
  });
}
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) { kvtier_emu::SyncWarp(); }

// HIP-CPU's __syncthreads is a block-wide fiber rotation that assumes equal barrier counts per
// thread; kernels here use the scheduler above instead.
#define __syncthreads() ::kvtier_emu::SyncThreads()
