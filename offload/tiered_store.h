// TieredStore: kvtier's KV memory. Sequences append K/V per layer; the first
// n_sink tokens stay hot as attention sinks, the most recent tokens stay hot
// in a local ring, and everything in between is cut into chunks of
// chunk_size tokens that live in the warm tier (host slabs, pinned when a CUDA
// device is present) and the cold tier (RocksDB). Attention asks for chunks
// with FetchChunks, which promotes them into hot slots asynchronously.
//
// Invariants:
//  * A sealed chunk is always in the warm tier or acknowledged by a lower
//    tier (or both); the hot slot is a cache of it. A chunk leaves warm only
//    after a lower tier acknowledged it.
//  * A chunk pinned by a FetchHandle is never demoted until the handle is
//    released or its lease (StoreOptions::pin_timeout_ms, measured on
//    StoreHooks::clock) runs out.
//  * One sequence is driven by one thread at a time; different sequences
//    may be driven from different threads concurrently.
//  * Landing: sealing a chunk submits its download from the local ring into a
//    pinned warm slot (HotTier::DownloadBatchAsync: asynchronous on a device tier,
//    done at submit on the host tier) and returns. Until the download has landed
//    the chunk is not held by warm, not fetchable, not indexed, not written to a
//    lower tier and not demotable, and readers do not see it (ListChunks,
//    ChunkCount, GetRepresentatives, ChunkUpdatesSince and ReadTokens see the
//    landed chunks only; counters() reports the rest as chunks_landing). A sealed
//    chunk lands on its sequence's driver, never on a reader: the sequence's next
//    Append (which lands those already complete and keeps at most
//    max_landing_chunks in flight per layer), BeginLayerStep, FetchChunks,
//    SetChunkScores or DropChunks of its layer, Flush, CloseSequence,
//    DropSequence or PublishSequence of the sequence, WaitForDurable() (every
//    sequence), and an Append that finds the warm tier full of landing chunks.
//    A failed download loses that chunk only (never acknowledged: its index
//    becomes a hole) and is returned by the next Status-returning call that lands
//    the layer (Append: before appending anything).
//  * With write_through (default), a chunk is acknowledged (durable across
//    SIGKILL) once the asynchronous lower-tier write has finished; WaitForDurable()
//    waits for all of them. Sinks and the local window are persisted by
//    CloseSequence.
//
// The store is the coordinator: it decides what moves where under one mutex, and the parts it
// holds own the state (listed at the top of offload/tiered_store.cc and in docs/architecture.md,
// "The store and its parts": SequenceTable, LayerRing, ChunkCatalog, Landing, WarmTier,
// LowerWriter, LowerTiers, HotPool, Promoter, all in offload/store/). The tiers below warm sit
// behind offload/lower_tier.h as an ordered list (RocksDB, then Redis), held with what concerns
// them all by LowerTiers.
// Around it: offload/transfer_engine.h moves the bytes on worker threads,
// offload/store_recovery.h rebuilds the state of a reopened store,
// offload/store_records.h is the format of what it keeps in the cold tier,
// offload/representatives.h chooses each chunk's representative keys, and
// offload/hot_tier.h builds the hot tier on the options' device.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kvtier/options.h"
#include "kvtier/store.h"
#include "offload/clock.h"
#include "offload/cold_tier.h"
#include "offload/demotion_policy.h"
#include "offload/hot_tier.h"
#include "offload/lower_tier.h"
#include "offload/remote_tier.h"
#include "offload/store/chunk_catalog.h"
#include "offload/store/counting_mutex.h"
#include "offload/store/hot_pool.h"
#include "offload/store/landing.h"
#include "offload/store/layer_ring.h"
#include "offload/store/lower_tiers.h"
#include "offload/store/lower_writer.h"
#include "offload/store/promoter.h"
#include "offload/store/sequence_table.h"
#include "offload/store/store_sync.h"
#include "offload/store/warm_tier.h"
#include "offload/store_counters.h"
#include "offload/store_hooks.h"
#include "offload/store_types.h"
#include "store/chunk.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

class TransferEngine;
namespace store_internal {
struct Chunk;
struct LayerState;
struct Sequence;
}  // namespace store_internal

