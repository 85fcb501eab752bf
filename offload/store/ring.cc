// TieredStore, part "ring": the per-(sequence, layer) sinks and local ring. Append copies
// K/V into the sinks, then the ring, and seals the ring's oldest chunk_size tokens into a
// chunk when the ring is full (SealOldestChunk submits its download into a warm slot and
// hands it to the landing pipeline, offload/store/landing.cc). ObserveQueries and
// AddLocalAttention keep the attention mass of the ring's tokens (the statistics the
// representatives of a sealed chunk are chosen from); GetHotView gives attention the sinks
// and the local window.
//
// Locking: the sinks, the ring and its mass (LayerState::sink_*, ring_*, ring_mass,
// n_tokens, sealed_end) belong to the sequence's driving thread, one at a time, and are
// touched without mu_; Append holds Sequence::busy while it copies so a drop waits for it.
// Chunk creation and the landing queue are under mu_.

#include <algorithm>
#include <cmath>

#include "offload/attention_backend.h"
#include "offload/store_state.h"
#include "offload/tiered_store.h"

namespace kvtier {

using store_internal::LandingChunk;

Status TieredStore::Append(SequenceId seq, int layer, const void* k, const void* v, int n, DType dtype,
                           MemorySpace space) {
  CountVisit();
  Sequence* s = nullptr;
  {
    std::unique_lock<CountingMutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, true, &s));
    if (n <= 0) return InvalidArgument("Append: token count must be > 0 (got " + std::to_string(n) + ")");
    if (k == nullptr || v == nullptr) return InvalidArgument("Append: k and v must not be null");
    if (dtype != options_.geometry.dtype)
      return InvalidArgument(std::string("Append: dtype ") + DTypeName(dtype) +
                             " does not match the store's " + DTypeName(options_.geometry.dtype));
    if (space != MemorySpace::kHost && space != MemorySpace::kDevice)
      return InvalidArgument("Append: unknown memory space " + std::to_string(static_cast<int>(space)) +
                             " (kHost or kDevice)");
    // Chunks sealed by earlier Appends whose downloads are complete land now (never waiting);
    // a failed one is reported here, before anything is appended.
    LandLayerLocked(l, s, layer, 0, true);
    KVTIER_RETURN_IF_ERROR(TakeLandingErrorLocked(s->layers[layer]));
    // A lower tier that failed a background write: say so now, before appending anything,
    // rather than after waiting for warm room behind it.
    KVTIER_RETURN_IF_ERROR(lower_.BackgroundErrorLocked());
    s->busy++;
  }
  // kDevice K/V are already in the tier's memory space: copied within it, never through the host.
  const auto copy_in = [this, space](uint8_t* dst, const uint8_t* src, size_t bytes) {
    return space == MemorySpace::kDevice ? hot_->CopyWithin(dst, src, bytes) : hot_->Upload(dst, src, bytes);
  };
  LayerState& ls = s->layers[layer];
  const auto* kb = static_cast<const uint8_t*>(k);
  const auto* vb = static_cast<const uint8_t*>(v);
  const int64_t ring = options_.n_local + options_.chunk_size;
  Status status;
  int done = 0;
  while (done < n) {
    if (ls.n_tokens < options_.n_sink) {
      const int take = static_cast<int>(std::min<int64_t>(n - done, options_.n_sink - ls.n_tokens));
      status = copy_in(ls.sink_k + ls.n_tokens * token_bytes_, kb + done * token_bytes_, take * token_bytes_);
      if (status.ok())
        status =
            copy_in(ls.sink_v + ls.n_tokens * token_bytes_, vb + done * token_bytes_, take * token_bytes_);
      if (!status.ok()) break;
      ls.n_tokens += take;
      ls.sealed_end = ls.n_tokens;
      done += take;
      continue;
    }
    if (ls.n_tokens - ls.sealed_end == ring) {
      status = ReturnOnBadAlloc("Append: sealing a chunk", [&] { return SealOldestChunk(s, layer); });
      if (!status.ok()) break;
    }
    // Copy up to the ring's free space, split at the wrap point.
    const int64_t free_tokens = ring - (ls.n_tokens - ls.sealed_end);
    const int64_t slot = (ls.n_tokens - options_.n_sink) % ring;
    const int take = static_cast<int>(std::min<int64_t>({n - done, free_tokens, ring - slot}));
    status = copy_in(ls.ring_k + slot * token_bytes_, kb + done * token_bytes_, take * token_bytes_);
    if (status.ok())
      status = copy_in(ls.ring_v + slot * token_bytes_, vb + done * token_bytes_, take * token_bytes_);
    if (!status.ok()) break;
    ls.n_tokens += take;
    done += take;
  }
  std::lock_guard<CountingMutex> l(mu_);
  s->busy--;
  cv_.notify_all();
  return status;
}

