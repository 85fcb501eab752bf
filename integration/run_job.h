// `kvtier run`: the main job. A long-sequence run on the synthetic ∞-Bench-
// shaped workload (integration/workload.h), or on a model's recorded attention
// (RunOptions::trace, integration/kv_trace.h): the context streams through a
// TieredStore in prefill windows, a question window and decode steps then
// attend over sinks | retrieved chunks | local window, and the same queries
// run full attention over the whole context on the same data in the same
// process, so quality and speed are reported as comparisons.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "integration/kv_trace.h"
#include "integration/stream_bandwidth.h"
#include "integration/turnover.h"
#include "integration/workload.h"
#include "kvtier/session.h"
#include "offload/device_memory.h"
#include "offload/tiered_store.h"
#include "retrieval/retriever.h"

namespace kvtier {

struct RunOptions {
  StoreOptions store;        ///< store layout and capacities (data_dir holds the cold tier)
  WorkloadOptions workload;  ///< the synthetic data
  /// Replay this recorded trace (integration/kv_trace.h) instead of the synthetic workload:
  /// RunJob takes the geometry's shape (keeping store.geometry.dtype) and workload.context,
  /// question_len and decode_steps from it (AdoptTrace); the other workload knobs do not apply.
  std::shared_ptr<const KvTrace> trace;
  RetrieverOptions retrieval =
      RecommendedRetrieval();  ///< the "kvtier" preset; budget_tokens is set from `budget`
  int budget = 2048;           ///< retrieved tokens per step and layer (budget / chunk_size chunks)
  /// Run StreamingLLM, InfLLM, InfLLM at its own defaults, ActQKV w/o cut-off, ActQKV and Quest on
  /// the same data beside the configured retrieval (rows in that order, "kvtier" last).
  bool compare = false;
  int spearman_windows = 8;  ///< prefill windows sampled for probe-to-oracle agreement (0 = skip)
  int window = 256;          ///< prefill window: tokens appended per layer at a time
  int stat_stride =
      8;  ///< every stat_stride-th query of a prefill window feeds representative-key statistics
  bool baseline = true;  ///< also run full attention on the same data (quality + speed comparison)
  /// Measure the memory's streaming read rate after the evaluated steps
  /// (MeasureStreamBandwidth with `bandwidth`), for each method's byte floor (MethodReport).
  /// Host tiers only: a cuda tier's step reads GPU memory, and its floor is not reported.
  bool measure_bandwidth = true;
  StreamBandwidthOptions bandwidth;
  bool progress = true;  ///< progress lines on stderr
  /// Drop the sequence from every tier (cold and remote included) when the job ends, an error
  /// included, so a run leaves no data behind (`kvtier run` without --keep). Default: kept.
  bool drop_at_end = false;
  /// Compression mode: this scoring policy drops chunks at prefill end (and every s
  /// decode steps for decode-time policies such as G-KV), keeping the chunks that hold its
  /// keep set's tokens up to `kv_budget` tokens per layer (sinks and local window
  /// included). Empty = off.
  std::string compress;
  int64_t kv_budget = 16384;  ///< tokens kept per layer in compression mode
  int observe = 32;           ///< prompt queries whose attention over every key the scoring policy sees
  /// On a "cuda" hot tier the decode steps hand K, V, queries and outputs over in device memory
  /// on the driver's own stream (Session::AppendDevice / AttendDevice, integration/device_driver.h),
  /// as an engine does; true: through the host-pointer Append / Attend instead. Host tiers ignore it.
  bool host_calls = false;
  /// SessionOptions::defer_cold_chunks of every method's session (the device lane skips a chosen
  /// chunk with no warm copy for a step instead of waiting for it).
  bool defer_cold_chunks = false;
  Status Validate() const;
};

/// What the scoring policy did at prefill end (demotion scores and/or compression).
struct PolicyStageReport {
  std::string spec;             ///< the scoring policy's factory string ("" = none ran)
  bool compressed = false;      ///< compression mode dropped chunks
  int compressions = 0;         ///< at prefill end, plus every s decode steps for decode-time policies (G-KV)
  double scoring_ms = 0;        ///< Observe + Scores/Keep over all layers
  double attention_ms = 0;      ///< the observation window's exact attention over every key, all layers
  uint64_t dropped_chunks = 0;  ///< over all layers
  uint64_t kept_tokens = 0;     ///< tokens the store holds per layer (mean) after the last compression
  uint64_t scratch_bytes = 0;   ///< one observation's K, V and attention rows (counted in the RSS bound)
};

/// The "InfLLM (own defaults)" row of `kvtier run --compare`: InfLLM's scoring as the InfLLM row
/// computes it (representatives per query head, the mean probe, a fixed top-k, index Flat) at
/// InfLLM's own defaults: blocks (chunks) of 128 tokens, 4 representatives, its top 16 blocks,
/// 2048 tokens a layer whatever the run's budget.
constexpr const char* kInfLLMDefaultsRow = "InfLLM (own defaults)";
constexpr int kInfLLMBlock = 128;
constexpr int kInfLLMReprTopk = 4;
constexpr int kInfLLMTopBlocks = 16;
/// The index of the "Quest" row (retrieval/quest_index.h): a chunk ranked by the head whose
/// min/max bound is highest, as Quest chooses pages per head. The row keeps every key as a
/// representative, probes with the current query (mean-pooled per kv head) and takes a fixed
/// top-k at the run's budget.
constexpr const char* kQuestRowIndex = "Quest:heads=max";

/// Quality and speed of one retrieval method on the run's steps.
struct MethodReport {
  std::string name;       ///< "ActQKV", "InfLLM", ... or "configured"
  std::string spec;       ///< probe / alloc / index / k
  int chunk_size = 0;     ///< tokens a chunk of the store the method reads
  int budget_tokens = 0;  ///< retrieved tokens per step and layer it was given
  double needle_hit_rate = 0, attention_recall = 0, output_rel_error = 0;
  double question_needle_hit_rate = 0, question_attention_recall = 0, question_output_rel_error = 0;
  double step_ms = 0;  ///< median decode step, all layers (append + probe + search + fetch + attention)
  double probe_ms = 0, search_ms = 0, alloc_ms = 0, fetch_ms = 0, attention_ms = 0, append_ms = 0;
  /// median of Session::Attend's wall time outside its timed parts (lock round trips, views,
  /// unpinning), summed over layers; not part of step_ms
  double other_ms = 0;
  double retrieval_share = 0;  ///< (probe + search + alloc) / step, medians
  double chunks_per_step = 0;  ///< mean retrieved chunks per decode step over all layers
  uint64_t bytes_moved = 0;    ///< bytes moved by this method's fetches
  /// Bytes a decode step read, all layers, mean over the decode steps, by part: the first stage
  /// and the rescoring of the search and the K/V attended (AttendStats' counts), and the fetch's
  /// promotions into hot slots (the store's warm, cold and remote loads times the chunk's bytes).
  double first_stage_bytes = 0, rescoring_bytes = 0, fetch_bytes = 0, attention_bytes = 0;
  double step_bytes() const { return first_stage_bytes + rescoring_bytes + fetch_bytes + attention_bytes; }
  /// Layer selections with chunks to choose from (prefill windows and decode steps), and how
  /// many of them reused the layer's last search (RetrieverOptions::reuse_cosine).
  uint64_t selections = 0, reused_selections = 0;
  /// ... and how many screened a slice of the chunks (RetrieverOptions::screen_period).
  uint64_t sliced_selections = 0;
  /// [layer] decode steps after the first: the retrieved chunks the previous decode step did
  /// not retrieve (integration/turnover.h).
  std::vector<SelectionTurnover> decode_turnover_by_layer;
  std::vector<double> step_ms_all, step_error_all;
  /// [layer][bucket]: how many times, summed over the decode steps, this method retrieved a
  /// chunk of the bucket (RunReport::chunk_choice says which chunks a bucket holds). The
  /// question window is not counted. Sums to chunks_per_step x decode steps over all layers.
  std::vector<std::vector<uint64_t>> chunk_counts;
  /// [layer][bucket]: decode steps in which the bucket's most often retrieved chunk was
  /// retrieved (<= steps): what stands out where a bucket holds many chunks (a needle's chunk
  /// taken at every step among chunks taken now and then).
  std::vector<std::vector<uint64_t>> chunk_max_steps;
};

/// Which chunks the methods retrieved, by position in the context: the buckets of
/// MethodReport::chunk_counts (the chunk-choice heat map of `python -m kvtier.tools.plot`). Bounded for
/// any context: chunk indices [0, chunks) are grouped into at most kMaxChunkChoiceBuckets buckets
/// of bucket_chunks consecutive chunks; bucket b holds tokens [first_position + b * bucket_chunks *
/// chunk_size, first_position + (b + 1) * bucket_chunks * chunk_size).
struct ChunkChoice {
  int steps = 0;  ///< decode steps counted
  int chunk_size = 0;
  int64_t first_position = 0;       ///< first token of chunk 0 (= the sinks)
  uint64_t chunks = 0;              ///< chunk indices: the most chunks a layer of the sequence held
  uint64_t bucket_chunks = 1;       ///< consecutive chunks per bucket (1 while chunks <= the cap)
  uint64_t buckets = 0;             ///< ceil(chunks / bucket_chunks) <= kMaxChunkChoiceBuckets
  std::vector<TokenRange> needles;  ///< the needles the question window's and decode steps' queries seek
};
constexpr uint64_t kMaxChunkChoiceBuckets = 128;

/// Spearman rho between a probe's chunk scores and the oracle chunk relevance.
struct SpearmanSummary {
  double median = 0, q1 = 0, q3 = 0;
  int samples = 0;  ///< (window, layer) pairs
};

struct RunReport {
  RunOptions options;
  std::vector<MethodReport> methods;  ///< the configured method, or the compared ones in table order
  /// A comparison's rows left out (and why) and rows whose budget differs from the run's.
  std::vector<std::string> compare_notes;
  int headline = 0;  ///< method whose numbers fill the top-level fields (the "kvtier" row in a comparison)
  SpearmanSummary spearman_act, spearman_mean;
  PolicyStageReport policy;
  ChunkChoice chunk_choice;       ///< the buckets of every method's chunk_counts
  SequenceId sequence = 0;        ///< the run's sequence in the store
  bool sequence_dropped = false;  ///< it left every tier at the end (RunOptions::drop_at_end)
  // quality (decode steps and question window, all layers)
  double needle_hit_rate = 0;   ///< (step, layer) pairs whose sought needle was fully attended
  double attention_recall = 0;  ///< mean share of full attention's mass on the attended set
  double output_rel_error = 0;  ///< median over decode steps of ||o - o_full|| / ||o_full||
  double question_needle_hit_rate = 0;
  double question_attention_recall = 0;
  double question_output_rel_error = 0;
  // The attention oracle (needs the baseline): per (step, layer) the oracle_take_chunks chunks
  // with the most full-attention mass, plus the sinks and local window every method attends.
  uint64_t oracle_take_chunks = 0;
  double oracle_needle_hit_rate = 0, oracle_attention_recall = 0;
  double question_oracle_needle_hit_rate = 0, question_oracle_attention_recall = 0;
  // time
  double prefill_s = 0;        ///< wall time of the prefill (append + statistics), generation excluded
  double prefill_drain_s = 0;  ///< then, until the cold tier acknowledged every chunk (WaitForDurable)
  double step_ms = 0;          ///< median decode step over all layers: append + retrieve + fetch + attention
  double retrieve_ms = 0, fetch_ms = 0, attention_ms = 0, append_ms = 0;  ///< medians of the step's parts
  double other_ms = 0;  ///< median wall time of the step's Attend calls outside those parts (not in step_ms)
  double full_attention_step_ms = 0;  ///< median full attention over the whole context, all layers, same step
  /// K and V of every token full attention reads in a decode step, all layers, mean over the steps.
  double full_attention_bytes = 0;
  /// The streaming read rate measured in this run (RunOptions::measure_bandwidth; 0 when not).
  StreamBandwidth bandwidth;
  /// The time `bytes` take at the measured rate, in ms (0 without a measurement).
  double FloorMs(double bytes) const;
  /// A step of `ms` over its floor for `bytes`; 0 when the bandwidth was not measured, the step
  /// not timed (ms <= 0) or the floor is 0.
  double OverFloor(double ms, double bytes) const;
  // memory
  uint64_t peak_rss_bytes = 0;  ///< peak RSS during the kvtier phases (before the baseline)
  uint64_t rss_bound_bytes =
      0;  ///< at start + warm + hot + regions + index or its cap + trace q/k/v + overhead
  uint64_t rss_at_start_bytes = 0;  ///< RSS before the store opened: program, libraries, device runtime
  uint64_t lower_tier_memory_peak_bytes =
      0;                                 ///< RocksDB's memtables + table readers + block cache, most seen
  uint64_t index_bytes = 0;              ///< chunk metadata and retriever index
  uint64_t index_cap_bytes = 0;          ///< StoreOptions::index_bytes per session (0 = unbounded)
  uint64_t index_compressed_chunks = 0;  ///< chunks the cap keeps as int8 codes (every method)
  uint64_t index_evicted_chunks = 0;     ///< chunks the cap evicted from the index (every method)
  uint64_t context_kv_bytes = 0;         ///< K+V bytes of the whole context, all layers
  StoreCounters counters;
  /// Blocking host waits on the device per generated token over the decode steps, made by the
  /// steps themselves (appends and attention on the calling thread, every method's session
  /// summed: SessionCounters::host_syncs); 0 on a cpu tier.
  double host_syncs_per_token = 0;
  /// The same waits made meanwhile by worker threads (the store's transfer workers:
  /// SessionCounters::worker_host_syncs, summed); 0 on a cpu tier.
  double worker_host_syncs_per_token = 0;
  /// Chunks the device lane chose with no warm copy and did not attend (SessionCounters::
  /// chunks_deferred) per generated token, every method's session summed; 0 on a cpu tier.
  double chunks_deferred_per_token = 0;
  /// Device memory (offload/device_memory.h's counted allocations) at its most during the
  /// kvtier phases, read with peak RSS: every owner at once, and each owner's own most. 0 on a
  /// cpu tier (it allocates none).
  uint64_t device_memory_peak_bytes = 0;
  uint64_t device_memory_peak_by_owner[kDeviceMemoryOwners] = {};
  std::vector<double> step_ms_all, full_step_ms_all, step_error_all;

  std::string ToJson() const;
  std::string ToTable() const;
  std::string CompareTable() const;  ///< one row per method (+ full attention)
  /// One row per method (+ full attention): bytes per decode step by part, the byte floor and
  /// the step's ratio to it.
  std::string FloorTable() const;
};

/// Stated fixed overhead in the RSS bound: RocksDB's memtables, table readers and block cache,
/// the per-window generation buffers, the allocator's slack. The program, its libraries and the
/// device runtime are measured instead (RunReport::rss_at_start_bytes).
constexpr uint64_t kRunRssOverheadBytes = 256ull << 20;

Result<RunReport> RunJob(const RunOptions& options);

}  // namespace kvtier
