// The FAISS index kinds ("Flat", "HNSW32", "IVF<n>,Flat", ...): FaissChunkIndex implements
// ChunkIndex over one vector per chunk; FaissVectorIndex is the FAISS wrapper under it.
//
// FaissChunkIndex: a chunk's vector is the mean of its R representative keys, kv heads
// concatenated (dimension kv_heads x head_dim), not normalised: the inner product with a
// probe is then InfLLM's score, the sum of q.k over the representatives (over R), and the
// top k keeps key norms, as attention does. Score's cosine is ActQKV Eq. 10 on the
// concatenated vectors: the logit over |probe| |vector|. Screen is Score; Best sorts it;
// Search asks FAISS (sub-linear for the approximate kinds). A concatenated vector's inner
// product is the sum over kv heads, so "heads=max" (Exact) has no FAISS counterpart.
//
// FaissVectorIndex: one FAISS index over chunk vectors, with the helpers ChunkVector (the
// mean of the representatives, L2-normalised per head) and ProbeVector (a probe normalised
// per head) for callers that want the inner product to be
//   score(c) = sum_h cos(probe_h, chunk_h)                     in [-H, H]
// i.e. ActQKV Eq. 10 evaluated per kv head and summed over the heads (the benchmark does).
//
// The index kind is a FAISS index_factory description ("Flat" exact, default;
// "HNSW32"; "IVF<n>,Flat"; ...), always with the inner-product metric. FAISS
// ids are chunk indices: IVF indexes take them natively (with a hash-table
// direct map, so Remove is O(1) per chunk); every other kind is wrapped in
// faiss::IndexIDMap2.
//
// Besides FAISS, the index keeps a flat copy of the live vectors, sorted by
// chunk index. It is the source of truth: ScoreAll scans it, search scores
// are recomputed from it (exact inner products even for lossy codes such as
// PQ), and whenever FAISS cannot serve a search the copy is scanned exactly
// instead (see Search). Memory is therefore the flat copy plus FAISS's own
// structure (memory_bytes() counts both).
//
// Training: indexes that need training (IVF, PQ, SQ...) are not trained until
// train_min vectors were added; until then searches scan the flat copy
// exactly. When the Add that reaches train_min arrives, FAISS is trained on
// every collected vector and they are all added (that one Add pays for the
// k-means). The index is never retrained later.
//
// Removal: Flat-family (faiss::IndexFlatCodes) and IVF indexes remove
// natively. Indexes that cannot remove (HNSW, NSG, ...) keep the removed
// chunk's vector in FAISS and remember its id in a tombstone set; searches
// ask FAISS for enough extra candidates to cover the expected number of
// tombstones among them and filter them out. When tombstones exceed
// kTombstoneRebuildFraction of the vectors FAISS holds, FAISS is rebuilt
// from the flat copy (for HNSW: O(n log n), paid by that one Remove).
// Re-adding a tombstoned chunk index also rebuilds first.
//
// Cost: a Flat search reads every vector (n x dim floats): on the 2-core
// development machine 2 ms at 32K x 128, 24 ms at 256K x 128 and 0.2 s at
// 256K x 1024 per layer and step, against ~0.5 ms for HNSW32 at 256K
// (bench/chunk_index_bench.cc). Search allocates only k-sized buffers.
//
// Persistence: rebuilt, not persisted. The store persists each chunk's
// representatives in the cold tier's meta records; after a reopen the owner
// rebuilds the index from what TieredStore::ChunkUpdatesSince hands over from
// the start (Retriever::Sync does).
//
// Thread-safety: one writer at a time (Add, AddBatch, Remove). Const methods
// (Search, ScoreAll, size, ...) may run concurrently with each other but not
// with a writer; the owner serialises them (e.g. a std::shared_mutex per
// index). Search runs its FAISS calls on the calling thread (an OpenMP team
// of one, set for that thread only): one query gains nothing from FAISS's
// OpenMP regions, and on a loaded machine their wake-up and barrier cost
// 15-40 ms per search. Parallelism comes from searching layers concurrently.
// AddBatch and rebuilds use FAISS's OpenMP threads.
//
// Errors: every method returns a Status; FAISS exceptions are caught here and
// reported with what failed. No exception leaves these classes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "retrieval/chunk_index.h"
#include "store/status.h"

namespace faiss {
struct Index;
}

