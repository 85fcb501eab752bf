// Retriever: for each prefill window and each decode step, builds the probe of
// every layer (ProbeBuilder: mean | act | question), scores the layer's chunks
// through its ChunkIndex (Exact | a FAISS kind, chunk_index.h), asks the
// BudgetAllocator (topk | entropy) how many chunks the layer may take, and
// returns the chosen chunk indices. Sinks and the local window are always
// attended on top of them; the caller fetches the chunks from the TieredStore
// (already-hot chunks are hits and move nothing) and runs attention.
//
// Layers must be served shallow -> deep within a step (BeginStep, then
// Select for layer 0, 1, ...): the entropy allocator (ActQKV Eq. 12) hands
// what a shallow layer did not use to the deeper ones.
//
// One layer's Select, whatever the index kind:
//   - topk (the allocator reads no scores): the index serves its top k by
//     logit (ChunkIndex::Search; approximate FAISS kinds stay sub-linear);
//   - entropy: the index screens every chunk (ChunkIndex::Screen), the
//     allocator turns the Eq. 10 cosines into the layer's budget B^l
//     (Eq. 11-12), and the index returns the B^l best by the allocator's rank
//     (ChunkIndex::Best: cosine, as ActQKV's Algorithm 1 says, or logit).
// Which scores a kind computes, and how (the Exact kind's int8 screen and
// fp32 rerank, heads=sum|max; the FAISS kinds' InfLLM mean vectors), is the
// index's business (chunk_index.h, exact_index.h, faiss_index.h).
//
// Where the selection runs: when the store's hot tier is on
// "cuda" (store->hot_tier()->device()), Create gives the Retriever a "cuda"
// RetrievalBackend (retrieval/device_scorer.h) and every Exact index keeps a
// device mirror of its representatives; a layer's Select then runs probe (host
// twin) -> scoring -> Eq. 11 entropy -> top-k on the device with one
// synchronisation, and Eq. 12 on the host (BudgetAllocator::
// AllocateWithEntropy). That path is one exact fp32 pass (what rerank=0
// chooses). A kvtier::Session over such a store gets it without asking, since
// it builds its Retriever with Create(store, ...). FAISS index kinds keep
// running on the host on any tier (their search is FAISS's CPU code). Host
// tiers keep the host path (the int8 screen + fp32 rerank): on a CPU it is
// faster than one fp32 pass and holds no second copy of the keys, so no spec
// key opts a host tier into the mirror; the Create overload with an explicit
// backend does (tests compare the "cpu" backend, the twins over a host mirror,
// with the host path that way). Creating the "cuda" backend without a device
// is Unavailable "no CUDA device: ...".
//
// Reusing a search (RetrieverOptions::reuse_cosine = c > 0): a layer keeps its last
// search's shortlist, its best three times the grant (best first), and the probe and the
// Eq. 11 entropy it was made for. The next Select of that layer reuses it, without Screen,
// Best or the backend, when (1) Sync found no chunk landed or left since, (2) every kv head's
// probe has Eq. 10 cosine >= c with the stored one, and (3) the grant the stored entropy gets
// now (BudgetAllocator::WouldTake) fits in the shortlist; the layer is then granted from that
// entropy (AllocateWithEntropy) and takes the grant's best of the shortlist, scored exactly
// for this step's probe (ChunkIndex::BestOf; kinds that cannot, the FAISS ones, take the
// shortlist's first as it is). Otherwise it searches as below. A decode query whose probe
// stays put (the same needle sought, step after step) pays for a few hundred chunks instead
// of every chunk; it misses what this step's query favours outside the shortlist (measured:
// docs/benchmarks.md "Reusing a search").
//
// Screening a slice (RetrieverOptions::screen_period = R > 1; decode steps, the entropy
// allocator and the host Exact index only): a layer keeps every chunk's latest Eq. 10 cosine
// and a shortlist (its best kSliceShortlist (2) times the grant, best first). A decode step screens
// the chunks that landed since and a slice of ceil(n / R) rows from a cursor that goes round
// (so every chunk is screened again within R steps), and rescores exactly the shortlist and the
// new chunks, and the chunks next to the last step's choice (chunk c - 1 and c + 1 of each: a
// head that reads on, such as a copy head, moves its target a token a step, and crossing a chunk
// boundary takes it into a neighbour the last probe had no reason to favour). Eq. 11 takes the kept cosines
// (exact where rescored, screened otherwise, some screened for earlier probes), Eq. 12 grants B^l from it,
// and the slice's chunks whose screened score plus its error bound reaches the B^l-th best rescored score are
// rescored too (no other slice chunk can be among the grant's best). The layer takes the B^l best of what was
// rescored; the best kSliceShortlist x B^l become the next shortlist. A decode step therefore reads 1/R of
// the screen's bytes, plus a few hundred chunks' keys. It chooses what a full screen chooses while the probe
// stays; when the probe moves, it misses what the new probe favours outside the shortlist until the slice
// comes round (measured: docs/benchmarks.md "Screening a slice"). A prefill window, the first decode step, a
// drop or an eviction, and a grant beyond the candidates screen every chunk (which starts the rolling screen
// over).
//
// Both at once (reuse_cosine > 0 and screen_period > 1): a step first tries to reuse, then to slice, then
// screens every chunk. A sliced step is a search like a full screen: its shortlist (three times the grant,
// the reuse length) and its probe are what the next step's reuse test compares with, so a chunk landing
// (which ends reuse) costs one sliced step, not a full screen.
//
// Configuration is four parts, each a factory string that ToString() spells
// out in full and Parse() reads back, the reuse threshold (" reuse=c", spelled only when
// not 0) and the screen period (" screen=R", spelled only when not 1):
//   probe=act:eps=1e-06 alloc=entropy:min=1,rank=cosine
//   index=Exact:heads=sum,rerank=1,rerank_min=0 budget=2048
// (rank belongs to the allocator: budget.h says why.) These defaults are
// ActQKV's Algorithm 1; kvtier's recommended configuration is the "kvtier"
// preset (RecommendedRetrieval(), include/kvtier/options.h).
//
// State and threading: the probe's running statistics (ActQKV Eq. 8) and the
// allocator's per-step budget are per layer, not per sequence, and Select
// reuses scratch buffers. So a Retriever serves ONE sequence, driven by one
// thread at a time: one Retriever per sequence (kvtier::Session owns one),
// never shared between sequences or called concurrently. Several Retrievers
// over one TieredStore may run on different threads.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvtier/options.h"
#include "offload/tiered_store.h"
#include "retrieval/budget.h"
#include "retrieval/chunk_index.h"
#include "retrieval/device_scorer.h"
#include "retrieval/exact_index.h"
#include "retrieval/probe.h"

