// QuestChunkIndex: the "Quest" index kind, a query-aware per-chunk bound after Quest (Tang et
// al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024:
// per page the element-wise minimum and maximum of its keys, and a page's criticality for the
// current query the largest q.k any key inside that box could give; the paper is not in
// ../shared/papers, so its equation and algorithm numbers are not cited here).
//
// Per chunk c and head h the index keeps, in fp32, the element-wise minimum m_{c,h} and maximum
// M_{c,h} of the chunk's representatives ([R, heads, head_dim], ChunkIndex::Add). They are the
// minimum and maximum of the chunk's keys when every key is a representative (StoreOptions::
// repr_topk = chunk_size: what `kvtier run --compare`'s Quest row uses, since an index only sees
// representatives); with fewer representatives they bound those keys only. For a probe p:
//   u_h(c) = sum_d max(p_{h,d} m_{c,h,d}, p_{h,d} M_{c,h,d})  >=  max_t <p_h, k_{c,t,h}>
// (every key lies in the box, and the sum takes each coordinate's larger product), computed as
// one fp32 dot of 2 x head_dim: <max(p_h, 0), M_{c,h}> + <min(p_h, 0), m_{c,h}>. So the bound
// holds up to that dot's fp32 rounding. The heads fold as the Exact kind folds them:
//   logit(c)  = fold_h u_h(c)                      (heads=sum: the sum; heads=max: the largest)
//   cosine(c) = fold_h u_h(c) / (|p_h| r_{c,h}),   r_{c,h} = sqrt(sum_d max(m_d^2, M_d^2)),
// r being the norm of the box's farthest corner, so each head's term is in [-1, 1] (u_h is p_h's
// dot with one corner of the box); heads=sum averages the terms, as Exact's cosines do. A zero
// probe head or an all-zero box gives cosine 0.
//
// Screen is Score (exact for this definition: there is no second stage); Best sorts it; Search
// is the default (Screen, then Best by logit). ScoreChunks and BestOf score chosen chunks alone;
// GatherSubset and ScreenRows are not served (FailedPrecondition, the interface's default).
//
// Memory per chunk and head: 2 x head_dim floats (M, then m) plus r: (2 head_dim + 1) x 4 bytes,
// and an 8-byte id per chunk. read_bytes(): Score reads every row (first stage), ScoreChunks and
// BestOf the rows they score (rescoring).
//
// Spec: "Quest[:heads=sum|max]" (default heads=sum). Bad keys and values are InvalidArgument
// naming them. Thread-safety: as ChunkIndex (one writer; const calls concurrently).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "retrieval/chunk_index.h"

namespace kvtier {

struct QuestIndexOptions {
  using HeadMerge = kvtier::HeadMerge;
  HeadMerge heads = HeadMerge::kSum;  ///< "heads": how the heads' bounds combine

  /// From an index spec "Quest[:heads=sum|max]".
  static Result<QuestIndexOptions> Parse(const std::string& spec);
  /// "Quest:heads=sum" or "Quest:heads=max".
  std::string ToString() const;
};

class QuestChunkIndex final : public ChunkIndex {
 public:
  /// InvalidArgument naming the field for a bad shape.
  static Result<std::unique_ptr<QuestChunkIndex>> Create(const ChunkShape& shape,
                                                         const QuestIndexOptions& options);

  using ChunkIndex::Add;
  /// Chunks ascending, each above every chunk indexed so far (InvalidArgument naming the chunk
  /// otherwise); NotFound from `read` skips the chunk (a hole); a non-finite representative is
  /// InvalidArgument naming the chunk. All or nothing.
  Status Add(const std::vector<uint64_t>& chunks, const ReprReader& read) override;
  Status Remove(const std::vector<uint64_t>& chunks) override;
  void Reserve(size_t chunks) override;
  /// Every chunk's bound (logit) and its cosine, as the header comment defines them.
  Status Score(const float* probe, ChunkScores* out) const override;
  /// The take best of `screened` (Score's answer) by `rank`.
  Status Best(const float* probe, const ChunkScores& screened, ChunkRank rank, size_t take,
              std::vector<uint64_t>* out) const override;
  Status BestOf(const float* probe, const std::vector<uint64_t>& chunks, ChunkRank rank, size_t take,
                std::vector<uint64_t>* out) const override;
  Status ScoreChunks(const float* probe, const std::vector<uint64_t>& chunks,
                     ChunkScores* out) const override;
  size_t size() const override { return ids_.size(); }
  uint64_t memory_bytes() const override;
  IndexReadBytes read_bytes() const override {
    return IndexReadBytes{first_stage_bytes_.load(std::memory_order_relaxed),
                          rescoring_bytes_.load(std::memory_order_relaxed)};
  }
  std::string ToString() const override { return options_.ToString(); }

 private:
  QuestChunkIndex(const ChunkShape& shape, const QuestIndexOptions& options)
      : ChunkIndex(shape), options_(options) {}
  // The probe split per head into [max(p_h, 0); min(p_h, 0)] ([heads, 2 D]) and each head's norm.
  struct SplitProbe {
    std::vector<float> halves;
    std::vector<float> norm;
  };
  Status Split(const float* probe, const char* who, SplitProbe* out) const;
  // Row `row`'s logit and cosine for the split probe.
  void ScoreRow(const SplitProbe& p, size_t row, float* logit, float* cosine) const;
  uint64_t RowBytes() const;  // what scoring one row reads

  const QuestIndexOptions options_;
  std::vector<uint64_t> ids_;  // [rows] ascending chunk indices
  std::vector<float> box_;     // [rows, heads, 2 D]: M (max), then m (min)
  std::vector<float> corner_;  // [rows, heads]: r, the norm of the box's farthest corner
  mutable std::atomic<uint64_t> first_stage_bytes_{0};
  mutable std::atomic<uint64_t> rescoring_bytes_{0};
};

}  // namespace kvtier
