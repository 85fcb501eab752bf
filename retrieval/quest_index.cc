#include "retrieval/quest_index.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "kernels/cpu/dot.h"
#include "store/factory_spec.h"

namespace kvtier {

using kernels::Dot;

// ---- spec ---------------------------------------------------------------------------

Result<QuestIndexOptions> QuestIndexOptions::Parse(const std::string& spec) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "index"));
  if (fs.name != "Quest") return InvalidArgument("index spec '" + spec + "' does not name the Quest index");
  QuestIndexOptions o;
  for (const auto& [key, value] : fs.params) {
    if (key == "heads") {
      KVTIER_ASSIGN_OR_RETURN(o.heads, ParseHeadMerge(value, spec));
    } else {
      return InvalidArgument("unknown key '" + key + "' for index 'Quest' in spec '" + spec +
                             "' (known: heads)");
    }
  }
  return o;
}

std::string QuestIndexOptions::ToString() const { return std::string("Quest:heads=") + HeadMergeName(heads); }

// ---- lifetime and writes ------------------------------------------------------------

Result<std::unique_ptr<QuestChunkIndex>> QuestChunkIndex::Create(const ChunkShape& shape,
                                                                 const QuestIndexOptions& options) {
  KVTIER_RETURN_IF_ERROR(shape.Validate());
  return std::unique_ptr<QuestChunkIndex>(new QuestChunkIndex(shape, options));
}

Status QuestChunkIndex::Add(const std::vector<uint64_t>& chunks, const ReprReader& read) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    const bool above = i > 0 ? chunks[i] > chunks[i - 1] : ids_.empty() || chunks[i] > ids_.back();
    if (!above)
      return InvalidArgument(
          "QuestChunkIndex::Add: chunk " + std::to_string(chunks[i]) +
          " is not above every chunk indexed before it (chunks are added in ascending order)");
  }
  const int H = shape_.kv_heads, D = shape_.head_dim, R = shape_.repr;
  const size_t head_box = 2 * static_cast<size_t>(D);
  std::vector<float> repr(shape_.repr_floats());
  // The batch's rows, appended only once every chunk was read (all or nothing).
  std::vector<uint64_t> ids;
  std::vector<float> box, corner;
  for (uint64_t c : chunks) {
    const Status st = read(c, repr.data());
    if (st.code() == StatusCode::kNotFound) continue;  // a hole: nothing to index
    KVTIER_RETURN_IF_ERROR(st);
    for (size_t i = 0; i < repr.size(); ++i)
      if (!std::isfinite(repr[i]))
        return InvalidArgument("QuestChunkIndex::Add: chunk " + std::to_string(c) + "'s representative " +
                               std::to_string(i / (static_cast<size_t>(H) * D)) + ", head " +
                               std::to_string(i / D % H) + ", element " + std::to_string(i % D) +
                               " is not finite (" + std::to_string(repr[i]) + ")");
    ids.push_back(c);
    const size_t row = ids.size() - 1;
    box.resize((row + 1) * H * head_box);
    corner.resize((row + 1) * H);
    for (int h = 0; h < H; ++h) {
      float* hi = box.data() + (row * H + h) * head_box;  // M
      float* lo = hi + D;                                 // m
      const float* k0 = repr.data() + static_cast<size_t>(h) * D;
      std::copy_n(k0, D, hi);
      std::copy_n(k0, D, lo);
      for (int r = 1; r < R; ++r) {
        const float* k = repr.data() + (static_cast<size_t>(r) * H + h) * D;
        for (int d = 0; d < D; ++d) {
          hi[d] = std::max(hi[d], k[d]);
          lo[d] = std::min(lo[d], k[d]);
        }
      }
      double far = 0.0;  // the farthest corner: each coordinate's larger magnitude
      for (int d = 0; d < D; ++d) {
        const double a = std::max(std::fabs(hi[d]), std::fabs(lo[d]));
        far += a * a;
      }
      corner[row * H + h] = static_cast<float>(std::sqrt(far));
    }
  }
  if (ids.empty()) return Status::Ok();
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  box_.insert(box_.end(), box.begin(), box.end());
  corner_.insert(corner_.end(), corner.begin(), corner.end());
  Changed();
  return Status::Ok();
}

