// CUDA attention over (dense parts | slot list) and the LSE merge. See kernels/cuda/kernels.h.
// NEVER RUN ON A GPU: compiled only. The CPU twin (kernels/cpu/slot_attention) defines it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvtier::kernels::cuda {
namespace {

constexpr int kWarps = 4;  // warps per block: each takes every kWarps-th key of every part
constexpr int kThreads = kWarps * 32;

// Per-warp online-softmax state over the keys it has seen: running max m, sum l of
// exp(s - m), and acc = sum exp(s - m) v, the lane holding elements [lane*E, lane*E + E).
template <int E>
struct WarpState {
  float m = -INFINITY;
  float l = 0.0f;
  float acc[E];
};

// Score of one key: scale * q.k, the warp's lanes each holding E consecutive elements.
template <typename T, int E>
__device__ __forceinline__ float WarpScore(const float (&q)[E], const T* k, int lane, float scale) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) s = fmaf(q[e], LoadAsFloat(k + lane * E + e), s);
  return WarpSum(s) * scale;
}

// Calls f(k_row, v_row, position, mass_ptr_or_null, key_index_in_mass) for every key this
// warp owns: dense parts first, then the selected slots, each strided over the warps.
template <typename T, typename F>
__device__ __forceinline__ void ForEachKey(const SlotAttentionParams& p, int kvh, int warp, F&& f) {
  const size_t row = static_cast<size_t>(p.kv_heads) * p.head_dim;  // elements per token
  for (int part = 0; part < p.n_dense; ++part) {
    const DenseKv& d = p.dense[part];
    const T* kb = static_cast<const T*>(d.k);
    const T* vb = static_cast<const T*>(d.v);
    float* mass = d.mass ? d.mass + static_cast<size_t>(kvh) * d.n_tokens : nullptr;
    for (int t = warp; t < d.n_tokens; t += kWarps)
      f(kb + t * row + static_cast<size_t>(kvh) * p.head_dim, vb + t * row + static_cast<size_t>(kvh) * p.head_dim,
        d.first_position + t, mass ? mass + t : nullptr);
  }
  const size_t slot_elems = row * p.slot_tokens;
  for (int i = 0; i < p.n_slots; ++i) {
    const int slot = p.slot_index[i];
    if (slot < 0 || slot >= p.pool_slots) continue;  // documented: skipped (the host cannot check)
    int n = p.slot_n_tokens ? p.slot_n_tokens[i] : p.slot_tokens;
    n = n < 0 ? 0 : (n > p.slot_tokens ? p.slot_tokens : n);
    const T* kb = static_cast<const T*>(p.pool_k) + slot * slot_elems;
    const T* vb = static_cast<const T*>(p.pool_v) + slot * slot_elems;
    float* mass = p.slot_mass ? p.slot_mass + (static_cast<size_t>(i) * p.kv_heads + kvh) * p.slot_tokens : nullptr;
    const int64_t pos0 = p.slot_first_position[i];
    for (int t = warp; t < n; t += kWarps)
      f(kb + t * row + static_cast<size_t>(kvh) * p.head_dim, vb + t * row + static_cast<size_t>(kvh) * p.head_dim,
        pos0 + t, mass ? mass + t : nullptr);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) SlotAttentionKernel(const SlotAttentionParams p, float scale) {
  constexpr int E = D / 32;
  const int h = blockIdx.x, qi = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kvh = h / (p.q_heads / p.kv_heads);
  const float* qrow = p.q + (static_cast<size_t>(qi) * p.q_heads + h) * D;
  float q[E];
#pragma unroll
  for (int e = 0; e < E; ++e) q[e] = qrow[lane * E + e];
  const bool causal = p.causal;
  const int64_t qpos = causal ? p.q_positions[qi] : 0;

  WarpState<E> st;
#pragma unroll
  for (int e = 0; e < E; ++e) st.acc[e] = 0.0f;
  ForEachKey<T>(p, kvh, warp, [&](const T* k, const T* v, int64_t pos, float*) {
    if (causal && pos > qpos) return;
    const float s = WarpScore<T, E>(q, k, lane, scale);
    const float m_new = fmaxf(st.m, s);
    const float corr = __expf(st.m - m_new);  // exp(-inf) = 0 on the first key
    const float w = __expf(s - m_new);
    st.l = st.l * corr + w;
#pragma unroll
    for (int e = 0; e < E; ++e) st.acc[e] = fmaf(w, LoadAsFloat(v + lane * E + e), st.acc[e] * corr);
    st.m = m_new;
  });

  // LSE merge of the warps' states (the same merge as split-K on the CPU).
  __shared__ float sm[kWarps], sl[kWarps], sacc[kWarps][D], s_lse;
  if (lane == 0) {
    sm[warp] = st.m;
    sl[warp] = st.l;
  }
#pragma unroll
  for (int e = 0; e < E; ++e) sacc[warp][lane * E + e] = st.acc[e];
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w]);
  float L = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) L += sl[w] > 0.0f ? sl[w] * __expf(sm[w] - M) : 0.0f;
  float* orow = p.out + (static_cast<size_t>(qi) * p.q_heads + h) * D;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float o = 0.0f;
    if (L > 0.0f) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        if (sl[w] > 0.0f) o += sacc[w][d] * __expf(sm[w] - M);
      o /= L;
    }
    orow[d] = o;
  }
  const float lse = L > 0.0f ? M + logf(L) : -INFINITY;
  if (threadIdx.x == 0) {
    s_lse = lse;
    if (p.lse) p.lse[static_cast<size_t>(qi) * p.q_heads + h] = lse;
  }

  // Mass: the final probabilities exp(s - lse), a second pass over K once lse is known.
  bool want_mass = p.slot_mass != nullptr;
  for (int i = 0; i < p.n_dense; ++i) want_mass = want_mass || p.dense[i].mass != nullptr;
  if (!want_mass || !(L > 0.0f)) return;
  __syncthreads();
  const float final_lse = s_lse;
  ForEachKey<T>(p, kvh, warp, [&](const T* k, const T*, int64_t pos, float* mass) {
    if (mass == nullptr || (causal && pos > qpos)) return;
    const float s = WarpScore<T, E>(q, k, lane, scale);
    if (lane == 0) atomicAdd(mass, __expf(s - final_lse));
  });
}

