// ExactChunkIndex: the "Exact" index kind. Every representative key is kept, and a chunk is
// scored by its best representative per kv head, combined over the heads:
//   logit(c)  = fold_h max_r <p_h, k_{c,r,h}>                  (InfLLM's q.k, best key per head)
//   cosine(c) = fold_h max_r cos(p_h, k_{c,r,h})               (ActQKV Eq. 10 per head)
// with fold = sum (heads=sum; the cosines averaged, so they stay in [-1, 1]) or max
// (heads=max: the most interested head decides). On the needle workload the best key finds
// the needle where a mean over the representatives dilutes it (at 32K: needle hit 1.0 vs
// 0.49 with Flat). heads=max: attention is per head, and a chunk one head needs badly (an
// induction head copying the needle) matters even when the other heads ignore it; under the
// sum their indifference drowns it (kvtier-llama passkey, docs/retrieval.md).
//
// repr=mean (with heads=sum: InfLLM's block score, Xiao et al. 2024, "InfLLM", the relevance of
// the current tokens to a memory unit in its memory lookup, q . k summed over the unit's
// representatives, which InfLLM's ContextManager averages over them; the paper is not in
// ../shared/papers, so its equation number is not cited here):
//   logit(c)  = sum_h (1/R) sum_r <p_h, k_{c,r,h}> = sum_h <p_h, kbar_{c,h}>,
//   cosine(c) = (1/H) sum_h cos(p_h, kbar_{c,h}),        kbar_{c,h} = (1/R) sum_r k_{c,r,h},
// so each chunk and head keeps the one key kbar (fp32), and every stage below runs on it as on
// a single representative. With representatives per query head (StoreOptions::repr_heads =
// query) h runs over the query heads and p_h is query head h's probe.
//
// Storage, per kv head so that one head's keys are contiguous:
//   - the keys in the store's dtype (the chunk's own values, nothing lost) and the inverse
//     norm of each;
//   - int8 codes of the same keys, in blocks of kernels::kI8Block lanes (see DotI8Blocks):
//     block g*R + r holds representative r of chunks [8g, 8g+8), one chunk per lane, so a
//     chunk's best representative is an element-wise max over R consecutive blocks, with a
//     code scale per key (and that scale times the inverse norm, for cosines);
//   - with screen=int4, also 4-bit codes of the same keys (kernels::QuantizeI4, a scale per key,
//     its cosine scale), in blocks of 8 lanes laid out as the int8 ones (see DotI4Blocks), a
//     group's R blocks consecutive: half the int8 blocks' bytes.
//
// Search in two stages (rerank=F > 0, the default F=1, rerank_min=N=0):
//   Screen: every chunk scored from the int8 codes (half the bytes of fp16 keys; the search
//     is memory-bound), with AVX-512 VNNI / AVX2 integer dots; the allocator sees these. With
//     each score comes a bound on its error (ChunkScores::logit_error, cosine_error): a key
//     element is off by at most half its code step and a probe element by half its int16
//     step, so |<p, k> - screened| <= scale_k (ps (|p16|_1 / 2 + 64 D) + rounding), with
//     scale_k the key's code step and ps the probe's; the max over representatives and the
//     fold over heads move by no more than the largest (max) or the sum (sum) of these.
//   Best:   the chunks the bound cannot rule out are rescored from the stored keys (converted
//     exactly, fp32 arithmetic) and the take best of them returned: every chunk whose
//     screened score plus its bound reaches the take-th largest screened-minus-bound. Each
//     chunk of the exact top take has an exact score at least that large, so the choice is
//     the single fp32 pass's, with as many candidates as the scores' spread needs (a few
//     times take when the scores are spread out, more when many are within the code error).
//     F and N add the best max(F x take, N) screened chunks to the candidates (for
//     comparisons; the bound alone makes the choice exact).
//   RefineForEntropy, between the two (the entropy allocator's path): Eq. 11 of the screened
//     cosines is certified within a target of Eq. 11 of the exact ones by rescoring, from the
//     stored keys, the chunks that contribute most to SoftmaxEntropyErrorBound (budget.h): the
//     chunks of large softmax weight and error first, the top of the ranking among them. Their
//     exact scores replace the screened ones (error 0, ChunkScores::exact_rows) and Best reuses
//     them without reading the keys again.
// rerank=0: Screen is that fp32 pass over every chunk, and Best sorts it. Score is always
// the fp32 pass.
//
// screen=int4 (rerank > 0): three stages, each with a bound.
//   Screen: every chunk scored from the 4-bit codes (DotI4Blocks, the same int16 probe), with
//     the int8 bound's reasoning at the 4-bit step: a key element within half its code step s4
//     (= max|k| / 7), a probe element within half its int16 step ps times |code| <= 7, so
//     |<p, k> - screened| <= s4 (ps (|p16|_1 / 2 + D / 2 + 4 D) + rounding), rounding as above
//     with max|k| = 7 s4. A compressed row's exact score is its int8 codes' (the cap dropped
//     its keys), so its bound adds the int8 one: |screened - exact8| <= e4 + e8.
//   Best:   C1 = the chunks whose int4 score + bound reaches the take-th largest int4 score -
//     bound. The take chunks of C1 with the best int4 scores (and C1's other chunks in their
//     8-row groups) are rescored from the int8 codes first (QuantizedScores' kernel and bound, on the groups
//     that hold them; a row RefineForEntropy made exact keeps its exact score, error 0); tau' = the take-th
//     largest of their int8 scores - bound. C1' = those and the chunks of C1 whose int4 score + bound reaches
//     tau', rescored from the int8 codes; C2 = the chunks of C1' whose int8 score + bound reaches the take-th
//     largest int8 score - bound among C1', plus C1''s best max(F x take, N) by int8 score; C2 rescored in
//     fp32 (ScoresOf) and its take best returned. The choice is the single fp32 pass's: let T be the fp32 top
//     take (ties to the smaller chunk). (1) At least take chunks have exact >= their int4 lower bound, so the
//     take-th largest exact score is >= tau1, the take-th largest int4 lower bound; each t in
//     T has upper bound >= exact >= tau1: T is in C1. (1') Likewise take chunks have exact >=
//     their int8 lower bound >= ... >= tau', so each t in T has int4 upper bound >= tau': T is
//     in C1'. (tau' sits an int8 bound below the take-th exact score where tau1 sits two int4
//     bounds below it: C1' is the smaller set.) (2) T is also the top take of C1' (a subset
//     holding it), so the same argument over C1' with the int8 bounds puts T in C2. (3)
//     TakeBest over C2 by exact scores, ties to the smaller chunk, is T, as C2 holds T and
//     every chunk of C2 outside T scores below T's last or ties it from a larger chunk index. The int8 stage
//     reads the whole 8-row groups that hold a row it rescores (counted as rescoring bytes, 8 CodeRowBytes()
//     a group, per pass); rescored_chunks() counts the fp32 stage, code_rescored_chunks() the int8 one.
//     RefineForEntropy and ScreenRows work on the int4 screen's scores and bounds as on the int8 ones.
//
// Remove compacts the rows (they keep their ascending chunk order, hence the tie order) and
// moves the kept rows' int8 codes into their new lanes; the result scores exactly as an index
// built afresh from the kept chunks.
//
// Memory (per chunk and kv head, R representatives of D dims, e bytes a key element):
//   keys R*D*e + inverse norms 4R  ("full" part)  |  int8 codes R*D + code scales 8R  |  id 8/H
//   |  with screen=int4, 4-bit codes R*ceil(D/4)*2 + their scales 8R.
// Vectors grow by an eighth (never double), so memory_bytes() stays within ~1/8 of the rows'
// bytes. A memory cap (SetMemoryCap, StoreOptions::index_bytes / layers) is checked after
// every chunk Add indexes; over it the index first COMPRESSES its oldest chunks (drops their
// stored keys and norms: they are scored from their int8 codes, dequantised, code x scale, in
// fp32, by Score and by Best's rescoring alike, so the two stages agree on them; with
// screen=int4 they keep their 4-bit codes too, and the int4 screen's bound grows by the int8
// one for them, see above), and once
// every chunk is compressed it EVICTS the oldest chunks (a multiple of 8, counted by
// evicted_chunks()): they are never chosen again. Each step frees down to 7/8 of the cap, so
// it runs about once per cap/8 bytes of new chunks. With a backend mirror the backend scores
// stored keys, so the cap evicts directly (no compression). The result depends only on the
// sequence of chunks, not on how Add batched them: a rebuild after a reopen or an attach (one
// Add of every chunk) ends in the state the incremental Adds reached.
//
// A backend mirror (AttachBackend, retrieval/device_scorer.h): the representatives and inverse
// norms also kept on a retrieval backend in kernels::ChunkScoreParams' layout, so that a layer's
// selection (SelectOnBackend) runs there: scoring, Eq. 11 and the top-k, one synchronisation.
// The Retriever attaches one when the store's hot tier is on "cuda"; host tiers keep the two-stage
// search above (faster on a CPU than one fp32 pass, and without a second copy of every key).
// The mirror path is always one exact pass: it chooses what rerank=0 chooses, whatever rerank
// says. Add and Remove keep the host rows as before and mark the first row they changed; the
// mirror takes the rows from there before the next selection (SyncMirror).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "retrieval/chunk_index.h"
#include "retrieval/device_scorer.h"

