#include "kernels/cpu/slot_attention.h"

#include <cmath>
#include <cstddef>
#include <limits>
#include <new>
#include <utility>
#include <vector>

namespace kvtier::kernels {

KernelError CheckSlotAttentionParams(const SlotAttentionParams& p) {
  if (p.q_heads <= 0 || p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0) return KernelError::kBadShape;
  if (!HeadDimSupported(p.head_dim) || p.n_queries < 0) return KernelError::kBadShape;
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16)
    return KernelError::kBadDType;
  if (!std::isfinite(p.scale)) return KernelError::kBadShape;
  if (p.n_dense < 0 || p.n_dense > kMaxDenseParts || p.n_slots < 0 || p.pool_slots < 0)
    return KernelError::kBadShape;
  if (p.n_leading_dense < -1 || p.n_leading_dense > p.n_dense) return KernelError::kBadShape;
  if (p.n_queries == 0) return KernelError::kOk;
  if (p.q == nullptr || p.out == nullptr || (p.causal && p.q_positions == nullptr))
    return KernelError::kNullPointer;
  for (int i = 0; i < p.n_dense; ++i) {
    const DenseKv& d = p.dense[i];
    if (d.n_tokens < 0) return KernelError::kBadShape;
    if (d.n_tokens > 0 && (d.k == nullptr || d.v == nullptr)) return KernelError::kNullPointer;
  }
  if (p.n_slots > 0) {
    if (p.slot_tokens <= 0 || p.pool_slots == 0) return KernelError::kBadShape;
    if (p.pool_k == nullptr || p.pool_v == nullptr || p.slot_index == nullptr ||
        p.slot_first_position == nullptr)
      return KernelError::kNullPointer;
  }
  return KernelError::kOk;
}

KernelError SlotAttention(const SlotAttentionParams& p) {
  if (const KernelError e = CheckSlotAttentionParams(p); e != KernelError::kOk) return e;
  if (p.n_queries == 0) return KernelError::kOk;
  for (int i = 0; i < p.n_slots; ++i) {
    if (p.slot_index[i] < 0 || p.slot_index[i] >= p.pool_slots) return KernelError::kBadShape;
    if (p.slot_n_tokens && (p.slot_n_tokens[i] < 0 || p.slot_n_tokens[i] > p.slot_tokens))
      return KernelError::kBadShape;
  }
  // One span per run, pointing into the caller's memory: a selected slot is read in place.
  std::vector<KvSpan> spans;
  try {
    spans.reserve(static_cast<size_t>(p.n_dense + p.n_slots));
  } catch (const std::bad_alloc&) {
    return KernelError::kOutOfMemory;
  }
  auto push_dense = [&](int from, int to) {
    for (int i = from; i < to; ++i) {
      const DenseKv& d = p.dense[i];
      KvSpan s;
      s.k = d.k;
      s.v = d.v;
      s.n_tokens = d.n_tokens;
      s.first_position = d.first_position;
      s.mass = d.mass;
      spans.push_back(s);
    }
  };
  const int leading = p.n_leading_dense < 0 ? p.n_dense : p.n_leading_dense;
  push_dense(0, leading);
  std::vector<std::pair<int, std::vector<float>>> ragged;  // (selected slot, its mass scratch)
  const size_t token_bytes = static_cast<size_t>(p.kv_heads) * p.head_dim * DTypeSize(p.dtype);
  const size_t slot_bytes = token_bytes * static_cast<size_t>(p.slot_tokens);
  for (int i = 0; i < p.n_slots; ++i) {
    const size_t off = static_cast<size_t>(p.slot_index[i]) * slot_bytes;
    KvSpan s;
    s.k = static_cast<const uint8_t*>(p.pool_k) + off;
    s.v = static_cast<const uint8_t*>(p.pool_v) + off;
    s.n_tokens = p.slot_n_tokens ? p.slot_n_tokens[i] : p.slot_tokens;
    s.first_position = p.slot_first_position[i];
    s.mass = p.slot_mass ? p.slot_mass + static_cast<size_t>(i) * p.kv_heads * p.slot_tokens : nullptr;
    if (s.mass != nullptr && s.n_tokens < p.slot_tokens) {
      // A span's mass is [kv_heads, n_tokens]; a partly filled slot's rows are slot_tokens
      // apart in slot_mass, so Attention adds into scratch that is scattered afterwards.
      try {
        ragged.push_back({i, std::vector<float>(static_cast<size_t>(p.kv_heads) * s.n_tokens, 0.0f)});
      } catch (const std::bad_alloc&) {
        return KernelError::kOutOfMemory;
      }
      s.mass = ragged.back().second.data();
    }
    spans.push_back(s);
  }
  push_dense(leading, p.n_dense);
  AttentionParams a;
  a.q_heads = p.q_heads;
  a.kv_heads = p.kv_heads;
  a.head_dim = p.head_dim;
  a.dtype = p.dtype;
  a.scale = p.scale;
  a.n_queries = p.n_queries;
  a.q = p.q;
  a.q_positions = p.q_positions;
  a.parts = spans.data();
  a.n_parts = static_cast<int>(spans.size());
  a.out = p.out;
  a.lse = p.lse;
  a.causal = p.causal;
  if (const KernelError e = Attention(a); e != KernelError::kOk) return e;
  for (const auto& [i, scratch] : ragged) {
    const int n = static_cast<int>(scratch.size() / p.kv_heads);
    float* dst = p.slot_mass + static_cast<size_t>(i) * p.kv_heads * p.slot_tokens;
    for (int h = 0; h < p.kv_heads; ++h)
      for (int t = 0; t < n; ++t)
        dst[static_cast<size_t>(h) * p.slot_tokens + t] += scratch[static_cast<size_t>(h) * n + t];
  }
  return KernelError::kOk;
}

void MergeAttentionStates(int rows, int head_dim, const float* out_a, const float* lse_a, const float* out_b,
                          const float* lse_b, float* out, float* lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rows; ++r) {
    const float la = lse_a[r], lb = lse_b[r];
    const size_t o = static_cast<size_t>(r) * head_dim;
    if (la == kNegInf && lb == kNegInf) {
      for (int d = 0; d < head_dim; ++d) out[o + d] = 0.0f;
      lse[r] = kNegInf;
      continue;
    }
    const float m = la > lb ? la : lb;
    const float wa = la == kNegInf ? 0.0f : std::exp(la - m);
    const float wb = lb == kNegInf ? 0.0f : std::exp(lb - m);
    const float inv = 1.0f / (wa + wb);
    for (int d = 0; d < head_dim; ++d) out[o + d] = (out_a[o + d] * wa + out_b[o + d] * wb) * inv;
    lse[r] = m + std::log(wa + wb);
  }
}

}  // namespace kvtier::kernels
