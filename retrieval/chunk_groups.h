// ChunkGroupBounds: certified upper bounds on the scores of groups of consecutive chunks, the
// hierarchy of ExactChunkIndex's "groups" key (issue 47; an experiment, off by default).
//
// Rows [g G, (g + 1) G) of an index form group g (the last one may be short). Per group and kv
// head two balls are kept, each a centre c (fp32) and a radius r that hold every representative
// key of the group's chunks:
//   raw:  the keys k themselves                       <p, k>              <= <p, c> + |p| r
//   unit: k times its stored inverse norm (a zero     <p, k> inv|k| / |p| <= <p, c> / |p| + r
//         key: the zero vector, cosine 0)
// (Cauchy-Schwarz on k - c). A chunk's best representative per head is below its group's head
// bound, and the fold over heads (a sum, the cosines times 1/H, or a max) is monotone, so the
// fold of the head bounds is above every chunk of the group's score. UpperBounds adds margins
// for the fp32 rounding of the exact pass (ScoresOf: a dot of D products, an inverse norm, the
// fold), each 16 times the worst case, so a bound is above the score that pass computes too,
// not only above the real number. A group holding a key that is not finite is bounded by +inf
// (never skipped); a probe that is not finite gives NaN bounds (never skipped either: callers
// skip only where bound < threshold holds).
//
// The radius is measured from the centre as stored (rounded to fp32) in double and rounded up,
// so rounding the centre costs nothing in validity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/cpu/chunk_score.h"
#include "retrieval/budget.h"  // ChunkRank

namespace kvtier {

class ChunkGroupBounds {
 public:
  /// Fills keys ([R, D] fp32, the row's stored keys exactly) and inv_norm ([R], the inverse
  /// norms the exact pass uses) of kv head h at `row`.
  using RowKeys = std::function<void(int h, size_t row, float* keys, float* inv_norm)>;

  /// Groups of `group_rows` rows of chunks with `repr` keys of `head_dim` per kv head.
  ChunkGroupBounds(int kv_heads, int head_dim, int repr, int group_rows);

  int group_rows() const { return group_rows_; }
  size_t groups() const { return groups_; }
  /// The index holds `rows` rows and rows from `first_changed` on are new or moved: recomputes
  /// the groups from first_changed's on (reading their rows through `keys`) and drops the
  /// groups beyond the last row.
  void Update(size_t rows, size_t first_changed, const RowKeys& keys);
  /// upper[g] for every group g: a bound on the `rank` score (the fold `fold` over heads) of
  /// every chunk of group g for `probe` ([kv_heads, head_dim] fp32), see the header comment.
  void UpperBounds(const float* probe, kernels::HeadFold fold, ChunkRank rank,
                   std::vector<float>* upper) const;
  /// Bytes one UpperBounds call reads (every group's centres and radii).
  uint64_t BoundBytes() const;
  uint64_t memory_bytes() const;

 private:
  const int heads_, dim_, repr_, group_rows_;
  size_t groups_ = 0;
  // Per head h: [groups][D] centres and [groups] radii, for the raw and the unit keys. A radius
  // of +inf marks a group with a key that is not finite.
  std::vector<std::vector<float>> raw_centre_, unit_centre_;
  std::vector<std::vector<float>> raw_radius_, unit_radius_;
};

}  // namespace kvtier
