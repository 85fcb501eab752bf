// Store layout shared by the SIGKILL test and its child process.
#pragma once

#include <string>

#include "offload/tiered_store.h"

namespace kvtier {

constexpr uint64_t kCrashSalt = 0xC4A5;
constexpr int kCrashSequences = 2;

inline StoreOptions CrashTestOptions(const std::string& dir) {
  StoreOptions o;
  o.geometry = Geometry{2, 4, 2, 32, DType::kBF16};
  o.n_sink = 16;
  o.n_local = 64;
  o.chunk_size = 16;
  o.warm_bytes = 32 * o.chunk_bytes();  // tiny: chunks keep leaving warm
  o.hot_bytes = 8 * o.chunk_bytes();
  o.data_dir = dir;
  o.write_through = true;
  return o;
}

}  // namespace kvtier
