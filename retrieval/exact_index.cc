#include "retrieval/exact_index.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/chunk_score.h"
#include "kernels/cpu/dot.h"
#include "kernels/tbb_tsan.h"
#include "store/factory_spec.h"

namespace kvtier {
namespace {

// HeadFold, InverseNorm and the fp32 scoring pass are kernels/cpu/chunk_score, the twin of
// the CUDA scoring kernel.
using kernels::InverseNorm;

kernels::HeadFold::Kind FoldKind(ExactIndexOptions::HeadMerge heads) {
  return heads == ExactIndexOptions::HeadMerge::kMax ? kernels::HeadFold::Kind::kMax
                                                     : kernels::HeadFold::Kind::kSum;
}

kernels::HeadFold FoldOf(ExactIndexOptions::HeadMerge heads, int n_heads) {
  return kernels::HeadFold(heads == ExactIndexOptions::HeadMerge::kMax ? kernels::HeadFold::Kind::kMax
                                                                       : kernels::HeadFold::Kind::kSum,
                           n_heads);
}

}  // namespace

// ---- spec ---------------------------------------------------------------------------

Result<ExactIndexOptions> ExactIndexOptions::Parse(const std::string& spec) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "index"));
  if (fs.name != "Exact") return InvalidArgument("index spec '" + spec + "' does not name the Exact index");
  ExactIndexOptions o;
  for (const auto& [key, value] : fs.params) {
    if (key == "heads") {
      if (value == "sum") {
        o.heads = HeadMerge::kSum;
      } else if (value == "max") {
        o.heads = HeadMerge::kMax;
      } else {
        return InvalidArgument("bad value '" + value + "' for key 'heads' in index spec '" + spec +
                               "' (expected sum or max)");
      }
    } else if (key == "rerank" || key == "rerank_min") {
      KVTIER_ASSIGN_OR_RETURN(int v, ParseSpecInt(spec, key, value));
      if (v < 0)
        return InvalidArgument("bad value '" + value + "' for key '" + key + "' in index spec '" + spec +
                               "' (expected an integer >= 0)");
      (key == "rerank" ? o.rerank_factor : o.rerank_min) = v;
    } else {
      return InvalidArgument("unknown key '" + key + "' for index 'Exact' in spec '" + spec +
                             "' (known: heads, rerank, rerank_min)");
    }
  }
  return o;
}

std::string ExactIndexOptions::ToString() const {
  return std::string("Exact:heads=") + (heads == HeadMerge::kMax ? "max" : "sum") +
         ",rerank=" + std::to_string(rerank_factor) + ",rerank_min=" + std::to_string(rerank_min);
}

// ---- lifetime and writes ------------------------------------------------------------

ExactChunkIndex::ExactChunkIndex(const ChunkShape& shape, const ExactIndexOptions& options)
    : ChunkIndex(shape), options_(options) {
  const size_t H = static_cast<size_t>(shape.kv_heads);
  repr_.resize(H);
  inv_norm_.resize(H);
  q8_.resize(H);
  q8_scale_.resize(H);
  q8_cos_scale_.resize(H);
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
  const int H = shape_.kv_heads, D = shape_.head_dim, R = shape_.repr;
  const DType dt = shape_.dtype;
  const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(dt);
  const size_t old_n = ids_.size();
  std::vector<float> repr(shape_.repr_floats());
  std::vector<uint8_t> stored(key_bytes);
  for (uint64_t i : chunks) {
    Status st = read(i, repr.data());
    if (st.code() == StatusCode::kNotFound) continue;  // a hole left by a crash: nothing to index
    if (!st.ok()) {                                    // all or nothing: drop the batch's rows again
      ids_.resize(old_n);
      for (int h = 0; h < H; ++h) {
        repr_[h].resize(old_n * R * key_bytes);
        inv_norm_[h].resize(old_n * R);
      }
      RequantiseAll();
      MarkMirrorStale(old_n);
      Changed();
      return st;
    }
    ids_.push_back(i);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) {
        const float* key = repr.data() + (static_cast<size_t>(r) * H + h) * D;
        FromFloat(dt, key, stored.data(), D);  // exact: the key came from this dtype
        repr_[h].insert(repr_[h].end(), stored.begin(), stored.end());
        const float inv_norm = InverseNorm(key, D);
        inv_norm_[h].push_back(inv_norm);
        PutQuantizedRow(h, ids_.size() - 1, r, key, inv_norm);
      }
  }
  MarkMirrorStale(old_n);
  Changed();
  return Status::Ok();
}

