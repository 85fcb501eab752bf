// TieredStore, the chunk calls: what readers ask of a layer's sealed chunks (ListChunks,
// ChunkCount, GetRepresentatives, ChunkUpdatesSince: the ChunkCatalog answers), their tokens
// (ReadTokens, from whichever tier holds them, promoting nothing), their scores
// (SetChunkScores), their removal (DropChunks) and their warm addresses for a device reader
// (WarmAddresses, which marks the slots exposed: offload/store/warm_tier.h). The readers see
// the landed chunks only and land nothing; SetChunkScores and DropChunks, called by the
// sequence's driver, land the layer first (offload/store/landing.h).
//
// Locking: the coordinator's mutex (sync_.mu); a call that takes the std::unique_lock may drop
// it while it reads bytes, and holds it again on return. ReadTokens pins each chunk it copies
// (warm_pins or hot_pins) and copies without the mutex.

#include <algorithm>
#include <cmath>
#include <cstring>

#include "offload/store_state.h"
#include "offload/tiered_store.h"

namespace kvtier {

Result<std::vector<ChunkInfo>> TieredStore::ListChunks(SequenceId seq, int layer) const {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
  return catalog_->List(s->layers[layer]);
}

Result<uint64_t> TieredStore::ChunkCount(SequenceId seq, int layer) const {
  visits_.Count();
  std::lock_guard<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
  return ChunkCatalog::LandedEnd(s->layers[layer]);
}

Status TieredStore::GetRepresentatives(const ChunkKey& key, float* out) const {
  visits_.Count();
  std::unique_lock<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(key.seq, static_cast<int>(key.layer), false, &s));
  const auto& chunks = s->layers[key.layer].chunks;
  if (key.index >= chunks.size() || chunks[key.index] == nullptr)
    return NotFound("chunk " + key.ToString() + " does not exist");
  if (chunks[key.index]->landing)
    return NotFound("chunk " + key.ToString() +
                    " has not landed yet (its sequence's next Append, layer step or Flush lands it)");
  const Chunk* c = chunks[key.index];
  const DType dt = options_.geometry.dtype;
  const size_t repr_elems = options_.repr_elems();
  if (!c->repr.empty()) {
    ToFloat(dt, c->repr.data(), out, repr_elems);
    return Status::Ok();
  }
  // Released from memory: read back from its meta record without the lock, as a fetch reads a
  // payload; busy keeps the sequence (and its remote namespace) while the lock is dropped.
  s->busy++;
  l.unlock();
  Status st = ReturnOnBadAlloc("GetRepresentatives: a read-back buffer", [&]() -> Status {
    std::vector<uint8_t> bytes(repr_elems * DTypeSize(dt));
    std::vector<LowerTiers::ReprRead> reads{LowerTiers::ReprRead{key, bytes.data(), Status::Ok()}};
    KVTIER_RETURN_IF_ERROR(lower_.ReadReprs(s, bytes.size(), &reads));
    ToFloat(dt, bytes.data(), out, repr_elems);
    return Status::Ok();
  });
  l.lock();
  s->busy--;
  sync_.cv.notify_all();
  return st;
}

Status TieredStore::WarmAddresses(SequenceId seq, int layer, const uint64_t* chunk_indices, size_t n,
                                  WarmChunkAddress* out, uint64_t* epoch, bool include_landing) {
  visits_.Count();
  if (n > 0 && (chunk_indices == nullptr || out == nullptr))
    return InvalidArgument("WarmAddresses: chunk_indices and out must not be null (n = " + std::to_string(n) +
                           ")");
  if (epoch == nullptr) return InvalidArgument("WarmAddresses: epoch must not be null");
  std::lock_guard<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
  const LayerState& ls = s->layers[layer];
  for (size_t i = 0; i < n; ++i)
    if (chunk_indices[i] >= ls.chunks.size())
      return InvalidArgument("WarmAddresses: chunk " +
                             ChunkKey{seq, static_cast<uint32_t>(layer), chunk_indices[i]}.ToString() +
                             " does not exist (layer has " + std::to_string(ls.chunks.size()) + " chunks)");
  const size_t half = chunk_bytes_ / 2;  // a warm slot is [K chunk][V chunk]
  for (size_t i = 0; i < n; ++i) {
    const Chunk* c = ls.chunks[chunk_indices[i]];
    out[i] = WarmChunkAddress{};
    if (c == nullptr) continue;  // dropped, or a hole left by a crash
    out[i].first_position = c->first_token;
    // Not landed (a reader lands nothing; a device reader ordered after the download may read
    // it), or not in warm.
    if ((c->landing && !include_landing) || c->warm_slot < 0) continue;
    const uint8_t* data = warm_->Expose(c);
    out[i].k = data;
    out[i].v = data + half;
    if (!c->landing) warm_->OnAccess(c->id);  // the device reads it, as a fetch from warm would
  }
  *epoch = warm_->epoch();
  return Status::Ok();
}

