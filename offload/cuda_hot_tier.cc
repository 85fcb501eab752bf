#include "offload/cuda_hot_tier.h"

#if KVTIER_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/kernels.h"
#include "offload/device_sync_cuda.h"

namespace kvtier {
namespace {

std::string CudaMessage(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

}  // namespace

Result<std::unique_ptr<CudaHotTier>> CudaHotTier::Create(size_t slot_pool_bytes, size_t slot_bytes) {
  if (slot_bytes == 0) return InvalidArgument("hot tier \"cuda\": slot_bytes must be > 0");
  const size_t n = slot_pool_bytes / slot_bytes;
  if (n < 1)
    return InvalidArgument("hot_bytes (" + std::to_string(slot_pool_bytes) + ") holds no slot of " +
                           std::to_string(slot_bytes) + " bytes");
  if (n > static_cast<size_t>(INT32_MAX)) return InvalidArgument("hot tier \"cuda\": too many slots");
  if (kernels::cuda::DeviceCount() == 0)
    return Unavailable(std::string("hot tier \"cuda\": no CUDA device: ") +
                       kernels::cuda::LastCudaErrorString());
  auto tier = std::unique_ptr<CudaHotTier>(new CudaHotTier(static_cast<int32_t>(n), slot_bytes));
  cudaError_t e = device_memory::Malloc(&tier->pool_, n * slot_bytes, DeviceMemoryOwner::kHotTier);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ResourceExhausted("hot tier \"cuda\": cudaMalloc of " + std::to_string(n * slot_bytes) +
                             " bytes for the slot pool failed (" + CudaMessage(e) + ")");
  }
  cudaStream_t s = nullptr;
  if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess)
    return Internal("hot tier \"cuda\": cudaStreamCreate: " + CudaMessage(e));
  tier->stream_ = s;
  return tier;
}

CudaHotTier::~CudaHotTier() {
  if (stream_) device_sync::SyncStream(static_cast<cudaStream_t>(stream_));
  for (auto& [ticket, ev] : in_flight_) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
  for (void* ev : spare_events_) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  if (pool_) device_memory::Free(pool_);
}

void CudaHotTier::ReleaseSlot(int32_t slot) {
  if (!book_.Release(slot).ok()) ++bad_releases_;
}

Result<uint8_t*> CudaHotTier::AllocateRegion(size_t bytes) {
  if (bytes == 0) return InvalidArgument("hot region size must be > 0");
  void* p = nullptr;
  const cudaError_t e = device_memory::Malloc(&p, bytes, DeviceMemoryOwner::kHotTier);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ResourceExhausted("hot tier \"cuda\": cudaMalloc of " + std::to_string(bytes) + " bytes failed (" +
                             CudaMessage(e) + ")");
  }
  return static_cast<uint8_t*>(p);
}

void CudaHotTier::FreeRegion(uint8_t* region, size_t) {
  // cudaFree synchronises the device: a region is freed only when its sequence is dropped.
  if (region) device_memory::Free(region);
}