Status QuestChunkIndex::Remove(const std::vector<uint64_t>& chunks) {
  std::vector<uint64_t> gone = chunks;
  std::sort(gone.begin(), gone.end());
  const size_t H = static_cast<size_t>(shape_.kv_heads), row_floats = H * 2 * shape_.head_dim;
  size_t kept = 0;
  for (size_t row = 0; row < ids_.size(); ++row) {
    if (std::binary_search(gone.begin(), gone.end(), ids_[row])) continue;
    if (kept != row) {
      ids_[kept] = ids_[row];
      std::copy_n(box_.begin() + static_cast<ptrdiff_t>(row * row_floats), row_floats,
                  box_.begin() + static_cast<ptrdiff_t>(kept * row_floats));
      std::copy_n(corner_.begin() + static_cast<ptrdiff_t>(row * H), H,
                  corner_.begin() + static_cast<ptrdiff_t>(kept * H));
    }
    ++kept;
  }
  if (kept == ids_.size()) return Status::Ok();  // nothing of ours: the rows stand
  ids_.resize(kept);
  box_.resize(kept * row_floats);
  corner_.resize(kept * H);
  Changed();
  return Status::Ok();
}

void QuestChunkIndex::Reserve(size_t chunks) {
  const size_t n = ids_.size() + chunks, H = static_cast<size_t>(shape_.kv_heads);
  ids_.reserve(n);
  box_.reserve(n * H * 2 * shape_.head_dim);
  corner_.reserve(n * H);
}

uint64_t QuestChunkIndex::memory_bytes() const {
  return ids_.capacity() * sizeof(uint64_t) + box_.capacity() * sizeof(float) +
         corner_.capacity() * sizeof(float);
}

uint64_t QuestChunkIndex::RowBytes() const {
  return static_cast<uint64_t>(shape_.kv_heads) * (2 * static_cast<uint64_t>(shape_.head_dim) + 1) *
         sizeof(float);
}

// ---- scoring ------------------------------------------------------------------------

Status QuestChunkIndex::Split(const float* probe, const char* who, SplitProbe* out) const {
  if (probe == nullptr) return InvalidArgument(std::string(who) + ": probe must not be null");
  const int H = shape_.kv_heads, D = shape_.head_dim;
  out->halves.resize(static_cast<size_t>(H) * 2 * D);
  out->norm.resize(static_cast<size_t>(H));
  for (int h = 0; h < H; ++h) {
    const float* p = probe + static_cast<size_t>(h) * D;
    float* pos = out->halves.data() + static_cast<size_t>(h) * 2 * D;  // pairs with M
    float* neg = pos + D;                                              // pairs with m
    for (int d = 0; d < D; ++d) {
      pos[d] = p[d] > 0.0f ? p[d] : 0.0f;
      neg[d] = p[d] < 0.0f ? p[d] : 0.0f;
    }
    out->norm[static_cast<size_t>(h)] = std::sqrt(Dot(p, p, D));
  }
  return Status::Ok();
}

void QuestChunkIndex::ScoreRow(const SplitProbe& p, size_t row, float* logit, float* cosine) const {
  const int H = shape_.kv_heads, D = shape_.head_dim;
  const bool sum = options_.heads == HeadMerge::kSum;
  float l = 0.0f, c = 0.0f;
  for (int h = 0; h < H; ++h) {
    const size_t at = row * H + h;
    const float u = Dot(p.halves.data() + static_cast<size_t>(h) * 2 * D, box_.data() + at * 2 * D, 2 * D);
    const float den = p.norm[static_cast<size_t>(h)] * corner_[at];
    const float cos = den > 0.0f ? std::clamp(u / den, -1.0f, 1.0f) : 0.0f;
    if (sum) {
      l += u;
      c += cos;
    } else {
      l = h == 0 ? u : std::max(l, u);
      c = h == 0 ? cos : std::max(c, cos);
    }
  }
  *logit = l;
  *cosine = sum ? c / static_cast<float>(H) : c;
}

