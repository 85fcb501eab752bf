// CudaHotTier: the hot tier in GPU memory. The retrieved-chunk slot pool is one
// cudaMalloc of capacity x slot_bytes; sinks and local rings are regions of their own
// (cudaMalloc each). Every pointer it returns is a DEVICE pointer. Upload and Download copy
// on the tier's own transfer stream (cudaStreamNonBlocking, so they overlap the compute
// stream) and wait for an event recorded after the copy: HotTier's contract is that the bytes
// are in place when the call returns. CopyWithin (Append's device K/V) is a device-to-device
// copy on the same stream with the same wait. DownloadBatchAsync (a sealed chunk leaving the
// local window for its pinned warm slot) records an event per ticket and returns: the store
// waits for it when the chunk lands, and the ring positions it read are refilled only by
// copies submitted later on the same stream. Every wait and every copy from or to host memory not
// known to be pinned (Upload's and Download's) is counted (offload/device_sync.h). Slot
// bookkeeping is SlotBook (host-only, tested on CPU).
//
// Built only with KVTIER_HAVE_CUDA; MakeHotTier("cuda") finds it then, and answers
// Unavailable "no CUDA device: ..." when the driver sees none. TieredStore takes it: the
// store reads hot memory only through Upload/Download, and Session runs attention on it
// through the cuda AttentionBackend (offload/attention_backend.h), whose kernels run on
// stream().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "offload/hot_tier.h"
#include "offload/pinned_staging.h"
#include "offload/slot_book.h"
#include "store/status.h"

namespace kvtier {

#if KVTIER_HAVE_CUDA

class CudaHotTier final : public HotTier {
 public:
  /// slot_pool_bytes / slot_bytes slots (at least one) on the current device.
  /// Unavailable "no CUDA device: ..." without a device; ResourceExhausted when cudaMalloc fails.
  static Result<std::unique_ptr<CudaHotTier>> Create(size_t slot_pool_bytes, size_t slot_bytes);
  ~CudaHotTier() override;
  CudaHotTier(const CudaHotTier&) = delete;
  CudaHotTier& operator=(const CudaHotTier&) = delete;

  Device device() const override { return Device::kCuda; }
  int32_t slot_capacity() const override { return book_.capacity(); }
  int32_t slots_used() const override { return book_.used(); }
  size_t slot_bytes() const override { return slot_bytes_; }
  int32_t AcquireSlot() override { return book_.Acquire(); }
  /// A bad release (outside the pool, or not taken) changes nothing and is counted.
  void ReleaseSlot(int32_t slot) override;
  uint8_t* slot_data(int32_t slot) override { return pool_ + static_cast<size_t>(slot) * slot_bytes_; }
  Result<uint8_t*> AllocateRegion(size_t bytes) override;
  void FreeRegion(uint8_t* region, size_t bytes) override;
  Status Upload(uint8_t* dst, const void* src, size_t bytes) override;
  Status Download(void* dst, const uint8_t* src, size_t bytes) override;
  /// One cudaMemcpyBatchAsync on the transfer stream, one event, one wait.
  Status UploadBatch(const UploadOp* ops, size_t n) override;
  /// Device -> device cudaMemcpyAsync on the transfer stream (ordered with Upload/Download and
  /// the downloads in flight), then the same event wait as Upload. `src` must be device memory
  /// whose writes are complete: the transfer stream does not wait for the engine's stream
  /// (synchronise it, or produce K/V on stream()).
  Status CopyWithin(uint8_t* dst, const void* src, size_t bytes) override;
  /// Upload without the wait: `src` is copied into a pinned staging buffer (a ring of
  /// kStagingBuffers, each reused once the copy that read it is done, counted as an event wait
  /// when it is not) and copied from there on the transfer stream, asynchronously. So an
  /// Append of host K/V blocks the host for neither copy.
  Status UploadOrdered(uint8_t* dst, const void* src, size_t bytes) override;
  static constexpr int kStagingBuffers = 64;
  /// CopyWithin without the wait: ordered before every later copy and kernel on the transfer
  /// stream, complete only once that stream reaches it. The caller keeps `src` unchanged until
  /// then (an engine's stream made to wait with MakeStreamWait does).
  Status CopyWithinOrdered(uint8_t* dst, const void* src, size_t bytes) override;
  /// Orders the transfer stream after the work submitted to `engine_stream` (a cudaStream_t;
  /// null is the legacy default stream) so far: an event recorded there, waited for on the
  /// device (cudaStreamWaitEvent). The host does not wait.
  Status WaitForStream(void* engine_stream);
  /// Orders `engine_stream` after the work submitted to the transfer stream so far, on the
  /// device, as WaitForStream the other way round.
  Status MakeStreamWait(void* engine_stream);
  /// Device -> host cudaMemcpyAsync of every op on the transfer stream, then an event of the
  /// ticket's own recorded after them; returns without waiting. The copies are asynchronous
  /// only into pinned host memory (the store's warm slots are pinned when a device is
  /// present); copies into pageable memory complete before the call returns.
  Result<TransferTicket> DownloadBatchAsync(const DownloadOp* ops, size_t n) override;
  /// cudaEventSynchronize on the ticket's event, which then goes back to the spare list.
  Status WaitTransfer(TransferTicket ticket) override;
  /// cudaEventQuery on the ticket's event.
  Result<bool> TransferDone(TransferTicket ticket) override;

  /// The transfer stream (a cudaStream_t) for kernels that should order after uploads.
  void* stream() const { return stream_; }
  uint64_t bad_releases() const { return bad_releases_; }

 private:
  CudaHotTier(int32_t capacity, size_t slot_bytes) : book_(capacity), slot_bytes_(slot_bytes) {}
  enum class CopyKind { kUpload, kDownload, kWithin };
  Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind, bool wait = true);
  // Records an event on `from` and makes `to` wait for it on the device.
  Status Order(void* from, void* to, const char* what);
  /// An event (cudaEvent_t) from the spare list, or a new one; ReturnEvent puts it back.
  Result<void*> TakeEvent();
  void ReturnEvent(void* event);
  /// Records `event` on the transfer stream and waits for it: every copy submitted so far is done.
  int WaitForStreamWork(void* event);

  SlotBook book_;
  size_t slot_bytes_;
  uint8_t* pool_ = nullptr;  // device memory: slot_capacity x slot_bytes
  void* stream_ = nullptr;   // cudaStream_t
  // Every wait has an event of its own (sessions copy from several threads at once): the
  // synchronous copies take one for the call, an asynchronous download one per ticket. Guarded
  // by tickets_mu_: the store lands chunks from whichever thread reads them.
  std::mutex tickets_mu_;
  std::unordered_map<TransferTicket, void*> in_flight_;
  std::vector<void*> spare_events_;
  TransferTicket next_ticket_ = kCompletedTransfer + 1;
  uint64_t bad_releases_ = 0;
  // UploadOrdered's pinned staging ring, guarded by staging_mu_ (sessions append from several
  // threads).
  std::mutex staging_mu_;
  PinnedStaging staging_{kStagingBuffers, "hot tier \"cuda\""};
};

#endif  // KVTIER_HAVE_CUDA

}  // namespace kvtier
