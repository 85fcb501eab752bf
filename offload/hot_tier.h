// The hot tier: where attention reads KV from. It holds each (sequence,
// layer)'s sinks and local ring, plus a pool of slots for retrieved chunks.
//
// HostHotTier keeps it in host memory; CudaHotTier (offload/cuda_hot_tier.h,
// builds with CUDA) implements the same interface with device memory: the
// pointers it returns are device pointers.
//
// TieredStore does not name an implementation: it builds its hot tier from
// StoreOptions::hot_tier (a factory string looked up in the registry below) or
// from StoreOptions::hot_tier_factory (an engine's own tier). "host" is built
// in, and so is "cuda" (offload/cuda_hot_tier.h) in builds with CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "offload/host_memory.h"
#include "store/factory_spec.h"
#include "store/status.h"

namespace kvtier {

class HotTier {
 public:
  virtual ~HotTier() = default;
  /// "cpu" or "cuda".
  virtual const char* device() const = 0;

  // ---- slot pool for retrieved chunks (fixed slot size = one chunk) ----
  virtual int32_t slot_capacity() const = 0;
  virtual int32_t slots_used() const = 0;
  /// Bytes of one slot; TieredStore refuses a tier whose slots are not one chunk.
  virtual size_t slot_bytes() const = 0;
  /// A free slot, or -1 when every slot is taken.
  virtual int32_t AcquireSlot() = 0;
  virtual void ReleaseSlot(int32_t slot) = 0;
  virtual uint8_t* slot_data(int32_t slot) = 0;

  // ---- per-(sequence, layer) regions: sinks and the local ring ----
  /// Memory that attention can read directly; freed with FreeRegion.
  virtual Result<uint8_t*> AllocateRegion(size_t bytes) = 0;
  virtual void FreeRegion(uint8_t* region, size_t bytes) = 0;

  /// Copies host bytes into hot memory (a slot or a region).
  virtual Status Upload(uint8_t* dst, const void* src, size_t bytes) = 0;

  /// One host -> hot copy of a batch.
  struct UploadOp {
    uint8_t* dst = nullptr;     ///< hot memory (a slot or a region)
    const void* src = nullptr;  ///< host memory (the pinned warm tier for a fetch)
    size_t bytes = 0;
  };
  /// Copies every op; all are in place when it returns OK. The default uploads them one by
  /// one and stops at the first error; a device tier submits one batch and waits once (no
  /// host synchronisation per chunk). On an error, which ops landed is unspecified.
  virtual Status UploadBatch(const UploadOp* ops, size_t n);
  /// Copies hot bytes out to host memory.
  virtual Status Download(void* dst, const uint8_t* src, size_t bytes) = 0;
};

/// Host-memory hot tier: slots come from an aligned SlotPool, regions from the heap.
class HostHotTier final : public HotTier {
 public:
  static Result<std::unique_ptr<HostHotTier>> Create(size_t slot_pool_bytes, size_t slot_bytes);
  const char* device() const override { return "cpu"; }
  int32_t slot_capacity() const override { return pool_->capacity(); }
  int32_t slots_used() const override { return pool_->used(); }
  size_t slot_bytes() const override { return pool_->slot_bytes(); }
  int32_t AcquireSlot() override { return pool_->Acquire(); }
  void ReleaseSlot(int32_t slot) override { pool_->Release(slot); }
  uint8_t* slot_data(int32_t slot) override { return pool_->slot_data(slot); }
  Result<uint8_t*> AllocateRegion(size_t bytes) override;
  void FreeRegion(uint8_t* region, size_t bytes) override;
  Status Upload(uint8_t* dst, const void* src, size_t bytes) override;
  Status Download(void* dst, const uint8_t* src, size_t bytes) override;

 private:
  std::unique_ptr<SlotPool> pool_;
};

// ---- the registry --------------------------------------------------------------------

/// Builds a hot tier with a slot pool of `slot_pool_bytes` (at least one slot of
/// `slot_bytes`); `spec` carries the factory string's parameters.
using HotTierFactory = std::function<Result<std::unique_ptr<HotTier>>(const FactorySpec& spec, size_t slot_pool_bytes,
                                                                      size_t slot_bytes)>;

/// Adds a named implementation (an engine's own tier). AlreadyExists when the name is
/// taken ("host" always, "cuda" in builds with CUDA), InvalidArgument for an empty name or
/// factory. Thread-safe.
Status RegisterHotTier(const std::string& name, HotTierFactory factory);
/// Names that MakeHotTier can build now, sorted ("host", plus registered ones).
std::vector<std::string> HotTierNames();
/// Checks `spec` without building anything: the same status MakeHotTier would give
/// for a spec problem. InvalidArgument for a malformed spec or an unknown name;
/// Unavailable for "cuda" in a build without CUDA or when no CUDA device is visible.
Status CheckHotTierSpec(const std::string& spec);
/// Builds the hot tier `spec` names ("host"; "host" takes no parameters).
Result<std::unique_ptr<HotTier>> MakeHotTier(const std::string& spec, size_t slot_pool_bytes, size_t slot_bytes);

}  // namespace kvtier
