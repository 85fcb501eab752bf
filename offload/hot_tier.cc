#include "offload/hot_tier.h"

#include <cstdlib>
#include <cstring>

#if KVTIER_HAVE_CUDA
#include "kernels/cuda/kernels.h"
#include "offload/cuda_hot_tier.h"
#endif

namespace kvtier {

Result<std::unique_ptr<HostHotTier>> HostHotTier::Create(size_t slot_pool_bytes, size_t slot_bytes) {
  auto tier = std::unique_ptr<HostHotTier>(new HostHotTier());
  KVTIER_ASSIGN_OR_RETURN(tier->pool_, SlotPool::Create("hot_bytes", slot_pool_bytes, slot_bytes, false));
  return tier;
}

const char* MemorySpaceName(MemorySpace space) {
  switch (space) {
    case MemorySpace::kHost:
      return "host";
    case MemorySpace::kDevice:
      return "device";
  }
  return "unknown";
}

Status HotTier::UploadBatch(const UploadOp* ops, size_t n) {
  for (size_t i = 0; i < n; ++i) KVTIER_RETURN_IF_ERROR(Upload(ops[i].dst, ops[i].src, ops[i].bytes));
  return Status::Ok();
}

Status HotTier::CopyWithin(uint8_t*, const void*, size_t) {
  return Unavailable(std::string("hot tier (") + DeviceName(device()) +
                     "): this tier does not copy within its own memory space; hand Append host K/V "
                     "(MemorySpace::kHost)");
}

Result<TransferTicket> HotTier::DownloadBatchAsync(const DownloadOp* ops, size_t n) {
  for (size_t i = 0; i < n; ++i) KVTIER_RETURN_IF_ERROR(Download(ops[i].dst, ops[i].src, ops[i].bytes));
  return kCompletedTransfer;
}

Status HotTier::WaitTransfer(TransferTicket ticket) {
  if (ticket != kCompletedTransfer)
    return InvalidArgument("hot tier: unknown transfer ticket " + std::to_string(ticket) +
                           " (never issued or already waited)");
  return Status::Ok();
}

Result<bool> HotTier::TransferDone(TransferTicket ticket) {
  // Not through WaitTransfer: a polled ticket must stay waitable in a tier that overrides it.
  if (ticket != kCompletedTransfer)
    return InvalidArgument("hot tier: unknown transfer ticket " + std::to_string(ticket) +
                           " (never issued or already waited)");
  return true;
}

Result<uint8_t*> HostHotTier::AllocateRegion(size_t bytes) {
  if (bytes == 0) return InvalidArgument("hot region size must be > 0");
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr)
    return ResourceExhausted("hot tier: could not allocate " + std::to_string(bytes) + " bytes");
  return static_cast<uint8_t*>(p);
}

void HostHotTier::FreeRegion(uint8_t* region, size_t) { std::free(region); }

Status HostHotTier::Upload(uint8_t* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostHotTier::Download(void* dst, const uint8_t* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostHotTier::CopyWithin(uint8_t* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

}  // namespace kvtier

// ---- kvtier's own tiers ------------------------------------------------------------------

namespace kvtier {

const char* DeviceName(Device device) {
  switch (device) {
    case Device::kCpu:
      return "cpu";
    case Device::kCuda:
      return "cuda";
  }
  return "unknown";
}

Result<Device> ParseDevice(const std::string& name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  return InvalidArgument("unknown device '" + name + "' (cpu|cuda)");
}

Status CheckDevice(Device device) {
  switch (device) {
    case Device::kCpu:
      return Status::Ok();
    case Device::kCuda:
#if KVTIER_HAVE_CUDA
      // Asked here, not only when building, so that StoreOptions::Validate names the missing
      // device before anything is opened.
      if (kernels::cuda::DeviceCount() == 0)
        return Unavailable(std::string("hot tier \"cuda\": no CUDA device: ") +
                           kernels::cuda::LastCudaErrorString());
      return Status::Ok();
#else
      return Unavailable(
          "hot tier \"cuda\": this build has no CUDA (configure with KVTIER_CUDA=on where nvcc "
          "exists); use cpu");
#endif
  }
  return InvalidArgument("unknown device " + std::to_string(static_cast<int>(device)) + " (cpu|cuda)");
}

Result<std::unique_ptr<HotTier>> MakeHotTier(Device device, size_t slot_pool_bytes, size_t slot_bytes) {
  KVTIER_RETURN_IF_ERROR(CheckDevice(device));
  if (device == Device::kCpu) {
    KVTIER_ASSIGN_OR_RETURN(auto tier, HostHotTier::Create(slot_pool_bytes, slot_bytes));
    return std::unique_ptr<HotTier>(std::move(tier));
  }
#if KVTIER_HAVE_CUDA
  KVTIER_ASSIGN_OR_RETURN(auto tier, CudaHotTier::Create(slot_pool_bytes, slot_bytes));
  return std::unique_ptr<HotTier>(std::move(tier));
#else
  return Internal("MakeHotTier: no CUDA in this build");  // CheckDevice refused it already
#endif
}

}  // namespace kvtier
