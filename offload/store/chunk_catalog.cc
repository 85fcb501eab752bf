// ChunkCatalog: see offload/store/chunk_catalog.h.

#include "offload/store/chunk_catalog.h"

#include <algorithm>
#include <cstring>

namespace kvtier {

using store_internal::Chunk;
using store_internal::LayerState;
using store_internal::Sequence;
using ReprRead = LowerTiers::ReprRead;

ChunkCatalog::ChunkCatalog(const StoreOptions& options, size_t token_bytes)
    : options_(options), repr_bytes_(options.repr_bytes()) {}

Chunk* ChunkCatalog::Create(const ChunkKey& key, int64_t first_token, std::vector<uint8_t> repr) {
  auto* c = new Chunk();
  c->key = key;
  c->first_token = first_token;
  c->repr = std::move(repr);
  Register(c);
  return c;
}

void ChunkCatalog::Register(Chunk* c) {
  c->id = next_id_++;
  by_id_[c->id] = c;
  if (!c->repr.empty()) repr_chunks_++;
}

void ChunkCatalog::Forget(Chunk* c) {
  by_id_.erase(c->id);
  if (!c->repr.empty()) repr_chunks_--;
  delete c;
}

Chunk* ChunkCatalog::Find(uint64_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

void ChunkCatalog::Adopt(ById chunks, uint64_t next_id) {
  by_id_ = std::move(chunks);
  next_id_ = next_id;
  repr_chunks_ = 0;
  for (const auto& [id, c] : by_id_) repr_chunks_ += !c->repr.empty();
}

void ChunkCatalog::ReleaseReprIfDurable(Chunk* c, uint8_t meta_tiers) {
  // The meta record in such a tier is then the other copy of these bytes (LowerWriter encodes
  // it from c->repr), and nothing writes this chunk's meta again: every write of a chunk to
  // the lower tiers (landing, demotion, CloseSequence) is of an unacknowledged one, and
  // PublishSequence reads released representatives back (sharing.cc).
  if (c->repr.empty() || c->warm_slot >= 0 || !c->lower_acked || c->lower_writing ||
      (c->tiers & meta_tiers) == 0)
    return;
  std::vector<uint8_t>().swap(c->repr);
  repr_chunks_--;
}

uint64_t ChunkCatalog::MetadataBytes() const {
  const size_t per_chunk = sizeof(Chunk) + 64;
  return by_id_.size() * per_chunk + repr_chunks_ * repr_bytes_;
}

uint64_t ChunkCatalog::LandedEnd(const LayerState& ls) {
  size_t in_flight = ls.landing.size() + static_cast<size_t>(ls.landers);
  if (in_flight == 0) return ls.chunks.size();
  // The landing chunks are among the newest, not always the last ones (two threads may land
  // a layer's chunks out of order): the first of them ends what readers see.
  uint64_t end = ls.chunks.size();
  for (size_t i = ls.chunks.size(); i > 0 && in_flight > 0; --i)
    if (const Chunk* c = ls.chunks[i - 1]; c != nullptr && c->landing) {
      end = i - 1;
      in_flight--;
    }
  return end;
}

std::vector<ChunkInfo> ChunkCatalog::List(const LayerState& ls) const {
  std::vector<ChunkInfo> out;
  for (const Chunk* c : ls.chunks) {
    if (c == nullptr || c->landing) continue;
    out.push_back(ChunkInfo{c->key, c->first_token, options_.chunk_size, c->tiers, c->score});
  }
  return out;
}

Status ChunkCatalog::UpdatesSince(std::unique_lock<CountingMutex>& l, StoreSync& sync,
                                  const LowerTiers& lower, Sequence* s, int layer, const ChunkCursor& since,
                                  ChunkUpdate* out, size_t max_added) const {
  const SequenceId seq = s->id;
  const LayerState& ls = s->layers[layer];
  const uint64_t landed = LandedEnd(ls);  // readers see the landed chunks only
  if (since.chunks > ls.chunks.size() || since.drops > ls.dropped.size())
    return InvalidArgument("ChunkUpdatesSince: cursor {chunks " + std::to_string(since.chunks) + ", drops " +
                           std::to_string(since.drops) + "} is past layer " + std::to_string(layer) +
                           " of sequence " + std::to_string(seq) + " (" + std::to_string(ls.chunks.size()) +
                           " chunks, " + std::to_string(ls.dropped.size()) + " drops)");
  const DType dt = options_.geometry.dtype;
  const size_t repr_elems = options_.repr_elems();
  const size_t repr_bytes = repr_bytes_;
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
    lower.ReadReprs(s, repr_bytes_, &batch).IgnoreError();  // per-chunk statuses below
    for (size_t j = 0; j < batch.size(); ++j) {
      paged[b + j].status = std::move(batch[j].status);
      if (paged[b + j].status.ok())
        ToFloat(dt, batch[j].dst, out->repr.data() + paged_slot[b + j] * repr_elems, repr_elems);
    }
  }
  l.lock();
  s->busy--;
  sync.cv.notify_all();
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

}  // namespace kvtier
