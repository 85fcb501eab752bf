// LowerTiers: the tiers below warm as one object (see offload/store/lower_tiers.h).

#include "offload/store/lower_tiers.h"

#include <algorithm>
#include <cstring>

#include "offload/store_records.h"

namespace kvtier {

using store_internal::Chunk;
using store_internal::Sequence;

void LowerTiers::Add(std::unique_ptr<LowerTier> tier) {
  error_window_ = std::min(error_window_, tier->error_window());
  if (tier->reads_chunk_meta()) meta_tiers_ |= tier->tier_bit();
  tiers_.push_back(std::move(tier));
}

void LowerTiers::AddCold(std::unique_ptr<ColdTier> cold) {
  cold_ = cold.get();
  Add(MakeColdLowerTier(std::move(cold)));
}

void LowerTiers::AddRemote(std::unique_ptr<RemoteTier> remote) {
  remote_ = remote.get();
  Add(MakeRemoteLowerTier(std::move(remote)));
}

Status LowerTiers::ReadChunk(const Sequence* s, const ChunkKey& key, void* dst, size_t bytes) const {
  LowerChunkRef ref;
  ref.key = key;
  if (store_internal::SharedChunk(s, key)) {
    ref.ns = &s->remote_ns;
    ref.key.seq = s->remote_seq;
  }
  // Each tier serves what the ones before it lost or damaged; every failure is reported.
  Status st = Internal("chunk " + key.ToString() + " is in no tier");
  bool tried = false;
  for (const auto& tier : tiers_) {
    if (ref.ns != nullptr && !tier->serves_published()) continue;
    Status got = tier->GetChunk(ref, dst, bytes);
    if (got.ok()) return got;
    st = tried ? Status(got.code(), st.message() + "; " + got.message()) : std::move(got);
    tried = true;
  }
  return st;
}

Status LowerTiers::ReadReprs(const Sequence* s, size_t repr_bytes, std::vector<ReprRead>* reads) const {
  // Bounded batches: a first index sync over a long sequence reads every chunk's meta.
  constexpr size_t kBatch = 256;
  std::vector<LowerTier::MetaGet> batch;
  std::vector<size_t> pending, asked, still;  // positions in *reads
  std::vector<uint8_t> tried(reads->size(), 0);
  for (size_t b = 0; b < reads->size(); b += kBatch) {
    const size_t e = std::min(reads->size(), b + kBatch);
    pending.clear();
    for (size_t i = b; i < e; ++i) {
      (*reads)[i].status = Internal("no lower tier that reads chunk metas holds it");
      pending.push_back(i);
    }
    for (const auto& tier : tiers_) {
      if (pending.empty()) break;
      if (!tier->reads_chunk_meta()) continue;
      batch.clear();
      asked.clear();
      for (size_t i : pending) {
        LowerTier::MetaGet g;
        g.ref.key = (*reads)[i].key;
        if (store_internal::SharedChunk(s, g.ref.key)) {
          if (!tier->serves_published()) continue;  // a publisher's chunk: not in this tier
          g.ref.ns = &s->remote_ns;
          g.ref.key.seq = s->remote_seq;
        }
        batch.push_back(std::move(g));
        asked.push_back(i);
      }
      if (batch.empty()) continue;
      tier->GetChunkMetas(&batch);
      for (size_t j = 0; j < batch.size(); ++j) {
        const size_t i = asked[j];
        ReprRead& r = (*reads)[i];
        Status got = std::move(batch[j].status);
        if (got.ok()) {
          Result<store_records::ChunkMeta> m =
              store_records::DecodeChunkMeta(batch[j].meta, r.key, repr_bytes);
          if (m.ok()) {
            std::memcpy(r.dst, m->repr.data(), repr_bytes);
            r.status = Status::Ok();
            continue;
          }
          got = m.status();
        }
        // Each tier serves what the ones before it lost or damaged; every failure is reported.
        r.status = tried[i] ? Status(got.code(), r.status.message() + "; " + got.message()) : std::move(got);
        tried[i] = 1;
      }
      still.clear();
      for (size_t i : pending)
        if (!(*reads)[i].status.ok()) still.push_back(i);
      pending.swap(still);
    }
  }
  Status first;
  for (ReprRead& r : *reads) {
    if (r.status.ok()) continue;
    r.status =
        Status(r.status.code(), "representatives of chunk " + r.key.ToString() +
                                    " could not be read back from the lower tiers: " + r.status.message());
    if (first.ok()) first = r.status;
  }
  return first;
}

Status LowerTiers::RemoveChunks(const std::vector<std::vector<ChunkKey>>& per_tier) const {
  for (size_t t = 0; t < tiers_.size(); ++t) KVTIER_RETURN_IF_ERROR(tiers_[t]->RemoveChunks(per_tier[t]));
  return Status::Ok();
}

Status LowerTiers::RemoveSequence(SequenceId seq, const std::vector<std::vector<ChunkKey>>& per_tier) const {
  for (size_t t = 0; t < tiers_.size(); ++t)
    KVTIER_RETURN_IF_ERROR(tiers_[t]->RemoveSequence(seq, per_tier[t]));
  return Status::Ok();
}

void LowerTiers::AddCounters(StoreCounters* c) const {
  for (const auto& tier : tiers_) tier->AddCounters(c);
}

uint64_t LowerTiers::memory_bytes() const {
  uint64_t bytes = 0;
  for (const auto& tier : tiers_) bytes += tier->memory_bytes();
  return bytes;
}

LowerTiers::AckListener LowerTiers::AckLocked(Chunk* c, uint8_t acks, size_t chunk_bytes,
                                              StoreCounters* counters) {
  if (!c->lower_acked) {
    c->lower_acked = true;
    c->tiers |= acks;
    if (acks & kTierCold) {
      counters->cold_chunks++;
      counters->cold_bytes += chunk_bytes;
    }
    counters->cold_writes++;
    counters->bytes_moved += chunk_bytes;
  }
  return ack_listener_;
}

void LowerTiers::RecordWriteFailureLocked(const Status& st) {
  if (!background_error_.ok() && std::chrono::steady_clock::now() < background_error_until_) return;
  background_error_ = st;
  // Sticky for the tiers' error window (the remote's retry window: its node fails every
  // command at once for that long), or until TakeBackgroundErrorLocked reports it.
  background_error_until_ = errors_expire() ? std::chrono::steady_clock::now() + error_window_
                                            : std::chrono::steady_clock::time_point::max();
}

Status LowerTiers::BackgroundErrorLocked() const {
  // After the remote's window a new attempt may succeed: no longer in the way (Take still
  // reports it).
  if (background_error_.ok() || std::chrono::steady_clock::now() >= background_error_until_)
    return Status::Ok();
  return background_error_;
}

Status LowerTiers::TakeBackgroundErrorLocked() {
  Status st = std::move(background_error_);
  background_error_ = Status::Ok();
  return st;
}

void LowerTiers::ForgetLocked(const store_internal::Chunk* c, size_t chunk_bytes, StoreCounters* counters) {
  if (c->lower_acked && (c->tiers & kTierCold) && counters->cold_chunks > 0) {
    counters->cold_chunks--;
    counters->cold_bytes -= chunk_bytes;
  }
}

std::vector<ChunkRange> LowerTiers::AcknowledgedChunks() const {
  return cold_ ? cold_->AcknowledgedChunks() : std::vector<ChunkRange>{};
}

std::vector<ChunkRange> LowerTiers::LostChunks() const {
  return cold_ ? cold_->lost_chunks() : std::vector<ChunkRange>{};
}

}  // namespace kvtier
