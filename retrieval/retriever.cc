#include "retrieval/retriever.h"

#include <algorithm>
#include <functional>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <limits>

#include "kernels/cpu/dot.h"

namespace kvtier {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

bool NeedsAllScores(const std::string& alloc_spec) { return alloc_spec.rfind("topk", 0) != 0; }

// Order-preserving map of a float to uint32: a < b exactly when OrderKey(a) < OrderKey(b); -0 and +0
// map alike (they compare equal as floats).
inline uint32_t OrderKey(float x) {
  uint32_t u;
  const float canonical = x + 0.0f;  // -0 -> +0
  std::memcpy(&u, &canonical, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k best rows of `score` (higher first, ties to the smaller row), in ascending row order
// (TakeBest's tie order): the k-th best order key is found on a copy (plain integers, no
// indirection through row indices, which cost as much as the first stage itself), then one
// pass keeps every row above it and the first rows equal to it.
void TopRowsAscending(const float* score, int64_t n, int64_t k, std::vector<int64_t>* rows,
                      std::vector<uint32_t>* scratch) {
  rows->clear();
  if (k <= 0 || n <= 0) return;
  if (k >= n) {
    rows->resize(n);
    std::iota(rows->begin(), rows->end(), 0);
    return;
  }
  scratch->resize(2 * static_cast<size_t>(n));
  uint32_t* key = scratch->data();
  uint32_t* sel = key + n;
  for (int64_t i = 0; i < n; ++i) key[i] = sel[i] = OrderKey(score[i]);
  std::nth_element(sel, sel + (k - 1), sel + n, std::greater<uint32_t>());
  const uint32_t t = sel[k - 1];
  int64_t greater = 0;
  for (int64_t i = 0; i < n; ++i) greater += key[i] > t ? 1 : 0;
  int64_t ties_left = k - greater;
  rows->reserve(k);
  for (int64_t i = 0; i < n; ++i) {
    if (key[i] > t) {
      rows->push_back(i);
    } else if (key[i] == t && ties_left > 0) {
      rows->push_back(i);
      --ties_left;
    }
  }
}

// The `take` best chunks by `rank`, best first (ties -> smaller chunk index; ids are
// ascending), never more than `cap`: the hot slot pool, since the entropy cut-off can hand
// one layer most of the step's budget.
std::vector<uint64_t> TakeBest(const std::vector<float>& rank, const std::vector<uint64_t>& ids, int take, size_t cap) {
  const size_t t = std::min<size_t>({rank.size(), static_cast<size_t>(std::max(0, take)), cap});
  std::vector<int64_t> rows;
  std::vector<uint32_t> keys;
  TopRowsAscending(rank.data(), static_cast<int64_t>(rank.size()), static_cast<int64_t>(t), &rows, &keys);
  // Ascending rows in, so a stable sort by score keeps ties in chunk order.
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) { return rank[a] > rank[b]; });
  std::vector<uint64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = ids[rows[i]];
  return out;
}

// How the kv heads' best scores make a chunk's totals (RetrieverOptions::head_merge): summed
// (cosines averaged, so they stay in [-1, 1]) or the best head's. Totals start at Start().
struct HeadFold {
  bool max = false;
  float cos_share = 1.0f;
  HeadFold(const std::string& head_merge, int heads)
      : max(head_merge == "max"), cos_share(max ? 1.0f : 1.0f / static_cast<float>(heads)) {}
  float Start() const { return max ? -std::numeric_limits<float>::infinity() : 0.0f; }
  void Add(float best, float best_cos, float* raw, float* cos) const {
    *raw = max ? std::max(*raw, best) : *raw + best;
    *cos = max ? std::max(*cos, best_cos) : *cos + best_cos * cos_share;
  }
};

}  // namespace