Status TieredStore::SealOldestChunk(Sequence* s, int layer) {
  LayerState& ls = s->layers[layer];
  const int64_t ring = options_.n_local + options_.chunk_size;
  const int64_t first = ls.sealed_end;
  const int64_t slot0 = (first - options_.n_sink) % ring;  // multiple of chunk_size: chunks never wrap
  const int kv_heads = options_.geometry.kv_heads;
  // The statistics of the positions the chunk leaves, taken now: they are reset below and
  // the positions refilled before the chunk lands.
  LandingChunk landing;
  landing.mass.resize(static_cast<size_t>(kv_heads) * options_.chunk_size);
  for (int h = 0; h < kv_heads; ++h)
    std::copy_n(ls.ring_mass.data() + h * ring + slot0, options_.chunk_size,
                landing.mass.data() + static_cast<size_t>(h) * options_.chunk_size);
  Chunk* c = nullptr;
  uint8_t* dst = nullptr;
  // Allocated before anything changes, so that running out of memory here loses nothing.
  std::vector<uint8_t> repr(static_cast<size_t>(options_.repr_topk) * token_bytes_);
  {
    std::unique_lock<CountingMutex> lock(mu_);
    KVTIER_RETURN_IF_ERROR(MakeWarmRoom(lock));
    const int32_t slot = warm_->Acquire();
    if (slot < 0) return Internal("warm tier reported room but had no free slot");
    c = new Chunk();
    c->id = next_chunk_id_++;
    c->key = ChunkKey{s->id, static_cast<uint32_t>(layer), ls.chunks.size()};
    c->first_token = first;
    c->repr = std::move(repr);  // chosen when the chunk lands
    c->warm_slot = slot;
    c->warm_pins = 1;  // being filled
    c->landing = true;
    chunk_by_id_[c->id] = c;
    repr_chunks_++;
    ls.chunks.push_back(c);
    landing_chunks_++;  // from here on its warm slot is not counted as a warm chunk
    dst = warm_->slot_data(c->warm_slot);
  }
  // Submit the download into the (pinned) warm slot, [K chunk][V chunk], and return without
  // waiting: on a device tier the copy overlaps what the engine does next. The ring
  // positions it reads are refilled by this sequence's next Append before the chunk lands;
  // that is safe because every copy into hot memory (Upload, CopyWithin) goes through the
  // same tier, which runs its copies in submission order (CudaHotTier: one transfer
  // stream), so the refill is ordered after the download read the old bytes.
  const size_t half = static_cast<size_t>(options_.chunk_size) * token_bytes_;
  const HotTier::DownloadOp ops[] = {{dst, ls.ring_k + slot0 * token_bytes_, half},
                                     {dst + half, ls.ring_v + slot0 * token_bytes_, half}};
  Result<TransferTicket> ticket = hot_->DownloadBatchAsync(ops, 2);
  std::unique_lock<CountingMutex> lock(mu_);
  if (!ticket.ok()) {
    // Nothing was submitted: the chunk stays in the ring, and the next Append seals it again.
    ls.chunks.pop_back();
    chunk_by_id_.erase(c->id);
    repr_chunks_--;
    warm_->Release(c->warm_slot);
    landing_chunks_--;
    delete c;
    return ticket.status();
  }
  for (int h = 0; h < kv_heads; ++h)
    std::fill_n(ls.ring_mass.data() + h * ring + slot0, options_.chunk_size, 0.0f);
  ls.sealed_end += options_.chunk_size;
  landing.chunk = c;
  landing.ticket = *ticket;
  ls.landing.push_back(std::move(landing));
  // A host tier's download is complete already: the chunk lands here, as if sealing were
  // synchronous. A device tier's lands at this sequence's next driving call (Append, the
  // layer step's door, Flush, ...), or here when too many are in flight.
  LandLayerLocked(lock, s, layer, static_cast<size_t>(options_.max_landing_chunks), false);
  LandLayerLocked(lock, s, layer, 0, true);
  return Status::Ok();
}

