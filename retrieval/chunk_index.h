// ChunkIndex: the search structure behind retrieval, one per (sequence, layer): the interface
// every index kind implements, and the factory that picks the kind from a spec string.
//
// A chunk enters an index as its R representative keys, [R, kv_heads, head_dim] fp32, the
// layout TieredStore::GetRepresentatives gives; each kind builds its own representation from
// them. For a probe ([kv_heads, head_dim] fp32, one layer's) an index gives (a store whose
// representatives are per query head, StoreOptions::repr_heads = query, makes every "kv_heads"
// here q_heads: ChunkShape::kv_heads counts the heads the representatives and probes are per):
//   - Score: every chunk's scores, exactly: the logit (InfLLM's q.k, as the kind defines a
//     chunk's key) and the ActQKV Eq. 10 cosine s_i = Q_probe . K[i] / (|Q_probe| |K[i]|);
//   - Screen: every chunk's scores as the allocator should see them (Eq. 10-12 take the
//     cosines): Score itself, or a cheaper approximation that Best then refines;
//   - Best: the `take` best chunks by the allocator's rank (cosine or logit, budget.h), best
//     first, ties to the smaller chunk index;
//   - Search: the top k by logit, for allocators that do not score every chunk (topk), so
//     approximate kinds stay sub-linear.
// Chunks leave with Remove (after TieredStore::DropChunks) and are never returned again.
//
// Kinds, chosen by the spec string (the factory-string syntax of store/factory_spec.h; the
// name may hold commas, as FAISS descriptions do: "IVF1024,Flat:nprobe=32"):
//
//   Exact[:heads=sum|max,repr=max|mean,rerank=F,rerank_min=N,theta=E,screen=int8|int4] (exact_index.h)
//       Every representative key is kept, in the store's dtype, plus int8 codes of it. A
//       chunk's score is its best representative per kv head, the heads summed (heads=sum;
//       cosines averaged, so they stay in [-1, 1]) or the most interested head's (heads=max).
//       repr=mean: a head's score is the mean logit over its representatives (InfLLM's block
//       score), kept as one fp32 mean key per chunk and head.
//       Screen reads the int8 codes, with a bound on each score's error; Best rescores from the
//       stored keys (fp32 arithmetic) the chunks the bound cannot rule out, plus the best
//       max(F x take, N) screened, so it chooses what one exact pass would. rerank=0: Screen is
//       the exact pass and Best sorts it. screen=int4: Screen reads 4-bit codes (half the
//       bytes) with their bound, and Best rescores from the int8 codes, then from the stored
//       keys, the chunks each bound cannot rule out: the same choice.
//       Defaults: heads=sum,rerank=1,rerank_min=0,screen=int8. Under a memory cap
//       (SetMemoryCap) the oldest chunks keep only their int8 codes, then the oldest are evicted.
//   <FAISS index_factory description>[:nprobe=N,ef=N,train_min=N]        (faiss_index.h)
//       "Flat", "HNSW32", "IVF<n>,Flat", ...: one vector per chunk, the mean of its
//       representatives with the kv heads concatenated, not normalised, so the inner product
//       is InfLLM's score (the sum of q.k over the representatives, over R). nprobe: IVF
//       lists searched [16]; ef: HNSW search breadth [64]; train_min: vectors collected
//       before training [0 = FAISS's rule of thumb]; each key only where it applies.
//       heads=sum is accepted (the concatenated inner product is the sum over heads);
//       heads=max is refused.
//   Quest[:heads=sum|max]                                                (quest_index.h)
//       Per chunk and head the element-wise min and max of its representatives (its keys when
//       every key is one, repr_topk = chunk_size); a head's score is the largest q.k a key in
//       that box could give, sum_d max(q_d min_d, q_d max_d), an upper bound of the chunk's best
//       key (Quest, Tang et al. 2024), the heads folded as Exact folds them. Default heads=sum.
//
// ToString() gives the canonical spec, every key of the kind spelled out, and the spec
// rebuilds an equal index (empty). Bad specs are InvalidArgument naming the key or value.
//
// Thread-safety: one writer at a time (Add, Remove); const methods may run concurrently with
// each other but not with a writer. The Retriever serialises them per sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "retrieval/budget.h"  // ChunkRank
#include "store/status.h"