Status ExactChunkIndex::Remove(const std::vector<uint64_t>& chunks) {
  std::vector<uint64_t> gone = chunks;
  std::sort(gone.begin(), gone.end());
  const size_t H = static_cast<size_t>(shape_.kv_heads), D = shape_.head_dim, R = shape_.repr;
  const size_t es = DTypeSize(shape_.dtype);
  size_t keep = 0, first_moved = ids_.size();
  for (size_t row = 0; row < ids_.size(); ++row) {
    if (std::binary_search(gone.begin(), gone.end(), ids_[row])) continue;
    if (keep != row) {  // compact in place: rows keep their ascending chunk order
      first_moved = std::min(first_moved, keep);
      ids_[keep] = ids_[row];
      for (size_t h = 0; h < H; ++h) {
        std::copy_n(repr_[h].begin() + row * R * D * es, R * D * es, repr_[h].begin() + keep * R * D * es);
        std::copy_n(inv_norm_[h].begin() + row * R, R, inv_norm_[h].begin() + keep * R);
      }
    }
    ++keep;
  }
  if (keep == ids_.size()) return Status::Ok();  // nothing of ours: the codes stand
  ids_.resize(keep);
  for (size_t h = 0; h < H; ++h) {
    repr_[h].resize(keep * R * D * es);
    inv_norm_[h].resize(keep * R);
  }
  // The int8 blocks interleave chunks: requantise the kept rows in their new places.
  RequantiseAll();
  MarkMirrorStale(std::min(first_moved, keep));
  Changed();
  return Status::Ok();
}

void ExactChunkIndex::RequantiseAll() {
  const int H = shape_.kv_heads, D = shape_.head_dim, R = shape_.repr;
  const DType dt = shape_.dtype;
  const size_t es = DTypeSize(dt);
  std::vector<float> key(D);
  for (int h = 0; h < H; ++h) {
    q8_[h].clear();
    q8_scale_[h].clear();
    q8_cos_scale_[h].clear();
    for (size_t row = 0; row < ids_.size(); ++row)
      for (int r = 0; r < R; ++r) {
        const size_t j = row * R + r;
        ToFloat(dt, repr_[h].data() + j * D * es, key.data(), D);  // exactly the key that was added
        PutQuantizedRow(h, row, r, key.data(), inv_norm_[h][j]);
      }
  }
}

void ExactChunkIndex::PutQuantizedRow(int h, size_t row, int r, const float* key, float inv_norm) {
  constexpr size_t B = kernels::kI8Block;
  const int D = shape_.head_dim, R = shape_.repr;
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
}

// ---- reads --------------------------------------------------------------------------

Status ExactChunkIndex::Score(const float* probe, ChunkScores* out) const {
  if (probe == nullptr || out == nullptr)
    return InvalidArgument("ExactChunkIndex::Score: probe and out must not be null");
  FullScores(probe, &out->logit, &out->cosine);
  if (!Current(*out)) out->ids = ids_;  // the same index unchanged: its ids are there already
  Stamp(out);
  return Status::Ok();
}

Status ExactChunkIndex::Screen(const float* probe, ChunkScores* out) const {
  if (options_.rerank_factor == 0) return Score(probe, out);
  if (probe == nullptr || out == nullptr)
    return InvalidArgument("ExactChunkIndex::Screen: probe and out must not be null");
  // The first stage: int8 codes, a quarter of the bytes of an fp32 pass, which is memory-bound.
  QuantizedScores(probe, &out->logit, &out->cosine);
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
  // The second stage: rescore the best candidates from the stored keys, in fp32.
  take = std::min(take, n);
  const int64_t n_cand = std::max<int64_t>(
      static_cast<int64_t>(options_.rerank_factor) * static_cast<int64_t>(take), options_.rerank_min);
  std::vector<int64_t> rows;
  TopRowsAscending(by.data(), static_cast<int64_t>(n), n_cand, &rows);
  std::vector<float> logit, cos;
  ScoresOf(probe, rows, &logit, &cos);
  std::vector<uint64_t> cand_ids(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) cand_ids[i] = ids_[rows[i]];
  *out = TakeBest(rank == ChunkRank::kLogit ? logit : cos, cand_ids, take);
  return Status::Ok();
}