Status TieredStore::ObserveQueries(SequenceId seq, int layer, const float* q, const int64_t* positions,
                                   int m) {
  CountVisit();
  if (m <= 0)
    return InvalidArgument("ObserveQueries: query count must be > 0 (got " + std::to_string(m) + ")");
  if (q == nullptr || positions == nullptr)
    return InvalidArgument("ObserveQueries: q and positions must not be null");
  KVTIER_ASSIGN_OR_RETURN(HotView view, GetHotView(seq, layer));
  const Geometry& g = options_.geometry;
  // This attention (for the representative-key statistics) runs on the host. With a device
  // tier the sinks and local window are read back into host copies first: one download of
  // at most n_sink + n_local + chunk_size tokens per call, and only prefill windows call it
  // (decode steps do not observe). A host mirror kept by Append would save that copy but
  // would have to be kept in step by every path that fills the regions (Append, reopen,
  // recovery, attach); the read-back cannot go stale.
  std::vector<std::vector<uint8_t>> host_copy;
  if (hot_->device() != Device::kCpu) {
    std::vector<kernels::KvSpan*> spans{&view.sinks};
    for (int i = 0; i < view.n_local_spans; ++i) spans.push_back(&view.local[i]);
    host_copy.resize(2 * spans.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      kernels::KvSpan& sp = *spans[i];
      const size_t bytes = static_cast<size_t>(sp.n_tokens) * token_bytes_;
      host_copy[2 * i].resize(std::max<size_t>(1, bytes));
      host_copy[2 * i + 1].resize(std::max<size_t>(1, bytes));
      KVTIER_RETURN_IF_ERROR(
          hot_->Download(host_copy[2 * i].data(), static_cast<const uint8_t*>(sp.k), bytes));
      KVTIER_RETURN_IF_ERROR(
          hot_->Download(host_copy[2 * i + 1].data(), static_cast<const uint8_t*>(sp.v), bytes));
      sp.k = host_copy[2 * i].data();
      sp.v = host_copy[2 * i + 1].data();
    }
  }
  std::vector<float> mass_sinks(static_cast<size_t>(g.kv_heads) * std::max(1, view.sinks.n_tokens), 0.0f);
  std::vector<std::vector<float>> mass_local(view.n_local_spans);
  std::vector<kernels::KvSpan> parts;
  parts.push_back(view.sinks);
  parts.back().mass = mass_sinks.data();
  for (int i = 0; i < view.n_local_spans; ++i) {
    mass_local[i].assign(static_cast<size_t>(g.kv_heads) * view.local[i].n_tokens, 0.0f);
    parts.push_back(view.local[i]);
    parts.back().mass = mass_local[i].data();
  }
  std::vector<float> out(static_cast<size_t>(m) * g.q_heads * g.head_dim);
  const kernels::AttentionParams p = DenseAttentionParams(g, g.dtype, q, positions, m, parts.data(),
                                                          static_cast<int>(parts.size()), out.data());
  const kernels::KernelError err = kernels::Attention(p);
  if (err != kernels::KernelError::kOk)
    return InvalidArgument(std::string("ObserveQueries: attention failed: ") +
                           kernels::KernelErrorString(err));
  for (int i = 0; i < view.n_local_spans; ++i) {
    KVTIER_RETURN_IF_ERROR(AddLocalAttention(seq, layer, view.local[i].first_position, view.local[i].n_tokens,
                                             mass_local[i].data()));
  }
  return Status::Ok();
}

Status TieredStore::AddLocalAttention(SequenceId seq, int layer, int64_t first_position, int n,
                                      const float* mass) {
  CountVisit();
  Sequence* s = nullptr;
  {
    std::lock_guard<CountingMutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, true, &s));
  }
  if (n <= 0 || mass == nullptr) return InvalidArgument("AddLocalAttention: need n > 0 and a mass array");
  LayerState& ls = s->layers[layer];
  if (first_position < ls.sealed_end || first_position + n > ls.n_tokens || ls.n_tokens <= options_.n_sink)
    return InvalidArgument("AddLocalAttention: tokens [" + std::to_string(first_position) + ", " +
                           std::to_string(first_position + n) + ") are not in the local window [" +
                           std::to_string(ls.sealed_end) + ", " + std::to_string(ls.n_tokens) + ")");
  const int64_t ring = options_.n_local + options_.chunk_size;
  for (int h = 0; h < options_.geometry.kv_heads; ++h) {
    float* dst = ls.ring_mass.data() + h * ring;
    for (int t = 0; t < n; ++t)
      dst[(first_position + t - options_.n_sink) % ring] += mass[static_cast<size_t>(h) * n + t];
  }
  return Status::Ok();
}

Result<HotView> TieredStore::GetHotView(SequenceId seq, int layer) {
  CountVisit();
  Sequence* s = nullptr;
  {
    std::lock_guard<CountingMutex> l(mu_);
    KVTIER_RETURN_IF_ERROR(CheckLayerLocked(seq, layer, false, &s));
  }
  HotView v;
  KVTIER_RETURN_IF_ERROR(HotViewOf(seq, s->layers[layer], &v));
  return v;
}

Status TieredStore::HotViewOf(SequenceId seq, const LayerState& ls, HotView* v) const {
  if (!ls.sinks_restored)
    return FailedPrecondition("sequence " + std::to_string(seq) +
                              " was recovered without its sinks and local window (it was not closed)");
  *v = HotView{};
  v->n_tokens = ls.n_tokens;
  v->sinks = kernels::KvSpan{ls.sink_k, ls.sink_v,
                             static_cast<int>(std::min<int64_t>(ls.n_tokens, options_.n_sink)), 0, nullptr};
  const int64_t ring = options_.n_local + options_.chunk_size;
  int64_t pos = std::max<int64_t>(ls.sealed_end, options_.n_sink);
  int64_t remaining = ls.n_tokens - pos;
  while (remaining > 0) {
    const int64_t slot = (pos - options_.n_sink) % ring;
    const int64_t take = std::min(remaining, ring - slot);
    v->local[v->n_local_spans++] =
        kernels::KvSpan{ls.ring_k + slot * token_bytes_, ls.ring_v + slot * token_bytes_,
                        static_cast<int>(take), pos, nullptr};
    pos += take;
    remaining -= take;
  }
  return Status::Ok();
}

}  // namespace kvtier
