// Policy evaluation: every scoring policy compresses the same context (synthetic, or a
// recorded trace of a real model: `trace`) to the same token budget, and decoding then
// shows what each kept.
//
// Token-level and exact, as the policies' papers evaluate them: the context's K/V are
// generated in memory (fp32), the last `observe` queries of the prompt (the end of the
// question window, where a real prompt puts its question) attend over every key, each
// policy observes that attention layer by layer and keeps `budget` tokens per kv head and
// layer. Then `decode_steps` tokens are generated; each step's query attends over what
// its kv head kept (plus the tokens generated since). Policies that compress once observe
// every step's attention; policies that compress while decoding (G-KV's s) observe, every
// s steps, the attention of the last min(observe, s) generated queries over the cache as
// it is then (their observation window) and compress again.
// Each step is compared with full attention over every token:
//   needle retention   share of the sought needle's tokens still in the cache, per head
//   attention recall   full-attention mass on the kept keys
//   output error       |o_kept - o_full| / |o_full| of the attention output
//   scoring share      policy time (Observe + Keep) / attention time of the same steps
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/compress.h"
#include "integration/kv_trace.h"
#include "integration/workload.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

struct PolicyEvalOptions {
  Geometry geometry{8, 8, 2, 64, DType::kF32};  ///< model shape (dtype unused: fp32 throughout)
  WorkloadOptions workload;                     ///< context, needles, decode_steps, ...
  /// Replay this recorded trace instead of the synthetic workload (geometry shape and
  /// workload lengths are taken from it, as RunOptions::trace).
  std::shared_ptr<const KvTrace> trace;
  std::vector<std::string> policies;  ///< factory strings; empty = every policy's defaults
  int64_t budget = 1024;              ///< kept tokens per kv head and layer
  int observe = 32;                   ///< prompt queries observed at prefill end
  int64_t sink_tokens = 64;           ///< protected sinks (PolicyGeometry)
  int64_t local_tokens = 256;         ///< protected local window (PolicyGeometry)
  Status Validate() const;
};

struct PolicyEvalRow {
  std::string spec;  ///< the policy's ToString()
  int64_t budget = 0;
  double needle_retention = 0;      ///< mean over decode steps, layers and kv heads
  double attention_recall = 0;      ///< mean over decode steps, layers and q heads
  double output_error = 0;          ///< mean over decode steps and layers
  double prefill_scoring_ms = 0;    ///< Observe + Keep over all layers at prefill end
  double prefill_attention_ms = 0;  ///< the observation window's attention over every key, all layers
  double decode_scoring_ms = 0;  ///< per decode step, all layers (mean: compressions every s steps amortised)
  double decode_attention_ms = 0;  ///< attention over the kept cache per decode step, all layers (mean)
  int compressions = 0;            ///< Keep calls per layer (1 at prefill end + decode-time ones)
  double mean_cache_tokens = 0;    ///< kept tokens per kv head and layer, mean over decode steps
  size_t peak_state_bytes = 0;     ///< policy state at its largest
};

// ExactAttentionRows (what a policy observes) lives in engine/compress.h.

/// Runs every policy on the same data. Errors name the policy that failed.
Result<std::vector<PolicyEvalRow>> EvaluatePolicies(const PolicyEvalOptions& options);

/// One table: a row per policy (and per budget when rows hold several budgets).
std::string PolicyEvalTable(const std::vector<PolicyEvalRow>& rows);

}  // namespace kvtier
