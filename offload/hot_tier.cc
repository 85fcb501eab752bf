#include "offload/hot_tier.h"

#include <cstdlib>
#include <cstring>

namespace kvtier {

Result<std::unique_ptr<HostHotTier>> HostHotTier::Create(size_t slot_pool_bytes, size_t slot_bytes) {
  auto tier = std::unique_ptr<HostHotTier>(new HostHotTier());
  KVTIER_ASSIGN_OR_RETURN(tier->pool_, SlotPool::Create("hot_bytes", slot_pool_bytes, slot_bytes, false));
  return tier;
}

Result<uint8_t*> HostHotTier::AllocateRegion(size_t bytes) {
  if (bytes == 0) return InvalidArgument("hot region size must be > 0");
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return ResourceExhausted("hot tier: could not allocate " + std::to_string(bytes) + " bytes");
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

}  // namespace kvtier