namespace kvtier {

/// Sets `key` to `value` in factory spec `spec` ("Exact" + heads=max -> "Exact:heads=max";
/// a key the spec sets already gets the new value in its place). The spec's name and keys are
/// not checked beyond the factory-string syntax. InvalidArgument for a malformed spec.
Result<std::string> SetSpecKey(const std::string& spec, const std::string& key, const std::string& value);
/// The value `spec` gives `key`, or "" when it sets none (or is malformed).
std::string SpecKey(const std::string& spec, const std::string& key);

/// What Select chose for one layer.
struct LayerSelection {
  std::vector<uint64_t> chunks;  ///< chunk indices to attend, best first
  double probe_ms = 0, search_ms = 0, alloc_ms = 0;
  double entropy = 0;  ///< Θ^ℓ when the allocator computed it (entropy), else 0
  /// Chunks the allocator granted this layer beyond what the hot slot pool holds, left out
  /// (the entropy cut-off can hand one layer more than the pool; the rest is attended).
  size_t clipped = 0;
  /// Chosen from the layer's last search's shortlist instead of a search
  /// (RetrieverOptions::reuse_cosine).
  bool reused = false;
  /// Chosen by screening a slice of the chunks (RetrieverOptions::screen_period).
  bool sliced = false;
  /// Bytes this selection's index reads touched (ChunkIndex::read_bytes, IndexReadBytes): the
  /// first stage over the chunks (the int8 screen, or a slice of it) and the chunks rescored
  /// from their stored keys (a reused search's shortlist included). 0 for kinds that do not count.
  uint64_t first_stage_bytes = 0, rescoring_bytes = 0;
};

class Retriever {
 public:
  /// The backend follows the store's hot tier: "cuda" -> a cuda RetrievalBackend, anything
  /// else -> the host path (see the header comment).
  static Result<std::unique_ptr<Retriever>> Create(TieredStore* store, const RetrieverOptions& options);
  /// With an explicit backend for the Exact index kind (null: the host path), whatever the
  /// tier: tests run the "cpu" backend this way.
  static Result<std::unique_ptr<Retriever>> Create(TieredStore* store, const RetrieverOptions& options,
                                                   std::unique_ptr<RetrievalBackend> backend);

