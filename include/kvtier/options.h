// The options an engine sets: StoreOptions (the tiers, Store::Open), RetrieverOptions
// (probe, allocator, index and budget of retrieval) and SessionOptions (one sequence's
// retrieval and positions, Session::Open). Each option's one-line comment is its meaning
// and default; Validate() refuses nonsense with InvalidArgument naming the field.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "kvtier/status.h"
#include "kvtier/types.h"

namespace kvtier {

/// Block compression of the cold tier's column families.
enum class Compression : uint8_t { kNone, kLZ4, kZSTD };

/// How a chunk's representative keys are chosen from the attention its keys received while
/// they were in the local window (offload/representatives.h): kMass takes the repr_topk most
/// attended keys (InfLLM); kDiverse takes the most attended key, then each next one by its
/// attention (relative to the most attended) minus its highest cosine with a key already taken;
/// kCluster takes kDiverse's keys as seeds, puts every key of the chunk with the seed it has the
/// highest cosine with, and stores each group's mean key.
enum class ReprChoice : uint8_t { kMass, kDiverse, kCluster };

/// Whose heads a chunk's representatives belong to (offload/representatives.h). kKv: per kv
/// head, chosen by the attention mass summed over the kv head's GQA group of query heads, laid
/// out [repr_topk, kv_heads, head_dim]. kQuery: per query head, as InfLLM's ContextManager keeps
/// them: each query head chooses its own repr_topk tokens by the mass it alone gave them, and
/// its representatives are its kv head's keys at those tokens, [repr_topk, q_heads, head_dim].
enum class ReprHeads : uint8_t { kKv, kQuery };

struct StoreOptions {
  Geometry geometry;                           ///< model KV shape and storage dtype
  int n_sink = 64;                             ///< attention-sink tokens kept hot per (sequence, layer)
  int n_local = 512;                           ///< most recent tokens kept hot (the local window)
  int chunk_size = 32;                         ///< tokens per chunk
  int repr_topk = 4;                           ///< representative keys per head per chunk
  ReprChoice repr_choice = ReprChoice::kMass;  ///< how they are chosen: mass (InfLLM) | diverse | cluster
  ReprHeads repr_heads = ReprHeads::kKv;       ///< per kv head (default) or per query head (InfLLM)
  uint64_t hot_bytes = 64ull << 20;            ///< hot slot pool for retrieved chunks (sinks/local are extra)
  uint64_t warm_bytes = 256ull << 20;          ///< warm tier capacity
  /// Retrieval index memory per session (the chunk indexes of all its layers; layers share it
  /// evenly); 0 = unbounded. Past it the Exact index keeps its oldest chunks as int8 codes
  /// only, then evicts the oldest (retrieval/exact_index.h). 0 or >= 1 MiB; Exact index only.
  uint64_t index_bytes = 0;
  std::string data_dir;                         ///< cold tier (RocksDB) directory; empty = no cold tier
  Compression compression = Compression::kLZ4;  ///< cold tier compression: none|lz4|zstd
  bool sync_writes = false;                     ///< fsync cold writes (power-loss durability)
  bool write_through = true;   ///< write each chunk to cold when sealed (crash-safe, free demotion)
  int pin_timeout_ms = 30000;  ///< lease of a pinned chunk; an expired pin no longer protects it
  /// Longest a fetch waits (real time) for hot slots that other fetches hold pinned or are
  /// loading, e.g. another Session's Attend that is about to unpin; 0 = fail at once. See
  /// FetchChunks. Default: 10000.
  int pin_wait_ms = 10000;
  std::string hot_policy = "lru";   ///< demotion policy of the hot slot pool
  std::string warm_policy = "lru";  ///< demotion policy of the warm tier
  int transfer_threads = 2;         ///< concurrency of the asynchronous transfer arena
  /// Sealed chunks per (sequence, layer) whose download from the local window may be in
  /// flight at once (a device tier copies them asynchronously: see "Landing" below); one
  /// more waits for the oldest. >= 1.
  int max_landing_chunks = 8;
  /// Where kvtier's hot tier keeps its memory (offload/hot_tier.h, MakeHotTier): kCpu (host
  /// memory) or kCuda (CudaHotTier, GPU memory; Unavailable without a CUDA build or device).
  /// Default: kCpu.
  Device device = Device::kCpu;
  /// Open checks that every chunk the cold tier acknowledged came back (a damaged or
  /// truncated RocksDB WAL can lose them): false (default) fails Open with Corruption
  /// naming the missing (sequence, layer, index) ranges; true opens anyway, the lost
  /// chunks become holes for good, and TieredStore::lower_tiers().LostChunks() lists them.
  bool accept_lost_chunks = false;
  /// Remote tier (offload/remote_tier.h): "redis://[USER:PASSWORD@]host:port[,...][?wait=N&...]",
  /// one Redis server or any nodes of a Redis Cluster; empty (default) = none. Chunks are
  /// written through to it (and to the cold tier when data_dir is set too) and a chunk is
  /// acknowledged once every lower tier has it; fetches read warm, then cold, then remote.
  /// Sequences of other stores are shared through it (PublishSequence, AttachPublished).
  /// Credentials: "redis://[USER]:PASSWORD@host:port...", password_file=PATH, or
  /// KVTIER_REDIS_PASSWORD / KVTIER_REDIS_USER (docs/cli.md); a refused one fails Open
  /// with PermissionDenied at once. No message or report holds the password.
  std::string remote;
  /// Key namespace of this store's chunks in the remote tier; empty (default) = a fresh
  /// one per Open (host, pid, time), so concurrent stores never overwrite each other's.
  std::string remote_namespace;