class TieredStore : public Store {
 public:
  /// Opens (and, with a data_dir holding an earlier store, recovers) a store, with what tests
  /// and tools plug in (offload/store_hooks.h: their own hot tier, the lease clock, a cold-tier
  /// fault injector). InvalidArgument names a bad option or hook.
  static Result<std::unique_ptr<TieredStore>> Open(const StoreOptions& options, const StoreHooks& hooks = {});
  ~TieredStore() override;
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  const StoreOptions& options() const override { return options_; }

  // ---- sequences ----
  Result<SequenceId> CreateSequence();
  /// Appends n tokens of K and V ([n, kv_heads, head_dim] each, dtype must
  /// equal the store's) to one layer. Blocks while the warm tier makes room.
  /// `space` says where k and v live: kHost (host memory, copied in with HotTier::Upload) or
  /// kDevice (the hot tier's own memory space, copied with HotTier::CopyWithin: device to
  /// device for "cuda", so a GPU engine's K/V never round-trip through the host; for "host"
  /// it is host memory, the same bytes as kHost). Any other value is InvalidArgument.
  /// `ordered` (kDevice only): copy with HotTier::CopyWithinOrdered, leaving the copies in flight
  /// on the tier's stream (the caller orders its own stream after them).
  Status Append(SequenceId seq, int layer, const void* k, const void* v, int n, DType dtype,
                MemorySpace space = MemorySpace::kHost, bool ordered = false);
  /// Attention statistics from an engine that computed them itself: mass
  /// ([kv_heads, n] fp32, each kv head's the sum over its query heads) received by tokens
  /// [first_position, first_position+n), which must lie in the local window.
  /// FailedPrecondition under ReprHeads::kQuery (a kv head's sum cannot be split into its
  /// query heads' mass: AddLocalQueryAttention).
  Status AddLocalAttention(SequenceId seq, int layer, int64_t first_position, int n, const float* mass);
  /// The same per query head, for a store whose representatives are per query head
  /// (ReprHeads::kQuery): mass [q_heads, n] fp32. FailedPrecondition under ReprHeads::kKv.
  Status AddLocalQueryAttention(SequenceId seq, int layer, int64_t first_position, int n, const float* mass);
  /// Persists sinks and local window; the sequence becomes read-only.
  Status CloseSequence(SequenceId seq) override;
  /// Removes the sequence from every tier.
  Status DropSequence(SequenceId seq) override;
  /// Policy scores of sealed chunks of one layer ((chunk index, score), higher = keep):
  /// kept with the chunk (persisted by its next lower-tier write issued after this call; a
  /// write already in flight carries the score it was issued with) and handed to
  /// score-driven demotion policies. Indices of dropped chunks are ignored; past the end is InvalidArgument.
  Status SetChunkScores(SequenceId seq, int layer, const std::vector<std::pair<uint64_t, float>>& scores);
  /// Compression: removes sealed chunks of one layer from every tier for good (their
  /// indices become holes: FetchChunks refuses them, ReadTokens says they are missing,
  /// a reopened store does not bring them back). Waits for transfers touching them;
  /// a chunk pinned by a live fetch handle is FailedPrecondition and nothing is dropped.
  /// Already-dropped indices are ignored; indices past the layer's chunks are InvalidArgument.
  /// `dropped` (optional) receives how many chunks this call removed.
  Status DropChunks(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices,
                    uint64_t* dropped = nullptr);
  /// Lands every chunk of the sequence still landing (see "Landing" above): its driver's
  /// way to make readers on other threads see everything appended so far. Returns the first
  /// landing failure not reported yet.
  Status Flush(SequenceId seq);
  std::vector<SequenceId> ListSequences() const override;
  /// Tokens appended to `layer` of `seq`.
  Result<int64_t> SequenceLength(SequenceId seq, int layer) const override;