void ExactChunkIndex::FullScores(const float* probe, std::vector<float>* raw, std::vector<float>* cos) const {
  const int H = shape_.kv_heads, D = shape_.head_dim, R = shape_.repr;
  const size_t n = ids_.size();
  const DType dt = shape_.dtype;
  const kernels::HeadFold fold = FoldOf(options_.heads, H);
  raw->assign(n, fold.Start());
  cos->assign(n, fold.Start());
  if (n == 0) return;
  std::vector<float> ip(n * R);
  for (int h = 0; h < H; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    const float inv_p = InverseNorm(p, D);
    // One pass over this head's n*R contiguous keys, split over the cores.
    // (Debian's FAISS is built without SIMD: its fvec kernels are the scalar
    // reference, so the vectorisable Dot is used instead.)
    const uint8_t* keys = repr_[h].data();
    TsanForkJoin fj;  // kernels/tbb_tsan.h
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, n, 1024), fj.Body([&](const tbb::blocked_range<size_t>& range) {
          const size_t c0 = range.begin();
          kernels::ScoreChunksOneHead(dt, keys, inv_norm_[h].data(), p, inv_p, D, R, c0, range.end(), fold,
                                      ip.data() + c0 * R, raw->data(), cos->data());
        }));
    fj.Join();
  }
}

void ExactChunkIndex::QuantizedScores(const float* probe, std::vector<float>* raw,
                                      std::vector<float>* cos) const {
  const int H = shape_.kv_heads, D = shape_.head_dim, R = shape_.repr;
  const size_t n = ids_.size();
  const kernels::HeadFold fold = FoldOf(options_.heads, H);
  raw->assign(n, fold.Start());
  cos->assign(n, fold.Start());
  std::vector<float> inv_p(H), p_scale(H);
  const size_t de = static_cast<size_t>(D + 1) / 2 * 2;
  std::vector<int16_t> p16(H * de);  // the probe in int16 for the integer block dots
  for (int h = 0; h < H; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    inv_p[h] = InverseNorm(p, D);
    p_scale[h] = kernels::QuantizeProbeI16(p, D, p16.data() + h * de);
  }
  // One pass over the chunk groups for every head (one fork-join per layer, not per head).
  constexpr int B = kernels::kI8Block;
  const size_t groups = (n + B - 1) / B, block_bytes = kernels::I8BlockBytes(D);
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(
      tbb::blocked_range<size_t>(0, groups, 64), fj.Body([&](const tbb::blocked_range<size_t>& range) {
        const size_t g0 = range.begin(), g1 = range.end();
        std::vector<int32_t> dots((g1 - g0) * R * B);
        for (int h = 0; h < H; ++h) {
          kernels::DotI8Blocks(q8_[h].data() + g0 * R * block_bytes, (g1 - g0) * R, p16.data() + h * de, D,
                               dots.data());
          const float* scale = q8_scale_[h].data() + g0 * R * B;
          const float* cos_scale = q8_cos_scale_[h].data() + g0 * R * B;
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
              fold.Add(best[c - g * B] * ps, std::max(-1.0f, best_cos[c - g * B] * cs), &(*raw)[c],
                       &(*cos)[c]);
          }
        }
      }));
  fj.Join();
}

void ExactChunkIndex::ScoresOf(const float* probe, const std::vector<int64_t>& rows, std::vector<float>* raw,
                               std::vector<float>* cos) const {
  const int H = shape_.kv_heads, D = shape_.head_dim, R = shape_.repr;
  const DType dt = shape_.dtype;
  const size_t key_bytes = static_cast<size_t>(D) * DTypeSize(dt);
  const kernels::HeadFold fold = FoldOf(options_.heads, H);
  raw->assign(rows.size(), fold.Start());
  cos->assign(rows.size(), fold.Start());
  std::vector<float> inv_p(H);
  for (int h = 0; h < H; ++h) inv_p[h] = InverseNorm(probe + static_cast<size_t>(h) * D, D);
  // The candidates sit at scattered rows, which no hardware prefetcher predicts: ask for the
  // representatives of the candidate a few places ahead while this one is scored.
  constexpr size_t kAhead = 4;
  const size_t chunk_repr_bytes = static_cast<size_t>(R) * key_bytes;
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(
      tbb::blocked_range<size_t>(0, rows.size(), 64), fj.Body([&](const tbb::blocked_range<size_t>& range) {
        for (size_t i = range.begin(); i < range.end(); ++i) {
          if (i + kAhead < range.end()) {
            const size_t ahead = static_cast<size_t>(rows[i + kAhead]);
            for (int h = 0; h < H; ++h) {
              const char* a = reinterpret_cast<const char*>(repr_[h].data() + ahead * chunk_repr_bytes);
              for (size_t off = 0; off < chunk_repr_bytes; off += 64) __builtin_prefetch(a + off);
            }
          }
          const size_t c = static_cast<size_t>(rows[i]);
          for (int h = 0; h < H; ++h) {
            const float* p = probe + static_cast<size_t>(h) * D;
            const uint8_t* keys = repr_[h].data();
            const float* inv = inv_norm_[h].data();
            float best = -std::numeric_limits<float>::infinity(), best_cos = -1.0f;
            for (int r = 0; r < R; ++r) {
              const float dot = kernels::DotKey(dt, keys + (c * R + r) * key_bytes, p, D);
              best = std::max(best, dot);
              best_cos = std::max(best_cos, dot * inv[c * R + r] * inv_p[h]);
            }
            fold.Add(best, best_cos, &(*raw)[i], &(*cos)[i]);
          }
        }
      }));
  fj.Join();
}