Status RetrieverOptions::Validate() const {
  if (budget_tokens < 0) return InvalidArgument("budget_tokens must be >= 0 (got " + std::to_string(budget_tokens) + ")");
  if (index.factory != "Exact") KVTIER_RETURN_IF_ERROR(index.Validate());
  if (rank_by != "cosine" && rank_by != "logit")
    return InvalidArgument("rank_by must be cosine or logit (got '" + rank_by + "')");
  if (head_merge != "sum" && head_merge != "max")
    return InvalidArgument("head_merge must be sum or max (got '" + head_merge + "')");
  if (head_merge != "sum" && index.factory != "Exact")
    return InvalidArgument("head_merge=" + head_merge + " needs the Exact index (a FAISS vector concatenates the kv "
                           "heads, so its inner product is the sum over heads)");
  if (rerank_factor < 0 || rerank_min < 0)
    return InvalidArgument("rerank_factor and rerank_min must be >= 0 (got " + std::to_string(rerank_factor) + ", " +
                           std::to_string(rerank_min) + ")");
  auto a = MakeBudgetAllocator(alloc);
  if (!a.ok()) return InvalidArgument("alloc: " + a.status().message());
  // The probe needs a geometry to be built; any valid one checks the spec.
  auto p = MakeProbeBuilder(probe, Geometry{1, 1, 1, 2, DType::kF32});
  if (!p.ok()) return InvalidArgument("probe: " + p.status().message());
  return Status::Ok();
}

Result<std::unique_ptr<Retriever>> Retriever::Create(TieredStore* store, const RetrieverOptions& options) {
  if (store == nullptr) return InvalidArgument("Retriever needs a store");
  KVTIER_RETURN_IF_ERROR(options.Validate());
  auto r = std::unique_ptr<Retriever>(new Retriever(store, options));
  const StoreOptions& so = store->options();
  KVTIER_ASSIGN_OR_RETURN(r->probe_, MakeProbeBuilder(options.probe, so.geometry));
  KVTIER_ASSIGN_OR_RETURN(r->alloc_, MakeBudgetAllocator(options.alloc));
  if (!r->exact()) KVTIER_RETURN_IF_ERROR(options.index.Validate(static_cast<int>(so.geometry.token_elems())));
  r->k_ = options.budget_tokens / so.chunk_size;
  r->probe_buf_.resize(so.geometry.token_elems());
  r->probe_vec_.resize(so.geometry.token_elems());
  return r;
}

void Retriever::BeginStep() { alloc_->BeginStep(store_->options().geometry.layers, std::max(1, k_)); }

Result<Retriever::LayerIndex*> Retriever::Index(SequenceId seq, int layer) {
  const uint64_t key = seq * 65536 + static_cast<uint64_t>(layer);
  auto it = indexes_.find(key);
  if (it == indexes_.end()) {
    LayerIndex li;
    if (!exact()) {
      KVTIER_ASSIGN_OR_RETURN(li.index, ChunkIndex::Create(static_cast<int>(store_->options().geometry.token_elems()),
                                                           options_.index));
    }
    it = indexes_.emplace(key, std::move(li)).first;
  }
  return &it->second;
}

Status Retriever::Sync(SequenceId seq, int layer) {
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  KVTIER_ASSIGN_OR_RETURN(uint64_t count, store_->ChunkCount(seq, layer));
  if (count <= li->next_chunk) return Status::Ok();
  const StoreOptions& so = store_->options();
  const int H = so.geometry.kv_heads, D = so.geometry.head_dim, R = so.repr_topk;
  repr_.resize(static_cast<size_t>(R) * H * D);
  const DType dt = so.geometry.dtype;
  const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(dt);
  std::vector<uint8_t> stored(key_bytes);
  std::vector<uint64_t> ids;
  std::vector<float> vecs;
  for (uint64_t i = li->next_chunk; i < count; ++i) {
    Status st = store_->GetRepresentatives(ChunkKey{seq, static_cast<uint32_t>(layer), i}, repr_.data());
    if (st.code() == StatusCode::kNotFound) continue;  // a hole left by a crash: nothing to index
    KVTIER_RETURN_IF_ERROR(st);
    if (exact()) {
      li->exact_ids.push_back(i);
      li->exact_repr.resize(H);
      li->exact_inv_norm.resize(H);
      li->exact_q8.resize(H);
      li->exact_q8_scale.resize(H);
      li->exact_q8_cos_scale.resize(H);
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) {
          const float* key = repr_.data() + (static_cast<size_t>(r) * H + h) * D;
          FromFloat(dt, key, stored.data(), D);  // exact: the key came from this dtype
          li->exact_repr[h].insert(li->exact_repr[h].end(), stored.begin(), stored.end());
          const float n2 = kernels::Dot(key, key, D);
          const float inv_norm = n2 > 0.0f ? 1.0f / std::sqrt(n2) : 0.0f;
          li->exact_inv_norm[h].push_back(inv_norm);
          PutQuantizedRow(li, h, li->exact_ids.size() - 1, r, R, key, D, inv_norm);
        }
      continue;
    }
    ids.push_back(i);
    vecs.resize(ids.size() * H * D);
    // InfLLM scores a chunk by the sum of q.k over its representatives, i.e.
    // the dot product with their mean: the index holds the raw mean (no
    // normalisation), so top-k keeps key norms, as attention does.
    float* v = vecs.data() + (ids.size() - 1) * H * D;
    std::fill(v, v + H * D, 0.0f);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < H * D; ++j) v[j] += repr_[static_cast<size_t>(r) * H * D + j] / static_cast<float>(R);
    if (li->norm.size() <= i) li->norm.resize(i + 1, 0.0f);
    li->norm[i] = std::sqrt(kernels::Dot(v, v, H * D));
  }
  if (!ids.empty()) KVTIER_RETURN_IF_ERROR(li->index->AddBatch(ids.size(), ids.data(), vecs.data()));
  li->next_chunk = count;
  return Status::Ok();
}

