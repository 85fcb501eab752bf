#include "retrieval/exact_index.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <iterator>
#include <limits>
#include <utility>

#include "kernels/cpu/chunk_score.h"
#include "kernels/cpu/dot.h"
#include "kernels/tbb_tsan.h"
#include "store/factory_spec.h"

namespace kvtier {
namespace {

// HeadFold, InverseNorm and the fp32 scoring pass are kernels/cpu/chunk_score, the twin of
// the CUDA scoring kernel.
using kernels::InverseNorm;

kernels::HeadFold::Kind FoldKind(HeadMerge heads) {
  return heads == HeadMerge::kMax ? kernels::HeadFold::Kind::kMax : kernels::HeadFold::Kind::kSum;
}

// out[h, d] = (1/R) sum_r repr[r, h, d]: a query's mean logit over the representatives is its
// logit with this key (InfLLM's block score, exact_index.h).
void MeanOfRepresentatives(const float* repr, int R, int H, int D, float* out) {
  const size_t n = static_cast<size_t>(H) * D;
  std::fill_n(out, n, 0.0f);
  for (int r = 0; r < R; ++r)
    for (size_t i = 0; i < n; ++i) out[i] += repr[static_cast<size_t>(r) * n + i];
  const float inv = 1.0f / static_cast<float>(R);
  for (size_t i = 0; i < n; ++i) out[i] *= inv;
}

// The rows' layout: the index's shape, or under repr=mean one fp32 key per chunk and head.
ChunkShape StoredShape(const ChunkShape& shape, const ExactIndexOptions& options) {
  if (options.repr != ExactIndexOptions::ReprFold::kMean) return shape;
  return ChunkShape{shape.kv_heads, shape.head_dim, 1, DType::kF32};
}

kernels::HeadFold FoldOf(HeadMerge heads, int n_heads) { return kernels::HeadFold(FoldKind(heads), n_heads); }

}  // namespace

// ---- spec ---------------------------------------------------------------------------

Result<ExactIndexOptions> ExactIndexOptions::Parse(const std::string& spec) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "index"));
  if (fs.name != "Exact") return InvalidArgument("index spec '" + spec + "' does not name the Exact index");
  ExactIndexOptions o;
  for (const auto& [key, value] : fs.params) {
    if (key == "heads") {
      KVTIER_ASSIGN_OR_RETURN(o.heads, ParseHeadMerge(value, spec));
    } else if (key == "repr") {
      if (value == "max") {
        o.repr = ReprFold::kMax;
      } else if (value == "mean") {
        o.repr = ReprFold::kMean;
      } else {
        return InvalidArgument("bad value '" + value + "' for key 'repr' in index spec '" + spec +
                               "' (expected max or mean)");
      }
    } else if (key == "rerank" || key == "rerank_min") {
      KVTIER_ASSIGN_OR_RETURN(int v, ParseSpecInt(spec, key, value));
      if (v < 0)
        return InvalidArgument("bad value '" + value + "' for key '" + key + "' in index spec '" + spec +
                               "' (expected an integer >= 0)");
      (key == "rerank" ? o.rerank_factor : o.rerank_min) = v;
    } else if (key == "theta") {
      KVTIER_ASSIGN_OR_RETURN(const double v, ParseSpecDouble(spec, key, value));
      if (!(v >= 0.0 && v <= 1.0))
        return InvalidArgument("bad value '" + value + "' for key 'theta' in index spec '" + spec +
                               "' (expected nats in [0, 1]; 0 = no certificate)");
      o.theta_error = v;
    } else if (key == "screen") {
      if (value == "int8") {
        o.screen = ScreenCodes::kInt8;
      } else if (value == "int4") {
        o.screen = ScreenCodes::kInt4;
      } else {
        return InvalidArgument("bad value '" + value + "' for key 'screen' in index spec '" + spec +
                               "' (expected int8 or int4)");
      }
    } else {
      return InvalidArgument("unknown key '" + key + "' for index 'Exact' in spec '" + spec +
                             "' (known: heads, repr, rerank, rerank_min, theta, screen)");
    }
  }
  return o;
}

std::string ExactIndexOptions::ToString() const {
  return std::string("Exact:heads=") + HeadMergeName(heads) + (repr == ReprFold::kMean ? ",repr=mean" : "") +
         ",rerank=" + std::to_string(rerank_factor) + ",rerank_min=" + std::to_string(rerank_min) +
         (theta_error > 0.0 ? ",theta=" + FormatSpecDouble(theta_error) : "") +
         (screen == ScreenCodes::kInt4 ? ",screen=int4" : "");
}

// ---- lifetime and writes ------------------------------------------------------------

ExactChunkIndex::ExactChunkIndex(const ChunkShape& shape, const ExactIndexOptions& options)
    : ChunkIndex(shape),
      options_(options),
      stored_(StoredShape(shape, options)),
      int4_(options.screen == ExactIndexOptions::ScreenCodes::kInt4 && options.rerank_factor > 0) {
  const size_t H = static_cast<size_t>(shape.kv_heads);
  repr_.resize(H);
  inv_norm_.resize(H);
  q8_.resize(H);
  q8_scale_.resize(H);
  q8_cos_scale_.resize(H);
  q4_.resize(H);
  q4_scale_.resize(H);
  q4_cos_scale_.resize(H);
}

Result<std::unique_ptr<ExactChunkIndex>> ExactChunkIndex::Create(const ChunkShape& shape,
                                                                 const ExactIndexOptions& options) {
  KVTIER_RETURN_IF_ERROR(shape.Validate());
  if (options.rerank_factor < 0 || options.rerank_min < 0)
    return InvalidArgument("ExactIndexOptions rerank_factor and rerank_min must be >= 0 (got " +
                           std::to_string(options.rerank_factor) + ", " + std::to_string(options.rerank_min) +
                           ")");
  return std::unique_ptr<ExactChunkIndex>(new ExactChunkIndex(shape, options));
}

Status ExactChunkIndex::Add(const std::vector<uint64_t>& chunks, const ReprReader& read) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    const bool above = i > 0 ? chunks[i] > chunks[i - 1] : ids_.empty() || chunks[i] > ids_.back();
    if (!above)
      return InvalidArgument(
          "ExactChunkIndex::Add: chunk " + std::to_string(chunks[i]) +
          " is not above every chunk indexed before it (chunks are added in ascending order)");
  }
  const int H = stored_.kv_heads, D = stored_.head_dim, R = stored_.repr;
  const DType dt = stored_.dtype;
  const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(dt);
  std::vector<float> repr(shape_.repr_floats());
  // repr=mean: the one stored key per head is the mean of the chunk's representatives (fp32).
  const bool mean = options_.repr == ExactIndexOptions::ReprFold::kMean;
  std::vector<float> mean_key(mean ? stored_.repr_floats() : 0);
  std::vector<uint8_t> stored(key_bytes);
  size_t first_new = ids_.size();  // the batch's first row (the cap may move it down)
  // Room for the whole batch at once: a first sync over a long sequence adds every chunk, and
  // growing row by row would reallocate each array dozens of times on the way. (Under a cap
  // the rows may be compressed on the way: growing as they come counts no unused room.)
  if (cap_ == 0) GrowForRows(chunks.size());
  for (uint64_t i : chunks) {
    Status st = read(i, repr.data());
    if (st.code() == StatusCode::kNotFound) continue;  // a hole left by a crash: nothing to index
    if (!st.ok()) {  // all or nothing for the batch (what the cap did to older rows stands)
      std::vector<size_t> kept;
      for (size_t row = 0; row < ids_.size() && ids_[row] < chunks.front(); ++row) kept.push_back(row);
      KeepRows(kept);
      MarkMirrorStale(std::min(first_new, ids_.size()));
      Changed();
      return st;
    }
    GrowForRows(1);
    ids_.push_back(i);
    const size_t row = ids_.size() - 1;
    if (mean) MeanOfRepresentatives(repr.data(), shape_.repr, H, D, mean_key.data());
    const float* keys = mean ? mean_key.data() : repr.data();
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) {
        const float* key = keys + (static_cast<size_t>(r) * H + h) * D;
        FromFloat(dt, key, stored.data(), D);  // exact: the key came from this dtype
        repr_[h].insert(repr_[h].end(), stored.begin(), stored.end());
        const float inv_norm = InverseNorm(key, D);
        inv_norm_[h].push_back(inv_norm);
        PutQuantizedRow(h, row, r, key, inv_norm);
      }
    const size_t before = ids_.size();
    const Status cap = EnforceCap();
    if (ids_.size() < before) first_new = 0;  // rows moved: the mirror takes them all again
    if (!cap.ok()) {
      MarkMirrorStale(std::min(first_new, ids_.size()));
      Changed();
      return cap;
    }
  }
  MarkMirrorStale(std::min(first_new, ids_.size()));
  Changed();
  return Status::Ok();
}

