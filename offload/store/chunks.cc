// TieredStore, part "chunks": the sealed chunks of a layer as readers and compression see
// them: their metadata (ListChunks, ChunkCount, GetRepresentatives), their tokens
// (ReadTokens, from whichever tier holds them, promoting nothing), their scores
// (SetChunkScores) and their removal (DropChunks, FreeChunkLocked). The readers see the
// landed chunks only and land nothing; SetChunkScores and DropChunks, called by the
// sequence's driver, land the layer first (offload/store/landing.cc).
//
// Locking: TieredStore's one mutex (mu_) guards every field this file touches, except where
// offload/store_state.h says otherwise (a layer's sinks and ring belong to the sequence's
// driving thread). A function named ...Locked is called with mu_ held; one that takes the
// std::unique_lock may drop it while it waits or copies bytes, and holds it again on return.
// ReadTokens pins each chunk it copies (warm_pins or hot_pins) and copies without mu_.

#include <algorithm>
#include <cmath>
#include <cstring>

#include "offload/store_state.h"
#include "offload/tiered_store.h"

namespace kvtier {

Result<std::vector<ChunkInfo>> TieredStore::ListChunks(SequenceId seq, int layer) const {
  CountVisit();
  std::lock_guard<CountingMutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  std::vector<ChunkInfo> out;
  for (const Chunk* c : s->layers[layer].chunks) {
    if (c == nullptr || c->landing) continue;
    out.push_back(ChunkInfo{c->key, c->first_token, options_.chunk_size, c->tiers, c->score});
  }
  return out;
}

Result<uint64_t> TieredStore::ChunkCount(SequenceId seq, int layer) const {
  CountVisit();
  std::lock_guard<CountingMutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  return LandedEndLocked(s->layers[layer]);
}

Status TieredStore::GetRepresentatives(const ChunkKey& key, float* out) const {
  CountVisit();
  std::unique_lock<CountingMutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(key.seq, static_cast<int>(key.layer), false, &s));
  const auto& chunks = s->layers[key.layer].chunks;
  if (key.index >= chunks.size() || chunks[key.index] == nullptr)
    return NotFound("chunk " + key.ToString() + " does not exist");
  if (chunks[key.index]->landing)
    return NotFound("chunk " + key.ToString() +
                    " has not landed yet (its sequence's next Append, layer step or Flush lands it)");
  const Chunk* c = chunks[key.index];
  const DType dt = options_.geometry.dtype;
  const size_t repr_elems = static_cast<size_t>(options_.repr_topk) * options_.geometry.token_elems();
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
    std::vector<ReprRead> reads{ReprRead{key, bytes.data(), Status::Ok()}};
    KVTIER_RETURN_IF_ERROR(ReadLowerTierRepr(s, &reads));
    ToFloat(dt, bytes.data(), out, repr_elems);
    return Status::Ok();
  });
  l.lock();
  s->busy--;
  cv_.notify_all();
  return st;
}

Status TieredStore::ChunkUpdatesSince(SequenceId seq, int layer, const ChunkCursor& since, ChunkUpdate* out,
                                      size_t max_added) const {
  CountVisit();
  if (out == nullptr) return InvalidArgument("ChunkUpdatesSince: out must not be null");
  if (max_added == 0) return InvalidArgument("ChunkUpdatesSince: max_added must be > 0");
  std::unique_lock<CountingMutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  return ChunkUpdatesLocked(l, s, layer, since, out, max_added);
}