Status Retriever::Forget(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices) {
  KVTIER_RETURN_IF_ERROR(Sync(seq, layer));  // index everything first, so nothing dropped is added later
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  if (!exact()) {
    for (uint64_t idx : chunk_indices) {
      Status st = li->index->Remove(idx);
      if (!st.ok() && st.code() != StatusCode::kNotFound) return st;
    }
    return Status::Ok();
  }
  std::vector<uint64_t> gone = chunk_indices;
  std::sort(gone.begin(), gone.end());
  const StoreOptions& so = store_->options();
  const size_t H = static_cast<size_t>(so.geometry.kv_heads), D = so.geometry.head_dim, R = so.repr_topk;
  const DType dt = so.geometry.dtype;
  const size_t es = DTypeSize(dt);
  size_t keep = 0;
  for (size_t row = 0; row < li->exact_ids.size(); ++row) {
    if (std::binary_search(gone.begin(), gone.end(), li->exact_ids[row])) continue;
    if (keep != row) {  // compact in place: rows keep their ascending chunk order
      li->exact_ids[keep] = li->exact_ids[row];
      for (size_t h = 0; h < H; ++h) {
        std::copy_n(li->exact_repr[h].begin() + row * R * D * es, R * D * es, li->exact_repr[h].begin() + keep * R * D * es);
        std::copy_n(li->exact_inv_norm[h].begin() + row * R, R, li->exact_inv_norm[h].begin() + keep * R);
      }
    }
    ++keep;
  }
  li->exact_ids.resize(keep);
  for (size_t h = 0; h < li->exact_repr.size(); ++h) {
    li->exact_repr[h].resize(keep * R * D * es);
    li->exact_inv_norm[h].resize(keep * R);
    // The int8 blocks interleave chunks: requantise the kept rows in their new places.
    li->exact_q8[h].clear();
    li->exact_q8_scale[h].clear();
    li->exact_q8_cos_scale[h].clear();
    std::vector<float> key(D);
    for (size_t row = 0; row < keep; ++row)
      for (size_t r = 0; r < R; ++r) {
        const size_t j = row * R + r;
        ToFloat(dt, li->exact_repr[h].data() + j * D * es, key.data(), D);
        PutQuantizedRow(li, static_cast<int>(h), row, static_cast<int>(r), static_cast<int>(R), key.data(),
                        static_cast<int>(D), li->exact_inv_norm[h][j]);
      }
  }
  return Status::Ok();
}

Status Retriever::Observe(int layer, const float* q, int m) { return probe_->Build(layer, q, m, probe_buf_.data()); }

Status Retriever::SetQuestion(int layer, const float* q, int m) { return probe_->SetQuestion(layer, q, m); }

