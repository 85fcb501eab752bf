#include "offload/store_recovery.h"

#include <algorithm>
#include <string>
#include <vector>

#include "offload/store/layer_regions.h"

namespace kvtier {

using store_internal::Chunk;
using store_internal::LayerState;
using store_internal::Sequence;
using store_records::SeqState;

namespace {

store_records::StoreLayout LayoutOf(const StoreOptions& o) {
  return store_records::StoreLayout{o.geometry, o.n_sink, o.n_local, o.chunk_size, o.repr_topk, o.repr_heads};
}

// The store record pins the layout: reopening with another geometry would misread every chunk.
Status CheckOrWriteStoreRecord(const StoreOptions& options, ColdTier* cold) {
  using namespace store_records;
  auto existing = cold->GetBlob(kStoreRecordSeq, 0, kStoreBlob);
  const std::string mine = EncodeStoreRecord(LayoutOf(options));
  if (existing.ok()) {
    if (*existing == mine) return Status::Ok();
    KVTIER_ASSIGN_OR_RETURN(StoreLayout theirs,
                            DecodeStoreRecord(*existing, "data_dir '" + options.data_dir + "'"));
    return InvalidArgument("data_dir '" + options.data_dir + "' holds a store with " + theirs.ToString() +
                           ", but the options say " + LayoutOf(options).ToString());
  }
  if (existing.status().code() != StatusCode::kNotFound) return existing.status();
  return cold->PutBlob(kStoreRecordSeq, 0, kStoreBlob, mine.data(), mine.size());
}

// Rebuilds the hot regions of a closed sequence's layer exactly as they were at close.
Status RestoreSinksAndLocal(const StoreOptions& o, size_t token_bytes, SequenceId id, int l, ColdTier* cold,
                            HotTier* hot, LayerState* ls, uint64_t* region_bytes) {
  auto sinks = cold->GetBlob(id, l, store_records::kSinksBlob);
  auto local = cold->GetBlob(id, l, store_records::kLocalBlob);
  // The record says closed, and CloseSequence wrote both before it: missing means damage.
  for (const Result<std::string>* r : {&sinks, &local})
    if (!r->ok())
      return r->status().code() == StatusCode::kNotFound
                 ? Corruption("cold tier: sequence " + std::to_string(id) + " is closed but layer " +
                              std::to_string(l) +
                              " lost what close wrote before it: " + r->status().message())
                 : r->status();
  const int64_t n_sink_tokens = std::min<int64_t>(ls->n_tokens, o.n_sink);
  const int64_t n_local_tokens = ls->n_tokens - std::max<int64_t>(ls->sealed_end, n_sink_tokens);
  if (sinks->size() != 2 * n_sink_tokens * token_bytes || n_local_tokens < 0 ||
      local->size() != 2 * static_cast<size_t>(n_local_tokens) * token_bytes)
    return Corruption("cold tier: sequence " + std::to_string(id) + " layer " + std::to_string(l) +
                      " sinks/local records do not match its token count");
  KVTIER_RETURN_IF_ERROR(store_internal::AllocateLayerRegions(o, token_bytes, hot, ls));
  *region_bytes += store_internal::LayerRegionBytes(o, token_bytes);
  KVTIER_RETURN_IF_ERROR(store_internal::RestoreLayerRegions(o, token_bytes, hot, *sinks, *local, ls));
  ls->sinks_restored = true;
  return Status::Ok();
}

}  // namespace

Status RecoverStore(const StoreOptions& options, ColdTier* cold, HotTier* hot, RecoveredStore* out) {
  KVTIER_RETURN_IF_ERROR(CheckOrWriteStoreRecord(options, cold));

  const int L = options.geometry.layers;
  const size_t token_bytes = options.geometry.token_elems() * DTypeSize(options.geometry.dtype);
  const size_t chunk_bytes = options.chunk_bytes();
  const size_t repr_bytes = options.repr_bytes();
  std::vector<std::pair<SequenceId, std::string>> records;
  KVTIER_RETURN_IF_ERROR(cold->ForEachSequence([&](SequenceId id, std::string_view rec) {
    records.emplace_back(id, std::string(rec));
    return Status::Ok();
  }));
  for (auto& [id, bytes] : records) {
    if (id == store_records::kStoreRecordSeq) continue;
    KVTIER_ASSIGN_OR_RETURN(store_records::SequenceRecord rec,
                            store_records::DecodeSequenceRecord(bytes, id, L));
    auto seq = std::make_unique<Sequence>();
    seq->id = id;
    seq->state = rec.state;
    seq->layers.resize(L);
    out->next_seq_id = std::max(out->next_seq_id, id + 1);
    Status meta_status =
        cold->ForEachChunkMeta(id, [&](const ChunkKey& key, std::string_view meta) -> Status {
          if (key.layer >= static_cast<uint32_t>(L))
            return Corruption("cold tier: chunk " + key.ToString() + " names a layer beyond the geometry");
          KVTIER_ASSIGN_OR_RETURN(store_records::ChunkMeta m,
                                  store_records::DecodeChunkMeta(meta, key, repr_bytes));
          auto c = std::make_unique<Chunk>();
          c->id = out->next_chunk_id++;
          c->key = key;
          c->first_token = m.first_token;
          // Cold only: its representatives stay in the meta record (checked above) and are read
          // back on demand (TieredStore::metadata_bytes).
          c->score = m.score;
          c->tiers = kTierCold;
          c->lower_acked = true;
          auto& chunks = seq->layers[key.layer].chunks;
          if (chunks.size() <= key.index) chunks.resize(key.index + 1, nullptr);
          out->chunk_by_id[c->id] = c.get();
          chunks[key.index] = c.release();
          out->cold_chunks++;
          out->cold_bytes += chunk_bytes;
          return Status::Ok();
        });
    // Hand the sequence over before checking the status, so its chunks are freed either way.
    Sequence* s = seq.get();
    out->sequences[id] = std::move(seq);
    KVTIER_RETURN_IF_ERROR(meta_status);
    for (int l = 0; l < L; ++l) {
      LayerState& ls = s->layers[l];
      // As at run time: sealed_end trails n_tokens while the sinks fill, then
      // sits at the end of the last chunk.
      if (s->state == SeqState::kClosed) {
        ls.n_tokens = rec.n_tokens[l];
        // The sealed chunk count follows from n_tokens (Append seals the oldest chunk
        // when the ring is full and a token arrives), not from the chunks found:
        // trailing chunks may have been dropped by compression (DropChunks).
        const int64_t beyond = ls.n_tokens - options.n_sink - (options.n_local + options.chunk_size);
        const int64_t sealed = beyond > 0 ? (beyond + options.chunk_size - 1) / options.chunk_size : 0;
        if (static_cast<int64_t>(ls.chunks.size()) > sealed)
          return Corruption("cold tier: sequence " + std::to_string(id) + " layer " + std::to_string(l) +
                            " has " + std::to_string(ls.chunks.size()) + " chunks but its " +
                            std::to_string(ls.n_tokens) + " tokens seal only " + std::to_string(sealed));
        ls.sealed_end = std::min<int64_t>(ls.n_tokens, options.n_sink) + sealed * options.chunk_size;
      } else {
        // Never closed: what the acknowledged chunks cover, read-only, without sinks or window.
        ls.sealed_end = ls.chunks.empty()
                            ? 0
                            : options.n_sink + static_cast<int64_t>(ls.chunks.size()) * options.chunk_size;
        ls.n_tokens = ls.sealed_end;
      }
      ls.sinks_restored = false;
      if (s->state == SeqState::kClosed)
        KVTIER_RETURN_IF_ERROR(
            RestoreSinksAndLocal(options, token_bytes, id, l, cold, hot, &ls, &out->region_bytes));
    }
  }
  return Status::Ok();
}

void FreeRecoveredStore(HotTier* hot, RecoveredStore* rec) {
  for (auto& [id, seq] : rec->sequences)
    for (auto& ls : seq->layers) {
      store_internal::FreeLayerRegions(hot, &ls);
      for (store_internal::Chunk* c : ls.chunks) delete c;
      ls.chunks.clear();
    }
  rec->sequences.clear();
  rec->chunk_by_id.clear();
}

}  // namespace kvtier
