#include "offload/transfer_engine.h"

#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>

#include "kernels/tbb_tsan.h"

namespace kvtier {

Result<std::unique_ptr<TransferEngine>> TransferEngine::Create(const Options& options) {
  if (options.threads < 1)
    return InvalidArgument("transfer engine: threads must be > 0 (got " + std::to_string(options.threads) +
                           ")");
  if (options.chunk_bytes == 0) return InvalidArgument("transfer engine: chunk_bytes must be > 0");
  if (options.hot == nullptr) return InvalidArgument("transfer engine: hot tier must not be null");
  auto engine = std::unique_ptr<TransferEngine>(new TransferEngine(options));
  // Ask for no more workers than the process has (oneTBB warns otherwise); on
  // two cores that is one transfer worker, and callers' waits never block it.
  engine->workers_ = std::max(1, std::min(options.threads, tbb::info::default_concurrency() - 1));
  engine->arena_ = std::make_unique<tbb::task_arena>(engine->workers_, 0);
  return engine;
}

TransferEngine::~TransferEngine() { WaitIdle(); }

void TransferEngine::Enqueue(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    inflight_++;
    enqueued_++;
  }
  // The fork oneTBB's uninstrumented library hides from TSan (kernels/tbb_tsan.h): what
  // the submitter wrote before this call happens before the task runs.
  TsanRelease(&fork_);
  arena_->enqueue([this, fn = std::move(fn)] {
    TsanAcquire(&fork_);
    fn();
    // Notify under the lock: once a waiter sees 0 it may destroy the engine.
    std::lock_guard<std::mutex> l(mu_);
    if (--inflight_ == 0) idle_.notify_all();
  });
}

void TransferEngine::WaitIdle() {
  std::unique_lock<std::mutex> l(mu_);
  idle_.wait(l, [&] { return inflight_ == 0; });
}

bool TransferEngine::WaitIdleFor(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  return idle_.wait_for(l, timeout, [&] { return inflight_ == 0; });
}

uint8_t* TransferEngine::ReadBuffer(Load* ld) const {
  if (ld->read_buf != nullptr) return ld->read_buf;
  ld->staging.resize(options_.chunk_bytes);
  return ld->staging.data();
}

void TransferEngine::CopyLoads(std::vector<Load>* loads) const {
  const size_t n = options_.chunk_bytes;
  // The warm copies go to the hot tier as one batch: for a device tier one batched H2D copy
  // and one wait per fetch instead of one per chunk (HotTier::UploadBatch).
  std::vector<HotTier::UploadOp> warm;
  // Per load: 0 no tier tried it yet, 1 a tier failed it (its status says how), 2 served.
  std::vector<uint8_t> state(loads->size(), 0);
  for (const Load& ld : *loads)
    if (ld.warm_src != nullptr) warm.push_back({ld.hot_dst, ld.warm_src, n});
  if (!warm.empty()) {
    const Status st = options_.hot->UploadBatch(warm.data(), warm.size());
    for (Load& ld : *loads)
      if (ld.warm_src != nullptr) {
        ld.status = st;
        if (st.ok()) ld.source = nullptr;
      }
  }
  // The rest falls through the lower tiers in order: each gets what the ones before it
  // could not serve (not there, lost, damaged, or its upload failed). Bytes are verified by
  // the tier; a failure is reported with the earlier ones, never replaced by unverified bytes.
  std::vector<size_t> idx;
  std::vector<LowerTier::Get> gets;
  for (LowerTier* tier : options_.lower) {
    idx.clear();
    gets.clear();
    for (size_t j = 0; j < loads->size(); ++j) {
      Load& ld = (*loads)[j];
      if (ld.warm_src != nullptr || state[j] == 2) continue;
      if (ld.ref.ns != nullptr && !tier->serves_published()) continue;
      idx.push_back(j);
      gets.push_back(LowerTier::Get{ld.ref, ReadBuffer(&ld), Status::Ok()});
    }
    if (gets.empty()) continue;
    // Uploads a load's bytes once its read is done (on the thread that read it).
    const auto finish = [&](size_t g) {
      Load& ld = (*loads)[idx[g]];
      const Status& got = gets[g].status;
      if (!got.ok()) {
        ld.status = state[idx[g]] == 1 ? Status(got.code(), ld.status.message() + "; " + got.message()) : got;
      } else {
        ld.status = ld.hot_dst == nullptr
                        ? Status::Ok()
                        : options_.hot->Upload(ld.hot_dst, static_cast<const uint8_t*>(gets[g].dst), n);
        if (ld.status.ok()) ld.source = tier;
      }
      state[idx[g]] = ld.status.ok() ? 2 : 1;
    };
    if (tier->parallel_reads() && gets.size() >= 2) {
      // Independent blocking reads are worth spreading over the workers (a fork-join costs
      // more than one memcpy, hence not for warm copies).
      TsanForkJoin fj;  // kernels/tbb_tsan.h
      tbb::parallel_for(size_t{0}, gets.size(), fj.Body([&](size_t g) {
        gets[g].status = tier->GetChunk(gets[g].ref, gets[g].dst, n);
        finish(g);
      }));
      fj.Join();
    } else {
      tier->GetChunks(&gets, n);
      for (size_t g = 0; g < gets.size(); ++g) finish(g);
    }
  }
  for (size_t j = 0; j < loads->size(); ++j)
    if ((*loads)[j].warm_src == nullptr && state[j] == 0)
      (*loads)[j].status = Internal("chunk " + (*loads)[j].key.ToString() + " is in no tier");
}

Status TransferEngine::WriteChunk(const ChunkKey& key, std::string_view meta, const uint8_t* payload,
                                  WriteAcks* acks) const {
  WriteAcks local = 0;
  if (acks == nullptr) acks = &local;
  *acks = 0;
  if (options_.lower.empty())
    return FailedPrecondition("writing chunk " + key.ToString() + ": the store has no cold or remote tier");
  for (LowerTier* tier : options_.lower) {
    KVTIER_RETURN_IF_ERROR(tier->PutChunk(key, meta, payload, options_.chunk_bytes));
    *acks |= tier->tier_bit();
  }
  return Status::Ok();
}

void TransferEngine::SubmitLowerWrite(LowerWrite write, std::function<void(Status, WriteAcks)> done) {
  Enqueue([this, w = std::move(write), done = std::move(done)] {
    WriteAcks acks = 0;
    Status st = WriteChunk(w.key, w.meta, w.payload, &acks);
    done(std::move(st), acks);
  });
}

}  // namespace kvtier