Result<void*> CudaHotTier::TakeEvent() {
  {
    std::lock_guard<std::mutex> l(tickets_mu_);
    if (!spare_events_.empty()) {
      void* ev = spare_events_.back();
      spare_events_.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev = nullptr;
  if (const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess)
    return Internal("hot tier \"cuda\": cudaEventCreate: " + CudaMessage(e));
  return static_cast<void*>(ev);
}

void CudaHotTier::ReturnEvent(void* ev) {
  std::lock_guard<std::mutex> l(tickets_mu_);
  spare_events_.push_back(ev);
}

int CudaHotTier::WaitForStreamWork(void* event) {
  // An event of this call's own: with one shared event, a second thread re-recording it while
  // the first waits makes the first wait for the second's copies (CUDA) or races on the event's
  // state (HIP-CPU's emulated device hung on exactly that under `kvtier stress --threads 2`).
  cudaEvent_t ev = static_cast<cudaEvent_t>(event);
  cudaError_t e = cudaEventRecord(ev, static_cast<cudaStream_t>(stream_));
  if (e == cudaSuccess) e = device_sync::SyncEvent(ev);
  return static_cast<int>(e);
}

Status CudaHotTier::Copy(void* dst, const void* src, size_t bytes, CopyKind kind, bool wait) {
  if (bytes == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  const cudaMemcpyKind dir = kind == CopyKind::kUpload     ? cudaMemcpyHostToDevice
                             : kind == CopyKind::kDownload ? cudaMemcpyDeviceToHost
                                                           : cudaMemcpyDeviceToDevice;
  auto ev = TakeEvent();
  if (!ev.ok()) return ev.status();
  // HotTier's Upload and Download take any host memory (an engine's buffers, the store's
  // vectors); the pinned warm slots travel through UploadBatch and DownloadBatchAsync.
  cudaError_t e = device_sync::CopyAsync(dst, src, bytes, dir, s, device_sync::HostMemory::kPageable);
  // HotTier's contract: the bytes are in place on return (the store reads them next), except
  // for CopyWithinOrdered, which only orders them.
  if (e == cudaSuccess && wait) e = static_cast<cudaError_t>(WaitForStreamWork(*ev));
  ReturnEvent(*ev);
  if (e != cudaSuccess) {
    const char* what = kind == CopyKind::kUpload     ? "upload"
                       : kind == CopyKind::kDownload ? "download"
                                                     : "device copy";
    return IOError(std::string("hot tier \"cuda\": ") + what + " of " + std::to_string(bytes) +
                   " bytes failed (" + CudaMessage(e) + ")");
  }
  return Status::Ok();
}

Status CudaHotTier::UploadBatch(const UploadOp* ops, size_t n) {
  if (n == 0) return Status::Ok();
  std::vector<void*> dsts(n);
  std::vector<const void*> srcs(n);
  std::vector<size_t> sizes(n);
  for (size_t i = 0; i < n; ++i) dsts[i] = ops[i].dst, srcs[i] = ops[i].src, sizes[i] = ops[i].bytes;
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  // From the pinned warm slots (UploadOp): asynchronous, not a wait; the event wait below is.
  if (kernels::cuda::MemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, s) !=
      kernels::KernelError::kOk)
    return IOError("hot tier \"cuda\": batch upload of " + std::to_string(n) + " copies failed (" +
                   kernels::cuda::LastCudaErrorString() + ")");
  auto ev = TakeEvent();
  if (!ev.ok()) return ev.status();
  const cudaError_t e = static_cast<cudaError_t>(WaitForStreamWork(*ev));
  ReturnEvent(*ev);
  if (e != cudaSuccess)
    return IOError("hot tier \"cuda\": batch upload of " + std::to_string(n) + " copies failed (" +
                   CudaMessage(e) + ")");
  return Status::Ok();
}

Status CudaHotTier::Upload(uint8_t* dst, const void* src, size_t bytes) {
  return Copy(dst, src, bytes, CopyKind::kUpload);
}

Status CudaHotTier::Download(void* dst, const uint8_t* src, size_t bytes) {
  return Copy(dst, src, bytes, CopyKind::kDownload);
}

Status CudaHotTier::CopyWithin(uint8_t* dst, const void* src, size_t bytes) {
  return Copy(dst, src, bytes, CopyKind::kWithin);
}

Status CudaHotTier::UploadOrdered(uint8_t* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  std::lock_guard<std::mutex> l(staging_mu_);
  Result<uint8_t*> staged = staging_.Take(bytes, "staged upload");
  Status st = staged.status();
  if (st.ok()) {
    std::memcpy(*staged, src, bytes);
    const cudaError_t e =
        device_sync::CopyAsync(dst, *staged, bytes, cudaMemcpyHostToDevice,
                               static_cast<cudaStream_t>(stream_), device_sync::HostMemory::kPinned);
    st = e == cudaSuccess ? staging_.Done(stream_) : Internal(CudaMessage(e));
  }
  if (!st.ok()) {
    (void)cudaGetLastError();
    return IOError("hot tier \"cuda\": staged upload of " + std::to_string(bytes) + " bytes failed (" +
                   st.message() + ")");
  }
  return Status::Ok();
}

Status CudaHotTier::CopyWithinOrdered(uint8_t* dst, const void* src, size_t bytes) {
  return Copy(dst, src, bytes, CopyKind::kWithin, /*wait=*/false);
}

Status CudaHotTier::Order(void* from, void* to, const char* what) {
  auto ev = TakeEvent();
  if (!ev.ok()) return ev.status();
  // cudaStreamWaitEvent waits for the event's record at the time of the call, so the event may
  // go back to the spare list (and be recorded again) at once.
  cudaError_t e = cudaEventRecord(static_cast<cudaEvent_t>(*ev), static_cast<cudaStream_t>(from));
  if (e == cudaSuccess)
    e = cudaStreamWaitEvent(static_cast<cudaStream_t>(to), static_cast<cudaEvent_t>(*ev), 0);
  ReturnEvent(*ev);
  if (e != cudaSuccess)
    return IOError(std::string("hot tier \"cuda\": ") + what + " (" + CudaMessage(e) + ")");
  return Status::Ok();
}

Status CudaHotTier::WaitForStream(void* engine_stream) {
  return Order(engine_stream, stream_, "ordering the transfer stream after the engine's stream");
}

Status CudaHotTier::MakeStreamWait(void* engine_stream) {
  return Order(stream_, engine_stream, "ordering the engine's stream after the transfer stream");
}

Result<TransferTicket> CudaHotTier::DownloadBatchAsync(const DownloadOp* ops, size_t n) {
  auto taken = TakeEvent();
  if (!taken.ok()) return taken.status();
  cudaEvent_t ev = static_cast<cudaEvent_t>(*taken);
  cudaError_t e = cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  // On the transfer stream, after every copy submitted so far and before every later one:
  // what lets the store refill the ring positions being read before the download is waited.
  for (size_t i = 0; i < n && e == cudaSuccess; ++i)
    if (ops[i].bytes > 0)
      e = device_sync::CopyAsync(ops[i].dst, ops[i].src, ops[i].bytes, cudaMemcpyDeviceToHost, s,
                                 device_sync::HostMemory::kPinned);  // warm slots (DownloadOp)
  if (e == cudaSuccess) e = cudaEventRecord(ev, s);
  std::lock_guard<std::mutex> l(tickets_mu_);
  if (e != cudaSuccess) {
    spare_events_.push_back(ev);
    return IOError("hot tier \"cuda\": asynchronous download of " + std::to_string(n) + " copies failed (" +
                   CudaMessage(e) + ")");
  }
  const TransferTicket ticket = next_ticket_++;
  in_flight_[ticket] = ev;
  return ticket;
}

Status CudaHotTier::WaitTransfer(TransferTicket ticket) {
  if (ticket == kCompletedTransfer) return Status::Ok();
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> l(tickets_mu_);
    auto it = in_flight_.find(ticket);
    if (it == in_flight_.end())
      return InvalidArgument("hot tier \"cuda\": unknown transfer ticket " + std::to_string(ticket) +
                             " (never issued or already waited)");
    ev = static_cast<cudaEvent_t>(it->second);
    in_flight_.erase(it);
  }
  // A copy already done needs no blocking call (nor a counted wait).
  cudaError_t e = cudaEventQuery(ev);
  if (e == cudaErrorNotReady) e = device_sync::SyncEvent(ev);
  std::lock_guard<std::mutex> l(tickets_mu_);
  spare_events_.push_back(ev);
  if (e != cudaSuccess)
    return IOError("hot tier \"cuda\": asynchronous download (ticket " + std::to_string(ticket) +
                   ") failed (" + CudaMessage(e) + ")");
  return Status::Ok();
}

Result<bool> CudaHotTier::TransferDone(TransferTicket ticket) {
  if (ticket == kCompletedTransfer) return true;
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> l(tickets_mu_);
    auto it = in_flight_.find(ticket);
    if (it == in_flight_.end())
      return InvalidArgument("hot tier \"cuda\": unknown transfer ticket " + std::to_string(ticket) +
                             " (never issued or already waited)");
    ev = static_cast<cudaEvent_t>(it->second);
  }
  // The event stays in in_flight_ until WaitTransfer, which only this ticket's owner calls.
  const cudaError_t e = cudaEventQuery(ev);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  return IOError("hot tier \"cuda\": asynchronous download (ticket " + std::to_string(ticket) + ") failed (" +
                 CudaMessage(e) + ")");
}

}  // namespace kvtier

#endif  // KVTIER_HAVE_CUDA