Result<LayerSelection> Retriever::Select(SequenceId seq, int layer, const float* q, int m, bool decode) {
  LayerSelection sel;
  const StoreOptions& so = store_->options();
  const int H = so.geometry.kv_heads, D = so.geometry.head_dim;
  auto t0 = std::chrono::steady_clock::now();
  KVTIER_RETURN_IF_ERROR(decode ? probe_->BuildDecode(layer, q, probe_buf_.data())
                                : probe_->Build(layer, q, m, probe_buf_.data()));
  std::copy(probe_buf_.begin(), probe_buf_.end(), probe_vec_.begin());
  const float probe_norm = std::sqrt(kernels::Dot(probe_vec_.data(), probe_vec_.data(), H * D));
  sel.probe_ms = MsSince(t0);

  t0 = std::chrono::steady_clock::now();
  KVTIER_RETURN_IF_ERROR(Sync(seq, layer));
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  const int n = static_cast<int>(exact() ? li->exact_ids.size() : li->index->size());
  if (k_ == 0 || n == 0) {
    // StreamingLLM-style budget 0, or nothing sealed yet: only sinks + local.
    LayerScores none{nullptr, 0};
    KVTIER_ASSIGN_OR_RETURN(int unused, alloc_->Allocate(layer, none));
    (void)unused;
    sel.search_ms = MsSince(t0);
    return sel;
  }
  if (exact()) {
    const bool by_cosine = NeedsAllScores(options_.alloc);               // Eq. 10-12 see cosines
    const bool rank_cos = by_cosine && options_.rank_by == "cosine";    // Algorithm 1's order
    const size_t cap = so.hot_bytes / so.chunk_bytes();
    if (options_.rerank_factor == 0) {
      std::vector<float> raw;
      ExactScores(*li, probe_vec_.data(), &raw, &scores_);
      ids_ = li->exact_ids;
      sel.search_ms = MsSince(t0);
      t0 = std::chrono::steady_clock::now();
      KVTIER_ASSIGN_OR_RETURN(int take, alloc_->Allocate(layer, LayerScores{scores_.data(), n}));
      if (by_cosine) sel.entropy = alloc_->last_entropy();  // Θ^ℓ, computed once by the allocator
      sel.chunks = TakeBest(rank_cos ? scores_ : raw, ids_, take, cap);
      sel.alloc_ms = MsSince(t0);
      return sel;
    }
    // Two stages. The first scores every chunk from int8 codes (a quarter of the
    // bytes of the fp32 pass, which is memory-bound); the allocator (Eq. 10-12
    // for entropy) sees these cosines. The second rescores the best candidates
    // from the fp32 keys, so quantisation error cannot reorder the chosen set.
    std::vector<float> raw1;
    QuantizedScores(*li, probe_vec_.data(), &raw1, &scores_);
    sel.search_ms = MsSince(t0);
    t0 = std::chrono::steady_clock::now();
    KVTIER_ASSIGN_OR_RETURN(int take, alloc_->Allocate(layer, LayerScores{scores_.data(), n}));
    if (by_cosine) sel.entropy = alloc_->last_entropy();  // Θ^ℓ, computed once by the allocator
    take = static_cast<int>(std::min<size_t>(static_cast<size_t>(std::max(0, take)), cap));
    sel.alloc_ms = MsSince(t0);
    t0 = std::chrono::steady_clock::now();
    const int64_t n_cand = std::max<int64_t>(static_cast<int64_t>(options_.rerank_factor) * take, options_.rerank_min);
    const std::vector<float>& rank1 = rank_cos ? scores_ : raw1;
    TopRowsAscending(rank1.data(), n, n_cand, &rows_, &rank_keys_);
    std::vector<float> raw, cos;
    ExactScoresOf(*li, probe_vec_.data(), rows_, &raw, &cos);
    std::vector<uint64_t> cand_ids(rows_.size());
    for (size_t i = 0; i < rows_.size(); ++i) cand_ids[i] = li->exact_ids[rows_[i]];
    sel.chunks = TakeBest(rank_cos ? cos : raw, cand_ids, take, cap);
    sel.search_ms += MsSince(t0);
    return sel;
  }
  if (!NeedsAllScores(options_.alloc)) {
    // Fixed k: the index serves the top k (approximate kinds stay sub-linear).
    KVTIER_RETURN_IF_ERROR(li->index->Search(probe_vec_.data(), k_, &sel.chunks, nullptr));
    sel.search_ms = MsSince(t0);
    t0 = std::chrono::steady_clock::now();
    KVTIER_ASSIGN_OR_RETURN(int take, alloc_->Allocate(layer, LayerScores{nullptr, n}));
    sel.chunks.resize(std::min<size_t>(sel.chunks.size(), static_cast<size_t>(take)));
    sel.alloc_ms = MsSince(t0);
    return sel;
  }
  // The entropy cut-off needs every chunk's score (Eq. 10-11 over the whole
  // cache). Eq. 10 is the cosine of the layer's probe and the chunk's key
  // vector (kv heads concatenated): the raw inner product over both norms.
  KVTIER_RETURN_IF_ERROR(li->index->ScoreAll(probe_vec_.data(), &ids_, &scores_));
  const std::vector<float> raw = options_.rank_by == "logit" ? scores_ : std::vector<float>();
  for (size_t i = 0; i < scores_.size(); ++i) {
    const float den = probe_norm * li->norm[ids_[i]];
    scores_[i] = den > 0.0f ? scores_[i] / den : 0.0f;
  }
  sel.search_ms = MsSince(t0);
  t0 = std::chrono::steady_clock::now();
  KVTIER_ASSIGN_OR_RETURN(int take, alloc_->Allocate(layer, LayerScores{scores_.data(), static_cast<int>(scores_.size())}));
  sel.entropy = alloc_->last_entropy();
  sel.chunks = TakeBest(options_.rank_by == "logit" ? raw : scores_, ids_, take, so.hot_bytes / so.chunk_bytes());
  sel.alloc_ms = MsSince(t0);
  return sel;
}

