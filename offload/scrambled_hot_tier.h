// XorScrambledHotTier: a stand-in for device memory, for tests and the Python binding's test
// hook. Its bytes at rest are the caller's bytes XOR a key, like device memory the host cannot
// read in place: only the tier's own copies translate. A store reader that dereferenced hot
// memory on the host instead of copying through the tier would see garbage, so a store (or a
// binding) over it that gives a host store's results never reads hot memory directly.
//
// Every copy that crosses the host boundary translates: Upload, UploadBatch, Download and
// DownloadBatchAsync (completed at submit: the scrambling is a host loop). CopyWithin moves
// bytes already at rest, so they stay scrambled as they are. Everything else (slots,
// regions) is the inner tier's (ForwardingHotTier).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "offload/hot_tier.h"

namespace kvtier {

class XorScrambledHotTier : public ForwardingHotTier {
 public:
  /// `device` is what device() reports (kCuda to look like device memory to the store;
  /// kCpu to keep the CPU attention backend).
  XorScrambledHotTier(std::unique_ptr<HotTier> inner, Device device, uint8_t key = 0x5A)
      : ForwardingHotTier(std::move(inner)), device_(device), key_(key) {}

  Device device() const override { return device_; }
  Status Upload(uint8_t* dst, const void* src, size_t bytes) override {
    Xor(dst, static_cast<const uint8_t*>(src), bytes);
    uploads_.fetch_add(1, std::memory_order_relaxed);
    return Status::Ok();
  }
  Status UploadBatch(const UploadOp* ops, size_t n) override {
    for (size_t i = 0; i < n; ++i) KVTIER_RETURN_IF_ERROR(Upload(ops[i].dst, ops[i].src, ops[i].bytes));
    return Status::Ok();
  }
  Status Download(void* dst, const uint8_t* src, size_t bytes) override {
    Xor(static_cast<uint8_t*>(dst), src, bytes);
    downloads_.fetch_add(1, std::memory_order_relaxed);
    return Status::Ok();
  }
  Result<TransferTicket> DownloadBatchAsync(const DownloadOp* ops, size_t n) override {
    for (size_t i = 0; i < n; ++i) KVTIER_RETURN_IF_ERROR(Download(ops[i].dst, ops[i].src, ops[i].bytes));
    return kCompletedTransfer;
  }
  // Tickets are this tier's (all complete at submit), not the inner tier's.
  Status WaitTransfer(TransferTicket ticket) override { return HotTier::WaitTransfer(ticket); }
  Result<bool> TransferDone(TransferTicket ticket) override { return HotTier::TransferDone(ticket); }

  /// Copies into and out of the tier so far (each op of a batch counts once).
  uint64_t uploads() const { return uploads_.load(std::memory_order_relaxed); }
  uint64_t downloads() const { return downloads_.load(std::memory_order_relaxed); }

 private:
  void Xor(uint8_t* dst, const uint8_t* src, size_t bytes) const {
    for (size_t i = 0; i < bytes; ++i) dst[i] = src[i] ^ key_;
  }

  Device device_;
  uint8_t key_;
  // Atomic: the store uploads from the appending thread and from transfer threads (fetches).
  std::atomic<uint64_t> uploads_{0}, downloads_{0};
};

}  // namespace kvtier