  Status Validate() const;
  /// Bytes of K+V of one chunk of one layer.
  size_t chunk_bytes() const { return static_cast<size_t>(chunk_size) * geometry.token_kv_bytes(); }
  /// Heads the representatives (and the local window's attention mass) are kept for:
  /// kv_heads, or q_heads under ReprHeads::kQuery.
  int repr_head_count() const {
    return repr_heads == ReprHeads::kQuery ? geometry.q_heads : geometry.kv_heads;
  }
  /// Elements of one chunk's representatives: [repr_topk, repr_head_count(), head_dim].
  size_t repr_elems() const {
    return static_cast<size_t>(repr_topk) * repr_head_count() * static_cast<size_t>(geometry.head_dim);
  }
  /// Bytes of one chunk's representatives in the storage dtype.
  size_t repr_bytes() const { return repr_elems() * DTypeSize(geometry.dtype); }
};

struct RetrieverOptions {
  // The defaults are kvtier's recommended configuration (the "kvtier" preset): ActQKV's probe
  // and budget, chunks ordered by logit, the most interested kv head decides.
  std::string probe = "act";  ///< probe builder spec: mean | act[:eps=..] | question[:base=..,weight=..]
  std::string alloc =
      "entropy:rank=logit";  ///< budget allocator spec: topk | entropy[:min=M,rank=cosine|logit]
  /// Chunk index spec per (sequence, layer):
  /// "Exact[:heads=sum|max,rerank=F,rerank_min=N,theta=E,screen=int8|int4]"
  /// (default "Exact:heads=max": every representative key kept, chunk score = best
  /// representative of the best kv head) or a FAISS description over one mean vector per
  /// chunk ("Flat", "HNSW32:ef=64", "IVF<n>,Flat:nprobe=16,train_min=0"). See chunk_index.h.
  std::string index = "Exact:heads=max";
  int budget_tokens = 2048;  ///< retrieved tokens per layer and step (k = budget_tokens / chunk_size chunks)
  /// While the index is unchanged (no chunk landed or left since a layer's last search) and
  /// every kv head's probe has at least this cosine with the probe that search was made for,
  /// the layer takes its grant's best of that search's shortlist (its best 3x the grant),
  /// rescored for the new probe, instead of searching every chunk (0 = search at every step;
  /// in [0, 1]). The budget of such a step comes from the stored search's Eq. 11 entropy.
  double reuse_cosine = 0.0;
  /// A decode step's search screens a rotating 1/R of the layer's chunks instead of all of
  /// them (R = screen_period; 1 = every chunk every step). The layer keeps every chunk's latest
  /// Eq. 10 cosine and a shortlist (its best 2x the grant); each step rescores exactly the
  /// shortlist, the chunks that landed since, the neighbours (c - 1, c + 1) of the last step's
  /// choice (where a head that reads on, such as a copy head, goes next), and the slice's chunks
  /// whose screened score
  /// could reach the grant's best, takes the grant's best of them, and computes Eq. 11 over the
  /// kept cosines. A chunk is screened again within R steps. Needs alloc=entropy and the
  /// Exact index kind; the device path (a cuda hot tier) screens every chunk whatever R is.
  int screen_period = 1;

  /// Checks every part; InvalidArgument names the part ("probe: ...", "alloc: ...",
  /// "index: ...") and, inside it, the bad key or value.
  Status Validate() const;
  /// "probe=act:eps=1e-06 alloc=entropy:min=1,rank=cosine index=Exact:heads=sum,rerank=1,rerank_min=0
  /// budget=2048": every part canonical (all keys spelled out), space-separated, then
  /// " reuse=C" when reuse_cosine is not 0 and " screen=R" when screen_period is not 1. Parse reads it back
  /// to options with the same ToString.
  std::string ToString() const;
  /// Space-separated key=value items, keys probe, alloc, index, budget, reuse, screen, each at most once; a
  /// key left out keeps its default. Unknown or duplicate keys, items without '=', a bad
  /// budget, or parts that do not validate are InvalidArgument naming them.
  static Result<RetrieverOptions> Parse(const std::string& spec);
};

/// How keys get their positions; see kvtier/session.h.
enum class PositionMode { kAbsolute, kInfLLM };
/// "absolute" | "infllm".
Result<PositionMode> ParsePositionMode(const std::string& s);
const char* PositionModeName(PositionMode mode);

/// The "kvtier" preset's retrieval options: RetrieverOptions{}, kvtier's recommended configuration.
RetrieverOptions RecommendedRetrieval();

struct SessionOptions {
  RetrieverOptions retrieval;  ///< probe, allocator, index and budget (the "kvtier" preset)
  bool retrieve = true;        ///< false: attend every live chunk (full attention through the store)
  PositionMode positions = PositionMode::kAbsolute;  ///< keys after RoPE (absolute) or before it (infllm)
  double rope_theta = 10000.0;                       ///< kInfLLM: RoPE base (rotate-half, Hugging Face Llama)
  bool observe_prefill = true;                       ///< prefill Attend feeds representative-key statistics
  int keep_queries = 0;  ///< most recent queries kept per layer for Compress (0 = none)
  /// A cuda tier's device lane (Session::AttendDevice): a chosen chunk with no warm copy (only in
  /// a lower tier) is skipped that step and brought back to warm, not to the hot tier, on a
  /// transfer worker (SessionCounters::chunks_deferred), instead of its layer taking the host path, which
  /// waits for it and attends it. Off: every output is the host path's.
  bool defer_cold_chunks = false;
  Status Validate() const;
  /// Validate(), and with retrieve, that `store`'s hot slot pool holds the retrieval budget:
  /// budget_tokens / chunk_size chunks at most hot_bytes / chunk_bytes(). InvalidArgument
  /// naming both numbers otherwise (the budget is never clipped silently).
  Status Validate(const StoreOptions& store) const;
};

}  // namespace kvtier