Status TieredStore::ChunkUpdatesLocked(std::unique_lock<CountingMutex>& l, Sequence* s, int layer,
                                       const ChunkCursor& since, ChunkUpdate* out, size_t max_added) const {
  const SequenceId seq = s->id;
  const LayerState& ls = s->layers[layer];
  const uint64_t landed = LandedEndLocked(ls);  // readers see the landed chunks only
  if (since.chunks > ls.chunks.size() || since.drops > ls.dropped.size())
    return InvalidArgument("ChunkUpdatesSince: cursor {chunks " + std::to_string(since.chunks) + ", drops " +
                           std::to_string(since.drops) + "} is past layer " + std::to_string(layer) +
                           " of sequence " + std::to_string(seq) + " (" + std::to_string(ls.chunks.size()) +
                           " chunks, " + std::to_string(ls.dropped.size()) + " drops)");
  const DType dt = options_.geometry.dtype;
  const size_t repr_elems = static_cast<size_t>(options_.repr_topk) * options_.geometry.token_elems();
  const size_t repr_bytes = repr_elems * DTypeSize(dt);
  std::vector<ReprRead> paged;     // chunks whose representatives left memory
  std::vector<size_t> paged_slot;  // their position in out->added
  Status st = ReturnOnBadAlloc("ChunkUpdatesSince: the representatives of the new chunks", [&]() -> Status {
    out->since = since;
    out->added.clear();
    out->repr.clear();
    out->dropped.assign(ls.dropped.begin() + static_cast<ptrdiff_t>(since.drops), ls.dropped.end());
    size_t n = 0, n_paged = 0;
    uint64_t end = since.chunks;  // the chunks handed over: [since.chunks, end)
    for (; end < landed && n < max_added; ++end)
      if (const Chunk* c = ls.chunks[end]; c != nullptr) {
        n++;
        n_paged += c->repr.empty();
      }
    out->added.reserve(n);
    out->repr.resize(n * repr_elems);
    paged.reserve(n_paged);
    paged_slot.reserve(n_paged);
    for (uint64_t i = since.chunks; i < end; ++i) {
      const Chunk* c = ls.chunks[i];
      if (c == nullptr) continue;
      if (c->repr.empty()) {
        paged.push_back(ReprRead{c->key, nullptr, Status::Ok()});
        paged_slot.push_back(out->added.size());
      } else if (c->repr.size() != repr_bytes) {
        return Internal("ChunkUpdatesSince: chunk " + c->key.ToString() + " holds " +
                        std::to_string(c->repr.size()) + " bytes of representatives, not " +
                        std::to_string(repr_bytes));
      } else {
        ToFloat(dt, c->repr.data(), out->repr.data() + out->added.size() * repr_elems, repr_elems);
      }
      out->added.push_back(i);
    }
    out->next = ChunkCursor{std::max(end, since.chunks), ls.dropped.size()};
    out->complete = end >= landed;
    out->pending = end >= landed ? 0 : landed - end;
    return Status::Ok();
  });
  if (!st.ok() || paged.empty()) return st;
  // The released ones are read back without the lock (as a fetch reads payloads), a bounded
  // batch at a time through one buffer; busy keeps the sequence while the lock is dropped.
  s->busy++;
  l.unlock();
  constexpr size_t kBatch = 256;
  std::vector<uint8_t> buf;
  std::vector<ReprRead> batch;
  st = ReturnOnBadAlloc("ChunkUpdatesSince: a read-back buffer", [&]() -> Status {
    buf.resize(std::min(paged.size(), kBatch) * repr_bytes);
    batch.reserve(std::min(paged.size(), kBatch));
    return Status::Ok();
  });
  for (size_t b = 0; b < paged.size() && st.ok(); b += kBatch) {
    const size_t e = std::min(paged.size(), b + kBatch);
    batch.assign(paged.begin() + static_cast<ptrdiff_t>(b), paged.begin() + static_cast<ptrdiff_t>(e));
    for (size_t j = 0; j < batch.size(); ++j) batch[j].dst = buf.data() + j * repr_bytes;
    ReadLowerTierRepr(s, &batch).IgnoreError();  // per-chunk statuses below
    for (size_t j = 0; j < batch.size(); ++j) {
      paged[b + j].status = std::move(batch[j].status);
      if (paged[b + j].status.ok())
        ToFloat(dt, batch[j].dst, out->repr.data() + paged_slot[b + j] * repr_elems, repr_elems);
    }
  }
  l.lock();
  s->busy--;
  cv_.notify_all();
  if (!st.ok()) return st;
  // A chunk dropped (DropChunks) while the lock was dropped may have lost its meta record
  // with it: it is left out (its drop comes with a later call), as any hole. Any other failed
  // read fails the call.
  std::vector<uint8_t> gone(out->added.size(), 0);
  bool any_gone = false;
  for (size_t j = 0; j < paged.size(); ++j) {
    if (paged[j].status.ok()) continue;
    if (ls.chunks[out->added[paged_slot[j]]] != nullptr) return paged[j].status;
    gone[paged_slot[j]] = 1;
    any_gone = true;
  }
  if (any_gone) {
    size_t w = 0;
    for (size_t r = 0; r < out->added.size(); ++r) {
      if (gone[r]) continue;
      if (w != r) {
        out->added[w] = out->added[r];
        std::copy_n(out->repr.data() + r * repr_elems, repr_elems, out->repr.data() + w * repr_elems);
      }
      w++;
    }
    out->added.resize(w);
    out->repr.resize(w * repr_elems);
  }
  return Status::Ok();
}

