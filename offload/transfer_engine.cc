#include "offload/transfer_engine.h"
#include "kernels/tbb_tsan.h"

#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>

namespace kvtier {

Result<std::unique_ptr<TransferEngine>> TransferEngine::Create(const Options& options) {
  if (options.threads < 1)
    return InvalidArgument("transfer engine: threads must be > 0 (got " + std::to_string(options.threads) + ")");
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

Status TransferEngine::CopyOne(Load* ld) const {
  const size_t n = options_.chunk_bytes;
  const uint8_t* src = ld->warm_src;
  if (src == nullptr) {
    if (options_.cold == nullptr || !ld->in_cold) {
      if (options_.remote == nullptr) return Internal("chunk " + ld->key.ToString() + " is in no tier");
      return Unavailable("chunk " + ld->key.ToString() + " is only in the remote tier");  // CopyLoads reads it
    }
    uint8_t* buf = ReadBuffer(ld);
    KVTIER_RETURN_IF_ERROR(options_.cold->GetChunk(ld->key, buf, n));
    src = buf;
    ld->source = 'c';
  } else {
    ld->source = 'w';
  }
  return options_.hot->Upload(ld->hot_dst, src, n);
}

uint8_t* TransferEngine::ReadBuffer(Load* ld) const {
  if (ld->read_buf != nullptr) return ld->read_buf;
  ld->staging.resize(options_.chunk_bytes);
  return ld->staging.data();
}

void TransferEngine::CopyLoads(std::vector<Load>* loads) const {
  // The warm copies go to the hot tier as one batch: for a device tier one batched H2D copy
  // and one wait per fetch instead of one per chunk (HotTier::UploadBatch).
  std::vector<HotTier::UploadOp> warm;
  std::vector<size_t> rest;  // loads read from cold (or the remote tier)
  size_t cold_loads = 0;
  for (size_t j = 0; j < loads->size(); ++j) {
    const Load& ld = (*loads)[j];
    if (ld.warm_src != nullptr) {
      warm.push_back({ld.hot_dst, ld.warm_src, options_.chunk_bytes});
    } else {
      rest.push_back(j);
      cold_loads += ld.in_cold && options_.cold ? 1 : 0;
    }
  }
  if (!warm.empty()) {
    const Status st = options_.hot->UploadBatch(warm.data(), warm.size());
    for (Load& ld : *loads)
      if (ld.warm_src != nullptr) {
        ld.status = st;
        if (st.ok()) ld.source = 'w';
      }
  }
  // Cold reads are worth spreading over the workers (a fork-join costs more than one memcpy).
  if (cold_loads >= 2) {
    TsanForkJoin fj;  // kernels/tbb_tsan.h
    tbb::parallel_for(size_t{0}, rest.size(), fj.Body([&](size_t i) {
      Load& ld = (*loads)[rest[i]];
      ld.status = CopyOne(&ld);
    }));
    fj.Join();
  } else {
    for (size_t j : rest) (*loads)[j].status = CopyOne(&(*loads)[j]);
  }
  if (options_.remote == nullptr) return;
  // What neither warm nor cold could serve (not there, lost, damaged) comes from the remote
  // tier, one pipelined batch for the whole fetch. Its bytes are verified there: a remote
  // failure is reported with the local one, never replaced by unverified bytes.
  std::vector<size_t> idx;
  std::vector<RemoteTier::Get> gets;
  for (size_t j = 0; j < loads->size(); ++j) {
    Load& ld = (*loads)[j];
    if (ld.status.ok() || ld.warm_src != nullptr) continue;
    RemoteTier::Get g;
    g.ref = ld.remote_ref;
    g.dst = ReadBuffer(&ld);
    g.payload_bytes = options_.chunk_bytes;
    gets.push_back(g);
    idx.push_back(j);
  }
  if (gets.empty()) return;
  options_.remote->GetChunks(&gets).IgnoreError();  // per-chunk statuses below
  for (size_t g = 0; g < gets.size(); ++g) {
    Load& ld = (*loads)[idx[g]];
    if (!gets[g].status.ok()) {
      ld.status = ld.in_cold && options_.cold
                      ? Status(gets[g].status.code(), ld.status.message() + "; " + gets[g].status.message())
                      : gets[g].status;
      continue;
    }
    ld.status = options_.hot->Upload(ld.hot_dst, static_cast<const uint8_t*>(gets[g].dst), options_.chunk_bytes);
    if (ld.status.ok()) ld.source = 'r';
  }
}

Status TransferEngine::WriteChunk(const ChunkKey& key, std::string_view meta, const uint8_t* payload,
                                  WriteAcks* acks) const {
  WriteAcks local;
  if (acks == nullptr) acks = &local;
  *acks = WriteAcks{};
  if (options_.cold == nullptr && options_.remote == nullptr)
    return FailedPrecondition("writing chunk " + key.ToString() + ": the store has no cold or remote tier");
  if (options_.cold != nullptr) {
    Status st = options_.cold->PutChunk(key, meta, payload, options_.chunk_bytes);
    if (!st.ok()) return Status(st.code(), "writing chunk " + key.ToString() + " to the cold tier: " + st.message());
    acks->cold = true;
  }
  if (options_.remote != nullptr) {
    KVTIER_RETURN_IF_ERROR(options_.remote->PutChunk(key, meta, payload, options_.chunk_bytes));
    acks->remote = true;
  }
  return Status::Ok();
}

void TransferEngine::SubmitColdWrite(ColdWrite write, std::function<void(Status, WriteAcks)> done) {
  Enqueue([this, w = std::move(write), done = std::move(done)] {
    WriteAcks acks;
    Status st = WriteChunk(w.key, w.meta, w.payload, &acks);
    done(std::move(st), acks);
  });
}

}  // namespace kvtier