namespace kvtier {

struct ExactIndexOptions {
  using HeadMerge = kvtier::HeadMerge;
  HeadMerge heads = HeadMerge::kSum;  ///< "heads": how the kv heads' best scores combine
  /// "repr": how a head's representatives make its score: kMax, the best one's (default);
  /// kMean, their mean logit, InfLLM's block score (the header's "repr=mean").
  enum class ReprFold { kMax, kMean };
  ReprFold repr = ReprFold::kMax;
  /// "rerank": > 0, the int8 pass screens every chunk and the chunks its error bound cannot
  /// rule out, plus its best max(rerank_factor x take, rerank_min), are rescored from the
  /// stored keys; 0 = one fp32 pass over every chunk. Default: 1.
  int rerank_factor = 1;
  int rerank_min = 0;  ///< "rerank_min". Default: 0.
  /// "theta": > 0, the entropy path's Θ (Eq. 11) is certified within this many nats of the fp32
  /// Θ (RefineForEntropy rescores the chunks that weigh most in it until
  /// SoftmaxEntropyErrorBound is within it; docs/retrieval.md, "The exactness contract"); 0 = the
  /// screened cosines' Θ, no certificate. Default: 0 (the certificate at 1e-3 doubles the 128K
  /// decode step on a CPU). In [0, 1].
  double theta_error = 0.0;
  /// "screen": the codes the first stage reads (rerank > 0; rerank = 0 ignores it). kInt8:
  /// int8 codes, then the fp32 rescoring. kInt4: 4-bit codes (half the bytes), then the int8
  /// codes, then fp32, each stage ruling chunks out by its error bound (the header's
  /// "screen=int4"; the choice stays the fp32 pass's). Default: kInt8.
  enum class ScreenCodes { kInt8, kInt4 };
  ScreenCodes screen = ScreenCodes::kInt8;