  // ---- reading ----
  /// Copies tokens [begin, end) of one layer into k_out/v_out
  /// ([end-begin, kv_heads, head_dim], storage dtype), from whichever tier
  /// holds them, without promoting anything.
  Status ReadTokens(SequenceId seq, int layer, int64_t begin, int64_t end, void* k_out, void* v_out);
  /// The layer step's door, for the sequence's driver (Session::Attend and Gather): one visit,
  /// one lock entry, and everything a layer step reads from the store before it fetches. It
  /// lands the layer's own sealed chunks (the caller drives the sequence, see "Landing"; a
  /// failed landing is returned), then fills `out` with the sticky background error (not
  /// returned: the caller decides whether it fails the step) and the hot view, and, when
  /// `since` is not null, `updates` with the layer's chunk changes since `since`, as
  /// ChunkUpdatesSince (at most max_added chunks). The step then goes on with one FetchChunks
  /// (+ Wait) of what it chose and the handle's Release: a decode step over hot chunks enters
  /// the store lock three times. Buffers in `updates` are reused, so a caller that keeps them
  /// allocates nothing in the steady state. `out` and `updates` are what a device-resident
  /// step's chunk table would be fed from: the hot view's device spans and the chunk indices
  /// that came and left. NotFound / InvalidArgument as ChunkUpdatesSince; FailedPrecondition for a sequence
  /// recovered without its sinks and local window (it was not closed).
  /// With `land` = kCompleteOnly (a device step that must not wait: the session's device lane),
  /// only the layer's chunks whose download is complete land (no wait; a layer some other thread
  /// is landing lands completely, as kAll), and out->sealing lists those still landing, in seal
  /// order, with the statistics their representatives are chosen from.
  Status BeginLayerStep(SequenceId seq, int layer, const ChunkCursor* since, ChunkUpdate* updates,
                        LayerStepView* out, size_t max_added = SIZE_MAX, LandRule land = LandRule::kAll);
  /// Where a device reader finds chunks of one layer in the warm tier (the sources of a
  /// device gather, kernels/cpu/chunk_table.h's src_k/src_v): out[i] is chunk
  /// chunk_indices[i]'s K and V halves of its warm slot and its first token's position, or null
  /// halves when it has no warm copy (only in a lower tier), has not landed, or was dropped. A
  /// reader: it lands nothing. Each slot handed out is EXPOSED: it does not change hands (its
  /// copy dropped for room, its chunk dropped, the sequence dropped, the store closed) before
  /// the store waited on the warm reader fence (SetWarmReaderFence) and moved the warm epoch.
  /// With `include_landing`, a chunk still landing gets its slot's halves too, exposed as the
  /// others: they hold its tokens once the hot tier's transfers submitted so far are done, so
  /// only a device reader ordered after them (CudaHotTier::MakeStreamWait) may read them.
  /// `*epoch` is that epoch now: the addresses stay valid while warm_epoch() still equals it;
  /// once it moved, ask again (it moves before the wait, and also when the wait fails). NotFound
  /// / InvalidArgument for the sequence and layer as ListChunks; InvalidArgument for an index
  /// past the layer's chunks (naming it) or null outputs.
  Status WarmAddresses(SequenceId seq, int layer, const uint64_t* chunk_indices, size_t n,
                       WarmChunkAddress* out, uint64_t* epoch, bool include_landing = false);
  /// The warm epoch now (see WarmAddresses): a reader holding addresses of an older epoch asks
  /// again. Lock-free (an atomic read), so a reader may check it under its fence's own lock
  /// (offload/store_types.h, WarmReaderFence).
  uint64_t warm_epoch() const { return warm_->epoch(); }
  /// Registers what the store waits on before an exposed warm slot changes hands
  /// (offload/store_types.h; not owned, null: none, and exposed slots then turn over with no
  /// wait, the marks cleared and the epoch moved). The fence is called under the store lock,
  /// once per turnover however many exposed slots it covers, and counted in
  /// StoreCounters::warm_reader_fences; its error fails the call that needed the slot (Append's
  /// room, DropChunks, DropSequence) and nothing changes hands (a fetch's read from a lower tier
  /// then keeps no warm copy, WarmTier::AcquireForRead). Replacing the fence does not
  /// wait on the old one: replace it once the old reader's reads are done. It must outlive the
  /// store or be replaced first; the store's destructor waits on it (an error there is ignored:
  /// the slabs go with the store).
  void SetWarmReaderFence(WarmReaderFence* fence);
  /// The hot tier (its device(), slot pool and, for "cuda", stream): what an attention
  /// backend plans against. Owned by the store.
  HotTier* hot_tier() const { return hot_.get(); }
  /// Metadata of the landed chunks of one layer, in token order (a reader: see "Landing").
  Result<std::vector<ChunkInfo>> ListChunks(SequenceId seq, int layer) const;
  /// Number of chunk indices sealed and landed in one layer (chunk i covers tokens
  /// [n_sink + i*chunk_size, n_sink + (i+1)*chunk_size)): the indices before the oldest chunk
  /// still landing.
  Result<uint64_t> ChunkCount(SequenceId seq, int layer) const override;
  /// Representative keys of one chunk: [repr_topk, repr_head_count(), head_dim] fp32. A chunk whose
  /// representatives left memory (see metadata_bytes) has them read back from its meta record
  /// in the lower tiers, without the store lock; a failed read is returned naming the chunk
  /// ("representatives of chunk ... could not be read back from the lower tiers: ...").
  /// NotFound for a chunk still landing.
  Status GetRepresentatives(const ChunkKey& key, float* out) const;
  /// What changed in one layer's chunks since `since`, handed over in one call under one
  /// lock (a reader: it lands nothing, and stops before the oldest chunk still landing): the
  /// landed chunks with index >=
  /// since.chunks, ascending, with their representative keys (those that left memory read back
  /// from the lower tiers in one batch without the store lock, as GetRepresentatives; a failed
  /// read fails the call and moves no cursor), and the chunks dropped
  /// (DropChunks) since drop number since.drops. `out->next` is the cursor for the next call.
  /// A retrieval index keeps its cursor per (sequence, layer) and starts at {0, 0}, which
  /// also builds it from what a recovered or attached sequence holds. Holes (dropped or lost
  /// chunks) are never in `added`; a dropped index may appear in `dropped` without ever
  /// having been added. NotFound for an unknown sequence, InvalidArgument for a bad layer or
  /// a cursor past the layer's state.
  /// At most `max_added` chunks are handed over (> 0): past them `out->complete` is false and
  /// `out->next` stands after the last one handed over (every drop comes with the first call),
  /// so that a reader catching up with a long sequence holds a bounded batch at a time.
  Status ChunkUpdatesSince(SequenceId seq, int layer, const ChunkCursor& since, ChunkUpdate* out,
                           size_t max_added = SIZE_MAX) const;
  /// Starts promoting the chunks into hot slots and pins them (async).
  ///
  /// A fetch takes every hot slot it needs under the store lock, or none. When the pool has
  /// too few slots that are free or hold an unpinned chunk, it waits (at most
  /// StoreOptions::pin_wait_ms; counted in StoreCounters::pin_waits and pin_wait_us) for other
  /// fetches to unpin or finish loading, holding no pin of its own call while it waits. Waiters
  /// are served oldest first: a fetch from a sequence that holds no pin waits behind them even
  /// where there is room, so a fetch of many chunks is not starved by a stream of small ones.
  /// It fails at once with ResourceExhausted, naming the numbers, where waiting could deadlock:
  /// when `seq` already holds pins and would hold more than its reservation (ReserveHotSlots)
  /// with this fetch, and when the slots free or held by other threads are too few for it
  /// (it would wait for pins its own thread holds: the live handles its earlier FetchChunks
  /// calls returned, whichever thread releases them; a batching engine that gathers every
  /// session's layer before releasing any would otherwise wait pin_wait_ms for itself). Why
  /// nothing deadlocks is written once, on HotPool (offload/store/hot_pool.h).
  ///
  /// `fit` = kWithinClaims (what Session uses for a retrieval grant): `chunk_indices` are best
  /// first, and a fetch of more chunks than `seq`'s reservation R keeps, of the chunks past R,
  /// only as many as leave every other sequence's claim free, where a sequence's claim is the
  /// larger of its reservation and the slots it holds pinned or loading: it keeps
  /// max(min(n, R), P - (the others' claims) - (the slots `seq` holds)) of its n chunks and
  /// leaves the rest out (spans() has one span per chunk kept). As long as every fetch past
  /// its reservation goes through this rule, the claims never exceed the pool, so a sequence
  /// can always pin its reservation without waiting, even when one thread holds every other
  /// sequence's pins. A fetch within its reservation, and any fetch with kAll, takes every
  /// chunk or fails as above.
  Result<FetchHandle> FetchChunks(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices,
                                  FetchFit fit = FetchFit::kAll);
  /// The warm-only fetch: brings chunks of one layer that are only in a lower tier back into
  /// warm slots, for a reader of warm copies (WarmAddresses: the session's device lane, which
  /// defers a chosen chunk with no warm copy). No hot slot, no upload to the hot tier, no pin; the
  /// calling thread does not wait (one lock entry: checks, then the reads go to a transfer
  /// worker). A chunk already in warm (or landing into it), or being read by an earlier
  /// warm-only fetch, is not read again. Room: a free warm slot, or the slot of the warm
  /// policy's victim among unpinned chunks a lower tier acknowledged (WarmTier::AcquireForRead,
  /// on the worker; an exposed victim waits on the warm reader fence there); a chunk with no room
  /// stays in the lower tiers and the handle's status is ResourceExhausted naming it. A failed
  /// read is the handle's status naming the chunk. NotFound / InvalidArgument for the sequence
  /// and layer as ListChunks; InvalidArgument naming an index past the layer's chunks or dropped
  /// (nothing is read then).
  Result<WarmFetchHandle> FetchToWarm(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices);

