// KvSource: where `kvtier run` and the policy comparison get a sequence's Q/K/V.
//
// Two implementations: the synthetic Workload (integration/workload.h), a pure
// function of (seed, layer, position, head, lane), and a recorded KvTrace
// (integration/kv_trace.h), a real model's attention on a real prompt. Both are
// random access by (layer, position range), so the store path, the full-attention
// baseline, the oracle relevance and the policies read the same bytes without the
// job keeping a copy of its own.
//
// Layout of a sequence: positions [0, context) are the prompt, prefilled in
// windows; its last part [question_begin, context) is the question window, whose
// queries seek the needles; positions [context, total_tokens()) are decode steps.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "integration/kv_trace.h"
#include "integration/workload.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

class KvSource {
 public:
  virtual ~KvSource() = default;
  /// Shape of q/k/v (dtype: fp32, what Generate writes).
  virtual Geometry geometry() const = 0;
  virtual int64_t context() const = 0;
  virtual int64_t question_begin() const = 0;
  virtual int64_t total_tokens() const = 0;
  int64_t question_len() const { return context() - question_begin(); }
  int64_t decode_steps() const { return total_tokens() - context(); }
  /// Q [n, q_heads, head_dim], K and V [n, kv_heads, head_dim], fp32, of positions
  /// [begin, end) of `layer`; q and k after RoPE. Any pointer may be null (skipped).
  /// Requires 0 <= layer < layers and 0 <= begin <= end <= total_tokens() (aborts
  /// otherwise: a caller bug, not bad input). Thread-safe.
  virtual void Generate(int layer, int64_t begin, int64_t end, float* q, float* k, float* v) const = 0;
  /// Token ranges of the needles a query at `position` seeks (none for a filler query).
  virtual std::vector<TokenRange> SoughtNeedles(int64_t position) const = 0;
  /// Bytes the source holds in memory (a trace's q/k/v; ~0 for the generator).
  virtual uint64_t memory_bytes() const = 0;
};

/// Writes the trace's shape into `geometry` (layers, heads, head_dim; the storage dtype
/// is kept) and its lengths into `workload` (context, question_len, decode_steps): what a
/// run over the trace uses. The synthetic knobs of `workload` do not apply to a trace.
void AdoptTrace(const KvTrace& trace, Geometry* geometry, WorkloadOptions* workload);

/// The trace when given, else the synthetic Workload of (geometry, workload). A trace must
/// have been adopted: a shape or length that differs from it is InvalidArgument naming it.
Result<std::unique_ptr<KvSource>> MakeKvSource(const Geometry& geometry, const WorkloadOptions& workload,
                                               std::shared_ptr<const KvTrace> trace);

}  // namespace kvtier
