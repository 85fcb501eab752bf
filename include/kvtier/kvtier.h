// kvtier's public header: everything an inference engine needs to use kvtier as
// its KV memory.
//
//   TieredStore   the tiers (hot slots, warm host memory, RocksDB cold tier), shared
//                 by every sequence: TieredStore::Open(StoreOptions)
//   Session       one sequence: Append K/V, Attend (probe, search, budget, fetch,
//                 attention in one call), Compress, Close/Drop, counters
//   Retriever, ScoringPolicy, kernels::Attention
//                 the lower-level parts, for engines that run their own attention
//                 or their own loop (Session::Gather gives the spans to attend)
//
// Errors are Status / Result<T> (store/status.h); nothing throws across this API.
// The README's "Embedding kvtier" section shows a complete decode loop. kvtier/kvtier_c.h
// is the same API for C (opaque handles, error codes with messages).
#pragma once

#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"
#include "kvtier/session.h"
#include "offload/policy/scoring_policy.h"
#include "offload/tiered_store.h"
#include "retrieval/retriever.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

/// The library's version, "major.minor.patch".
const char* Version();

}  // namespace kvtier