namespace kvtier {

/// What one chunk's representatives look like: `repr` keys per kv head, given as
/// [repr, kv_heads, head_dim] fp32 (TieredStore::GetRepresentatives), read from a store that
/// holds keys in `dtype`.
struct ChunkShape {
  int kv_heads = 0;  ///< heads of a representative and a probe: q_heads under repr_heads = query
  int head_dim = 0;
  int repr = 0;               ///< R: representatives per chunk and kv head (StoreOptions::repr_topk)
  DType dtype = DType::kF32;  ///< the store's key dtype
  Status Validate() const;    ///< every count > 0, head_dim <= 4096; names the bad field
  size_t repr_floats() const { return static_cast<size_t>(repr) * kv_heads * head_dim; }
  int dim() const { return kv_heads * head_dim; }  ///< a probe's length
};

/// How a kind folds its heads' chunk scores into one (index key "heads"): the sum, where every
/// head's interest counts, or the largest, where the most interested head decides.
enum class HeadMerge { kSum, kMax };
/// The value of an index spec's "heads" key: "sum" or "max"; else InvalidArgument naming the
/// value and `spec`.
Result<HeadMerge> ParseHeadMerge(const std::string& value, const std::string& spec);
/// "sum" or "max".
const char* HeadMergeName(HeadMerge heads);

class ChunkIndex;
struct ChunkScores;

/// Chosen chunks' representatives gathered side by side, to be scored for probe after probe:
/// a reused search's shortlist (Retriever::ReuseLast), whose chunks lie scattered over the
/// index's rows. A copy: it scores what the index held when it was made, exactly as the
/// index's ScoreChunks scored those chunks then, bit for bit.
class ChunkSubset {
 public:
  virtual ~ChunkSubset();
  /// The subset's exact scores for `probe` ([kv_heads, head_dim] fp32), ids ascending. Not a
  /// whole screen: Best refuses it.
  virtual Status Score(const float* probe, ChunkScores* out) const = 0;
  virtual size_t size() const = 0;            ///< chunks in the subset
  virtual uint64_t memory_bytes() const = 0;  ///< what the copy holds
  /// Bytes its Score calls read (keys and what scores them), summed over the calls; 0 for kinds
  /// that do not count.
  virtual uint64_t read_bytes() const { return 0; }
};

/// Scores of an index's chunks for one probe, rows in ascending chunk index. Reusing one
/// object across calls keeps its buffers (and, for the same index, its ids) allocated.
struct ChunkScores {
  std::vector<uint64_t> ids;  ///< chunk indices
  std::vector<float> logit;   ///< the raw inner product (attention logit; InfLLM's score)
  std::vector<float> cosine;  ///< ActQKV Eq. 10, in [-1, 1]
  const std::vector<float>& by(ChunkRank r) const { return r == ChunkRank::kLogit ? logit : cosine; }
  /// Set by a screen that approximates: a bound on |screened - exact| per chunk, for each
  /// score (ExactChunkIndex's int8 pass). Empty when the scores are the exact ones.
  std::vector<float> logit_error;
  std::vector<float> cosine_error;
  const std::vector<float>& error_by(ChunkRank r) const {
    return r == ChunkRank::kLogit ? logit_error : cosine_error;
  }
  /// Rows (ascending) whose scores RefineForEntropy replaced with the exact ones (their errors
  /// 0), so that Best need not score them again. Cleared by Score and Screen.
  std::vector<int64_t> exact_rows;
  /// Set by Score/Screen: which index, in which of its states (changed by every Add or
  /// Remove), the scores are of. Best refuses scores of another index or state.
  const ChunkIndex* index = nullptr;
  uint64_t generation = 0;
};

/// The bytes an index's reads touched, summed over its calls since it was created: what a step's
/// byte floor counts (kvtier run, "bytes by part"). Counted per call from row counts, never per
/// element. `first_stage`: the pass over every chunk the allocator sees (Screen, ScreenRows, and
/// Score, an fp32 pass over every chunk); `rescoring`: the chunks scored again from their stored
/// keys (Best's second stage, BestOf, ScoreChunks, GatherSubset's copy). A kind that does not
/// count reports 0 (the default); the FAISS kinds count their exhaustive scans only.
struct IndexReadBytes {
  uint64_t first_stage = 0;
  uint64_t rescoring = 0;
};

/// Fills `repr` ([R, kv_heads, head_dim] fp32) with the representative keys of `chunk`.
/// NotFound means the chunk is a hole (nothing to index); any other error stops Add.
using ReprReader = std::function<Status(uint64_t chunk, float* repr)>;

class ChunkIndex {
 public:
  virtual ~ChunkIndex();
  ChunkIndex(const ChunkIndex&) = delete;
  ChunkIndex& operator=(const ChunkIndex&) = delete;

