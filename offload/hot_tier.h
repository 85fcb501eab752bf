// The hot tier: where attention reads KV from. It holds each (sequence,
// layer)'s sinks and local ring, plus a pool of slots for retrieved chunks.
//
// HostHotTier keeps it in host memory; CudaHotTier (offload/cuda_hot_tier.h,
// builds with CUDA) implements the same interface with device memory: the
// pointers it returns are device pointers.
//
// TieredStore does not name an implementation: it builds kvtier's own tier on
// StoreOptions::device (MakeHotTier below: HostHotTier on kCpu, CudaHotTier on
// kCuda in builds with CUDA), or calls StoreHooks::hot_tier_factory
// (offload/store_hooks.h), the internal way tests and tools bring their own tier.
// This interface is not installed: a pluggable hot tier is not public.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/types.h"
#include "offload/host_memory.h"
#include "store/factory_spec.h"
#include "store/status.h"

namespace kvtier {

// MemorySpace (where Append's K/V live) is public vocabulary: kvtier/types.h.

/// Names one asynchronous download (HotTier::DownloadBatchAsync). kCompletedTransfer names a
/// download that was complete when it was submitted (a host tier's memcpy).
using TransferTicket = uint64_t;
inline constexpr TransferTicket kCompletedTransfer = 0;

class HotTier {
 public:
  virtual ~HotTier() = default;
  /// Where this tier's memory is.
  virtual Device device() const = 0;

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

  /// Copies bytes that already live in this tier's memory space (MemorySpace::kDevice: device
  /// memory for "cuda", host memory for "host") into hot memory, so that a GPU engine's K/V
  /// never round-trip through the host. Same completion guarantee as Upload (in place on
  /// return), and ordered with the tier's other copies the same way. The default refuses
  /// (Unavailable naming the tier): a tier must say how to copy within its own memory.
  virtual Status CopyWithin(uint8_t* dst, const void* src, size_t bytes);
  /// Upload that a device tier may leave in flight: `src` is copied (or staged) before the call
  /// returns, so the caller may reuse it at once, and the bytes reach `dst` before the tier's
  /// later copies and kernels run (CudaHotTier stages them in pinned memory). The default is
  /// Upload (complete on return).
  virtual Status UploadOrdered(uint8_t* dst, const void* src, size_t bytes) {
    return Upload(dst, src, bytes);
  }
  /// CopyWithin that a device tier may leave in flight: ordered before the tier's later copies
  /// and kernels, complete once the tier's stream reaches it (CudaHotTier). The default is
  /// CopyWithin (complete on return).
  virtual Status CopyWithinOrdered(uint8_t* dst, const void* src, size_t bytes) {
    return CopyWithin(dst, src, bytes);
  }

  /// One hot -> host copy of an asynchronous batch.
  struct DownloadOp {
    void* dst = nullptr;           ///< host memory (a pinned warm slot: what lets a device copy run async)
    const uint8_t* src = nullptr;  ///< hot memory (a slot or a region)
    size_t bytes = 0;
  };
  /// Submits the copies and returns at once with a ticket; the bytes are in `dst` only once
  /// WaitTransfer(ticket) returned OK (or TransferDone said true). Until then the caller must
  /// not read `dst`, and `src` may be overwritten only by this tier's copies submitted later
  /// (a device tier runs its copies in submission order on one stream, so a later Upload or
  /// CopyWithin into `src` lands after the download read it). Every ticket must be waited
  /// once (that frees it). The default downloads synchronously and returns
  /// kCompletedTransfer; a tier overriding it overrides WaitTransfer and TransferDone too.
  virtual Result<TransferTicket> DownloadBatchAsync(const DownloadOp* ops, size_t n);
  /// Blocks until the ticket's copies are complete; their status. kCompletedTransfer is OK at
  /// once; a ticket that is unknown (or already waited) is InvalidArgument.
  virtual Status WaitTransfer(TransferTicket ticket);
  /// Non-blocking: true once WaitTransfer(ticket) would return without waiting. An error is
  /// the copy's failure (WaitTransfer reports it too) or an unknown ticket.
  virtual Result<bool> TransferDone(TransferTicket ticket);
};

/// Host-memory hot tier: slots come from an aligned SlotPool, regions from the heap.
class HostHotTier final : public HotTier {
 public:
  static Result<std::unique_ptr<HostHotTier>> Create(size_t slot_pool_bytes, size_t slot_bytes);
  Device device() const override { return Device::kCpu; }
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
  /// Host memory is this tier's memory space: a memcpy, like Upload.
  Status CopyWithin(uint8_t* dst, const void* src, size_t bytes) override;