  /// Admission of a Session (kvtier/session.h reserves its retrieval budget in chunks, what
  /// one Attend pins in the steady state): reserves `slots` hot slots for `seq`, so that
  /// sessions running at once never need more than the pool in total. Reservations of one
  /// sequence count once, at their largest (sessions attached to one sequence do not run at
  /// once). ResourceExhausted, naming the pool's slots, the slots reserved and the slots
  /// asked, when the reservations would exceed the pool; InvalidArgument for slots < 0;
  /// NotFound for an unknown sequence. Returns an id for ReleaseHotSlots (never 0).
  Result<uint64_t> ReserveHotSlots(SequenceId seq, int32_t slots);
  /// Gives a reservation back (unknown ids and 0 are ignored).
  void ReleaseHotSlots(uint64_t reservation);

  /// Frees every hot slot that is not pinned or loading (the chunks stay in
  /// warm/cold). For fair comparisons of methods over one store.
  void EvictHot();

  // ---- durability and accounting ----
  /// Waits until every write-through lower-tier write issued so far has finished, and returns
  /// (and clears) the first that failed, naming the chunk and the tier (for Redis the
  /// node). With a remote tier, once a write has failed it returns that error without
  /// waiting for the writes still queued, so it never waits on a dead remote longer than
  /// one retry window (and the remote tier fails every queued write to a node at once once
  /// that node has failed for retry_ms, offload/redis_client.h, so the store's destructor
  /// does not wait much longer either).
  ///
  /// A failed background write is sticky until then: the next Append of any sequence (and
  /// BeginLayerStep's view, which Session::Attend reads) returns it too, so nothing waits
  /// on warm room behind a dead lower tier. With a remote tier it also expires once the
  /// remote's retry_ms has passed since the failure, so a restarted server is used again.
  ///
  /// No chunk is lost on the way: a chunk leaves the warm tier only after a lower tier
  /// acknowledged it. With both tiers, a chunk the cold tier (RocksDB) acknowledged but
  /// Redis refused counts as acknowledged (durable on the local disk; it may leave warm
  /// and is read back from the cold tier), lacks the remote tier in ChunkInfo::tiers, is
  /// not written to Redis again by the store (PublishSequence copies it up), and the Redis
  /// error is reported as above.
  Status WaitForDurable() override;
  /// A snapshot; counts landed chunks, and the chunks still landing as chunks_landing
  /// (a reader: it lands nothing).
  StoreCounters counters() const override;

