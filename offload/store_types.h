// The types of TieredStore's calls that its parts share (offload/tiered_store.h): a chunk's
// metadata, the change feed's cursor and batch, the hot view and what a layer step reads, and
// what a device reader of the warm tier is handed (WarmChunkAddress) and fenced by (WarmReaderFence).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu/attention.h"
#include "store/chunk.h"
#include "store/status.h"

namespace kvtier {

/// Per-chunk metadata visible to retrieval and policies.
struct ChunkInfo {
  ChunkKey key;
  int64_t first_token = 0;    ///< absolute position of the chunk's first token
  int n_tokens = 0;           ///< chunk_size
  uint8_t tiers = kTierNone;  ///< TierBits where the chunk is resident
  float score = 0.0f;         ///< policy score (higher = keep)
};

/// Where a reader of one layer's chunk changes stands (TieredStore::ChunkUpdatesSince).
struct ChunkCursor {
  uint64_t chunks = 0;  ///< chunk indices below this were handed over (or were holes)
  uint64_t drops = 0;   ///< drops of the layer handed over so far
};

/// One layer's chunk changes since a cursor (TieredStore::ChunkUpdatesSince).
struct ChunkUpdate {
  ChunkCursor next;               ///< the cursor after these changes
  ChunkCursor since;              ///< the cursor these changes start from
  std::vector<uint64_t> added;    ///< landed chunk indices, ascending
  std::vector<float> repr;        ///< [added][repr_topk, repr heads, head_dim] fp32 representative keys
                                  ///< (StoreOptions::repr_head_count())
  std::vector<uint64_t> dropped;  ///< chunk indices dropped since the cursor, in drop order
  bool complete = true;           ///< false: max_added was reached, more landed chunks wait past next
  uint64_t pending = 0;           ///< chunk indices past next still to hand over (holes included: at most)
};

/// What attention reads for one (sequence, layer) besides retrieved chunks:
/// the sinks and the local window (the ring gives up to two spans). Pointers
/// stay valid until the next Append to that (sequence, layer).
struct HotView {
  kernels::KvSpan sinks;     ///< n_tokens may be < n_sink early on
  kernels::KvSpan local[2];  ///< oldest part first
  int n_local_spans = 0;
  int64_t n_tokens = 0;  ///< tokens appended to this layer so far
};

/// What a layer step reads from the store besides the chunk updates (TieredStore::BeginLayerStep).
/// How BeginLayerStep lands the layer's sealed chunks.
enum class LandRule {
  kAll,           ///< every one, waiting for downloads in flight
  kCompleteOnly,  ///< those whose download is complete; the rest are listed (LayerStepView::sealing)
};

/// A chunk of the layer sealed and not landed yet: not indexed, its download from the ring into
/// its warm slot possibly in flight (TieredStore::WarmAddresses with include_landing gives the
/// slot's address for a device reader).
struct SealingChunk {
  uint64_t index = 0;          ///< the chunk's index in its layer
  int64_t first_position = 0;  ///< absolute position of its first token
  /// [repr heads, chunk_size]: the attention mass its tokens received in the local window,
  /// what its representatives are chosen from (offload/representatives.h); all zero: none.
  std::vector<float> mass;
};

struct LayerStepView {
  Status background;  ///< the sticky lower-tier write error (LowerTiers::BackgroundErrorLocked); OK when none
  HotView hot;        ///< sinks and local window of the layer
  /// LandRule::kCompleteOnly: the layer's chunks still landing, in seal order (empty with kAll).
  std::vector<SealingChunk> sealing;
};

/// How FetchChunks treats a fetch longer than its sequence's hot slot reservation
/// (TieredStore::ReserveHotSlots).
enum class FetchFit {
  kAll,  ///< every chunk asked for, or an error
  /// The chunks are best first; a tail that would take slots other sequences' reservations
  /// claim is left out (see FetchChunks).
  kWithinClaims,
};

/// Where a device reader finds one chunk's warm copy (TieredStore::WarmAddresses): the K half
/// and the V half of its warm slot ([K chunk][V chunk], each [chunk_size, kv_heads, head_dim]
/// in the storage dtype), host memory (pinned and mapped when a CUDA device is present, so a
/// kernel reads it through UVA). Valid while the store's warm epoch is the one the call
/// returned; null when the chunk has no warm copy (only in a lower tier), is still landing, or
/// was dropped.
struct WarmChunkAddress {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t first_position = 0;  ///< absolute position of the chunk's first token (0 for a dropped chunk)
};

/// What the store waits on before a warm slot whose address it handed out
/// (TieredStore::WarmAddresses) changes hands: the device reads issued so far. Registered with
/// TieredStore::SetWarmReaderFence. The store first moves the warm epoch, then calls
/// WaitForReaders under its lock: it must only wait for work already submitted (a CUDA event
/// recorded after the reader's reads of handed-out addresses) and must never call the store.
/// A reader that enqueues reads on another thread than the store's callers makes "check
/// TieredStore::warm_epoch() (lock-free), enqueue the reads, record the event" one critical
/// section of its own lock, which WaitForReaders takes too: either the wait covers those
/// reads, or the check sees the epoch moved and the reader asks again (it never holds that
/// lock while it calls the store). An error stops the reuse that needed it and is returned by
/// the store call that needed the slot (the chunk stays in warm, still exposed).
class WarmReaderFence {
 public:
  virtual ~WarmReaderFence();
  /// Returns once every read of a handed-out warm address issued so far has finished.
  virtual Status WaitForReaders() = 0;
};

}  // namespace kvtier