  /// From an index spec
  /// "Exact[:heads=sum|max,repr=max|mean,rerank=F,rerank_min=N,theta=E,screen=int8|int4]" (F, N >= 0,
  /// E in [0, 1]).
  static Result<ExactIndexOptions> Parse(const std::string& spec);
  /// "Exact:heads=sum,rerank=1,rerank_min=0": every key spelled out, ",repr=mean" after heads
  /// under kMean, ",theta=E" when E > 0 and ",screen=int4" under kInt4.
  std::string ToString() const;
};

class ExactChunkIndex final : public ChunkIndex {
 public:
  static Result<std::unique_ptr<ExactChunkIndex>> Create(const ChunkShape& shape,
                                                         const ExactIndexOptions& options);

  using ChunkIndex::Add;
  Status Add(const std::vector<uint64_t>& chunks, const ReprReader& read) override;
  Status Remove(const std::vector<uint64_t>& chunks) override;
  void Reserve(size_t chunks) override;
  /// The fp32 pass over every chunk.
  Status Score(const float* probe, ChunkScores* out) const override;
  /// The int8 (screen=int8) or int4 (screen=int4) pass (rerank > 0), else Score.
  Status Screen(const float* probe, ChunkScores* out) const override;
  /// rerank > 0: rescores, from the stored keys, the chunks of `screened` whose error bound
  /// cannot rule them out of the take best by `rank`, plus its best max(rerank x take,
  /// rerank_min), and returns the take best of them (the single fp32 pass's choice); the rows in
  /// screened.exact_rows keep their (exact) scores unread. rerank = 0: the take best of `screened`.
  Status Best(const float* probe, const ChunkScores& screened, ChunkRank rank, size_t take,
              std::vector<uint64_t>* out) const override;
  /// rerank > 0: the chunks of the largest contributions to the Θ bound rescored from the
  /// stored keys, as Best rescores (counted in rescored_chunks() and the rescoring bytes), until
  /// the bound is <= max_error or every chunk is exact; rerank = 0: the scores are exact.
  Status RefineForEntropy(const float* probe, double max_error, ChunkScores* screened,
                          double* bound) const override;
  double entropy_error_target() const override { return options_.theta_error; }
  Status BestOf(const float* probe, const std::vector<uint64_t>& chunks, ChunkRank rank, size_t take,
                std::vector<uint64_t>* out) const override;
  Status ScoreChunks(const float* probe, const std::vector<uint64_t>& chunks,
                     ChunkScores* out) const override;
  /// The stored keys of `chunks` copied side by side; FailedPrecondition where one of them is
  /// compressed (its codes only).
  Status GatherSubset(const std::vector<uint64_t>& chunks,
                      std::unique_ptr<ChunkSubset>* subset) const override;
  /// The int8 pass over rows [begin, end) (rerank > 0), else the fp32 pass over them.
  Status ScreenRows(const float* probe, size_t begin, size_t end, ChunkScores* out) const override;
  size_t size() const override { return ids_.size(); }
  uint64_t memory_bytes() const override;
  /// Caps memory_bytes() (0 = unbounded); an index over the new cap shrinks at once.
  Status SetMemoryCap(uint64_t bytes) override;
  uint64_t memory_cap() const override { return cap_; }
  uint64_t compressed_chunks() const override { return full_from_; }
  uint64_t evicted_chunks() const override { return evicted_; }
  /// Chunks Best and RefineForEntropy have rescored from the stored keys, summed over their calls
  /// (a chunk Best takes from RefineForEntropy's exact_rows is not read, nor counted, again).
  uint64_t rescored_chunks() const { return rescored_.load(std::memory_order_relaxed); }
  /// screen=int4: the chunks Best rescored from their int8 codes (its middle stage), summed.
  uint64_t code_rescored_chunks() const { return code_rescored_.load(std::memory_order_relaxed); }
  /// Of rescored_chunks(), the chunks RefineForEntropy rescored.
  uint64_t entropy_rescored_chunks() const { return entropy_rescored_.load(std::memory_order_relaxed); }
  /// The first stage reads, per chunk, CodeRowBytes() (int8 screen), Int4RowBytes() (int4
  /// screen) or, for an fp32 pass, FullRowBytes() (CodeRowBytes() for a row the cap
  /// compressed); the rescoring FullRowBytes() a chunk and, under screen=int4, CodeRowBytes()
  /// for each row of the 8-row groups its int8 stage reads.
  IndexReadBytes read_bytes() const override;
  /// Per chunk, one int8 screen's read: R x kv_heads x (head_dim codes + a code scale and its
  /// cosine scale, 4 bytes each).
  uint64_t CodeRowBytes() const;
  /// Per chunk, one int4 screen's read: R x kv_heads x (ceil(head_dim / 4) x 2 code bytes + a
  /// code scale and its cosine scale, 4 bytes each).
  uint64_t Int4RowBytes() const;
  /// Per chunk, one fp32 pass's read: R x kv_heads x (head_dim keys in the store's dtype + an
  /// inverse norm, 4 bytes).
  uint64_t FullRowBytes() const;
  std::string ToString() const override { return options_.ToString(); }
  const ExactIndexOptions& options() const { return options_; }