  /// Indexes `chunks` (ascending, each above every chunk indexed so far), reading each one's
  /// representatives through `read`. One call is one batch (the FAISS kinds insert it with
  /// one FAISS call). All or nothing: on an error nothing of the batch stays indexed.
  virtual Status Add(const std::vector<uint64_t>& chunks, const ReprReader& read) = 0;
  /// Indexes one chunk whose representatives ([R, kv_heads, head_dim] fp32) are at hand.
  Status Add(uint64_t chunk, const float* repr);
  /// Makes room for `chunks` more chunks that Adds in several batches will bring (a first sync
  /// over a long sequence), so that the index grows to them once instead of batch by batch,
  /// each growth a copy and a freed block the allocator may keep. A hint: an index under a
  /// memory cap, or a kind that cannot reserve, ignores it.
  virtual void Reserve(size_t chunks) { (void)chunks; }
  /// Takes chunks out of the index; chunk indices it does not hold are ignored.
  virtual Status Remove(const std::vector<uint64_t>& chunks) = 0;

  /// Every chunk's logit and cosine, computed exactly. probe: [kv_heads, head_dim] fp32.
  virtual Status Score(const float* probe, ChunkScores* out) const = 0;
  /// Every chunk's scores as the allocator sees them; Best refines them. Default: Score.
  virtual Status Screen(const float* probe, ChunkScores* out) const { return Score(probe, out); }
  /// Makes Eq. 11 of `screened`'s cosines (Screen's answer for the same probe) certified within
  /// `max_error` nats of Eq. 11 of the exact cosines: while SoftmaxEntropyErrorBound (budget.h)
  /// of the cosines and their error bounds exceeds it, the chunks of the largest contributions
  /// are scored exactly and their scores replace the screened ones (errors 0, rows added to
  /// exact_rows). *bound gets the final bound (<= max_error, or every chunk exact). Default:
  /// nothing to refine for exact scores (*bound = the bound of 0 errors); an approximate kind
  /// that cannot rescore leaves the scores and reports their bound.
  virtual Status RefineForEntropy(const float* probe, double max_error, ChunkScores* screened,
                                  double* bound) const;
  /// The Θ error (nats) the index's spec asks the entropy path to certify with RefineForEntropy
  /// (the Exact index's "theta"); 0 = none (the default, and every other kind).
  virtual double entropy_error_target() const { return 0.0; }
  /// The `take` best chunks by `rank`, best first, ties to the smaller chunk index; `screened`
  /// is Screen's answer for the same probe (refined or not). take larger than size() returns every chunk.
  virtual Status Best(const float* probe, const ChunkScores& screened, ChunkRank rank, size_t take,
                      std::vector<uint64_t>* out) const = 0;
  /// The top k by logit, best first, ties to the smaller chunk index (approximate kinds: among
  /// their candidates). Default: Screen, then Best by logit.
  virtual Status Search(const float* probe, size_t k, std::vector<uint64_t>* out) const;
  /// The `take` best of `chunks` by `rank`, scored exactly for `probe` (as Score would), best
  /// first, ties to the smaller chunk index; chunks the index does not hold are left out.
  /// FailedPrecondition for kinds that cannot score chosen chunks alone (the FAISS kinds).
  virtual Status BestOf(const float* probe, const std::vector<uint64_t>& chunks, ChunkRank rank, size_t take,
                        std::vector<uint64_t>* out) const;

