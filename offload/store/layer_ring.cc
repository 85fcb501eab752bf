// LayerRing: see offload/store/layer_ring.h.

#include "offload/store/layer_ring.h"

#include <algorithm>

namespace kvtier {

using store_internal::LayerState;

LayerRing::LayerRing(const StoreOptions& options, size_t token_bytes)
    : options_(options), token_bytes_(token_bytes), capacity_(options.n_local + options.chunk_size) {}

Status LayerRing::Append(LayerState& ls, const uint8_t* kb, const uint8_t* vb, int n, const CopyIn& copy_in,
                         const std::function<Status()>& seal) const {
  const size_t tb = token_bytes_;
  int done = 0;
  while (done < n) {
    if (ls.n_tokens < options_.n_sink) {
      const int take = static_cast<int>(std::min<int64_t>(n - done, options_.n_sink - ls.n_tokens));
      KVTIER_RETURN_IF_ERROR(copy_in(ls.sink_k + ls.n_tokens * tb, kb + done * tb, take * tb));
      KVTIER_RETURN_IF_ERROR(copy_in(ls.sink_v + ls.n_tokens * tb, vb + done * tb, take * tb));
      ls.n_tokens += take;
      ls.sealed_end = ls.n_tokens;
      done += take;
      continue;
    }
    if (ls.n_tokens - ls.sealed_end == capacity_) KVTIER_RETURN_IF_ERROR(seal());
    // Copy up to the ring's free space, split at the wrap point.
    const int64_t free_tokens = capacity_ - (ls.n_tokens - ls.sealed_end);
    const int64_t slot = (ls.n_tokens - options_.n_sink) % capacity_;
    const int take = static_cast<int>(std::min<int64_t>({n - done, free_tokens, capacity_ - slot}));
    KVTIER_RETURN_IF_ERROR(copy_in(ls.ring_k + slot * tb, kb + done * tb, take * tb));
    KVTIER_RETURN_IF_ERROR(copy_in(ls.ring_v + slot * tb, vb + done * tb, take * tb));
    ls.n_tokens += take;
    done += take;
  }
  return Status::Ok();
}

Status LayerRing::View(SequenceId seq, const LayerState& ls, HotView* v) const {
  if (!ls.sinks_restored)
    return FailedPrecondition("sequence " + std::to_string(seq) +
                              " was recovered without its sinks and local window (it was not closed)");
  *v = HotView{};
  v->n_tokens = ls.n_tokens;
  v->sinks = kernels::KvSpan{ls.sink_k, ls.sink_v,
                             static_cast<int>(std::min<int64_t>(ls.n_tokens, options_.n_sink)), 0, nullptr};
  int64_t pos = std::max<int64_t>(ls.sealed_end, options_.n_sink);
  int64_t remaining = ls.n_tokens - pos;
  while (remaining > 0) {
    const int64_t slot = (pos - options_.n_sink) % capacity_;
    const int64_t take = std::min(remaining, capacity_ - slot);
    v->local[v->n_local_spans++] =
        kernels::KvSpan{ls.ring_k + slot * token_bytes_, ls.ring_v + slot * token_bytes_,
                        static_cast<int>(take), pos, nullptr};
    pos += take;
    remaining -= take;
  }
  return Status::Ok();
}

Status LayerRing::AddMass(LayerState& ls, int64_t first, int n, const float* mass) const {
  if (n <= 0 || mass == nullptr) return InvalidArgument("AddLocalAttention: need n > 0 and a mass array");
  if (first < ls.sealed_end || first + n > ls.n_tokens || ls.n_tokens <= options_.n_sink)
    return InvalidArgument("AddLocalAttention: tokens [" + std::to_string(first) + ", " +
                           std::to_string(first + n) + ") are not in the local window [" +
                           std::to_string(ls.sealed_end) + ", " + std::to_string(ls.n_tokens) + ")");
  for (int h = 0; h < options_.repr_head_count(); ++h) {
    float* dst = ls.ring_mass.data() + h * capacity_;
    for (int t = 0; t < n; ++t)
      dst[(first + t - options_.n_sink) % capacity_] += mass[static_cast<size_t>(h) * n + t];
  }
  return Status::Ok();
}

int64_t LayerRing::OldestChunkSlot(const LayerState& ls) const {
  return (ls.sealed_end - options_.n_sink) % capacity_;
}

std::vector<float> LayerRing::OldestChunkMass(const LayerState& ls) const {
  const int64_t slot0 = OldestChunkSlot(ls);
  const int heads = options_.repr_head_count();
  std::vector<float> mass(static_cast<size_t>(heads) * options_.chunk_size);
  for (int h = 0; h < heads; ++h)
    std::copy_n(ls.ring_mass.data() + h * capacity_ + slot0, options_.chunk_size,
                mass.data() + static_cast<size_t>(h) * options_.chunk_size);
  return mass;
}

void LayerRing::AdvancePastOldestChunk(LayerState& ls) const {
  const int64_t slot0 = OldestChunkSlot(ls);
  for (int h = 0; h < options_.repr_head_count(); ++h)
    std::fill_n(ls.ring_mass.data() + h * capacity_ + slot0, options_.chunk_size, 0.0f);
  ls.sealed_end += options_.chunk_size;
}

Status LayerRing::CopyOut(HotTier* hot, const LayerState& ls, std::string* sinks, std::string* local) const {
  const int64_t n_sink_tokens = std::min<int64_t>(ls.n_tokens, options_.n_sink);
  const size_t sink_bytes = static_cast<size_t>(n_sink_tokens) * token_bytes_;
  sinks->assign(2 * sink_bytes, '\0');
  KVTIER_RETURN_IF_ERROR(hot->Download(sinks->data(), ls.sink_k, sink_bytes));
  KVTIER_RETURN_IF_ERROR(hot->Download(sinks->data() + sink_bytes, ls.sink_v, sink_bytes));
  HotView view;
  KVTIER_RETURN_IF_ERROR(View(0, ls, &view));
  const int64_t n_local = ls.n_tokens - std::max<int64_t>(ls.sealed_end, n_sink_tokens);
  const size_t local_bytes = static_cast<size_t>(std::max<int64_t>(0, n_local)) * token_bytes_;
  local->assign(2 * local_bytes, '\0');
  size_t off = 0;
  for (int i = 0; i < view.n_local_spans; ++i) {
    const size_t bytes = static_cast<size_t>(view.local[i].n_tokens) * token_bytes_;
    KVTIER_RETURN_IF_ERROR(
        hot->Download(local->data() + off, static_cast<const uint8_t*>(view.local[i].k), bytes));
    KVTIER_RETURN_IF_ERROR(hot->Download(local->data() + local_bytes + off,
                                         static_cast<const uint8_t*>(view.local[i].v), bytes));
    off += bytes;
  }
  return Status::Ok();
}

}  // namespace kvtier
