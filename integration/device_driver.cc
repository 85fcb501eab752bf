#include "integration/device_driver.h"

#include <cstring>
#include <string>

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "offload/device_memory_cuda.h"
#include "offload/device_sync_cuda.h"
#endif

namespace kvtier {

#if KVTIER_HAVE_CUDA

namespace {
std::string CudaMessage(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}
}  // namespace

// Per layer: K, V and q in device memory and in pinned staging, and the output on the device.
// The staging of a layer is rewritten only after the step's read-back waited for the stream,
// so a copy in flight never reads a buffer being rewritten.
struct DeviceDriver::Buffers {
  cudaStream_t stream = nullptr;
  size_t kv_bytes = 0, q_bytes = 0;
  uint8_t* device = nullptr;  // [layers][k | v | q | out]
  uint8_t* pinned = nullptr;  // [layers][k | v | q | out]
  size_t layer_bytes = 0;
  int layers = 0;
  uint8_t* DeviceK(int l) const { return device + static_cast<size_t>(l) * layer_bytes; }
  uint8_t* PinnedK(int l) const { return pinned + static_cast<size_t>(l) * layer_bytes; }
  size_t VOffset() const { return kv_bytes; }
  size_t QOffset() const { return 2 * kv_bytes; }
  size_t OutOffset() const { return 2 * kv_bytes + q_bytes; }
  ~Buffers() {
    if (stream != nullptr) device_sync::SyncStream(stream);
    if (device != nullptr) device_memory::Free(device);
    if (pinned != nullptr) device_memory::FreeHost(pinned);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

DeviceDriver::DeviceDriver(const Geometry& g) : g_(g), b_(std::make_unique<Buffers>()) {}
DeviceDriver::~DeviceDriver() = default;

Result<std::unique_ptr<DeviceDriver>> DeviceDriver::Create(const Geometry& g) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  auto d = std::unique_ptr<DeviceDriver>(new DeviceDriver(g));
  Buffers& b = *d->b_;
  b.layers = g.layers;
  b.kv_bytes = g.token_kv_bytes() / 2;  // one of K and V
  b.q_bytes = static_cast<size_t>(g.q_heads) * g.head_dim * sizeof(float);
  b.layer_bytes = (2 * b.kv_bytes + 2 * b.q_bytes + 255) / 256 * 256;
  const size_t total = b.layer_bytes * static_cast<size_t>(g.layers);
  cudaError_t e = cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = device_memory::Malloc(&b.device, total, DeviceMemoryOwner::kEngineArrays);
  if (e == cudaSuccess) e = device_memory::HostAlloc(&b.pinned, total, cudaHostAllocDefault);
  if (e != cudaSuccess)
    return Unavailable("kvtier run: the engine's device arrays (" + std::to_string(total) +
                       " bytes): " + CudaMessage(e));
  return d;
}

Status DeviceDriver::Append(Session* session, int layer, const void* k, const void* v, DType dtype) {
  Buffers& b = *b_;
  uint8_t* host = b.PinnedK(layer);
  uint8_t* dev = b.DeviceK(layer);
  std::memcpy(host, k, b.kv_bytes);
  std::memcpy(host + b.VOffset(), v, b.kv_bytes);
  const cudaError_t e = device_sync::CopyAsync(dev, host, 2 * b.kv_bytes, cudaMemcpyHostToDevice, b.stream,
                                               device_sync::HostMemory::kPinned);
  if (e != cudaSuccess) return Internal("kvtier run: the engine's K/V upload: " + CudaMessage(e));
  return session->AppendDevice(layer, dev, dev + b.VOffset(), 1, dtype, b.stream);
}

Status DeviceDriver::Attend(Session* session, int layer, const float* q, const int64_t* position,
                            AttendStats* stats) {
  Buffers& b = *b_;
  uint8_t* host = b.PinnedK(layer) + b.QOffset();
  uint8_t* dev = b.DeviceK(layer);
  std::memcpy(host, q, b.q_bytes);
  const cudaError_t e = device_sync::CopyAsync(dev + b.QOffset(), host, b.q_bytes, cudaMemcpyHostToDevice,
                                               b.stream, device_sync::HostMemory::kPinned);
  if (e != cudaSuccess) return Internal("kvtier run: the engine's query upload: " + CudaMessage(e));
  return session->AttendDevice(layer, reinterpret_cast<const float*>(dev + b.QOffset()), position, 1,
                               reinterpret_cast<float*>(dev + b.OutOffset()), b.stream, stats);
}

Status DeviceDriver::ReadOutputs(std::vector<std::vector<float>>* out) {
  Buffers& b = *b_;
  cudaError_t e = cudaSuccess;
  for (int l = 0; l < b.layers && e == cudaSuccess; ++l)
    e = device_sync::CopyAsync(b.PinnedK(l) + b.OutOffset(), b.DeviceK(l) + b.OutOffset(), b.q_bytes,
                               cudaMemcpyDeviceToHost, b.stream, device_sync::HostMemory::kPinned);
  if (e == cudaSuccess) e = device_sync::SyncStream(b.stream);
  if (e != cudaSuccess) return Internal("kvtier run: reading the outputs back: " + CudaMessage(e));
  out->resize(static_cast<size_t>(b.layers));
  for (int l = 0; l < b.layers; ++l) {
    const auto* src = reinterpret_cast<const float*>(b.PinnedK(l) + b.OutOffset());
    (*out)[static_cast<size_t>(l)].assign(src, src + b.q_bytes / sizeof(float));
  }
  return Status::Ok();
}

#else  // !KVTIER_HAVE_CUDA

struct DeviceDriver::Buffers {};
DeviceDriver::DeviceDriver(const Geometry& g) : g_(g) {}
DeviceDriver::~DeviceDriver() = default;
Result<std::unique_ptr<DeviceDriver>> DeviceDriver::Create(const Geometry& g) {
  (void)g;
  return Unavailable("kvtier run: the device-pointer calls need a build with CUDA");
}
Status DeviceDriver::Append(Session*, int, const void*, const void*, DType) {
  return Unavailable("kvtier run: the device-pointer calls need a build with CUDA");
}
Status DeviceDriver::Attend(Session*, int, const float*, const int64_t*, AttendStats*) {
  return Unavailable("kvtier run: the device-pointer calls need a build with CUDA");
}
Status DeviceDriver::ReadOutputs(std::vector<std::vector<float>>*) {
  return Unavailable("kvtier run: the device-pointer calls need a build with CUDA");
}

#endif

}  // namespace kvtier