Status Retriever::ObserveAndScore(SequenceId seq, int layer, const float* q, int m, std::vector<uint64_t>* ids,
                                  std::vector<float>* scores) {
  KVTIER_RETURN_IF_ERROR(probe_->Build(layer, q, m, probe_buf_.data()));
  std::copy(probe_buf_.begin(), probe_buf_.end(), probe_vec_.begin());
  KVTIER_RETURN_IF_ERROR(Sync(seq, layer));
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  if (exact()) {
    std::vector<float> cos;
    ExactScores(*li, probe_vec_.data(), scores, &cos);
    *ids = li->exact_ids;
    return Status::Ok();
  }
  return li->index->ScoreAll(probe_vec_.data(), ids, scores);
}

void Retriever::ExactScores(const LayerIndex& li, const float* probe, std::vector<float>* raw,
                            std::vector<float>* cos) const {
  const StoreOptions& so = store_->options();
  const int H = so.geometry.kv_heads, D = so.geometry.head_dim, R = so.repr_topk;
  const size_t n = li.exact_ids.size();
  const DType dt = so.geometry.dtype;
  const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(dt);
  const HeadFold fold(options_.head_merge, H);
  raw->assign(n, fold.Start());
  cos->assign(n, fold.Start());
  if (n == 0) return;
  std::vector<float> ip(n * R);
  for (int h = 0; h < H; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    const float pn2 = kernels::Dot(p, p, D);
    const float inv_p = pn2 > 0.0f ? 1.0f / std::sqrt(pn2) : 0.0f;
    // One pass over this head's n*R contiguous keys, split over the cores.
    // (Debian's FAISS is built without SIMD: its fvec kernels are the scalar
    // reference, so the vectorisable Dot is used instead.)
    const uint8_t* keys = li.exact_repr[h].data();
    tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1024), [&](const tbb::blocked_range<size_t>& range) {
      const size_t c0 = range.begin();
      for (size_t j = c0 * R; j < range.end() * R; ++j) ip[j] = kernels::DotKey(dt, keys + j * key_bytes, p, D);
      const float* inv = li.exact_inv_norm[h].data();
      for (size_t c = c0; c < range.end(); ++c) {
        float best = -std::numeric_limits<float>::infinity(), best_cos = -1.0f;
        for (int r = 0; r < R; ++r) {
          const float dot = ip[c * R + r];
          best = std::max(best, dot);
          best_cos = std::max(best_cos, dot * inv[c * R + r] * inv_p);
        }
        fold.Add(best, best_cos, &(*raw)[c], &(*cos)[c]);
      }
    });
  }
}

