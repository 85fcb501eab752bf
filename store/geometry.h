// Geometry: the shape of a model's KV cache, and the byte sizes derived from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/dtype.h"
#include "store/status.h"

namespace kvtier {

struct Geometry {
  int layers = 32;           ///< transformer layers (default 32)
  int q_heads = 32;          ///< query heads (default 32)
  int kv_heads = 8;          ///< key/value heads; q_heads % kv_heads == 0 (GQA)
  int head_dim = 128;        ///< channels per head (default 128)
  DType dtype = DType::kF16; ///< storage dtype of K and V (default fp16)

  /// Query heads sharing one kv head.
  int group_size() const { return q_heads / kv_heads; }
  /// Elements of K (or V) for one token of one layer: kv_heads * head_dim.
  size_t token_elems() const { return static_cast<size_t>(kv_heads) * head_dim; }
  /// Bytes of K plus V for one token of one layer.
  size_t token_kv_bytes() const { return 2 * token_elems() * DTypeSize(dtype); }

  Status Validate() const;
  /// "L,Hq,Hkv,D:dtype", e.g. "32,32,8,128:f16".
  std::string ToString() const;
  /// Parses "L,Hq,Hkv,D" (dtype unchanged) into *this; validates.
  Status ParseShape(const std::string& text);
};

bool operator==(const Geometry& a, const Geometry& b);

}  // namespace kvtier
