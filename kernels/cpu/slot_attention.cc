#include "kernels/cpu/slot_attention.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "kernels/cpu/rope.h"
#include "kernels/tbb_tsan.h"

namespace kvtier::kernels {
namespace {

// The fp32 copies a rotating call attends: [K][V] of every span, kept per thread between
// calls. A call that finds its thread's copy in use (a call nested in another's parallel
// work, on a thread that took a task of it) allocates its own.
struct RotatedCopies {
  std::vector<float> floats;
  bool busy = false;
};
thread_local RotatedCopies tls_rotated;

// One span's K/V copied out: `tokens` tokens from src_k/src_v (storage dtype) to dst_k/dst_v
// (fp32), K rotated at rope_position (kRopeAtKeyPositions: token t at first_position + t).
struct CopyJob {
  const uint8_t* src_k;
  const uint8_t* src_v;
  float* dst_k;
  float* dst_v;
  int tokens;
  int64_t first_position;
  int64_t rope_position;
};

// Widens and rotates every job, in blocks of tokens spread over oneTBB's threads.
void RunCopyJobs(const SlotAttentionParams& p, const std::vector<CopyJob>& jobs) {
  constexpr int kBlockTokens = 64;
  const size_t row = static_cast<size_t>(p.kv_heads) * p.head_dim;
  const size_t row_bytes = row * DTypeSize(p.dtype);
  std::vector<std::pair<int, int>> blocks;  // (job, first token)
  for (int j = 0; j < static_cast<int>(jobs.size()); ++j)
    for (int t = 0; t < jobs[static_cast<size_t>(j)].tokens; t += kBlockTokens) blocks.push_back({j, t});
  auto run = [&](int b) {
    const CopyJob& job = jobs[static_cast<size_t>(blocks[static_cast<size_t>(b)].first)];
    const int t0 = blocks[static_cast<size_t>(b)].second;
    const int n = std::min(kBlockTokens, job.tokens - t0);
    ToFloat(p.dtype, job.src_k + t0 * row_bytes, job.dst_k + t0 * row, n * row);
    ToFloat(p.dtype, job.src_v + t0 * row_bytes, job.dst_v + t0 * row, n * row);
    if (job.rope_position != kRopeAtKeyPositions) {
      // Every token at one position: the block is one token of n * kv_heads heads to Rope,
      // which then computes the angles once (the same floats, the same arithmetic).
      Rope(job.dst_k + t0 * row, 1, n * p.kv_heads, p.head_dim, &job.rope_position, p.rope_inv_freq);
      return;
    }
    int64_t pos[kBlockTokens];
    for (int t = 0; t < n; ++t) pos[t] = job.first_position + t0 + t;
    Rope(job.dst_k + t0 * row, n, p.kv_heads, p.head_dim, pos, p.rope_inv_freq);
  };
  const int n_blocks = static_cast<int>(blocks.size());
  if (n_blocks <= 1) {
    if (n_blocks == 1) run(0);
    return;
  }
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(tbb::blocked_range<int>(0, n_blocks, 1), fj.Body([&](const tbb::blocked_range<int>& r) {
    for (int b = r.begin(); b < r.end(); ++b) run(b);
  }));
  fj.Join();
}

}  // namespace

KernelError CheckSlotAttentionParams(const SlotAttentionParams& p) {
  if (p.q_heads <= 0 || p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0) return KernelError::kBadShape;
  if (!HeadDimSupported(p.head_dim) || p.n_queries < 0) return KernelError::kBadShape;
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16)
    return KernelError::kBadDType;
  if (!std::isfinite(p.scale)) return KernelError::kBadShape;
  if (p.n_dense < 0 || p.n_dense > kMaxDenseParts || p.n_slots < 0 || p.pool_slots < 0)
    return KernelError::kBadShape;
  if (p.n_leading_dense < -1 || p.n_leading_dense > p.n_dense) return KernelError::kBadShape;
  // A rotation position without frequencies, below kRopeAtKeyPositions, or an odd head_dim to rotate.
  if (p.slot_rope_position < kRopeAtKeyPositions) return KernelError::kBadShape;
  if (p.rope_inv_freq == nullptr && p.slot_rope_position != kRopeAtKeyPositions)
    return KernelError::kBadShape;
  for (int i = 0; i < p.n_dense; ++i) {
    const int64_t r = p.dense[i].rope_position;
    if (r < kRopeAtKeyPositions || (p.rope_inv_freq == nullptr && r != kRopeAtKeyPositions))
      return KernelError::kBadShape;
  }
  if (p.rope_inv_freq != nullptr && p.head_dim % 2 != 0) return KernelError::kBadShape;
  if (p.q_rope_positions != nullptr && p.rope_inv_freq == nullptr) return KernelError::kBadShape;
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

KernelError SlotAttention(const SlotAttentionParams& params) {
  if (const KernelError e = CheckSlotAttentionParams(params); e != KernelError::kOk) return e;
  if (params.n_queries == 0) return KernelError::kOk;
  // The count in memory makes this the call with n_slots = the count; rotated queries make it
  // the call with q rotated by Rope.
  SlotAttentionParams p = params;
  if (p.n_slots_in_memory != nullptr) {
    const int32_t count = *p.n_slots_in_memory;
    if (count < 0 || count > p.n_slots) return KernelError::kBadShape;
    p.n_slots = count;
    p.n_slots_in_memory = nullptr;
  }
  std::vector<float> rotated_q;
  if (p.q_rope_positions != nullptr) {
    try {
      rotated_q.assign(p.q, p.q + static_cast<size_t>(p.n_queries) * p.q_heads * p.head_dim);
    } catch (const std::bad_alloc&) {
      return KernelError::kOutOfMemory;
    }
    Rope(rotated_q.data(), p.n_queries, p.q_heads, p.head_dim, p.q_rope_positions, p.rope_inv_freq);
    p.q = rotated_q.data();
    p.q_rope_positions = nullptr;
  }
  for (int i = 0; i < p.n_slots; ++i) {
    if (p.slot_index[i] < 0 || p.slot_index[i] >= p.pool_slots) return KernelError::kBadShape;
    if (p.slot_n_tokens && (p.slot_n_tokens[i] < 0 || p.slot_n_tokens[i] > p.slot_tokens))
      return KernelError::kBadShape;
  }
  // One span per run, pointing into the caller's memory: a selected slot is read in place.
  std::vector<KvSpan> spans;
  std::vector<int64_t> rope_positions;  // [spans] where each span's keys are rotated
  try {
    spans.reserve(static_cast<size_t>(p.n_dense + p.n_slots));
    rope_positions.reserve(static_cast<size_t>(p.n_dense + p.n_slots));
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
      rope_positions.push_back(d.rope_position);
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
    rope_positions.push_back(p.slot_rope_position);
  }
  push_dense(leading, p.n_dense);
  DType attended = p.dtype;
  RotatedCopies own;
  RotatedCopies* copies = tls_rotated.busy ? &own : &tls_rotated;
  struct Release {
    RotatedCopies* c;
    ~Release() { c->busy = false; }
  } release{copies};
  copies->busy = true;
  if (p.rope_inv_freq != nullptr) {
    // Every span's K and V as fp32 copies, K rotated where the span says; the spans then
    // point at the copies and Attention reads fp32.
    const size_t row = static_cast<size_t>(p.kv_heads) * p.head_dim;
    size_t total = 0;
    for (const KvSpan& s : spans) total += 2 * static_cast<size_t>(s.n_tokens) * row;
    std::vector<CopyJob> jobs;
    try {
      if (copies->floats.size() < total) copies->floats.resize(total);
      jobs.reserve(spans.size());
    } catch (const std::bad_alloc&) {
      return KernelError::kOutOfMemory;
    }
    float* at = copies->floats.data();
    for (size_t i = 0; i < spans.size(); ++i) {
      KvSpan& s = spans[i];
      const size_t n = static_cast<size_t>(s.n_tokens) * row;
      jobs.push_back(CopyJob{static_cast<const uint8_t*>(s.k), static_cast<const uint8_t*>(s.v), at, at + n,
                             s.n_tokens, s.first_position, rope_positions[i]});
      s.k = at;
      s.v = at + n;
      at += 2 * n;
    }
    RunCopyJobs(p, jobs);
    attended = DType::kF32;
  }
  AttentionParams a;
  a.q_heads = p.q_heads;
  a.kv_heads = p.kv_heads;
  a.head_dim = p.head_dim;
  a.dtype = attended;
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