  /// `chunks`' exact scores (as Score gives them), ids ascending; chunks the index does not
  /// hold are left out. Not a whole screen: Best refuses it. FailedPrecondition for kinds
  /// that cannot score chosen chunks alone (the FAISS ones).
  virtual Status ScoreChunks(const float* probe, const std::vector<uint64_t>& chunks, ChunkScores* out) const;
  /// Fills *subset with a ChunkSubset of `chunks` (chunks the index does not hold are left
  /// out), reusing its buffers when it holds one of this kind (else replacing it).
  /// FailedPrecondition for kinds that cannot score chosen chunks alone (the FAISS ones) and
  /// where a chosen chunk keeps only its int8 codes (Exact under a memory cap); after an error
  /// *subset must be gathered again before it is scored.
  virtual Status GatherSubset(const std::vector<uint64_t>& chunks,
                              std::unique_ptr<ChunkSubset>* subset) const;
  /// Rows [begin, end) screened as Screen screens them: ids, scores and, where the screen
  /// approximates, error bounds, for those rows only (a row is a chunk's place in ascending
  /// chunk order: Add appends rows, Remove and a memory cap's eviction shift them). Not a whole
  /// screen: Best refuses it. InvalidArgument for rows outside [0, size()); FailedPrecondition
  /// for kinds that cannot screen part of their chunks (the FAISS ones).
  virtual Status ScreenRows(const float* probe, size_t begin, size_t end, ChunkScores* out) const;
  virtual size_t size() const = 0;            ///< chunks indexed (not removed)
  virtual uint64_t memory_bytes() const = 0;  ///< everything the index holds (from container sizes)
  /// What the reads have touched so far (IndexReadBytes); a caller takes differences around the
  /// calls it wants counted. Safe beside concurrent const calls.
  virtual IndexReadBytes read_bytes() const { return {}; }

  // ---- bounded memory (StoreOptions::index_bytes) ----
  /// Caps memory_bytes() at `bytes` from now on (0 = unbounded): after every chunk an Add
  /// indexes, an index over its cap gives up precision and then chunks, oldest (smallest chunk
  /// index) first, as the kind documents. Only the Exact kind is bounded: the others answer
  /// InvalidArgument for a cap > 0.
  virtual Status SetMemoryCap(uint64_t bytes);
  virtual uint64_t memory_cap() const { return 0; }  ///< 0 = unbounded
  /// Chunks indexed at reduced precision (Exact: int8 codes only), counted in size().
  virtual uint64_t compressed_chunks() const { return 0; }
  /// Chunks the cap took out of the index since it was created (never returned again).
  virtual uint64_t evicted_chunks() const { return 0; }
  virtual std::string ToString() const = 0;  ///< the canonical spec: rebuilds an equal (empty) index
  const ChunkShape& shape() const { return shape_; }

 protected:
  explicit ChunkIndex(const ChunkShape& shape) : shape_(shape) {}
  /// Writers call Changed() whenever the indexed set changes.
  void Changed() { ++generation_; }
  /// Whether `s` holds this index's scores of its current state (ids included).
  bool Current(const ChunkScores& s) const { return s.index == this && s.generation == generation_; }
  /// Marks `s` as this index's scores of its current state.
  void Stamp(ChunkScores* s) const {
    s->index = this;
    s->generation = generation_;
  }
  /// InvalidArgument unless `screened` is Current, naming `who`.
  Status CheckCurrent(const ChunkScores& screened, const char* who) const;

  const ChunkShape shape_;

 private:
  uint64_t generation_ = 0;
};

/// An empty index of the kind `spec` names (see the header comment) for chunks of `shape`.
/// InvalidArgument names the bad key, value or field.
Result<std::unique_ptr<ChunkIndex>> MakeChunkIndex(const std::string& spec, const ChunkShape& shape);
/// Parses and checks `spec` without a shape (FAISS descriptions are built once at dimension
/// FaissIndexOptions::kValidateDim) and returns its canonical form.
Result<std::string> CanonicalChunkIndexSpec(const std::string& spec);

// ---- ranking helpers shared by the kinds ----

/// The `take` best rows of `rank` (higher first, ties to the smaller row), best first, as
/// their ids. Rows ascend in chunk index, so ties go to the smaller chunk index.
std::vector<uint64_t> TakeBest(const std::vector<float>& rank, const std::vector<uint64_t>& ids, size_t take);
/// The k-th largest of v[0..n) (NaNs ordered as TopRowsAscending orders them); +inf for k <= 0
/// or n <= 0, -inf for k > n.
float KthLargest(const float* v, int64_t n, int64_t k);
/// The k best rows of score[0..n) (higher first, ties to the smaller row), in ascending row
/// order. +0 and -0 tie.
void TopRowsAscending(const float* score, int64_t n, int64_t k, std::vector<int64_t>* rows);

}  // namespace kvtier