 private:
  std::unique_ptr<SlotPool> pool_;
};

/// A tier that forwards every call to an inner tier it owns: the base of wrappers (a test's
/// scrambled "device", a binding's instrumented tier) that override only what they change.
/// Every virtual forwards, the batched and asynchronous copies too, straight to the inner
/// tier: a subclass that changes how bytes are copied must override each copy it changes
/// (Upload, UploadBatch, Download, DownloadBatchAsync with WaitTransfer/TransferDone,
/// CopyWithin), since a forwarded batch never passes through its own Upload or Download. The
/// ordered copies (UploadOrdered, CopyWithinOrdered) are not forwarded: they keep HotTier's
/// defaults, which call this tier's own Upload and CopyWithin.
class ForwardingHotTier : public HotTier {
 public:
  explicit ForwardingHotTier(std::unique_ptr<HotTier> inner) : inner_(std::move(inner)) {}
  Device device() const override { return inner_->device(); }
  int32_t slot_capacity() const override { return inner_->slot_capacity(); }
  int32_t slots_used() const override { return inner_->slots_used(); }
  size_t slot_bytes() const override { return inner_->slot_bytes(); }
  int32_t AcquireSlot() override { return inner_->AcquireSlot(); }
  void ReleaseSlot(int32_t slot) override { inner_->ReleaseSlot(slot); }
  uint8_t* slot_data(int32_t slot) override { return inner_->slot_data(slot); }
  Result<uint8_t*> AllocateRegion(size_t bytes) override { return inner_->AllocateRegion(bytes); }
  void FreeRegion(uint8_t* region, size_t bytes) override { inner_->FreeRegion(region, bytes); }
  Status Upload(uint8_t* dst, const void* src, size_t bytes) override {
    return inner_->Upload(dst, src, bytes);
  }
  Status UploadBatch(const UploadOp* ops, size_t n) override { return inner_->UploadBatch(ops, n); }
  Status Download(void* dst, const uint8_t* src, size_t bytes) override {
    return inner_->Download(dst, src, bytes);
  }
  Status CopyWithin(uint8_t* dst, const void* src, size_t bytes) override {
    return inner_->CopyWithin(dst, src, bytes);
  }
  Result<TransferTicket> DownloadBatchAsync(const DownloadOp* ops, size_t n) override {
    return inner_->DownloadBatchAsync(ops, n);
  }
  Status WaitTransfer(TransferTicket ticket) override { return inner_->WaitTransfer(ticket); }
  Result<bool> TransferDone(TransferTicket ticket) override { return inner_->TransferDone(ticket); }

 protected:
  HotTier& inner() const { return *inner_; }

 private:
  std::unique_ptr<HotTier> inner_;
};

// ---- kvtier's own tiers ----------------------------------------------------------------

/// Checks that MakeHotTier(device, ...) can build here, without building anything:
/// Unavailable for kCuda in a build without CUDA or when no CUDA device is visible,
/// InvalidArgument for a value outside the enum.
Status CheckDevice(Device device);
/// kvtier's hot tier on `device` with a slot pool of `slot_pool_bytes` (at least one slot of
/// `slot_bytes`): HostHotTier on kCpu, CudaHotTier on kCuda.
Result<std::unique_ptr<HotTier>> MakeHotTier(Device device, size_t slot_pool_bytes, size_t slot_bytes);

}  // namespace kvtier