Status TieredStore::ChunkUpdatesSince(SequenceId seq, int layer, const ChunkCursor& since, ChunkUpdate* out,
                                      size_t max_added) const {
  visits_.Count();
  if (out == nullptr) return InvalidArgument("ChunkUpdatesSince: out must not be null");
  if (max_added == 0) return InvalidArgument("ChunkUpdatesSince: max_added must be > 0");
  std::unique_lock<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
  return catalog_->UpdatesSince(l, sync_, lower_, s, layer, since, out, max_added);
}

Status TieredStore::ReadTokens(SequenceId seq, int layer, int64_t begin, int64_t end, void* k_out,
                               void* v_out) {
  visits_.Count();
  Sequence* s = nullptr;
  {
    std::unique_lock<CountingMutex> l(sync_.mu);
    KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
    if (begin < 0 || end < begin || end > s->layers[layer].n_tokens)
      return InvalidArgument("ReadTokens: range [" + std::to_string(begin) + ", " + std::to_string(end) +
                             ") is outside [0, " + std::to_string(s->layers[layer].n_tokens) + ")");
    if (k_out == nullptr || v_out == nullptr) return InvalidArgument("ReadTokens: outputs must not be null");
    s->busy++;
  }
  LayerState& ls = s->layers[layer];
  auto* ko = static_cast<uint8_t*>(k_out);
  auto* vo = static_cast<uint8_t*>(v_out);
  const int64_t ring = options_.n_local + options_.chunk_size;
  const size_t half = static_cast<size_t>(options_.chunk_size) * token_bytes_;
  std::vector<uint8_t> staging;
  Status st;
  int64_t p = begin;
  while (p < end && st.ok()) {
    const size_t off = static_cast<size_t>(p - begin) * token_bytes_;
    if (p < options_.n_sink && !ls.sinks_restored) {
      st =
          FailedPrecondition("sequence " + std::to_string(seq) +
                             " was recovered without its sinks (it was not closed before the store stopped)");
      break;
    }
    if (p < std::min<int64_t>(options_.n_sink, ls.n_tokens) && p < ls.sealed_end && ls.sinks_restored) {
      const int64_t take = std::min<int64_t>(end, options_.n_sink) - p;
      st = hot_->Download(ko + off, ls.sink_k + p * token_bytes_, take * token_bytes_);
      if (st.ok()) st = hot_->Download(vo + off, ls.sink_v + p * token_bytes_, take * token_bytes_);
      p += take;
    } else if (p < ls.sealed_end) {
      const uint64_t idx =
          static_cast<uint64_t>(ChunkOfPosition(p, options_.n_sink, options_.chunk_size, kAnyChunkCount));
      const int64_t in_chunk = (p - options_.n_sink) % options_.chunk_size;
      const int64_t take = std::min<int64_t>(end - p, options_.chunk_size - in_chunk);
      Chunk* c = nullptr;
      const uint8_t* src = nullptr;
      bool from_hot = false;
      {
        std::lock_guard<CountingMutex> l(sync_.mu);
        c = idx < ls.chunks.size() ? ls.chunks[idx] : nullptr;
        if (c == nullptr) {
          st = NotFound("chunk " + ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                        " is missing (dropped by compression, lost before it was acknowledged, or lost "
                        "from a damaged cold tier and accepted at open)");
          break;
        }
        if (c->landing) {  // a reader lands nothing: its bytes may still be on their way to warm
          st = FailedPrecondition(
              "chunk " + c->key.ToString() +
              " has not landed yet (its sequence's next Append, layer step or Flush lands it)");
          break;
        }
        if (c->warm_slot >= 0) {
          c->warm_pins++;
          src = warm_->slot_data(c->warm_slot);
        } else if (c->hot_slot >= 0 && !c->hot_loading) {
          c->hot_pins++;
          from_hot = true;
          src = hot_->slot_data(c->hot_slot);
        }
      }
      if (src == nullptr) {
        st = ReturnOnBadAlloc("ReadTokens: a lower-tier chunk's staging buffer", [&] {
          staging.resize(chunk_bytes_);
          return Status::Ok();
        });
        if (st.ok()) st = lower_.ReadChunk(s, c->key, staging.data(), chunk_bytes_);
        src = staging.data();
        if (st.ok()) {
          std::lock_guard<CountingMutex> l(sync_.mu);
          counters_.cold_reads++;
        }
      }
      if (st.ok()) {
        auto copy = [&](uint8_t* dst, const uint8_t* from, size_t n) {
          return from_hot ? hot_->Download(dst, from, n) : (std::memcpy(dst, from, n), Status::Ok());
        };
        st = copy(ko + off, src + in_chunk * token_bytes_, take * token_bytes_);
        if (st.ok()) st = copy(vo + off, src + half + in_chunk * token_bytes_, take * token_bytes_);
      }
      {
        std::lock_guard<CountingMutex> l(sync_.mu);
        if (src != staging.data()) (from_hot ? c->hot_pins : c->warm_pins)--;
        sync_.cv.notify_all();
      }
      p += take;
    } else {
      if (!ls.sinks_restored) {
        st = FailedPrecondition("sequence " + std::to_string(seq) + " lost its local window (not closed)");
        break;
      }
      const int64_t slot = (p - options_.n_sink) % ring;
      const int64_t take = std::min(end - p, ring - slot);
      st = hot_->Download(ko + off, ls.ring_k + slot * token_bytes_, take * token_bytes_);
      if (st.ok()) st = hot_->Download(vo + off, ls.ring_v + slot * token_bytes_, take * token_bytes_);
      p += take;
    }
  }
  std::lock_guard<CountingMutex> l(sync_.mu);
  s->busy--;
  sync_.cv.notify_all();
  return st;
}