Status ExactChunkIndex::Remove(const std::vector<uint64_t>& chunks) {
  std::vector<uint64_t> gone = chunks;
  std::sort(gone.begin(), gone.end());
  std::vector<size_t> kept;
  kept.reserve(ids_.size());
  for (size_t row = 0; row < ids_.size(); ++row)
    if (!std::binary_search(gone.begin(), gone.end(), ids_[row])) kept.push_back(row);
  if (kept.size() == ids_.size()) return Status::Ok();  // nothing of ours: the rows stand
  size_t first_moved = kept.size();
  for (size_t i = 0; i < kept.size(); ++i)
    if (kept[i] != i) {
      first_moved = i;
      break;
    }
  KeepRows(kept);
  MarkMirrorStale(first_moved);
  Changed();
  return Status::Ok();
}

namespace {

// Reserves room for `need` elements, `slack` of that more when it must grow.
template <typename T>
void GrowTo(std::vector<T>* v, size_t need, double slack) {
  if (v->capacity() < need) v->reserve(need + static_cast<size_t>(static_cast<double>(need) * slack));
}

template <typename T>
uint64_t CapacityBytes(const std::vector<T>& v) {
  return v.capacity() * sizeof(T);
}

}  // namespace

void ExactChunkIndex::Reserve(size_t chunks) {
  if (cap_ == 0) GrowForRows(chunks, 0.0);  // a capped index keeps to its cap instead
}

void ExactChunkIndex::GrowForRows(size_t more, double slack) {
  constexpr size_t B = kernels::kI8Block;
  const size_t H = static_cast<size_t>(stored_.kv_heads), D = stored_.head_dim, R = stored_.repr;
  const size_t es = DTypeSize(stored_.dtype), n = ids_.size() + more, full = n - full_from_;
  const size_t groups = (n + B - 1) / B, block_bytes = kernels::I8BlockBytes(static_cast<int>(D));
  GrowTo(&ids_, n, slack);
  for (size_t h = 0; h < H; ++h) {
    GrowTo(&repr_[h], full * R * D * es, slack);
    GrowTo(&inv_norm_[h], full * R, slack);
    GrowTo(&q8_[h], groups * R * block_bytes, slack);
    GrowTo(&q8_scale_[h], groups * R * B, slack);
    GrowTo(&q8_cos_scale_[h], groups * R * B, slack);
    if (int4_) {
      GrowTo(&q4_[h], groups * R * kernels::I4BlockBytes(static_cast<int>(D)), slack);
      GrowTo(&q4_scale_[h], groups * R * B, slack);
      GrowTo(&q4_cos_scale_[h], groups * R * B, slack);
    }
  }
}

void ExactChunkIndex::KeepRows(const std::vector<size_t>& kept) {
  constexpr size_t B = kernels::kI8Block;
  const size_t H = static_cast<size_t>(stored_.kv_heads), D = stored_.head_dim, R = stored_.repr;
  const size_t es = DTypeSize(stored_.dtype), key_row = R * D * es;
  const size_t block_bytes = kernels::I8BlockBytes(static_cast<int>(D));
  const size_t n = kept.size(), groups = (n + B - 1) / B;
  size_t new_full_from = 0;
  while (new_full_from < n && kept[new_full_from] < full_from_) ++new_full_from;
  std::vector<uint64_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = ids_[kept[i]];
  for (size_t h = 0; h < H; ++h) {
    // The stored keys and norms of the kept full rows (each kept full row was full before).
    std::vector<uint8_t> keys((n - new_full_from) * key_row);
    std::vector<float> inv((n - new_full_from) * R);
    for (size_t i = new_full_from; i < n; ++i) {
      const size_t old = kept[i] - full_from_;
      std::copy_n(repr_[h].begin() + old * key_row, key_row, keys.begin() + (i - new_full_from) * key_row);
      std::copy_n(inv_norm_[h].begin() + old * R, R, inv.begin() + (i - new_full_from) * R);
    }
    // The codes, lane by lane (no requantisation: compressed rows have nothing else).
    std::vector<int8_t> codes(groups * R * block_bytes, 0);
    std::vector<float> scale(groups * R * B, 0.0f), cos_scale(groups * R * B, 0.0f);
    const size_t block4 = kernels::I4BlockBytes(static_cast<int>(D));
    std::vector<uint8_t> codes4(int4_ ? groups * R * block4 : 0, 0);
    std::vector<float> scale4(int4_ ? groups * R * B : 0, 0.0f), cos_scale4(scale4.size(), 0.0f);
    for (size_t i = 0; i < n; ++i) {
      const size_t o = kept[i], og = o / B, ol = o % B, ng = i / B, nl = i % B;
      for (size_t r = 0; r < R; ++r) {
        const int8_t* src = q8_[h].data() + (og * R + r) * block_bytes;
        int8_t* dst = codes.data() + (ng * R + r) * block_bytes;
        for (size_t d = 0; d < D; ++d)
          dst[kernels::I8Offset(static_cast<int>(d), static_cast<int>(nl))] =
              src[kernels::I8Offset(static_cast<int>(d), static_cast<int>(ol))];
        scale[(ng * R + r) * B + nl] = q8_scale_[h][(og * R + r) * B + ol];
        cos_scale[(ng * R + r) * B + nl] = q8_cos_scale_[h][(og * R + r) * B + ol];
        if (!int4_) continue;
        const uint8_t* src4 = q4_[h].data() + (og * R + r) * block4;
        uint8_t* dst4 = codes4.data() + (ng * R + r) * block4;
        for (size_t d = 0; d < D; ++d)
          kernels::PutI4(dst4, static_cast<int>(d), static_cast<int>(nl),
                         kernels::GetI4(src4, static_cast<int>(d), static_cast<int>(ol)));
        scale4[(ng * R + r) * B + nl] = q4_scale_[h][(og * R + r) * B + ol];
        cos_scale4[(ng * R + r) * B + nl] = q4_cos_scale_[h][(og * R + r) * B + ol];
      }
    }
    q4_[h].swap(codes4);
    q4_scale_[h].swap(scale4);
    q4_cos_scale_[h].swap(cos_scale4);
    repr_[h].swap(keys);
    inv_norm_[h].swap(inv);
    q8_[h].swap(codes);
    q8_scale_[h].swap(scale);
    q8_cos_scale_[h].swap(cos_scale);
  }
  ids_.swap(ids);
  full_from_ = new_full_from;
}

Status ExactChunkIndex::SetMemoryCap(uint64_t bytes) {
  cap_ = bytes;
  const size_t before = ids_.size(), full_before = full_from_;
  KVTIER_RETURN_IF_ERROR(EnforceCap());
  if (ids_.size() != before || full_from_ != full_before) {
    MarkMirrorStale(0);
    Changed();
  }
  return SyncMirror();
}

Status ExactChunkIndex::EnforceCap() {
  if (cap_ == 0) return Status::Ok();
  const size_t H = static_cast<size_t>(stored_.kv_heads), D = stored_.head_dim, R = stored_.repr;
  const size_t es = DTypeSize(stored_.dtype);
  const uint64_t target = cap_ - cap_ / 8;
  const uint64_t full_row = H * (R * D * es + R * sizeof(float));
  const uint64_t code_row = H * (R * D + 2 * R * sizeof(float)) + sizeof(uint64_t) +
                            (int4_ ? Int4RowBytes() : 0);  // compression keeps both codes
  // With a mirror, its rows for chunks it has not taken yet count too (SyncMirror adds them).
  auto projected = [&] {
    uint64_t b = memory_bytes();
    if (mirror_ != nullptr && ids_.size() > mirror_->capacity())
      b += (ids_.size() - mirror_->capacity()) * mirror_->row_bytes();
    return b;
  };
  while (projected() > cap_ && !ids_.empty()) {
    const uint64_t over = projected() - target;
    if (mirror_ == nullptr && full_from_ < ids_.size()) {
      // Compress the oldest full rows: their keys and norms go, their codes stay.
      uint64_t slack = 0;
      for (size_t h = 0; h < H; ++h)
        slack +=
            (repr_[h].capacity() - repr_[h].size()) + (inv_norm_[h].capacity() - inv_norm_[h].size()) * 4;
      size_t k = over > slack ? static_cast<size_t>((over - slack + full_row - 1) / full_row) : 0;
      k = std::min(k, ids_.size() - full_from_);
      for (size_t h = 0; h < H; ++h) {
        repr_[h].erase(repr_[h].begin(), repr_[h].begin() + k * R * D * es);
        inv_norm_[h].erase(inv_norm_[h].begin(), inv_norm_[h].begin() + k * R);
        repr_[h].shrink_to_fit();
        inv_norm_[h].shrink_to_fit();
      }
      full_from_ += k;
      continue;
    }
    // Every row is compressed (or a mirror needs the keys): evict the oldest rows, whole groups.
    uint64_t row = code_row;
    if (mirror_ != nullptr) row += 2 * full_row;  // the host's keys and the mirror's
    constexpr size_t B = kernels::kI8Block;
    size_t k = static_cast<size_t>((over + row - 1) / row);
    k = std::min(ids_.size(), (k + B - 1) / B * B);
    std::vector<size_t> kept(ids_.size() - k);
    for (size_t i = 0; i < kept.size(); ++i) kept[i] = k + i;
    KeepRows(kept);
    evicted_ += k;
    if (mirror_ != nullptr) {
      MarkMirrorStale(0);
      KVTIER_RETURN_IF_ERROR(SyncMirror());  // the mirror shrinks with the rows
    }
  }
  return Status::Ok();
}