namespace kvtier {

struct FaissIndexOptions {
  /// FAISS index_factory description: "Flat" (exact, default), "HNSW32",
  /// "IVF<n>,Flat" (trained once enough vectors exist), ...
  std::string factory = "Flat";
  int ivf_nprobe = 16;      ///< IVF lists searched ("nprobe", default 16; capped at nlist)
  int hnsw_ef_search = 64;  ///< HNSW search breadth ("ef", default 64; FAISS uses max(ef, k))
  /// Vectors to collect before training ("train_min", default 0 = 39 x nlist for IVF,
  /// FAISS's rule of thumb; 39 x 256 for other trainable kinds such as PQ).
  /// IVF needs train_min >= nlist.
  int train_min = 0;

  /// Parses the factory string (builds a throwaway index at dimension
  /// kValidateDim) and checks the numeric fields; the message names the bad
  /// field. Dimension-dependent constraints (e.g. PQ<m> needs m | dim) are
  /// checked again by FaissVectorIndex::Create with the real dimension.
  Status Validate() const;
  /// Same checks with a given vector dimension.
  Status Validate(int dim) const;

  /// From an index spec "<factory>[:nprobe=N,ef=N,train_min=N,heads=sum]" (chunk_index.h).
  /// Keys that do not apply to the kind (ef on a non-HNSW index, ...) are refused, and so is
  /// heads=max, naming them.
  static Result<FaissIndexOptions> Parse(const std::string& spec);
  /// The canonical spec: the factory, then the keys that apply to its kind (nprobe for IVF,
  /// ef for HNSW, train_min for kinds that train), every one spelled out.
  std::string ToString() const;

  static constexpr int kValidateDim = 1024;  ///< dimension Validate() builds its throwaway index at
};

/// One FAISS index over chunk vectors of `dim` floats (see the header comment).
class FaissVectorIndex {
 public:
  /// Tombstones (removed chunks still inside a FAISS index that cannot
  /// remove) above this fraction of FAISS's vectors trigger a rebuild.
  static constexpr double kTombstoneRebuildFraction = 0.25;

  /// out[h*D + d] = mean_r repr[(r*H + h)*D + d], then each head scaled to
  /// unit L2 norm. A head whose mean is zero (or R <= 0) stays a zero vector,
  /// so it contributes cos = 0 to every score. repr: [R, H, D] (the layout of
  /// TieredStore::GetRepresentatives); out: [H*D], must not alias repr.
  static void ChunkVector(const float* repr, int R, int H, int D, float* out);
  /// out = probe ([H, D]) with each head scaled to unit L2 norm; zero-norm
  /// heads stay zero. out may equal probe (in place).
  static void ProbeVector(const float* probe, int H, int D, float* out);

  /// An empty index for vectors of `dim` floats. Fails with InvalidArgument
  /// (naming the field) when dim <= 0 or the options do not validate.
  static Result<std::unique_ptr<FaissVectorIndex>> Create(int dim, const FaissIndexOptions& options);
  ~FaissVectorIndex();
  FaissVectorIndex(const FaissVectorIndex&) = delete;
  FaissVectorIndex& operator=(const FaissVectorIndex&) = delete;

  /// Indexes one chunk vector ([dim], normally from ChunkVector). Ids are
  /// chunk indices (< 2^63). AlreadyExists if the chunk is indexed;
  /// InvalidArgument for a null or non-finite vector. On failure the index is
  /// unchanged.
  Status Add(uint64_t chunk_index, const float* vec);
  /// Indexes n chunks at once ([n, dim] vectors): one FAISS call, so HNSW
  /// inserts in parallel. Use it to rebuild after a reopen. All or nothing:
  /// duplicate or already-indexed ids reject the whole batch.
  Status AddBatch(size_t n, const uint64_t* chunk_indices, const float* vecs);
  /// Drops a chunk from the index (NotFound if it is not indexed). See the
  /// header comment for indexes that cannot remove (tombstones).
  Status Remove(uint64_t chunk_index);

  /// Top k by inner product, best first; ties -> smaller chunk index. Also the
  /// full score list of the returned chunks (scores may be null; ids may
  /// not). k larger than size returns all; k = 0 or an empty index returns
  /// nothing. probe_vec: [dim], normally from ProbeVector.
  ///
  /// FAISS serves the search with k (+1, + tombstone over-fetch) results;
  /// the returned scores are exact inner products recomputed from the flat
  /// copy (the same values ScoreAll gives). The flat copy is scanned exactly
  /// instead when: the index is not trained yet; k >= size (everything is
  /// returned anyway); FAISS found fewer than k live chunks (e.g. IVF lists
  /// too short for k); or, for the exact kind "Flat", a tie straddles the
  /// k-th place (so the smaller chunk index wins, as documented). For
  /// approximate kinds, ties are broken among the candidates FAISS returned.
  Status Search(const float* probe_vec, int k, std::vector<uint64_t>* ids, std::vector<float>* scores) const;