Status TieredStore::SetChunkScores(SequenceId seq, int layer,
                                   const std::vector<std::pair<uint64_t, float>>& scores) {
  visits_.Count();
  std::unique_lock<CountingMutex> l(sync_.mu);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
  landing_->LandLayer(l, s, layer);
  KVTIER_RETURN_IF_ERROR(Landing::TakeError(s->layers[layer]));
  LayerState& ls = s->layers[layer];
  for (const auto& [idx, score] : scores) {
    if (idx >= ls.chunks.size())
      return InvalidArgument("SetChunkScores: chunk " +
                             ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                             " does not exist (layer has " + std::to_string(ls.chunks.size()) + " chunks)");
    if (!std::isfinite(score))
      return InvalidArgument("SetChunkScores: score of chunk " + std::to_string(idx) + " is not finite");
  }
  for (const auto& [idx, score] : scores) {
    Chunk* c = ls.chunks[idx];
    if (c == nullptr) continue;
    c->score = score;
    hot_pool_->policy().OnScore(c->id, score);
    warm_->OnScore(c->id, score);
  }
  return Status::Ok();
}

Status TieredStore::DropChunks(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices,
                               uint64_t* dropped) {
  visits_.Count();
  if (dropped != nullptr) *dropped = 0;
  std::vector<std::vector<ChunkKey>> tier_keys(lower_.size());  // per lower tier, what it may hold
  {
    std::unique_lock<CountingMutex> l(sync_.mu);
    Sequence* s = nullptr;
    KVTIER_RETURN_IF_ERROR(sequences_->Check(seq, layer, false, &s));
    landing_->LandLayer(l, s, layer);
    KVTIER_RETURN_IF_ERROR(Landing::TakeError(s->layers[layer]));
    LayerState& ls = s->layers[layer];
    for (uint64_t idx : chunk_indices)
      if (idx >= ls.chunks.size())
        return InvalidArgument("DropChunks: chunk " +
                               ChunkKey{seq, static_cast<uint32_t>(layer), idx}.ToString() +
                               " does not exist (layer has " + std::to_string(ls.chunks.size()) + " chunks)");
    const Clock::time_point now = hooks_.clock->Now();
    for (uint64_t idx : chunk_indices) {
      const Chunk* c = ls.chunks[idx];
      if (c && HotPool::Pinned(c, now))
        return FailedPrecondition("DropChunks: chunk " + c->key.ToString() +
                                  " is pinned by a live fetch handle; release it first");
    }
    // Transfers in flight finish first (Chunk::transferring).
    sync_.cv.wait(l, [&] {
      for (uint64_t idx : chunk_indices) {
        const Chunk* c = ls.chunks[idx];
        if (c && c->transferring()) return false;
      }
      return true;
    });
    // A warm slot handed to a device reader is freed below: the reads first (a failed wait
    // drops nothing).
    for (uint64_t idx : chunk_indices)
      if (const Chunk* c = ls.chunks[idx]; c != nullptr && warm_->exposed(c->warm_slot)) {
        KVTIER_RETURN_IF_ERROR(warm_->FenceReaders());
        break;
      }
    for (uint64_t idx : chunk_indices) {
      Chunk* c = ls.chunks[idx];
      if (c == nullptr) continue;
      // Written (or being written) to the lower tiers; a publisher's chunk is not this store's to remove.
      if (c->lower_acked || c->lower_writing)
        for (size_t t = 0; t < lower_.size(); ++t)
          if (!(lower_[t]->serves_published() && store_internal::SharedChunk(s, c->key)))
            tier_keys[t].push_back(c->key);
      warm_->Forget(c);
      hot_pool_->ForgetLocked(c);
      LowerTiers::ForgetLocked(c, chunk_bytes_, &counters_);
      catalog_->Forget(c);
      ls.chunks[idx] = nullptr;
      ls.dropped.push_back(idx);
      counters_.dropped_chunks++;
      if (dropped != nullptr) ++*dropped;
    }
    counters_.warm_chunks = warm_->used();
    counters_.hot_chunks = hot_->slots_used();
  }
  // The chunk is gone from memory; removing its lower-tier copies is what makes the drop
  // survive a reopen.
  return lower_.RemoveChunks(tier_keys);
}

}  // namespace kvtier