void ExactChunkIndex::PutQuantizedRow(int h, size_t row, int r, const float* key, float inv_norm) {
  constexpr size_t B = kernels::kI8Block;
  const int D = stored_.head_dim, R = stored_.repr;
  std::vector<int8_t>& codes = q8_[h];
  std::vector<float>& scale = q8_scale_[h];
  std::vector<float>& cos_scale = q8_cos_scale_[h];
  const size_t group = row / B, lane = row % B, block = group * R + r, block_bytes = kernels::I8BlockBytes(D);
  const size_t group_end = (group + 1) * R;  // blocks of the whole group exist (zero padding lanes)
  if (codes.size() < group_end * block_bytes) codes.resize(group_end * block_bytes, 0);
  if (scale.size() < group_end * B) {
    scale.resize(group_end * B, 0.0f);
    cos_scale.resize(group_end * B, 0.0f);
  }
  int8_t tmp[4096];  // head_dim <= 4096 (ChunkShape::Validate)
  const size_t slot = block * B + lane;
  scale[slot] = kernels::QuantizeI8(key, D, tmp);
  cos_scale[slot] = scale[slot] * inv_norm;
  int8_t* dst = codes.data() + block * block_bytes;
  for (int d = 0; d < D; ++d) dst[kernels::I8Offset(d, static_cast<int>(lane))] = tmp[d];
  if (!int4_) return;
  const size_t block4 = kernels::I4BlockBytes(D);
  if (q4_[h].size() < group_end * block4) q4_[h].resize(group_end * block4, 0);
  if (q4_scale_[h].size() < group_end * B) {
    q4_scale_[h].resize(group_end * B, 0.0f);
    q4_cos_scale_[h].resize(group_end * B, 0.0f);
  }
  q4_scale_[h][slot] = kernels::QuantizeI4(key, D, tmp);
  q4_cos_scale_[h][slot] = q4_scale_[h][slot] * inv_norm;
  uint8_t* dst4 = q4_[h].data() + block * block4;
  for (int d = 0; d < D; ++d) kernels::PutI4(dst4, d, static_cast<int>(lane), tmp[d]);
}

// ---- reads --------------------------------------------------------------------------

Status ExactChunkIndex::Score(const float* probe, ChunkScores* out) const {
  if (probe == nullptr || out == nullptr)
    return InvalidArgument("ExactChunkIndex::Score: probe and out must not be null");
  FullScores(probe, &out->logit, &out->cosine);
  first_stage_bytes_.fetch_add(full_from_ * CodeRowBytes() + (ids_.size() - full_from_) * FullRowBytes(),
                               std::memory_order_relaxed);
  out->logit_error.clear();  // exact
  out->cosine_error.clear();
  out->exact_rows.clear();
  if (!Current(*out)) out->ids = ids_;  // the same index unchanged: its ids are there already
  Stamp(out);
  return Status::Ok();
}

Status ExactChunkIndex::Screen(const float* probe, ChunkScores* out) const {
  if (options_.rerank_factor == 0) return Score(probe, out);
  if (probe == nullptr || out == nullptr)
    return InvalidArgument("ExactChunkIndex::Screen: probe and out must not be null");
  // The first stage: int8 codes, a quarter of the bytes of an fp32 pass, which is memory-bound
  // (int4 codes: an eighth).
  QuantizedScores(probe, 0, ids_.size(), out);
  first_stage_bytes_.fetch_add(ids_.size() * (int4_ ? Int4RowBytes() : CodeRowBytes()),
                               std::memory_order_relaxed);
  out->exact_rows.clear();
  if (!Current(*out)) out->ids = ids_;
  Stamp(out);
  return Status::Ok();
}

Status ExactChunkIndex::Best(const float* probe, const ChunkScores& screened, ChunkRank rank, size_t take,
                             std::vector<uint64_t>* out) const {
  if (probe == nullptr || out == nullptr)
    return InvalidArgument("ExactChunkIndex::Best: probe and out must not be null");
  KVTIER_RETURN_IF_ERROR(CheckCurrent(screened, "ExactChunkIndex::Best"));
  const size_t n = ids_.size();
  const std::vector<float>& by = screened.by(rank);
  if (screened.ids.size() != n || by.size() != n)
    return InvalidArgument("ExactChunkIndex::Best: " + std::to_string(screened.ids.size()) + " ids and " +
                           std::to_string(by.size()) + " scores for " + std::to_string(n) + " chunks");
  if (options_.rerank_factor == 0) {
    *out = TakeBest(by, screened.ids, take);
    return Status::Ok();
  }
  // The second stage: rescore, in fp32 from the stored keys, every chunk the screen's error
  // bound cannot rule out of the take best, and the best max(F x take, N) screened.
  take = std::min(take, n);
  const std::vector<int64_t>& exact = screened.exact_rows;
  if (!exact.empty() && (exact.back() < 0 || static_cast<size_t>(exact.back()) >= n))
    return InvalidArgument("ExactChunkIndex::Best: exact row " + std::to_string(exact.back()) + " of " +
                           std::to_string(n) + " rows");
  const int64_t at_least = std::max<int64_t>(
      static_cast<int64_t>(options_.rerank_factor) * static_cast<int64_t>(take), options_.rerank_min);
  std::vector<int64_t> rows;
  if (int4_ && screened.error_by(rank).size() == n) {
    // screen=int4 (the header's proof): C1 by the int4 bounds; C1's take best int4 scores (and
    // C1's other rows in their groups) rescored from the int8 codes first, whose take-th
    // largest int8 lower bound cuts C1 to
    // the rows whose int4 upper bound reaches it; those rescored from the int8 codes too; then
    // C2 by the int8 bounds among them, plus their best at_least by int8 score.
    const std::vector<float>& err4 = screened.error_by(rank);
    std::vector<int64_t> c1, top, picked;
    CandidateRows(by, err4, take, 0, &c1);
    const size_t m = c1.size();
    std::vector<float> s8(m), e8(m, 0.0f);
    std::vector<uint8_t> done(m, 0);
    std::vector<int64_t> coded;
    std::vector<size_t> where;
    std::vector<float> coded_score, coded_error;
    // Scores c1[i] for the indexes i in `idx` (ascending): exact rows keep their scores (error
    // 0), the others from their int8 codes.
    auto rescore = [&](const std::vector<size_t>& idx) {
      coded.clear();
      where.clear();
      for (size_t i : idx) {
        done[i] = 1;
        if (std::binary_search(exact.begin(), exact.end(), c1[i])) {
          s8[i] = by[static_cast<size_t>(c1[i])];
        } else {
          coded.push_back(c1[i]);
          where.push_back(i);
        }
      }
      const size_t groups = Int8ScoresOf(probe, coded, rank, &coded_score, &coded_error);
      code_rescored_.fetch_add(coded.size(), std::memory_order_relaxed);
      rescoring_bytes_.fetch_add(groups * kernels::kI8Block * CodeRowBytes(), std::memory_order_relaxed);
      for (size_t k = 0; k < coded.size(); ++k) {
        s8[where[k]] = coded_score[k];
        e8[where[k]] = coded_error[k];
      }
    };
    std::vector<float> c1_score(m);
    for (size_t i = 0; i < m; ++i) c1_score[i] = by[static_cast<size_t>(c1[i])];
    TopRowsAscending(c1_score.data(), static_cast<int64_t>(m), static_cast<int64_t>(take), &top);
    // With them every row of C1 in their groups (read anyway), so no group is read twice.
    std::vector<size_t> idx;
    constexpr size_t B = kernels::kI8Block;
    for (size_t i = 0, t = 0; i < m; ++i) {
      const size_t g = static_cast<size_t>(c1[i]) / B;
      while (t < top.size() && static_cast<size_t>(c1[static_cast<size_t>(top[t])]) / B < g) ++t;
      if (t < top.size() && static_cast<size_t>(c1[static_cast<size_t>(top[t])]) / B == g) idx.push_back(i);
    }
    rescore(idx);
    std::vector<float> lower(idx.size());
    for (size_t k = 0; k < idx.size(); ++k) lower[k] = s8[idx[k]] - e8[idx[k]];
    const float cut =
        KthLargest(lower.data(), static_cast<int64_t>(lower.size()), static_cast<int64_t>(take));
    idx.clear();
    for (size_t i = 0; i < m; ++i) {
      const size_t r = static_cast<size_t>(c1[i]);
      if (!done[i] && !(by[r] + err4[r] < cut)) idx.push_back(i);  // NaN bounds stay
    }
    rescore(idx);
    std::vector<int64_t> kept;
    std::vector<float> ks, ke;
    for (size_t i = 0; i < m; ++i)
      if (done[i]) {
        kept.push_back(c1[i]);
        ks.push_back(s8[i]);
        ke.push_back(e8[i]);
      }
    CandidateRows(ks, ke, take, at_least, &picked);
    rows.resize(picked.size());
    for (size_t i = 0; i < picked.size(); ++i) rows[i] = kept[static_cast<size_t>(picked[i])];
  } else {
    CandidateRows(by, screened.error_by(rank), take, at_least, &rows);
  }
  // Candidates RefineForEntropy scored exactly keep those scores (bit for bit what ScoresOf
  // gives); the others are scored now.
  std::vector<int64_t> fresh;
  std::vector<uint8_t> known(rows.size(), 0);
  fresh.reserve(rows.size());
  for (size_t i = 0, j = 0; i < rows.size(); ++i) {
    while (j < exact.size() && exact[j] < rows[i]) ++j;
    known[i] = j < exact.size() && exact[j] == rows[i];
    if (!known[i]) fresh.push_back(rows[i]);
  }
  rescored_.fetch_add(fresh.size(), std::memory_order_relaxed);
  rescoring_bytes_.fetch_add(ExactPassBytes(fresh), std::memory_order_relaxed);
  std::vector<float> fresh_logit, fresh_cos;
  // Only the rank's scores: the logit needs neither the inverse norms nor the cosines.
  ScoresOf(probe, fresh, &fresh_logit, rank == ChunkRank::kLogit ? nullptr : &fresh_cos);
  const std::vector<float>& fresh_by = rank == ChunkRank::kLogit ? fresh_logit : fresh_cos;
  std::vector<float> score(rows.size());
  std::vector<uint64_t> cand_ids(rows.size());
  for (size_t i = 0, f = 0; i < rows.size(); ++i) {
    cand_ids[i] = ids_[rows[i]];
    score[i] = known[i] ? by[static_cast<size_t>(rows[i])] : fresh_by[f++];
  }
  *out = TakeBest(score, cand_ids, take);
  return Status::Ok();
}