Status QuestChunkIndex::Score(const float* probe, ChunkScores* out) const {
  if (out == nullptr) return InvalidArgument("QuestChunkIndex::Score: out must not be null");
  SplitProbe p;
  KVTIER_RETURN_IF_ERROR(Split(probe, "QuestChunkIndex::Score", &p));
  const size_t n = ids_.size();
  out->ids = ids_;
  out->logit.resize(n);
  out->cosine.resize(n);
  for (size_t row = 0; row < n; ++row) ScoreRow(p, row, &out->logit[row], &out->cosine[row]);
  out->logit_error.clear();  // the bound itself: nothing to refine
  out->cosine_error.clear();
  out->exact_rows.clear();
  first_stage_bytes_.fetch_add(n * RowBytes(), std::memory_order_relaxed);
  Stamp(out);
  return Status::Ok();
}

Status QuestChunkIndex::Best(const float* probe, const ChunkScores& screened, ChunkRank rank, size_t take,
                             std::vector<uint64_t>* out) const {
  (void)probe;  // the screened scores are the index's scores
  if (out == nullptr) return InvalidArgument("QuestChunkIndex::Best: out must not be null");
  KVTIER_RETURN_IF_ERROR(CheckCurrent(screened, "QuestChunkIndex::Best"));
  const std::vector<float>& by = screened.by(rank);
  if (by.size() != screened.ids.size())
    return InvalidArgument("QuestChunkIndex::Best: " + std::to_string(screened.ids.size()) + " ids but " +
                           std::to_string(by.size()) + " " + ChunkRankName(rank) + " scores");
  *out = TakeBest(by, screened.ids, take);
  return Status::Ok();
}

Status QuestChunkIndex::ScoreChunks(const float* probe, const std::vector<uint64_t>& chunks,
                                    ChunkScores* out) const {
  if (out == nullptr) return InvalidArgument("QuestChunkIndex::ScoreChunks: out must not be null");
  SplitProbe p;
  KVTIER_RETURN_IF_ERROR(Split(probe, "QuestChunkIndex::ScoreChunks", &p));
  std::vector<uint64_t> wanted(chunks);
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  out->ids.clear();
  out->logit.clear();
  out->cosine.clear();
  for (uint64_t c : wanted) {
    const auto it = std::lower_bound(ids_.begin(), ids_.end(), c);
    if (it == ids_.end() || *it != c) continue;  // not held: left out
    float l = 0.0f, cos = 0.0f;
    ScoreRow(p, static_cast<size_t>(it - ids_.begin()), &l, &cos);
    out->ids.push_back(c);
    out->logit.push_back(l);
    out->cosine.push_back(cos);
  }
  out->logit_error.clear();
  out->cosine_error.clear();
  out->exact_rows.clear();
  out->index = nullptr;  // not a whole screen: Best refuses it
  rescoring_bytes_.fetch_add(out->ids.size() * RowBytes(), std::memory_order_relaxed);
  return Status::Ok();
}

Status QuestChunkIndex::BestOf(const float* probe, const std::vector<uint64_t>& chunks, ChunkRank rank,
                               size_t take, std::vector<uint64_t>* out) const {
  if (out == nullptr) return InvalidArgument("QuestChunkIndex::BestOf: out must not be null");
  ChunkScores scored;
  KVTIER_RETURN_IF_ERROR(ScoreChunks(probe, chunks, &scored));
  *out = TakeBest(scored.by(rank), scored.ids, take);
  return Status::Ok();
}

}  // namespace kvtier