  // ---- sharing through the remote tier ----
  /// Publishes a closed sequence under `name` (1..128 of [A-Za-z0-9-_.]) for other
  /// processes: every chunk is acknowledged by the remote tier first, then each layer's
  /// record (chunk metas, sinks, local window), then the manifest. A reader sees the
  /// sequence only once the manifest exists, so never half of it. Publishing a name again
  /// replaces the manifest. FailedPrecondition without a remote tier or for an open sequence.
  Status PublishSequence(SequenceId seq, std::string_view name) override;
  /// Opens a sequence another store published: its sinks and local window are restored
  /// here, its chunks stay in the remote tier (under the publisher's keys, never written
  /// or deleted by this store) and fetches bring them into this store's warm and hot
  /// tiers. Tokens appended afterwards (decode) are this store's own chunks. NotFound when
  /// `name` is not (completely) published; InvalidArgument when the publisher's layout
  /// (geometry, n_sink, n_local, chunk_size, repr_topk) differs from this store's. The
  /// attached sequence is not persisted in this store's cold tier.
  Result<SequenceId> AttachPublished(std::string_view name) override;
  /// The tiers below warm (offload/store/lower_tiers.h): the cold tier (its acknowledged and
  /// lost chunks: ColdTier::AcknowledgedChunks, lost_chunks), the remote tier, the memory their
  /// machinery holds (memory_bytes).
  const LowerTiers& lower_tiers() const { return lower_; }