Status ExactChunkIndex::RefineForEntropy(const float* probe, double max_error, ChunkScores* screened,
                                         double* bound) const {
  if (probe == nullptr || screened == nullptr || bound == nullptr)
    return InvalidArgument("ExactChunkIndex::RefineForEntropy: probe, screened and bound must not be null");
  KVTIER_RETURN_IF_ERROR(CheckCurrent(*screened, "ExactChunkIndex::RefineForEntropy"));
  const size_t n = ids_.size();
  if (screened->cosine_error.size() != n)  // exact scores (rerank=0): nothing to refine
    return ChunkIndex::RefineForEntropy(probe, max_error, screened, bound);
  if (screened->cosine.size() != n || screened->logit.size() != n || screened->logit_error.size() != n)
    return InvalidArgument("ExactChunkIndex::RefineForEntropy: " + std::to_string(screened->cosine.size()) +
                           " cosines for " + std::to_string(n) + " chunks");
  std::vector<double> contribution;
  std::vector<std::pair<double, int64_t>> order;  // (contribution, row) of the rows still screened
  std::vector<int64_t> rows, merged;
  std::vector<float> logit, cos;
  // Contributions fall into buckets a quarter octave wide, largest first: a positive double's
  // bits order as its value, and its exponent with two mantissa bits name its bucket.
  constexpr int kBuckets = 256;
  const auto key = [](double c) { return std::bit_cast<uint64_t>(c) >> 50; };
  std::vector<double> bucket_sum(kBuckets);
  std::vector<uint8_t> bucket_of;
  std::vector<std::pair<double, int64_t>> in_last;
  for (;;) {
    *bound = SoftmaxEntropyErrorBound(screened->cosine.data(), screened->cosine_error.data(),
                                      static_cast<int>(n), &contribution);
    if (*bound <= max_error) return Status::Ok();
    order.clear();
    for (size_t i = 0; i < n; ++i)
      if (screened->cosine_error[i] != 0.0f) order.emplace_back(contribution[i], static_cast<int64_t>(i));
    if (order.empty()) return Status::Ok();  // every chunk exact: the bound is rounding alone
    size_t take = order.size();  // a bound that is not finite (a NaN error): every row still screened
    if (std::isfinite(*bound)) {
      // The largest contributions (ties to the smaller row) until those left sum to at most 0.9
      // of the target: the last tenth leaves room for the terms every contribution shares (the
      // softmax, its mean, m), which move as exact cosines replace screened ones; the loop
      // rescores more if needed. The buckets before the one where the sum is reached are taken
      // whole, that one's rows in order: the same rows as a full sort, in linear time.
      double need = -0.9 * max_error;
      uint64_t top = 0;
      for (const auto& o : order) {
        need += o.first;
        top = std::max(top, key(o.first));
      }
      std::fill(bucket_sum.begin(), bucket_sum.end(), 0.0);
      bucket_of.resize(order.size());
      for (size_t i = 0; i < order.size(); ++i) {
        bucket_of[i] = static_cast<uint8_t>(std::min<uint64_t>(top - key(order[i].first), kBuckets - 1));
        bucket_sum[bucket_of[i]] += order[i].first;
      }
      int last = 0;  // the bucket where the sum is reached
      while (last < kBuckets - 1 && need - bucket_sum[static_cast<size_t>(last)] > 0.0)
        need -= bucket_sum[static_cast<size_t>(last++)];
      // The taken buckets' rows move to the front (in place: a row moves only backwards), then
      // the last bucket's, largest first, while the sum is not reached (at least one row).
      take = 0;
      in_last.clear();
      for (size_t i = 0; i < order.size(); ++i) {
        const int b = static_cast<int>(bucket_of[i]);
        if (b < last)
          order[take++] = order[i];
        else if (b == last)
          in_last.push_back(order[i]);
      }
      std::sort(in_last.begin(), in_last.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      for (size_t i = 0; i < in_last.size() && (need > 0.0 || take == 0); ++i) {
        need -= in_last[i].first;
        order[take++] = in_last[i];
      }
    }
    rows.resize(take);
    for (size_t i = 0; i < take; ++i) rows[i] = order[i].second;
    std::sort(rows.begin(), rows.end());
    rescored_.fetch_add(rows.size(), std::memory_order_relaxed);
    rescoring_bytes_.fetch_add(ExactPassBytes(rows), std::memory_order_relaxed);
    entropy_rescored_.fetch_add(rows.size(), std::memory_order_relaxed);
    ScoresOf(probe, rows, &logit, &cos);
    for (size_t i = 0; i < rows.size(); ++i) {
      const size_t r = static_cast<size_t>(rows[i]);
      screened->logit[r] = logit[i];
      screened->cosine[r] = cos[i];
      screened->logit_error[r] = 0.0f;
      screened->cosine_error[r] = 0.0f;
    }
    merged.clear();
    std::merge(screened->exact_rows.begin(), screened->exact_rows.end(), rows.begin(), rows.end(),
               std::back_inserter(merged));
    screened->exact_rows.swap(merged);
  }
}

Status ExactChunkIndex::BestOf(const float* probe, const std::vector<uint64_t>& chunks, ChunkRank rank,
                               size_t take, std::vector<uint64_t>* out) const {
  if (probe == nullptr || out == nullptr)
    return InvalidArgument("ExactChunkIndex::BestOf: probe and out must not be null");
  ChunkScores scored;
  KVTIER_RETURN_IF_ERROR(ScoreChunks(probe, chunks, &scored));
  *out = TakeBest(scored.by(rank), scored.ids, take);
  return Status::Ok();
}

std::vector<int64_t> ExactChunkIndex::RowsOf(const std::vector<uint64_t>& chunks) const {
  // The chunks in id order, found by one forward walk over the ascending ids_ (galloping from
  // the last find): the walk reads ids_ in order, where a binary search per chunk misses the
  // cache at each level of its descent.
  std::vector<uint64_t> wanted(chunks);
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  std::vector<int64_t> rows;
  rows.reserve(wanted.size());
  size_t lo = 0;  // ids_[lo - 1] < the chunk looked for
  for (uint64_t c : wanted) {
    size_t hi = lo, step = 1;
    while (hi < ids_.size() && ids_[hi] < c) {
      lo = hi + 1;
      hi += step;
      step *= 2;
    }
    const auto it = std::lower_bound(ids_.begin() + static_cast<ptrdiff_t>(lo),
                                     ids_.begin() + static_cast<ptrdiff_t>(std::min(hi, ids_.size())), c);
    lo = static_cast<size_t>(it - ids_.begin());
    if (it != ids_.end() && *it == c) rows.push_back(static_cast<int64_t>(lo));
  }
  return rows;
}

namespace {

// ExactChunkIndex::GatherSubset's copy: per kv head the chosen rows' keys [m, R, D] in the store's
// dtype and their inverse norms [m, R], scored as ScoresOf scores full rows (DotKeys, then
// MaxDotAndCosine per chunk and head, the heads folded in order), so the scores are equal bit
// for bit. Contiguous keys stream from memory (or stay in the caches from step to step) where
// the same rows of the index are a scattered read at every step.
class ExactChunkSubset final : public ChunkSubset {
 public:
  ExactChunkSubset(const ChunkShape& shape, kernels::HeadFold fold) : shape_(shape), fold_(fold) {}
  // Whether this subset's buffers can take another gather of an index of `shape` and `fold`.
  bool Fits(const ChunkShape& shape, kernels::HeadFold fold) const {
    return shape.kv_heads == shape_.kv_heads && shape.head_dim == shape_.head_dim &&
           shape.repr == shape_.repr && shape.dtype == shape_.dtype && fold.max == fold_.max &&
           fold.cos_share == fold_.cos_share;
  }

  Status Score(const float* probe, ChunkScores* out) const override {
    if (probe == nullptr || out == nullptr)
      return InvalidArgument("ChunkSubset::Score: probe and out must not be null");
    const int H = shape_.kv_heads, D = shape_.head_dim, R = shape_.repr;
    const size_t m = ids.size(), key_bytes = static_cast<size_t>(D) * DTypeSize(shape_.dtype);
    out->logit.assign(m, fold_.Start());
    out->cosine.assign(m, fold_.Start());
    std::vector<float> dots(m * static_cast<size_t>(R));
    for (int h = 0; h < H; ++h) {
      const float* p = probe + static_cast<size_t>(h) * D;
      const float inv_p = InverseNorm(p, D);
      kernels::DotKeys(shape_.dtype, keys[h].data(), key_bytes, p, D, m * static_cast<size_t>(R),
                       dots.data());
      for (size_t c = 0; c < m; ++c) {
        float best = -std::numeric_limits<float>::infinity(), best_cos = -1.0f;
        kernels::MaxDotAndCosine(dots.data() + c * R, inv_norm[h].data() + c * R, inv_p,
                                 static_cast<size_t>(R), &best, &best_cos);
        fold_.Add(best, best_cos, &out->logit[c], &out->cosine[c]);
      }
    }
    out->ids = ids;
    out->logit_error.clear();  // exact
    out->cosine_error.clear();
    out->index = nullptr;  // not a whole screen: Best refuses it
    read_bytes_.fetch_add(m * static_cast<size_t>(R) * H * (key_bytes + sizeof(float)),
                          std::memory_order_relaxed);
    return Status::Ok();
  }
  size_t size() const override { return ids.size(); }
  uint64_t read_bytes() const override { return read_bytes_.load(std::memory_order_relaxed); }
  uint64_t memory_bytes() const override {
    uint64_t b = ids.capacity() * sizeof(uint64_t);
    for (const auto& k : keys) b += k.capacity();
    for (const auto& v : inv_norm) b += v.capacity() * sizeof(float);
    return b;
  }

  std::vector<uint64_t> ids;                 // [m] ascending
  std::vector<std::vector<uint8_t>> keys;    // [H][m, R, D] in the store's dtype
  std::vector<std::vector<float>> inv_norm;  // [H][m, R]

 private:
  const ChunkShape shape_;
  const kernels::HeadFold fold_;
  mutable std::atomic<uint64_t> read_bytes_{0};  // read_bytes()
};

}  // namespace

Status ExactChunkIndex::GatherSubset(const std::vector<uint64_t>& chunks,
                                     std::unique_ptr<ChunkSubset>* subset) const {
  if (subset == nullptr) return InvalidArgument("ExactChunkIndex::GatherSubset: subset must not be null");
  const std::vector<int64_t> rows = RowsOf(chunks);
  const int H = stored_.kv_heads, R = stored_.repr;
  const size_t key_bytes = static_cast<size_t>(stored_.head_dim) * DTypeSize(stored_.dtype);
  const size_t row_bytes = static_cast<size_t>(R) * key_bytes;
  if (!rows.empty() && static_cast<size_t>(rows.front()) < full_from_)
    return FailedPrecondition("ExactChunkIndex::GatherSubset: chunk " + std::to_string(ids_[rows.front()]) +
                              " keeps only its int8 codes under the memory cap");
  const kernels::HeadFold fold = FoldOf(options_.heads, H);
  auto* mine = dynamic_cast<ExactChunkSubset*>(subset->get());
  if (mine == nullptr || !mine->Fits(stored_, fold)) {
    *subset = std::make_unique<ExactChunkSubset>(stored_, fold);
    mine = static_cast<ExactChunkSubset*>(subset->get());
  }
  rescoring_bytes_.fetch_add(rows.size() * FullRowBytes(), std::memory_order_relaxed);  // the copy's reads
  mine->ids.resize(rows.size());
  mine->keys.resize(H);
  mine->inv_norm.resize(H);
  for (int h = 0; h < H; ++h) {
    mine->keys[h].resize(rows.size() * row_bytes);
    mine->inv_norm[h].resize(rows.size() * R);
  }
  // The rows lie scattered: ask for the representatives of a row a few places ahead.
  constexpr size_t kAhead = 4;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (i + kAhead < rows.size()) {
      const size_t ahead = static_cast<size_t>(rows[i + kAhead]) - full_from_;
      for (int h = 0; h < H; ++h)
        for (size_t off = 0; off < row_bytes; off += 64)
          __builtin_prefetch(repr_[h].data() + ahead * row_bytes + off);
    }
    const size_t c = static_cast<size_t>(rows[i]) - full_from_;
    mine->ids[i] = ids_[static_cast<size_t>(rows[i])];
    for (int h = 0; h < H; ++h) {
      std::copy_n(repr_[h].data() + c * row_bytes, row_bytes, mine->keys[h].data() + i * row_bytes);
      std::copy_n(inv_norm_[h].data() + c * R, R, mine->inv_norm[h].data() + i * R);
    }
  }
  return Status::Ok();
}

