#include "retrieval/chunk_index.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>

#include "retrieval/exact_index.h"
#include "retrieval/faiss_index.h"
#include "retrieval/quest_index.h"
#include "store/factory_spec.h"

namespace kvtier {
namespace {

// Order-preserving map of a float to uint32: a < b exactly when OrderKey(a) < OrderKey(b); -0 and +0
// map alike (they compare equal as floats).
inline uint32_t OrderKey(float x) {
  uint32_t u;
  const float canonical = x + 0.0f;  // -0 -> +0
  std::memcpy(&u, &canonical, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

bool IsExact(const FactorySpec& fs) { return fs.name == "Exact"; }
bool IsQuest(const FactorySpec& fs) { return fs.name == "Quest"; }

}  // namespace

Status ChunkShape::Validate() const {
  if (kv_heads <= 0)
    return InvalidArgument("ChunkShape.kv_heads must be > 0 (got " + std::to_string(kv_heads) + ")");
  if (head_dim <= 0 || head_dim > 4096)
    return InvalidArgument("ChunkShape.head_dim must be in [1, 4096] (got " + std::to_string(head_dim) + ")");
  if (repr <= 0) return InvalidArgument("ChunkShape.repr must be > 0 (got " + std::to_string(repr) + ")");
  return Status::Ok();
}

ChunkIndex::~ChunkIndex() = default;
ChunkSubset::~ChunkSubset() = default;

Status ChunkIndex::CheckCurrent(const ChunkScores& screened, const char* who) const {
  if (Current(screened)) return Status::Ok();
  return InvalidArgument(std::string(who) +
                         ": the scores are not this index's of its current state (Screen with "
                         "this index after its last Add or Remove)");
}

Status ChunkIndex::SetMemoryCap(uint64_t bytes) {
  if (bytes == 0) return Status::Ok();
  return InvalidArgument("index_bytes: the index kind '" + ToString() +
                         "' cannot be bounded (only the Exact index takes a memory cap; use index_bytes 0)");
}

Status ChunkIndex::Add(uint64_t chunk, const float* repr) {
  if (repr == nullptr) return InvalidArgument("ChunkIndex::Add: repr must not be null");
  const size_t floats = shape_.repr_floats();
  return Add(std::vector<uint64_t>{chunk}, [&](uint64_t, float* out) {
    std::copy_n(repr, floats, out);
    return Status::Ok();
  });
}

Status ChunkIndex::Search(const float* probe, size_t k, std::vector<uint64_t>* out) const {
  ChunkScores screened;
  KVTIER_RETURN_IF_ERROR(Screen(probe, &screened));
  return Best(probe, screened, ChunkRank::kLogit, k, out);
}

Status ChunkIndex::RefineForEntropy(const float* probe, double max_error, ChunkScores* screened,
                                    double* bound) const {
  (void)probe;
  (void)max_error;
  if (screened == nullptr || bound == nullptr)
    return InvalidArgument("ChunkIndex::RefineForEntropy: screened and bound must not be null");
  const int n = static_cast<int>(screened->cosine.size());
  if (screened->cosine_error.size() == screened->cosine.size()) {
    *bound = SoftmaxEntropyErrorBound(screened->cosine.data(), screened->cosine_error.data(), n);
  } else {
    const std::vector<float> none(screened->cosine.size(), 0.0f);  // exact scores
    *bound = SoftmaxEntropyErrorBound(screened->cosine.data(), none.data(), n);
  }
  return Status::Ok();
}

Status ChunkIndex::BestOf(const float* probe, const std::vector<uint64_t>& chunks, ChunkRank rank,
                          size_t take, std::vector<uint64_t>* out) const {
  (void)probe, (void)chunks, (void)rank, (void)take, (void)out;
  return FailedPrecondition("index '" + ToString() + "' cannot score chosen chunks alone");
}

Status ChunkIndex::ScoreChunks(const float* probe, const std::vector<uint64_t>& chunks,
                               ChunkScores* out) const {
  (void)probe, (void)chunks, (void)out;
  return FailedPrecondition("index '" + ToString() + "' cannot score chosen chunks alone");
}

Status ChunkIndex::GatherSubset(const std::vector<uint64_t>& chunks,
                                std::unique_ptr<ChunkSubset>* subset) const {
  (void)chunks, (void)subset;
  return FailedPrecondition("index '" + ToString() + "' cannot score chosen chunks alone");
}

Status ChunkIndex::ScreenRows(const float* probe, size_t begin, size_t end, ChunkScores* out) const {
  (void)probe, (void)begin, (void)end, (void)out;
  return FailedPrecondition("index '" + ToString() + "' cannot screen part of its chunks");
}

Result<std::unique_ptr<ChunkIndex>> MakeChunkIndex(const std::string& spec, const ChunkShape& shape) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "index"));
  if (IsExact(fs)) {
    KVTIER_ASSIGN_OR_RETURN(ExactIndexOptions o, ExactIndexOptions::Parse(spec));
    KVTIER_ASSIGN_OR_RETURN(auto index, ExactChunkIndex::Create(shape, o));
    return std::unique_ptr<ChunkIndex>(std::move(index));
  }
  if (IsQuest(fs)) {
    KVTIER_ASSIGN_OR_RETURN(QuestIndexOptions o, QuestIndexOptions::Parse(spec));
    KVTIER_ASSIGN_OR_RETURN(auto index, QuestChunkIndex::Create(shape, o));
    return std::unique_ptr<ChunkIndex>(std::move(index));
  }
  KVTIER_ASSIGN_OR_RETURN(FaissIndexOptions o, FaissIndexOptions::Parse(spec));
  KVTIER_ASSIGN_OR_RETURN(auto index, FaissChunkIndex::Create(shape, o));
  return std::unique_ptr<ChunkIndex>(std::move(index));
}