  // ---- the backend mirror ----
  /// Keeps a mirror on `backend` from now on (it must outlive the index), uploading the rows
  /// indexed so far. InvalidArgument when one is attached already or the dtype cannot be scored there.
  Status AttachBackend(RetrievalBackend* backend);
  const ReprMirror* mirror() const { return mirror_.get(); }
  /// The chunk index of each row, ascending: row r of the mirror and of a top-k over it is
  /// chunk row_ids()[r]. Remove and the memory cap compact the rows.
  const std::vector<uint64_t>& row_ids() const { return ids_; }
  /// Whether a chunk's row holds its representatives as the store chose them (no repr=mean
  /// fold) and rows only come and go with the chunks (no memory cap evicting them): then a
  /// chunk not indexed yet may be scored as one more row from its representatives alone.
  bool RowsAreRepresentatives() const {
    return options_.repr != ExactIndexOptions::ReprFold::kMean && cap_ == 0;
  }
  /// The mirror brought in step with the rows (SyncMirror) as the scoring kernel reads it:
  /// ReprMirror::Params with the index's head fold. FailedPrecondition without a mirror.
  Result<kernels::ChunkScoreParams> MirrorView();
  /// Brings the mirror in step with the rows (a no-op without a mirror or changes).
  Status SyncMirror();
  /// One layer's selection on the backend: the min(k_max, size()) best chunks by `rank`, best
  /// first, ties to the smaller chunk index, and, when `entropy`, Eq. 11 of every chunk's
  /// cosine with the count of cosines that are not finite (both 0 otherwise).
  /// FailedPrecondition without a mirror; InvalidArgument for a null probe or out, k_max < 0.
  Status SelectOnBackend(const float* probe, ChunkRank rank, bool entropy, int k_max,
                         std::vector<uint64_t>* chunks, double* theta, int32_t* non_finite);
  /// The same from a decode query in the backend's memory: the backend builds the probe
  /// (BackendQueries) and checks q; *q_non_finite and *q_first get LayerSelectResult's
  /// q_non_finite and q_first_non_finite, and when q is not finite the chunks come back empty.
  /// With no rows a layer still checks q.
  Status SelectOnBackend(const BackendQueries& queries, ChunkRank rank, bool entropy, int k_max,
                         std::vector<uint64_t>* chunks, double* theta, int32_t* non_finite,
                         int32_t* q_non_finite, int32_t* q_first);