Status ExactChunkIndex::ScoreChunks(const float* probe, const std::vector<uint64_t>& chunks,
                                    ChunkScores* out) const {
  if (probe == nullptr || out == nullptr)
    return InvalidArgument("ExactChunkIndex::ScoreChunks: probe and out must not be null");
  const std::vector<int64_t> rows = RowsOf(chunks);
  ScoresOf(probe, rows, &out->logit, &out->cosine);
  rescoring_bytes_.fetch_add(ExactPassBytes(rows), std::memory_order_relaxed);
  out->ids.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out->ids[i] = ids_[static_cast<size_t>(rows[i])];
  out->logit_error.clear();  // exact
  out->cosine_error.clear();
  out->index = nullptr;  // not a whole screen: Best refuses it
  return Status::Ok();
}

Status ExactChunkIndex::ScreenRows(const float* probe, size_t begin, size_t end, ChunkScores* out) const {
  if (probe == nullptr || out == nullptr)
    return InvalidArgument("ExactChunkIndex::ScreenRows: probe and out must not be null");
  if (begin > end || end > ids_.size())
    return InvalidArgument("ExactChunkIndex::ScreenRows: rows [" + std::to_string(begin) + ", " +
                           std::to_string(end) + ") of " + std::to_string(ids_.size()));
  if (options_.rerank_factor == 0) {  // the screen is the fp32 pass
    std::vector<int64_t> rows(end - begin);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int64_t>(begin + i);
    ScoresOf(probe, rows, &out->logit, &out->cosine);
    first_stage_bytes_.fetch_add(ExactPassBytes(rows), std::memory_order_relaxed);
    out->logit_error.clear();
    out->cosine_error.clear();
  } else {
    QuantizedScores(probe, begin, end, out);
    first_stage_bytes_.fetch_add((end - begin) * (int4_ ? Int4RowBytes() : CodeRowBytes()),
                                 std::memory_order_relaxed);
  }
  out->ids.assign(ids_.begin() + static_cast<ptrdiff_t>(begin), ids_.begin() + static_cast<ptrdiff_t>(end));
  out->exact_rows.clear();
  out->index = nullptr;  // not a whole screen: Best refuses it
  return Status::Ok();
}

