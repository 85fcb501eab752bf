// What the two-process share test (tests/offload/remote_tier_test.cc, tests/child_remote_publisher.cc)
// agrees on: the store layout and the tokens the publisher writes.
#pragma once

#include <string>
#include <vector>

#include "integration/pattern.h"
#include "offload/tiered_store.h"

namespace kvtier {
namespace remote_share {

inline constexpr uint64_t kSalt = 1515;
inline constexpr uint64_t kPatternSeq = 7;  // the pattern's sequence id, whatever id the store gives it
inline constexpr int64_t kTokens = 600;     // per layer: sinks, ~66 chunks, a partial local window

inline StoreOptions Options(const std::string& remote) {
  StoreOptions o;
  o.geometry = Geometry{2, 4, 2, 16, DType::kF16};
  o.n_sink = 8;
  o.n_local = 32;
  o.chunk_size = 8;
  o.repr_topk = 2;
  o.hot_bytes = 64 * o.chunk_bytes();
  o.warm_bytes = 16 * o.chunk_bytes();  // most chunks live only in the lower tier
  o.remote = remote;
  return o;
}

inline size_t TokenBytes(const StoreOptions& o) {
  return o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
}

/// K or V (which 0/1) of tokens [from, to) of one layer.
inline std::vector<uint8_t> Tokens(const StoreOptions& o, int layer, int which, int64_t from, int64_t to) {
  std::vector<uint8_t> out(static_cast<size_t>(to - from) * TokenBytes(o));
  FillPattern(kSalt, kPatternSeq, static_cast<uint32_t>(layer), which, from, to - from, TokenBytes(o),
              out.data());
  return out;
}

/// Appends the whole pattern to `seq`, every layer, in blocks of 50 tokens.
inline Status Write(TieredStore* s, SequenceId seq) {
  for (int l = 0; l < s->options().geometry.layers; ++l)
    for (int64_t p = 0; p < kTokens; p += 50) {
      const int64_t e = std::min<int64_t>(kTokens, p + 50);
      const auto k = Tokens(s->options(), l, 0, p, e), v = Tokens(s->options(), l, 1, p, e);
      KVTIER_RETURN_IF_ERROR(
          s->Append(seq, l, k.data(), v.data(), static_cast<int>(e - p), s->options().geometry.dtype));
    }
  return Status::Ok();
}

}  // namespace remote_share
}  // namespace kvtier