  /// Bytes of host memory held for indexes and chunk metadata: a record per chunk, plus the
  /// representative keys of the chunks that hold them in memory. A chunk holds them from its
  /// seal until it has left the warm tier with its meta record (which carries the same bytes)
  /// acknowledged by a lower tier that reads metas alone (LowerTier::reads_chunk_meta: the cold
  /// tier); then they are released and read back on demand. Chunks recovered at Open hold none.
  /// A store without such a tier (none, or only a remote tier) keeps every chunk's.
  uint64_t metadata_bytes() const;

 private:
  friend class TieredStoreTestPeer;  // tests/tiered_store_test_peer.h
  using Chunk = store_internal::Chunk;
  using LayerState = store_internal::LayerState;
  using Sequence = store_internal::Sequence;
  TieredStore(const StoreOptions& options, const StoreHooks& hooks);
  // Adds mass [repr_head_count(), n] to the layer's ring (AddLocalAttention and
  // AddLocalQueryAttention, after each checked its kind).
  Status AddMass(SequenceId seq, int layer, int64_t first_position, int n, const float* mass);

  // The parts, in the order they are built at Open and destroyed in reverse (what a part
  // refers to outlives it); which file owns what is on each part's header.
  StoreOptions options_;
  StoreHooks hooks_;
  size_t chunk_bytes_ = 0;
  size_t token_bytes_ = 0;  // K (or V) bytes of one token
  // The coordinator's lock, its condition and the count of public calls (LayerStep's test).
  mutable StoreSync sync_;
  mutable CallCounter visits_;
  // Hot memory: the tier's slots and regions (offload/hot_tier.h), then who holds which slot.
  std::unique_ptr<HotTier> hot_;
  StoreCounters counters_;  // guarded by sync_.mu; parts add to it
  std::unique_ptr<LayerRing> ring_;
  std::unique_ptr<SequenceTable> sequences_;
  std::unique_ptr<ChunkCatalog> catalog_;
  std::unique_ptr<HotPool> hot_pool_;
  // The tiers below warm, in order, with their reads, acknowledgements and sticky error.
  LowerTiers lower_;
  std::unique_ptr<WarmTier> warm_;
  // After the tiers it copies between, so that it is destroyed (idle) before them.
  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<LowerWriter> writer_;
  std::unique_ptr<Landing> landing_;
  std::unique_ptr<Promoter> promoter_;
};

/// Sinks and local window of one layer, in hot memory (device pointers for a "cuda" tier): the
/// hot view of TieredStore::BeginLayerStep, for a caller that needs nothing else. A call of the
/// sequence's driver (it lands the layer's sealed chunks).
Result<HotView> GetHotView(TieredStore& store, SequenceId seq, int layer);

}  // namespace kvtier