void ExactChunkIndex::CandidateRows(const std::vector<float>& score, const std::vector<float>& error,
                                    size_t take, int64_t at_least, std::vector<int64_t>* rows) {
  const int64_t n = static_cast<int64_t>(score.size());
  if (error.size() != score.size()) {  // exact scores: their best max(take, at_least)
    TopRowsAscending(score.data(), n, std::max<int64_t>(static_cast<int64_t>(take), at_least), rows);
    return;
  }
  rows->clear();
  if (take == 0 || n == 0) return;
  // A chunk of the exact top take scores at least the take-th largest lower bound
  // (screened - error); a chunk whose upper bound (screened + error) is below it cannot be one.
  std::vector<float> lower(score.size());
  for (size_t i = 0; i < score.size(); ++i) lower[i] = score[i] - error[i];
  const float threshold = KthLargest(lower.data(), n, static_cast<int64_t>(take));
  std::vector<int64_t> extra;  // the best max(F x take, N) screened, beyond the bound's
  if (at_least > static_cast<int64_t>(take)) TopRowsAscending(score.data(), n, at_least, &extra);
  size_t e = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool in_extra = e < extra.size() && extra[e] == i;
    e += in_extra ? 1 : 0;
    // NaN bounds compare false: such a chunk is rescored (its exact score decides).
    if (in_extra || !(score[static_cast<size_t>(i)] + error[static_cast<size_t>(i)] < threshold))
      rows->push_back(i);
  }
}

void ExactChunkIndex::FullScores(const float* probe, std::vector<float>* raw, std::vector<float>* cos) const {
  const int H = stored_.kv_heads, D = stored_.head_dim, R = stored_.repr;
  const size_t n = ids_.size(), f0 = full_from_;
  const DType dt = stored_.dtype;
  const kernels::HeadFold fold = FoldOf(options_.heads, H);
  raw->assign(n, fold.Start());
  cos->assign(n, fold.Start());
  if (n == 0) return;
  std::vector<float> ip(n * R);
  for (int h = 0; h < H; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    const float inv_p = InverseNorm(p, D);
    // One pass over this head's rows, split over the cores: the compressed rows [0, f0) from
    // their codes, the full rows from their n - f0 contiguous keys (rows indexed from f0).
    // (Debian's FAISS is built without SIMD: its fvec kernels are the scalar
    // reference, so the vectorisable Dot is used instead.)
    const uint8_t* keys = repr_[h].data();
    TsanForkJoin fj;  // kernels/tbb_tsan.h
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, n, 1024), fj.Body([&](const tbb::blocked_range<size_t>& range) {
          const size_t c0 = range.begin(), c1 = range.end();
          for (size_t c = c0; c < std::min(c1, f0); ++c) {
            float best = -std::numeric_limits<float>::infinity(), best_cos = -1.0f;
            for (int r = 0; r < R; ++r) {
              float dot, cs;
              DequantisedDot(h, c, r, p, inv_p, &dot, &cs);
              best = std::max(best, dot);
              best_cos = std::max(best_cos, cs);
            }
            fold.Add(best, best_cos, &(*raw)[c], &(*cos)[c]);
          }
          const size_t a = std::max(c0, f0);
          if (a < c1)
            kernels::ScoreChunksOneHead(dt, keys, inv_norm_[h].data(), p, inv_p, D, R, a - f0, c1 - f0, fold,
                                        ip.data() + a * R, raw->data() + f0, cos->data() + f0);
        }));
    fj.Join();
  }
}

void ExactChunkIndex::DequantisedDot(int h, size_t row, int r, const float* p, float inv_p, float* dot,
                                     float* cos) const {
  constexpr size_t B = kernels::kI8Block;
  const int D = stored_.head_dim, R = stored_.repr;
  const size_t block = (row / B) * R + r, lane = row % B, slot = block * B + lane;
  const int8_t* codes = q8_[h].data() + block * kernels::I8BlockBytes(D);
  float acc = 0.0f;
  for (int d = 0; d < D; ++d)
    acc += static_cast<float>(codes[kernels::I8Offset(d, static_cast<int>(lane))]) * p[d];
  *dot = acc * q8_scale_[h][slot];
  // The cosine scale is the code scale times the key's inverse norm (kept when the key went).
  *cos = acc * q8_cos_scale_[h][slot] * inv_p;
}

struct ExactChunkIndex::ProbeCodes {
  int stride = 0;              // elements per head in p16: I4ProbeLength(D) (>= the even D)
  std::vector<int16_t> p16;    // [H][stride] the probe in int16 (zero pad)
  std::vector<float> inv_p;    // [H] the probe's inverse norm
  std::vector<float> p_scale;  // [H] its int16 step
  std::vector<float> step8;    // [H] the int8 codes' logit bound per unit of code scale
  std::vector<float> step4;    // [H] the int4 codes' (0 without them)
};

ExactChunkIndex::ProbeCodes ExactChunkIndex::QuantizeProbe(const float* probe) const {
  const int H = stored_.kv_heads, D = stored_.head_dim;
  ProbeCodes pc;
  pc.stride = kernels::I4ProbeLength(D);
  pc.p16.assign(static_cast<size_t>(H) * pc.stride, 0);
  pc.inv_p.resize(H);
  pc.p_scale.resize(H);
  pc.step8.resize(H);
  pc.step4.resize(H, 0.0f);
  for (int h = 0; h < H; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    int16_t* p16 = pc.p16.data() + static_cast<size_t>(h) * pc.stride;
    pc.inv_p[h] = InverseNorm(p, D);
    pc.p_scale[h] = kernels::QuantizeProbeI16(p, D, p16);
    // A key with code step s: each element within s/2, so the codes' dot is within
    // s |p|_1 / 2 of <p, k>, and |p|_1 <= ps (|p16|_1 + D/2); the probe's int16 rounding adds
    // at most ps/2 per element times |code| <= 127: 64 ps D (int4: |code| <= 7, 4 ps D).
    // Rounding of the fp32 sums, of the screen's and of the rescoring's, is below
    // 2^-24 (D + 8) max|k| |p|_1, bounded here 16 times over (max|k| = 127 s, int4: 7 s).
    double p16_l1 = 0.0, p_l1 = 0.0;
    for (int d = 0; d < D; ++d) {
      p16_l1 += std::abs(static_cast<double>(p16[d]));
      p_l1 += std::fabs(static_cast<double>(p[d]));
    }
    const double ps = pc.p_scale[h], quantised = 0.5 * p16_l1 + 0.5 * D;
    pc.step8[h] = static_cast<float>(ps * (quantised + 64.0 * D) + 127.0 * (D + 8) * p_l1 / 1048576.0);
    if (int4_)
      pc.step4[h] = static_cast<float>(ps * (quantised + 4.0 * D) + 7.0 * (D + 8) * p_l1 / 1048576.0);
  }
  return pc;
}