Status TieredStore::ReadTokens(SequenceId seq, int layer, int64_t begin, int64_t end, void* k_out,
                               void* v_out) {
  CountVisit();
  Sequence* s = nullptr;
  {
    std::unique_lock<CountingMutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
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
        std::lock_guard<CountingMutex> l(mu_);
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
          std::lock_guard<CountingMutex> l(mu_);
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
        std::lock_guard<CountingMutex> l(mu_);
        if (src != staging.data()) (from_hot ? c->hot_pins : c->warm_pins)--;
        cv_.notify_all();
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
  std::lock_guard<CountingMutex> l(mu_);
  s->busy--;
  cv_.notify_all();
  return st;
}

Status TieredStore::SetChunkScores(SequenceId seq, int layer,
                                   const std::vector<std::pair<uint64_t, float>>& scores) {
  CountVisit();
  std::unique_lock<CountingMutex> l(mu_);
  Sequence* s = nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  LandLayerLocked(l, s, layer);
  KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s->layers[layer]));
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
    warm_policy_->OnScore(c->id, score);
  }
  return Status::Ok();
}

Status TieredStore::DropChunks(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices,
                               uint64_t* dropped) {
  CountVisit();
  if (dropped != nullptr) *dropped = 0;
  std::vector<std::vector<ChunkKey>> tier_keys(lower_.size());  // per lower tier, what it may hold
  {
    std::unique_lock<CountingMutex> l(mu_);
    Sequence* s = nullptr;
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
    LandLayerLocked(l, s, layer);
    KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s->layers[layer]));
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
    // Transfers in flight finish first: a warm read, a lower-tier write, a hot load.
    cv_.wait(l, [&] {
      for (uint64_t idx : chunk_indices) {
        const Chunk* c = ls.chunks[idx];
        if (c && (c->warm_pins > 0 || c->lower_writing || c->hot_loading)) return false;
      }
      return true;
    });
    for (uint64_t idx : chunk_indices) {
      Chunk* c = ls.chunks[idx];
      if (c == nullptr) continue;
      // Written (or being written) to the lower tiers; a publisher's chunk is not this store's to remove.
      if (c->lower_acked || c->lower_writing)
        for (size_t t = 0; t < lower_.size(); ++t)
          if (!(lower_[t]->serves_published() && store_internal::SharedChunk(s, c->key)))
            tier_keys[t].push_back(c->key);
      FreeChunkLocked(c);
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

void TieredStore::FreeChunkLocked(Chunk* c) {
  if (c->warm_slot >= 0) {
    warm_->Release(c->warm_slot);
    warm_policy_->OnRemove(c->id);
  }
  if (c->hot_slot >= 0) {
    hot_->ReleaseSlot(c->hot_slot);
    hot_pool_->policy().OnRemove(c->id);
  }
  if (c->lower_acked && (c->tiers & kTierCold) && counters_.cold_chunks > 0) {
    counters_.cold_chunks--;
    counters_.cold_bytes -= chunk_bytes_;
  }
  chunk_by_id_.erase(c->id);
  if (!c->repr.empty()) repr_chunks_--;
  delete c;
}

}  // namespace kvtier