void Retriever::PutQuantizedRow(LayerIndex* li, int h, size_t row, int r, int R, const float* key, int D,
                                float inv_norm) {
  constexpr size_t B = kernels::kI8Block;
  std::vector<int8_t>& codes = li->exact_q8[h];
  std::vector<float>& scale = li->exact_q8_scale[h];
  std::vector<float>& cos_scale = li->exact_q8_cos_scale[h];
  const size_t group = row / B, lane = row % B, block = group * R + r, block_bytes = kernels::I8BlockBytes(D);
  const size_t group_end = (group + 1) * R;  // blocks of the whole group exist (zero padding lanes)
  if (codes.size() < group_end * block_bytes) codes.resize(group_end * block_bytes, 0);
  if (scale.size() < group_end * B) {
    scale.resize(group_end * B, 0.0f);
    cos_scale.resize(group_end * B, 0.0f);
  }
  int8_t tmp[4096];  // head_dim <= 4096 (Geometry::Validate)
  const size_t slot = block * B + lane;
  scale[slot] = kernels::QuantizeI8(key, D, tmp);
  cos_scale[slot] = scale[slot] * inv_norm;
  int8_t* dst = codes.data() + block * block_bytes;
  for (int d = 0; d < D; ++d) dst[kernels::I8Offset(d, static_cast<int>(lane))] = tmp[d];
}

void Retriever::QuantizedScores(const LayerIndex& li, const float* probe, std::vector<float>* raw,
                                std::vector<float>* cos) const {
  const StoreOptions& so = store_->options();
  const int H = so.geometry.kv_heads, D = so.geometry.head_dim, R = so.repr_topk;
  const size_t n = li.exact_ids.size();
  const HeadFold fold(options_.head_merge, H);
  raw->assign(n, fold.Start());
  cos->assign(n, fold.Start());
  std::vector<float> inv_p(H), p_scale(H);
  const size_t de = static_cast<size_t>(D + 1) / 2 * 2;
  std::vector<int16_t> p16(H * de);  // the probe in int16 for the integer block dots
  for (int h = 0; h < H; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    const float pn2 = kernels::Dot(p, p, D);
    inv_p[h] = pn2 > 0.0f ? 1.0f / std::sqrt(pn2) : 0.0f;
    p_scale[h] = kernels::QuantizeProbeI16(p, D, p16.data() + h * de);
  }
  // One pass over the chunk groups for every head (one fork-join per layer, not per head).
  constexpr int B = kernels::kI8Block;
  const size_t groups = (n + B - 1) / B, block_bytes = kernels::I8BlockBytes(D);
  tbb::parallel_for(tbb::blocked_range<size_t>(0, groups, 64), [&](const tbb::blocked_range<size_t>& range) {
    const size_t g0 = range.begin(), g1 = range.end();
    std::vector<int32_t> dots((g1 - g0) * R * B);
    for (int h = 0; h < H; ++h) {
      kernels::DotI8Blocks(li.exact_q8[h].data() + g0 * R * block_bytes, (g1 - g0) * R, p16.data() + h * de, D,
                           dots.data());
      const float* scale = li.exact_q8_scale[h].data() + g0 * R * B;
      const float* cos_scale = li.exact_q8_cos_scale[h].data() + g0 * R * B;
      // The probe's scales are >= 0, so they commute with the max over a chunk's
      // representatives and are applied once per chunk.
      const float ps = p_scale[h], cs = p_scale[h] * inv_p[h];
      for (size_t g = g0; g < g1; ++g) {
        const size_t base = (g - g0) * R * B;
        float best[B], best_cos[B];
        for (int lane = 0; lane < B; ++lane) {
          best[lane] = static_cast<float>(dots[base + lane]) * scale[base + lane];
          best_cos[lane] = static_cast<float>(dots[base + lane]) * cos_scale[base + lane];
        }
        for (int r = 1; r < R; ++r)
          for (int lane = 0; lane < B; ++lane) {
            const size_t j = base + static_cast<size_t>(r) * B + lane;
            best[lane] = std::max(best[lane], static_cast<float>(dots[j]) * scale[j]);
            best_cos[lane] = std::max(best_cos[lane], static_cast<float>(dots[j]) * cos_scale[j]);
          }
        const size_t c_end = std::min(n, (g + 1) * B);
        for (size_t c = g * B; c < c_end; ++c)
          fold.Add(best[c - g * B] * ps, std::max(-1.0f, best_cos[c - g * B] * cs), &(*raw)[c], &(*cos)[c]);
      }
    }
  });
}