void ExactChunkIndex::GroupBest(bool int4, size_t g, int h, const ProbeCodes& pc, int32_t* dots, float* logit,
                                float* cos, float* logit_error, float* cos_error) const {
  constexpr int B = kernels::kI8Block;
  static_assert(kernels::kI4Block == B, "the int4 and int8 groups are the same rows");
  const int D = stored_.head_dim, R = stored_.repr;
  const int16_t* p16 = pc.p16.data() + static_cast<size_t>(h) * pc.stride;
  const size_t first_slot = g * R * B;
  const float* scale = (int4 ? q4_scale_[h] : q8_scale_[h]).data() + first_slot;
  const float* cos_scale = (int4 ? q4_cos_scale_[h] : q8_cos_scale_[h]).data() + first_slot;
  if (int4)
    kernels::DotI4Blocks(q4_[h].data() + g * R * kernels::I4BlockBytes(D), static_cast<size_t>(R), p16, D,
                         dots);
  else
    kernels::DotI8Blocks(q8_[h].data() + g * R * kernels::I8BlockBytes(D), static_cast<size_t>(R), p16, D,
                         dots);
  // The probe's scales are >= 0, so they commute with the max over a chunk's representatives
  // and are applied once per chunk.
  float best[B], best_cos[B], max_scale[B], max_cos_scale[B];
  kernels::MaxScaledI8Dots(dots, scale, cos_scale, R, best, best_cos, max_scale, max_cos_scale);
  const float ps = pc.p_scale[h], cs = pc.p_scale[h] * pc.inv_p[h];
  const float step = int4 ? pc.step4[h] : pc.step8[h];
  const float cos_step = step * pc.inv_p[h];
  for (int lane = 0; lane < B; ++lane) {
    logit[lane] = best[lane] * ps;
    cos[lane] = std::max(-1.0f, best_cos[lane] * cs);
    logit_error[lane] = max_scale[lane] * step;
    cos_error[lane] = max_cos_scale[lane] * cos_step;
  }
  // A compressed row's exact score is its int8 codes': the int4 bound grows by the int8 one.
  if (int4 && g * B < full_from_) {
    const float* s8 = q8_scale_[h].data() + first_slot;
    const float* c8 = q8_cos_scale_[h].data() + first_slot;
    for (int lane = 0; lane < B && g * B + lane < full_from_; ++lane) {
      float ms = s8[lane], mc = c8[lane];
      for (int r = 1; r < R; ++r) {
        ms = std::max(ms, s8[static_cast<size_t>(r) * B + lane]);
        mc = std::max(mc, c8[static_cast<size_t>(r) * B + lane]);
      }
      logit_error[lane] += ms * pc.step8[h];
      cos_error[lane] += mc * pc.step8[h] * pc.inv_p[h];
    }
  }
}

void ExactChunkIndex::QuantizedScores(const float* probe, size_t begin, size_t end, ChunkScores* out) const {
  const int H = stored_.kv_heads, R = stored_.repr;
  const size_t n = end - begin;  // rows [begin, end) land at [0, n) of out's vectors
  const kernels::HeadFold fold = FoldOf(options_.heads, H);
  std::vector<float>& raw = out->logit;
  std::vector<float>& cos = out->cosine;
  raw.assign(n, fold.Start());
  cos.assign(n, fold.Start());
  // The error bounds fold as the scores do: max over heads, or a sum (the cosines' with the
  // same 1/H share), so they start at 0 either way.
  out->logit_error.assign(n, 0.0f);
  out->cosine_error.assign(n, 0.0f);
  const ProbeCodes pc = QuantizeProbe(probe);
  // One pass over the chunk groups for every head (one fork-join per layer, not per head).
  constexpr int B = kernels::kI8Block;
  // Whole groups of B rows: the first and the last may hold rows outside [begin, end).
  const size_t first_group = begin / B, end_group = (end + B - 1) / B;
  const bool sum = !fold.max;
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(tbb::blocked_range<size_t>(first_group, end_group, 64),
                    fj.Body([&](const tbb::blocked_range<size_t>& range) {
                      // One group's dots at a time, folded while they are still in the L1 cache; each row
                      // still takes its heads in order, so the folds are the same sums and maxima.
                      std::vector<int32_t> dots(static_cast<size_t>(R) * B);
                      float lg[B], cs[B], e[B], ec[B];
                      for (size_t g = range.begin(); g < range.end(); ++g) {
                        const size_t row_begin = std::max(begin, g * B), row_end = std::min(end, (g + 1) * B);
                        for (int h = 0; h < H; ++h) {
                          GroupBest(int4_, g, h, pc, dots.data(), lg, cs, e, ec);
                          for (size_t row = row_begin; row < row_end; ++row) {
                            const int lane = static_cast<int>(row - g * B);
                            const size_t c = row - begin;
                            fold.Add(lg[lane], cs[lane], &raw[c], &cos[c]);
                            out->logit_error[c] =
                                sum ? out->logit_error[c] + e[lane] : std::max(out->logit_error[c], e[lane]);
                            out->cosine_error[c] = sum ? out->cosine_error[c] + ec[lane] * fold.cos_share
                                                       : std::max(out->cosine_error[c], ec[lane]);
                          }
                        }
                      }
                    }));
  fj.Join();
}

size_t ExactChunkIndex::Int8ScoresOf(const float* probe, const std::vector<int64_t>& rows, ChunkRank rank,
                                     std::vector<float>* score, std::vector<float>* error) const {
  const int H = stored_.kv_heads, R = stored_.repr;
  const kernels::HeadFold fold = FoldOf(options_.heads, H);
  score->assign(rows.size(), fold.Start());
  error->assign(rows.size(), 0.0f);
  if (rows.empty()) return 0;
  constexpr int B = kernels::kI8Block;
  // The groups holding a row, each with its first index into rows (ascending, so a group's
  // rows are consecutive).
  std::vector<size_t> starts;
  for (size_t i = 0; i < rows.size(); ++i)
    if (i == 0 || static_cast<size_t>(rows[i]) / B != static_cast<size_t>(rows[i - 1]) / B)
      starts.push_back(i);
  starts.push_back(rows.size());
  const size_t groups = starts.size() - 1;
  const ProbeCodes pc = QuantizeProbe(probe);
  const bool sum = !fold.max, logit = rank == ChunkRank::kLogit;
  auto run = [&](size_t k0, size_t k1) {
    std::vector<int32_t> dots(static_cast<size_t>(R) * B);
    float lg[B], cs[B], e[B], ec[B];
    for (size_t k = k0; k < k1; ++k) {
      const size_t g = static_cast<size_t>(rows[starts[k]]) / B;
      for (int h = 0; h < H; ++h) {
        GroupBest(false, g, h, pc, dots.data(), lg, cs, e, ec);
        for (size_t i = starts[k]; i < starts[k + 1]; ++i) {
          const int lane = static_cast<int>(static_cast<size_t>(rows[i]) - g * B);
          float unused = fold.Start();
          // The fold of the ranked score alone, as QuantizedScores folds it.
          if (logit)
            fold.Add(lg[lane], cs[lane], &(*score)[i], &unused);
          else
            fold.Add(lg[lane], cs[lane], &unused, &(*score)[i]);
          const float x = logit ? e[lane] : ec[lane] * (sum ? fold.cos_share : 1.0f);
          (*error)[i] = sum ? (*error)[i] + x : std::max((*error)[i], x);
        }
      }
    }
  };
  constexpr size_t kGroupsPerTask = 64;
  if (groups <= kGroupsPerTask) {
    run(0, groups);
  } else {
    TsanForkJoin fj;  // kernels/tbb_tsan.h
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, groups, kGroupsPerTask),
        fj.Body([&](const tbb::blocked_range<size_t>& range) { run(range.begin(), range.end()); }));
    fj.Join();
  }
  return groups;
}

void ExactChunkIndex::ScoresOf(const float* probe, const std::vector<int64_t>& rows, std::vector<float>* raw,
                               std::vector<float>* cos) const {
  const int H = stored_.kv_heads, D = stored_.head_dim, R = stored_.repr;
  const DType dt = stored_.dtype;
  const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(dt);
  const kernels::HeadFold fold = FoldOf(options_.heads, H);
  const bool with_cos = cos != nullptr;
  raw->assign(rows.size(), fold.Start());
  if (with_cos) cos->assign(rows.size(), fold.Start());
  std::vector<float> inv_ps(H);
  for (int h = 0; h < H; ++h) inv_ps[h] = InverseNorm(probe + static_cast<size_t>(h) * D, D);
  const size_t chunk_repr_bytes = static_cast<size_t>(R) * key_bytes;
  // The candidates sit at scattered rows, which no hardware prefetcher predicts: ask for the
  // representatives of the candidate a few places ahead while this one is scored.
  constexpr size_t kAhead = 4;
  auto score_rows = [&](size_t i0, size_t i1, float* dots) {
    for (size_t i = i0; i < i1; ++i) {
      if (i + kAhead < i1 && static_cast<size_t>(rows[i + kAhead]) >= full_from_) {
        const size_t ahead = static_cast<size_t>(rows[i + kAhead]) - full_from_;
        for (int h = 0; h < H; ++h) {
          const char* a = reinterpret_cast<const char*>(repr_[h].data() + ahead * chunk_repr_bytes);
          for (size_t off = 0; off < chunk_repr_bytes; off += 64) __builtin_prefetch(a + off);
        }
      }
      const size_t row = static_cast<size_t>(rows[i]);
      float best_cos_unused = 0.0f;
      for (int h = 0; h < H; ++h) {
        const float* p = probe + static_cast<size_t>(h) * D;
        float best = -std::numeric_limits<float>::infinity(), best_cos = -1.0f;
        if (row < full_from_) {  // compressed: its codes, as FullScores scores it
          for (int r = 0; r < R; ++r) {
            float dot, cs;
            DequantisedDot(h, row, r, p, inv_ps[h], &dot, &cs);
            best = std::max(best, dot);
            best_cos = std::max(best_cos, cs);
          }
        } else {
          const size_t c = row - full_from_;
          kernels::BestOfKeys(dt, repr_[h].data() + c * chunk_repr_bytes, key_bytes, p, D,
                              static_cast<size_t>(R), with_cos ? inv_norm_[h].data() + c * R : nullptr,
                              inv_ps[h], &best, &best_cos, dots);
        }
        fold.Add(best, best_cos, &(*raw)[i], with_cos ? &(*cos)[i] : &best_cos_unused);
      }
    }
  };
  constexpr size_t kRowsPerTask = 64;
  if (rows.size() <= kRowsPerTask) {  // one task's worth: no fork-join
    std::vector<float> dots(static_cast<size_t>(R));
    score_rows(0, rows.size(), dots.data());
    return;
  }
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(tbb::blocked_range<size_t>(0, rows.size(), kRowsPerTask),
                    fj.Body([&](const tbb::blocked_range<size_t>& range) {
                      std::vector<float> dots(static_cast<size_t>(R));
                      score_rows(range.begin(), range.end(), dots.data());
                    }));
  fj.Join();
}