__global__ void MergeStatesKernel(int rows, int head_dim, const float* out_a, const float* lse_a, const float* out_b,
                                  const float* lse_b, float* out, float* lse) {
  const int r = blockIdx.x;
  if (r >= rows) return;
  const float la = lse_a[r], lb = lse_b[r];
  const size_t o = static_cast<size_t>(r) * head_dim;
  const bool none = la == -INFINITY && lb == -INFINITY;
  const float m = fmaxf(la, lb);
  const float wa = la == -INFINITY ? 0.0f : expf(la - m);
  const float wb = lb == -INFINITY ? 0.0f : expf(lb - m);
  const float inv = none ? 0.0f : 1.0f / (wa + wb);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
    out[o + d] = none ? 0.0f : (out_a[o + d] * wa + out_b[o + d] * wb) * inv;
  __syncthreads();  // out may alias out_a: every read of this row is done before lse moves
  if (threadIdx.x == 0) lse[r] = none ? -INFINITY : m + logf(wa + wb);
}

template <typename T>
KernelError LaunchTyped(const SlotAttentionParams& p, float scale, cudaStream_t s) {
  const dim3 grid(p.q_heads, p.n_queries);
  if (p.head_dim == 64)
    SlotAttentionKernel<T, 64><<<grid, kThreads, 0, s>>>(p, scale);
  else
    SlotAttentionKernel<T, 128><<<grid, kThreads, 0, s>>>(p, scale);
  return CheckLaunch();
}

}  // namespace

size_t SlotAttentionWorkspaceBytes(const SlotAttentionParams&) { return 0; }

KernelError LaunchSlotAttention(const SlotAttentionParams& p, void*, size_t, Stream stream) {
  if (const KernelError e = CheckSlotAttentionParams(p); e != KernelError::kOk) return e;
  if (p.head_dim != 64 && p.head_dim != 128) return KernelError::kBadShape;
  if (p.n_queries == 0) return KernelError::kOk;
  if (p.n_queries > 65535) return KernelError::kBadShape;  // grid.y limit
  const float scale = p.scale != 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kF32: return LaunchTyped<float>(p, scale, s);
    case DType::kF16: return LaunchTyped<__half>(p, scale, s);
    case DType::kBF16: return LaunchTyped<__nv_bfloat16>(p, scale, s);
  }
  return KernelError::kBadDType;
}

KernelError LaunchMergeAttentionStates(int rows, int head_dim, const float* out_a, const float* lse_a,
                                       const float* out_b, const float* lse_b, float* out, float* lse,
                                       Stream stream) {
  if (rows < 0 || head_dim <= 0) return KernelError::kBadShape;
  if (rows == 0) return KernelError::kOk;
  if (!out_a || !lse_a || !out_b || !lse_b || !out || !lse) return KernelError::kNullPointer;
  MergeStatesKernel<<<rows, 128, 0, static_cast<cudaStream_t>(stream)>>>(rows, head_dim, out_a, lse_a, out_b, lse_b,
                                                                          out, lse);
  return CheckLaunch();
}

}  // namespace kvtier::kernels::cuda