  /// Scores of EVERY indexed chunk (exact inner products, for the entropy
  /// cut-off and for analysis), in ascending chunk index, computed from the
  /// flat copy, not from FAISS, so it works for any index kind. O(n * dim).
  Status ScoreAll(const float* probe_vec, std::vector<uint64_t>* ids, std::vector<float>* scores) const;

  size_t size() const;            ///< live (indexed, not removed) chunks
  int dim() const;                ///< vector dimension (kv_heads * head_dim)
  uint64_t memory_bytes() const;  ///< flat copy + FAISS structure (estimate from container sizes)
  std::string factory() const;    ///< the factory string the index was created with
  bool trained() const;           ///< FAISS serves searches (false: not trained yet, exact scan)
  size_t tombstones() const;      ///< removed chunks still inside FAISS (indexes that cannot remove)
  bool exhaustive() const { return exact_; }  ///< the FAISS index scans every vector ("Flat")
  const FaissIndexOptions& options() const { return options_; }

 private:
  FaissVectorIndex(int dim, const FaissIndexOptions& options, size_t train_min, bool can_remove, bool exact);

  size_t RowOf(uint64_t id) const;  // row in the flat copy, or size() when absent
  Status Rebuild();                 // new FAISS index from the flat copy (trains if due)
  void ExactTopK(const float* probe, size_t take, std::vector<uint64_t>* ids,
                 std::vector<float>* scores) const;

  const int dim_;
  const FaissIndexOptions options_;
  const size_t train_min_;  // 0 = FAISS needs no training
  const bool can_remove_;   // FAISS removes natively (else tombstones)
  const bool exact_;        // FAISS index is exhaustive (tie straddling k-th place -> exact scan)

  // Flat copy of the live vectors, rows sorted by chunk index.
  std::vector<uint64_t> ids_;  // [n]
  std::vector<float> vecs_;    // [n, dim]

  std::unique_ptr<faiss::Index> faiss_;  // null only after a failed Rebuild
  bool live_ = false;                    // faiss_ is trained and holds every live vector (+ tombstones)
  std::unordered_set<uint64_t> tombstones_;
};

/// The FAISS kinds behind the ChunkIndex interface: one unnormalised mean vector per chunk
/// (InfLLM), see the header comment.
class FaissChunkIndex final : public ChunkIndex {
 public:
  static Result<std::unique_ptr<FaissChunkIndex>> Create(const ChunkShape& shape,
                                                         const FaissIndexOptions& options);

  using ChunkIndex::Add;
  /// The batch's mean vectors go to FAISS in one AddBatch (HNSW inserts them in parallel;
  /// an untrained IVF trains on every vector once train_min is reached).
  Status Add(const std::vector<uint64_t>& chunks, const ReprReader& read) override;
  Status Remove(const std::vector<uint64_t>& chunks) override;
  Status Score(const float* probe, ChunkScores* out) const override;
  Status Best(const float* probe, const ChunkScores& screened, ChunkRank rank, size_t take,
              std::vector<uint64_t>* out) const override;
  Status Search(const float* probe, size_t k, std::vector<uint64_t>* out) const override;
  size_t size() const override { return vectors_->size(); }
  uint64_t memory_bytes() const override;
  /// The first stage only: Score reads every chunk's vector and norm; Search every vector where
  /// it scans them all (the exhaustive kind "Flat", an untrained index, or k >= size()). What an
  /// approximate kind's walk (IVF lists, an HNSW graph) reads is not counted.
  IndexReadBytes read_bytes() const override {
    return IndexReadBytes{first_stage_bytes_.load(std::memory_order_relaxed), 0};
  }
  std::string ToString() const override { return vectors_->options().ToString(); }

  const FaissVectorIndex& vectors() const { return *vectors_; }

 private:
  FaissChunkIndex(const ChunkShape& shape, std::unique_ptr<FaissVectorIndex> vectors)
      : ChunkIndex(shape), vectors_(std::move(vectors)) {}
  std::unique_ptr<FaissVectorIndex> vectors_;
  std::vector<float> norm_;  // [chunk index] L2 norm of the chunk's mean vector (Eq. 10 cosines)
  mutable std::atomic<uint64_t> first_stage_bytes_{0};  // read_bytes()
};

}  // namespace kvtier