Result<HeadMerge> ParseHeadMerge(const std::string& value, const std::string& spec) {
  if (value == "sum") return HeadMerge::kSum;
  if (value == "max") return HeadMerge::kMax;
  return InvalidArgument("bad value '" + value + "' for key 'heads' in index spec '" + spec +
                         "' (expected sum or max)");
}

const char* HeadMergeName(HeadMerge heads) { return heads == HeadMerge::kMax ? "max" : "sum"; }

Result<std::string> CanonicalChunkIndexSpec(const std::string& spec) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "index"));
  if (IsExact(fs)) {
    KVTIER_ASSIGN_OR_RETURN(ExactIndexOptions o, ExactIndexOptions::Parse(spec));
    return o.ToString();
  }
  if (IsQuest(fs)) {
    KVTIER_ASSIGN_OR_RETURN(QuestIndexOptions o, QuestIndexOptions::Parse(spec));
    return o.ToString();
  }
  KVTIER_ASSIGN_OR_RETURN(FaissIndexOptions o, FaissIndexOptions::Parse(spec));
  return o.ToString();
}

// ---- ranking ------------------------------------------------------------------------

namespace {

// The k-th largest of n order keys. For k much smaller than n (a layer's take out of its
// chunks), a min-heap of the k best seen so far: most keys are below its top and cost one
// comparison. Otherwise nth_element on a copy (plain integers, no indirection through row
// indices, which cost as much as the Exact index's first stage itself).
uint32_t KthLargestKey(const uint32_t* key, int64_t n, int64_t k) {
  if (k * 16 <= n) {
    std::vector<uint32_t> heap(key, key + k);
    std::make_heap(heap.begin(), heap.end(), std::greater<uint32_t>());  // heap.front() = smallest
    for (int64_t i = k; i < n; ++i)
      if (key[i] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<uint32_t>());
        heap.back() = key[i];
        std::push_heap(heap.begin(), heap.end(), std::greater<uint32_t>());
      }
    return heap.front();
  }
  const auto sel = std::make_unique_for_overwrite<uint32_t[]>(static_cast<size_t>(n));
  std::copy(key, key + n, sel.get());
  std::nth_element(sel.get(), sel.get() + (k - 1), sel.get() + n, std::greater<uint32_t>());
  return sel[k - 1];
}

}  // namespace

float KthLargest(const float* v, int64_t n, int64_t k) {
  if (n <= 0 || k <= 0) return std::numeric_limits<float>::infinity();
  if (k > n) return -std::numeric_limits<float>::infinity();
  const auto key = std::make_unique_for_overwrite<uint32_t[]>(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) key[i] = OrderKey(v[i]);
  const uint32_t t = KthLargestKey(key.get(), n, k);
  for (int64_t i = 0; i < n; ++i)
    if (key[i] == t) return v[i];
  return v[0];  // unreachable: t is one of the keys
}

// The k-th best order key, then one pass keeps every row above it and the first rows equal to
// it.
void TopRowsAscending(const float* score, int64_t n, int64_t k, std::vector<int64_t>* rows) {
  rows->clear();
  if (k <= 0 || n <= 0) return;
  if (k >= n) {
    rows->resize(n);
    std::iota(rows->begin(), rows->end(), 0);
    return;
  }
  // Written before it is read: no zero-fill (it is a hot loop's buffer).
  const auto scratch = std::make_unique_for_overwrite<uint32_t[]>(static_cast<size_t>(n));
  uint32_t* key = scratch.get();
  for (int64_t i = 0; i < n; ++i) key[i] = OrderKey(score[i]);
  const uint32_t t = KthLargestKey(key, n, k);
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

std::vector<uint64_t> TakeBest(const std::vector<float>& rank, const std::vector<uint64_t>& ids,
                               size_t take) {
  const size_t t = std::min(rank.size(), take);
  std::vector<int64_t> rows;
  TopRowsAscending(rank.data(), static_cast<int64_t>(rank.size()), static_cast<int64_t>(t), &rows);
  // Ascending rows in, so a stable sort by score keeps ties in chunk order.
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) { return rank[a] > rank[b]; });
  std::vector<uint64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = ids[rows[i]];
  return out;
}

}  // namespace kvtier
