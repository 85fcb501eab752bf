// `kvtier stress`: an offload stress test. Several threads each drive their own
// sequences, appending blocks of random length with deterministic content
// (integration/pattern.h) into a store whose tiers are tiny, so chunks move
// between hot, warm and cold all the time; random fetches promote chunks back
// and check their bytes on the spot. At the end every sequence is closed, every
// token is read back and compared bit for bit, the store is reopened from its
// RocksDB directory and everything is verified again.
#pragma once

#include <string>

#include "offload/tiered_store.h"

namespace kvtier {

struct StressOptions {
  StoreOptions store;              ///< small geometry and tiny capacities by default (see cli)
  int sequences = 8;               ///< sequences in total
  int threads = 4;                 ///< driver threads (std::thread; sequences are split among them)
  int64_t tokens = 4096;           ///< tokens appended per sequence and layer
  int max_block = 97;              ///< appends use random blocks of 1..max_block tokens
  double fetch_probability = 0.3;  ///< chance of a random fetch (and check) after each append
  int fetch_chunks = 4;            ///< chunks per random fetch
  bool reopen = true;              ///< close the store, reopen it from data_dir and verify again
  uint64_t seed = 1;
  /// Drop every sequence from every tier (cold and remote included) once verified, so the
  /// test leaves no data behind (`kvtier stress` without --keep). Default: kept.
  bool drop_at_end = false;
  Status Validate() const;
};

struct StressReport {
  uint64_t appends = 0, fetches = 0, fetched_chunks = 0, verified_tokens = 0, verified_after_reopen = 0;
  uint64_t bytes_appended = 0;
  uint64_t errors = 0;  ///< failed operations plus mismatching bytes
  std::string first_error;
  double seconds = 0;
  bool sequences_dropped = false;  ///< StressOptions::drop_at_end did
  StoreCounters counters;
  std::string ToJson(const StressOptions& o) const;
  std::string ToTable(const StressOptions& o) const;
};

Result<StressReport> RunStress(const StressOptions& options);

}  // namespace kvtier