 private:
  ExactChunkIndex(const ChunkShape& shape, const ExactIndexOptions& options);
  // Writes representative r of the chunk at `row` into head h's int8 blocks (and int4 ones under
  // screen=int4), from its fp32 key.
  void PutQuantizedRow(int h, size_t row, int r, const float* key, float inv_norm);
  // Makes room for `more` rows, growing each vector where it is short to what it needs plus
  // `slack` of that (an eighth by default: a vector never doubles).
  void GrowForRows(size_t more, double slack = 0.125);
  // Keeps the rows `kept` (ascending) in that order, their codes moved lane by lane; every
  // vector ends exactly sized.
  void KeepRows(const std::vector<size_t>& kept);
  // Over the cap: compress, then evict, the oldest rows until memory_bytes() <= 7/8 of it.
  Status EnforceCap();
  // The fp32 logit and cosine of representative r of a compressed row, from its int8 codes.
  void DequantisedDot(int h, size_t row, int r, const float* p, float inv_p, float* dot, float* cos) const;
  // Rows from `row` on changed: the mirror takes them before the next selection.
  void MarkMirrorStale(size_t row);
  // The rows of `chunks` (those the index holds), ascending.
  std::vector<int64_t> RowsOf(const std::vector<uint64_t>& chunks) const;
  // The fp32 scores of the chunks at rows `rows` only (the rescoring stage); cosine null: the
  // logits alone (the same bits), without reading the inverse norms.
  void ScoresOf(const float* probe, const std::vector<int64_t>& rows, std::vector<float>* logit,
                std::vector<float>* cosine) const;
  // The first stage's scores (int8 or, under screen=int4, int4 codes) and their error bounds (see
  // "Search in two stages" above) for rows [begin, end), at [0, end - begin) of out's vectors.
  void QuantizedScores(const float* probe, size_t begin, size_t end, ChunkScores* out) const;
  // The int8 codes' scores by `rank` and their bounds for the rows `rows` (ascending), Best's
  // middle stage under screen=int4; returns the groups of 8 rows it read.
  size_t Int8ScoresOf(const float* probe, const std::vector<int64_t>& rows, ChunkRank rank,
                      std::vector<float>* score, std::vector<float>* error) const;
  // The probe's int16 codes, scales and the code bounds' steps per head (exact_index.cc).
  struct ProbeCodes;
  ProbeCodes QuantizeProbe(const float* probe) const;
  // Head h's best representative per lane of group g from the int4 (int4 = true) or int8 codes:
  // the logit and cosine (probe scales applied) and their error bounds, 8 lanes each.
  void GroupBest(bool int4, size_t g, int h, const ProbeCodes& pc, int32_t* dots, float* logit, float* cos,
                 float* logit_error, float* cos_error) const;
  // Rows (ascending) of the chunks Best rescores: those whose score + error reaches the take-th
  // largest score - error, and the best at_least by score; with no errors (exact scores) the
  // best max(take, at_least).
  static void CandidateRows(const std::vector<float>& score, const std::vector<float>& error, size_t take,
                            int64_t at_least, std::vector<int64_t>* rows);
  void FullScores(const float* probe, std::vector<float>* logit, std::vector<float>* cosine) const;
  // What an fp32 pass over `rows` reads: FullRowBytes() a row, CodeRowBytes() for compressed ones.
  uint64_t ExactPassBytes(const std::vector<int64_t>& rows) const;