  /// Starts a step (a prefill window or a decode token) over all layers.
  void BeginStep();
  /// Chooses the chunks of one layer. q: [m, q_heads, head_dim] fp32, the
  /// window's queries (m >= 1), or the current token's query when `decode`.
  /// `update`: the store's chunk changes of the layer since Cursor(seq, layer), fetched by the
  /// caller in its layer step's one store visit (TieredStore::BeginLayerStep into
  /// step_update()); Select applies them instead of asking the store (Apply). Null: Select
  /// syncs with the store itself (Sync).
  Result<LayerSelection> Select(SequenceId seq, int layer, const float* q, int m, bool decode,
                                const ChunkUpdate* update = nullptr);
  /// Whether a decode step's Select can take its query in the backend's memory
  /// (SelectDecodeOnBackend): a backend with the Exact index's mirrors and no reuse of searches
  /// (which compares probes on the host).
  bool SelectsDecodeOnBackend() const {
    return backend_ != nullptr && mirrors_ && options_.reuse_cosine <= 0.0;
  }
  /// Select for a decode step whose query stays in the backend's memory: the backend builds the
  /// probe (retrieval/device_scorer.h) and checks q, which is never copied to the host.
  /// InvalidArgument naming q[0][head][d] when q holds a NaN or an infinity (the layer's
  /// allocation then does not happen: the step is over); FailedPrecondition when
  /// SelectsDecodeOnBackend() is false.
  Result<LayerSelection> SelectDecodeOnBackend(SequenceId seq, int layer, const BackendQueries& queries,
                                               const ChunkUpdate* update = nullptr);
  /// What a session's device lane (engine/device_lane.h) reads to select one decode layer on
  /// the device, with no host wait, in place of SelectDecodeOnBackend.
  struct LaneLayer {
    kernels::ChunkScoreParams score;                 ///< the mirror's view (probe, logit, cosine unset)
    const std::vector<uint64_t>* row_ids = nullptr;  ///< chunk index of each mirror row, ascending
    int n = 0;                                       ///< rows (chunks of the layer)
    int cap = 0;           ///< the most chunks the hot slot pool holds (a grant is clipped to it)
    int k = 0;             ///< chunks per layer (budget_tokens / chunk_size): the step's k
    bool entropy = false;  ///< the entropy allocator (Eq. 12 on the device), else topk (k per layer)
    ChunkRank rank = ChunkRank::kLogit;  ///< the score the top-k orders by
    /// Chunks sealed and not indexed yet may be scored as rows n, n + 1, ... from representatives
    /// chosen by the mass rule (the store's repr_choice is mass, and the index's rows are the
    /// representatives: ExactChunkIndex::RowsAreRepresentatives); the index then gives them
    /// those rows when they land.
    bool sealed_rows = false;
  };
  /// Applies `update` to (seq, layer)'s index (as Select does; null: Sync) and brings its mirror
  /// up to date (a wait when rows changed), and returns the layer as the lane reads it. The
  /// selection itself is the lane's: call LaneServed(layer) once it is submitted.
  /// FailedPrecondition when SelectsDecodeOnBackend() is false.
  Result<LaneLayer> PrepareLaneLayer(SequenceId seq, int layer, const ChunkUpdate* update);
  /// The lane selected `layer` of this step on the device: the allocator's step protocol moves
  /// past it (its Eq. 12 state, when it has one, is on the device meanwhile: grant_state()).
  void LaneServed(int layer);
  /// The allocator's running state (entropy), which the lane uploads and downloads; null for topk.
  kernels::EntropyGrantState* grant_state() { return alloc_->grant_state(); }
  /// The bytes every Select so far read (LayerSelection's, summed).
  const IndexReadBytes& read_bytes() const { return read_bytes_; }
  /// Feeds a prefill window to the probe builder without retrieving (keeps
  /// ActQKV's running statistics of Eq. 8 over every window).
  Status Observe(int layer, const float* q, int m);
  /// Observe() plus the logits (ChunkIndex::Score, exact) of every indexed chunk
  /// of (seq, layer) for this window's probe, in chunk order. For analysis:
  /// probe-to-oracle agreement.
  Status ObserveAndScore(SequenceId seq, int layer, const float* q, int m, std::vector<uint64_t>* ids,
                         std::vector<float>* scores);
  /// Sets the task question for a question-aware probe (Q-LLM).
  Status SetQuestion(int layer, const float* q, int m);
  /// Brings (seq, layer)'s index up to the store in one store call
  /// (TieredStore::ChunkUpdatesSince): adds the chunks landed since the last call (all of
  /// them the first time, which rebuilds after a reopen or an attach) and removes the
  /// chunks DropChunks dropped, whichever session or thread dropped them. Select runs it.
  Status Sync(SequenceId seq, int layer);
  /// Where (seq, layer)'s index stands in the store's change feed (creating the index): the
  /// cursor a caller passes to TieredStore::BeginLayerStep (or ChunkUpdatesSince).
  Result<ChunkCursor> Cursor(SequenceId seq, int layer);
  /// Brings (seq, layer)'s index up with changes the caller fetched from the store: `update`
  /// must start at Cursor(seq, layer) (ChunkUpdate::since); one taken from another cursor is
  /// ignored and the index syncs itself, and one that stops short (complete == false, a first
  /// sync over a long sequence) is completed by Sync.
  Status Apply(SequenceId seq, int layer, const ChunkUpdate& update);
  /// A buffer for the store's changes of one layer step, kept from step to step so that the
  /// steady state allocates nothing; fill it with at most kSyncBatch chunks.
  ChunkUpdate* step_update() { return &step_update_; }
  /// The most chunks one store call hands over to a sync (their fp32 representatives are never
  /// all in memory at once beside the index they go into).
  static constexpr size_t kSyncBatch = 4096;
  /// Removes chunks from (seq, layer)'s index now. Sync removes what DropChunks dropped by
  /// itself; this is for chunks an engine wants out of the index while the store keeps
  /// them. Unknown indices are ignored.
  Status Forget(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices);