// ---- the backend mirror ----------------------------------------------------------------

void ExactChunkIndex::MarkMirrorStale(size_t row) { mirror_stale_from_ = std::min(mirror_stale_from_, row); }

Status ExactChunkIndex::AttachBackend(RetrievalBackend* backend) {
  if (mirror_ != nullptr)
    return InvalidArgument("ExactChunkIndex::AttachBackend: a backend mirror is attached already");
  KVTIER_ASSIGN_OR_RETURN(mirror_, ReprMirror::Create(backend, shape_));
  mirror_stale_from_ = 0;
  return SyncMirror();
}

Status ExactChunkIndex::SyncMirror() {
  if (mirror_ == nullptr) return Status::Ok();
  if (mirror_stale_from_ >= ids_.size() && mirror_->rows() == ids_.size()) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(mirror_->Update(mirror_stale_from_, ids_.size(), repr_, inv_norm_));
  mirror_stale_from_ = std::numeric_limits<size_t>::max();
  return Status::Ok();
}

Status ExactChunkIndex::SelectOnBackend(const float* probe, ChunkRank rank, bool entropy, int k_max,
                                        std::vector<uint64_t>* chunks, double* theta, int32_t* non_finite) {
  if (mirror_ == nullptr)
    return FailedPrecondition("ExactChunkIndex::SelectOnBackend: no backend mirror (AttachBackend first)");
  if (probe == nullptr || chunks == nullptr || theta == nullptr || non_finite == nullptr)
    return InvalidArgument("ExactChunkIndex::SelectOnBackend: probe and outputs must not be null");
  if (k_max < 0)
    return InvalidArgument("ExactChunkIndex::SelectOnBackend: k_max must be >= 0 (got " +
                           std::to_string(k_max) + ")");
  KVTIER_RETURN_IF_ERROR(SyncMirror());
  LayerSelectPlan plan;
  plan.score = mirror_->Params(FoldKind(options_.heads));
  plan.probe = probe;
  plan.rank = rank;
  plan.entropy = entropy;
  plan.k_max = static_cast<int>(std::min<int64_t>(k_max, plan.score.n_chunks));
  KVTIER_RETURN_IF_ERROR(mirror_->backend()->RunLayer(plan, &backend_result_));
  chunks->resize(backend_result_.rows.size());
  for (size_t i = 0; i < backend_result_.rows.size(); ++i) (*chunks)[i] = ids_[backend_result_.rows[i]];
  *theta = backend_result_.entropy;
  *non_finite = backend_result_.non_finite;
  return Status::Ok();
}

uint64_t ExactChunkIndex::memory_bytes() const {
  uint64_t b = ids_.capacity() * sizeof(uint64_t);
  for (const auto& v : repr_) b += v.capacity();
  for (const auto& v : inv_norm_) b += v.capacity() * sizeof(float);
  for (const auto& v : q8_) b += v.capacity();
  for (const auto& v : q8_scale_) b += v.capacity() * sizeof(float);
  for (const auto& v : q8_cos_scale_) b += v.capacity() * sizeof(float);
  if (mirror_ != nullptr) b += mirror_->bytes();  // backend memory: device memory on "cuda"
  return b;
}

}  // namespace kvtier