  const ExactIndexOptions options_;
  // The rows' layout: shape() itself, or under repr=mean {heads, head_dim, 1 key, fp32}.
  const ChunkShape stored_;
  std::vector<uint64_t> ids_;                          // [n] chunk index of each row, ascending
  size_t full_from_ = 0;                               // rows below it are compressed (int8 codes only)
  std::vector<std::vector<uint8_t>> repr_;             // [H][n - full_from_, R, D] in the store's dtype
  std::vector<std::vector<float>> inv_norm_;           // [H][n - full_from_, R]
  uint64_t cap_ = 0;                                   // memory cap in bytes (0 = unbounded)
  uint64_t evicted_ = 0;                               // rows the cap evicted
  mutable std::atomic<uint64_t> rescored_{0};          // rescored_chunks()
  mutable std::atomic<uint64_t> entropy_rescored_{0};  // entropy_rescored_chunks()
  mutable std::atomic<uint64_t> code_rescored_{0};     // code_rescored_chunks()
  // read_bytes(): the first stage's and the rescoring's bytes, added once per call.
  mutable std::atomic<uint64_t> first_stage_bytes_{0}, rescoring_bytes_{0};
  std::vector<std::vector<int8_t>> q8_;       // [H] int8 blocks
  std::vector<std::vector<float>> q8_scale_;  // [H][block * 8 + lane]: the row's code scale (0 in padding)
  std::vector<std::vector<float>> q8_cos_scale_;  // [H][block * 8 + lane]: code scale times inverse norm
  const bool int4_;                               // screen=int4 with rerank > 0: the int4 codes below kept
  std::vector<std::vector<uint8_t>> q4_;          // [H] int4 blocks (kernels::I4BlockBytes each)
  std::vector<std::vector<float>> q4_scale_;      // [H][block * 8 + lane]: the 4-bit code scale
  std::vector<std::vector<float>> q4_cos_scale_;  // [H][block * 8 + lane]: that times the inverse norm
  std::unique_ptr<ReprMirror> mirror_;            // null: no backend attached
  size_t mirror_stale_from_ = 0;                  // rows from here may differ in the mirror (SIZE_MAX: none)
  LayerSelectResult backend_result_;              // SelectOnBackend's scratch (reused)
  Status RunOnBackend(LayerSelectPlan plan, int k_max, std::vector<uint64_t>* chunks, double* theta,
                      int32_t* non_finite);
};

}  // namespace kvtier