// ---- the backend mirror ----------------------------------------------------------------

void ExactChunkIndex::MarkMirrorStale(size_t row) { mirror_stale_from_ = std::min(mirror_stale_from_, row); }

Status ExactChunkIndex::AttachBackend(RetrievalBackend* backend) {
  if (mirror_ != nullptr)
    return InvalidArgument("ExactChunkIndex::AttachBackend: a backend mirror is attached already");
  if (full_from_ > 0)
    return FailedPrecondition("ExactChunkIndex::AttachBackend: " + std::to_string(full_from_) +
                              " chunks are compressed to int8 codes by the memory cap, and a backend scores "
                              "stored keys (attach before the index fills)");
  KVTIER_ASSIGN_OR_RETURN(mirror_, ReprMirror::Create(backend, stored_));
  mirror_stale_from_ = 0;
  return SyncMirror();
}

Status ExactChunkIndex::SyncMirror() {
  if (mirror_ == nullptr) return Status::Ok();
  const size_t n = ids_.size();
  // Under a cap the mirror may take what the cap leaves once the host rows are counted.
  size_t max_rows = SIZE_MAX;
  if (cap_ > 0) {
    const uint64_t host = memory_bytes() - mirror_->bytes();
    max_rows =
        host >= cap_ ? n : std::max<size_t>(n, (cap_ - host) / std::max<uint64_t>(1, mirror_->row_bytes()));
  }
  if (mirror_stale_from_ >= n && mirror_->rows() == n && mirror_->capacity() <= max_rows) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(mirror_->Update(mirror_stale_from_, n, repr_, inv_norm_, max_rows));
  mirror_stale_from_ = std::numeric_limits<size_t>::max();
  return Status::Ok();
}

Status ExactChunkIndex::SelectOnBackend(const float* probe, ChunkRank rank, bool entropy, int k_max,
                                        std::vector<uint64_t>* chunks, double* theta, int32_t* non_finite) {
  if (probe == nullptr)
    return InvalidArgument("ExactChunkIndex::SelectOnBackend: probe and outputs must not be null");
  LayerSelectPlan plan;
  plan.probe = probe;
  plan.rank = rank;
  plan.entropy = entropy;
  return RunOnBackend(plan, k_max, chunks, theta, non_finite);
}

Status ExactChunkIndex::SelectOnBackend(const BackendQueries& queries, ChunkRank rank, bool entropy,
                                        int k_max, std::vector<uint64_t>* chunks, double* theta,
                                        int32_t* non_finite, int32_t* q_non_finite, int32_t* q_first) {
  if (queries.q == nullptr || q_non_finite == nullptr || q_first == nullptr)
    return InvalidArgument("ExactChunkIndex::SelectOnBackend: queries and outputs must not be null");
  LayerSelectPlan plan;
  plan.queries = queries;
  plan.rank = rank;
  plan.entropy = entropy;
  KVTIER_RETURN_IF_ERROR(RunOnBackend(plan, k_max, chunks, theta, non_finite));
  *q_non_finite = backend_result_.q_non_finite;
  *q_first = backend_result_.q_first_non_finite;
  return Status::Ok();
}

Result<kernels::ChunkScoreParams> ExactChunkIndex::MirrorView() {
  if (mirror_ == nullptr)
    return FailedPrecondition("ExactChunkIndex::MirrorView: no backend mirror (AttachBackend first)");
  KVTIER_RETURN_IF_ERROR(SyncMirror());
  return mirror_->Params(FoldKind(options_.heads));
}

Status ExactChunkIndex::RunOnBackend(LayerSelectPlan plan, int k_max, std::vector<uint64_t>* chunks,
                                     double* theta, int32_t* non_finite) {
  if (mirror_ == nullptr)
    return FailedPrecondition("ExactChunkIndex::SelectOnBackend: no backend mirror (AttachBackend first)");
  if (chunks == nullptr || theta == nullptr || non_finite == nullptr)
    return InvalidArgument("ExactChunkIndex::SelectOnBackend: probe and outputs must not be null");
  if (k_max < 0)
    return InvalidArgument("ExactChunkIndex::SelectOnBackend: k_max must be >= 0 (got " +
                           std::to_string(k_max) + ")");
  KVTIER_RETURN_IF_ERROR(SyncMirror());
  plan.score = mirror_->Params(FoldKind(options_.heads));
  plan.k_max = static_cast<int>(std::min<int64_t>(k_max, plan.score.n_chunks));
  KVTIER_RETURN_IF_ERROR(mirror_->backend()->RunLayer(plan, &backend_result_));
  // One fp32 pass over the mirror's rows: the first stage (what rerank=0 chooses).
  first_stage_bytes_.fetch_add(static_cast<uint64_t>(plan.score.n_chunks) * FullRowBytes(),
                               std::memory_order_relaxed);
  chunks->resize(backend_result_.rows.size());
  for (size_t i = 0; i < backend_result_.rows.size(); ++i) (*chunks)[i] = ids_[backend_result_.rows[i]];
  *theta = backend_result_.entropy;
  *non_finite = backend_result_.non_finite;
  return Status::Ok();
}

uint64_t ExactChunkIndex::CodeRowBytes() const {
  return static_cast<uint64_t>(stored_.repr) * stored_.kv_heads * (stored_.head_dim + 2 * sizeof(float));
}

uint64_t ExactChunkIndex::Int4RowBytes() const {
  return static_cast<uint64_t>(stored_.repr) * stored_.kv_heads *
         (kernels::I4BlockBytes(stored_.head_dim) / kernels::kI4Block + 2 * sizeof(float));
}

uint64_t ExactChunkIndex::FullRowBytes() const {
  return static_cast<uint64_t>(stored_.repr) * stored_.kv_heads *
         (static_cast<uint64_t>(stored_.head_dim) * DTypeSize(stored_.dtype) + sizeof(float));
}

uint64_t ExactChunkIndex::ExactPassBytes(const std::vector<int64_t>& rows) const {
  // Rows below full_from_ keep only their codes (none without a memory cap).
  const uint64_t compressed =
      full_from_ == 0 ? 0 : static_cast<uint64_t>(std::count_if(rows.begin(), rows.end(), [&](int64_t r) {
        return static_cast<size_t>(r) < full_from_;
      }));
  return compressed * CodeRowBytes() + (rows.size() - compressed) * FullRowBytes();
}

IndexReadBytes ExactChunkIndex::read_bytes() const {
  return IndexReadBytes{first_stage_bytes_.load(std::memory_order_relaxed),
                        rescoring_bytes_.load(std::memory_order_relaxed)};
}

uint64_t ExactChunkIndex::memory_bytes() const {
  uint64_t b = ids_.capacity() * sizeof(uint64_t);
  for (const auto& v : repr_) b += v.capacity();
  for (const auto& v : inv_norm_) b += v.capacity() * sizeof(float);
  for (const auto& v : q8_) b += v.capacity();
  for (const auto& v : q8_scale_) b += v.capacity() * sizeof(float);
  for (const auto& v : q8_cos_scale_) b += v.capacity() * sizeof(float);
  for (const auto& v : q4_) b += v.capacity();
  for (const auto& v : q4_scale_) b += v.capacity() * sizeof(float);
  for (const auto& v : q4_cos_scale_) b += v.capacity() * sizeof(float);
  if (mirror_ != nullptr) b += mirror_->bytes();  // backend memory: device memory on "cuda"
  return b;
}

}  // namespace kvtier