  ProbeBuilder& probe() { return *probe_; }
  /// The backend Exact indexes select on, or null for the host path.
  const RetrievalBackend* backend() const { return backend_.get(); }
  const RetrieverOptions& options() const { return options_; }
  /// The indexes' memory_bytes() and the shortlists gathered for reuse (reuse_cosine).
  uint64_t memory_bytes() const;
  /// Summed over the indexes: chunks kept as int8 codes only, and chunks evicted, by the
  /// memory cap (StoreOptions::index_bytes; each layer's index gets index_bytes / layers).
  uint64_t compressed_chunks() const;
  uint64_t evicted_chunks() const;
  /// Layer selections served by reusing the layer's last search (reuse_cosine), and all
  /// layer selections that had chunks to choose from, since the Retriever was created.
  uint64_t reused_selections() const { return reused_selections_; }
  /// Layer selections that screened a slice of the chunks (screen_period > 1) instead of all.
  uint64_t sliced_selections() const { return sliced_selections_; }
  uint64_t selections() const { return selections_; }
  /// Frees every index; a layer's next Sync rebuilds its index from the store (as after an
  /// attach). For analysis retrievers that score only now and then.
  void DropIndexes() { indexes_.clear(); }
  /// The configuration, canonical: RetrieverOptions::ToString() of the parts as built
  /// ("probe=act:eps=1e-06 alloc=entropy:min=1,rank=cosine index=Exact:heads=sum,rerank=1,
  /// rerank_min=0 budget=2048"); RetrieverOptions::Parse reads it back.
  std::string Describe() const { return spec_; }