void Retriever::ExactScoresOf(const LayerIndex& li, const float* probe, const std::vector<int64_t>& rows,
                              std::vector<float>* raw, std::vector<float>* cos) const {
  const StoreOptions& so = store_->options();
  const int H = so.geometry.kv_heads, D = so.geometry.head_dim, R = so.repr_topk;
  const DType dt = so.geometry.dtype;
  const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(dt);
  const HeadFold fold(options_.head_merge, H);
  raw->assign(rows.size(), fold.Start());
  cos->assign(rows.size(), fold.Start());
  std::vector<float> inv_p(H);
  for (int h = 0; h < H; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    const float pn2 = kernels::Dot(p, p, D);
    inv_p[h] = pn2 > 0.0f ? 1.0f / std::sqrt(pn2) : 0.0f;
  }
  // The candidates sit at scattered rows, which no hardware prefetcher predicts: ask for the
  // representatives of the candidate a few places ahead while this one is scored.
  constexpr size_t kAhead = 4;
  const size_t chunk_repr_bytes = static_cast<size_t>(R) * key_bytes;
  tbb::parallel_for(tbb::blocked_range<size_t>(0, rows.size(), 64), [&](const tbb::blocked_range<size_t>& range) {
    for (size_t i = range.begin(); i < range.end(); ++i) {
      if (i + kAhead < range.end()) {
        const size_t ahead = static_cast<size_t>(rows[i + kAhead]);
        for (int h = 0; h < H; ++h) {
          const char* a = reinterpret_cast<const char*>(li.exact_repr[h].data() + ahead * chunk_repr_bytes);
          for (size_t off = 0; off < chunk_repr_bytes; off += 64) __builtin_prefetch(a + off);
        }
      }
      const size_t c = static_cast<size_t>(rows[i]);
      for (int h = 0; h < H; ++h) {
        const float* p = probe + static_cast<size_t>(h) * D;
        const uint8_t* keys = li.exact_repr[h].data();
        const float* inv = li.exact_inv_norm[h].data();
        float best = -std::numeric_limits<float>::infinity(), best_cos = -1.0f;
        for (int r = 0; r < R; ++r) {
          const float dot = kernels::DotKey(dt, keys + (c * R + r) * key_bytes, p, D);
          best = std::max(best, dot);
          best_cos = std::max(best_cos, dot * inv[c * R + r] * inv_p[h]);
        }
        fold.Add(best, best_cos, &(*raw)[i], &(*cos)[i]);
      }
    }
  });
}

uint64_t Retriever::memory_bytes() const {
  uint64_t b = 0;
  for (const auto& [key, li] : indexes_) {
    if (li.index) b += li.index->memory_bytes();
    for (const auto& v : li.exact_repr) b += v.capacity();
    for (const auto& v : li.exact_inv_norm) b += v.capacity() * sizeof(float);
    for (const auto& v : li.exact_q8) b += v.capacity();
    for (const auto& v : li.exact_q8_scale) b += v.capacity() * sizeof(float);
    for (const auto& v : li.exact_q8_cos_scale) b += v.capacity() * sizeof(float);
    b += li.norm.capacity() * sizeof(float) + li.exact_ids.capacity() * sizeof(uint64_t);
  }
  return b;
}

std::string Retriever::Describe() const {
  return "probe=" + probe_->ToString() + " alloc=" + alloc_->ToString() + " index=" + options_.index.factory +
         (exact() ? " heads=" + options_.head_merge : std::string()) +
         (NeedsAllScores(options_.alloc) ? " rank=" + options_.rank_by : std::string()) + " k=" + std::to_string(k_);
}

}  // namespace kvtier
