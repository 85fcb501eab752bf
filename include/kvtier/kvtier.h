// kvtier's public header: everything an inference engine needs to use kvtier as
// its KV memory.
//
//   Store         the tiers (hot slots, warm host memory, RocksDB cold tier, Redis
//                 remote tier), shared by every sequence: Store::Open(StoreOptions)
//   Session       one sequence: Append K/V, Attend (probe, search, budget, fetch,
//                 attention in one call), Compress, Close/Drop, counters
//   options       StoreOptions, RetrieverOptions, SessionOptions (kvtier/options.h)
//   counters      StoreCounters, SessionCounters, AttendStats (kvtier/counters.h)
//
// Errors are Status / Result<T> (kvtier/status.h); nothing throws across this API.
// The README's "Embedding kvtier" section shows a complete decode loop. kvtier/kvtier_c.h
// is the same API for C (opaque handles, error codes with messages). Only the headers of
// include/kvtier/ are installed; the store's internals (tiers, retrieval, kernels) are not.
#pragma once

#include "kvtier/counters.h"
#include "kvtier/options.h"
#include "kvtier/session.h"
#include "kvtier/status.h"
#include "kvtier/store.h"
#include "kvtier/types.h"

namespace kvtier {

/// The library's version, "major.minor.patch".
const char* Version();

}  // namespace kvtier