 private:
  Retriever(TieredStore* store, const RetrieverOptions& options) : store_(store), options_(options) {}
  struct LayerIndex {
    std::unique_ptr<ChunkIndex> index;
    ExactChunkIndex* mirrored = nullptr;  // the index, when it keeps a backend mirror
    ChunkCursor cursor;                   // what of the store's chunk changes the index holds
    // The layer's last search, for reuse_cosine: valid until a chunk lands or leaves.
    bool last_valid = false;
    std::vector<float> last_probe;      // the probe it searched for
    std::vector<uint64_t> last_chunks;  // its shortlist, best first (ShortlistSize of the grant)
    double last_theta = 0.0;            // its Eq. 11 entropy (entropy allocator)
    // The shortlist's representatives side by side, gathered by the second step that reuses
    // it (last_gathered: it holds last_chunks) into buffers kept from search to search.
    std::unique_ptr<ChunkSubset> last_subset;
    bool last_gathered = false;
    int last_reuses = 0;  // steps that reused it so far
    // The rolling screen (screen_period > 1), valid from a decode step's full screen until a
    // chunk leaves: every chunk's latest Eq. 10 cosine (exact where rescored, else screened) by
    // row, the next slice's first row, and the shortlist (best first).
    bool roll_valid = false;
    std::vector<uint64_t> roll_ids;     // the chunk at each row, ascending
    std::vector<float> roll_cos;        // [rows] latest cosine
    std::vector<float> roll_exp;        // [rows] e^{roll_cos}, as added to roll_z
    double roll_z = 0.0, roll_w = 0.0;  // sum of e^{s}, of s e^{s}: Eq. 11's sums
    size_t roll_cursor = 0;
    std::vector<uint64_t> roll_shortlist;
    size_t roll_granted = 0;    // the last step's choice: the shortlist's first roll_granted
    uint64_t roll_evicted = 0;  // the index's evicted_chunks() then: an eviction shifts rows
  };
  // screen_period > 1: screens this step's slice and the chunks that landed, rescores the
  // shortlist and what of the slice could enter it, and grants the layer from Eq. 11 over the
  // kept cosines. False (nothing granted) when a full screen must run instead.
  Result<bool> ScreenSlice(LayerIndex* li, int layer, int n, size_t cap, LayerSelection* sel);
  // Select's work; Select adds what it read (LayerSelection's byte counts). `queries`: a
  // decode query in the backend's memory instead of q (SelectDecodeOnBackend).
  Result<LayerSelection> SelectLayer(SequenceId seq, int layer, const float* q, int m, bool decode,
                                     const ChunkUpdate* update, const BackendQueries* queries);
  // The selection's read bytes added to it and to read_bytes_ around SelectLayer.
  Result<LayerSelection> CountedSelect(SequenceId seq, int layer, const float* q, int m, bool decode,
                                       const ChunkUpdate* update, const BackendQueries* queries);
  // The rolling screen's Eq. 11 sums: afresh from the kept cosines, one cosine replaced, and
  // the entropy they give.
  static void KeepEntropySums(LayerIndex* li);
  static void KeepCosine(LayerIndex* li, size_t row, float cosine);
  static double KeptEntropy(const LayerIndex& li);
  // The reuse_cosine test; on success fills *sel from li's last search and grants the layer its
  // budget from that search's entropy. False (nothing granted) when the search must run.
  Result<bool> ReuseLast(LayerIndex* li, int layer, int n, size_t cap, LayerSelection* sel);
  // Records a search's shortlist for reuse: the first `keep` of `chunks` (best first).
  void RememberSearch(LayerIndex* li, const std::vector<uint64_t>& chunks, size_t keep, double theta);
  // A chunk landed or left: the layer's last search may not be reused.
  static void ForgetSearch(LayerIndex* li);
  // Select's path through the backend (the index keeps a mirror).
  Status SelectOnBackend(LayerIndex* li, int layer, int n, size_t cap, LayerSelection* sel,
                         const BackendQueries* queries);
  // InvalidArgument naming q's first NaN or infinity (the backend's check), OK when there is none.
  Status QueriesFinite(int layer, int32_t count, int32_t first) const;
  Result<LayerIndex*> Index(SequenceId seq, int layer);
  // Adds the update's chunks to li's index, removes its drops and moves li's cursor.
  Status ApplyUpdate(LayerIndex* li, const ChunkUpdate& update);
  // Frees a buffer that held a first sync's batch: a step hands over a chunk or none.
  void ShrinkUpdate(ChunkUpdate* update) const;

  TieredStore* store_;
  RetrieverOptions options_;
  ChunkShape shape_;
  std::string spec_;  // Describe()
  std::unique_ptr<ProbeBuilder> probe_;
  std::unique_ptr<BudgetAllocator> alloc_;
  std::unique_ptr<RetrievalBackend> backend_;  // null: the host path
  bool mirrors_ = false;  // the index kind keeps a backend mirror (Exact), so backend_ selects
  std::unordered_map<uint64_t, LayerIndex> indexes_;  // key: seq * 65536 + layer
  std::vector<float> probe_buf_, probe_vec_;
  ChunkScores scores_;                  // Select: the layer's screened scores (reused)
  ChunkUpdate update_;                  // Sync: the store's changes (reused)
  ChunkUpdate step_update_;             // step_update(): a caller's layer step's changes (reused)
  ChunkScores roll_part_, roll_exact_;  // ScreenSlice's scratch
  ChunkScores reuse_scores_;            // ReuseLast's scratch
  int k_ = 0;
  uint64_t reused_selections_ = 0, selections_ = 0, sliced_selections_ = 0;
  IndexReadBytes read_bytes_;  // read_bytes()
};

}  // namespace kvtier
