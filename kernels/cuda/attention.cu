// CUDA attention over (dense parts | slot list) and the LSE merge. See kernels/cuda/kernels.h.
// The CPU twin (kernels/cpu/slot_attention) defines it; tests/kernel_backends_test.cc checks
// this against the twin, on a GPU and on the emulated device.
//
// Grid (q heads, queries, splits): decode has q_heads x 1 rows, 32 blocks for Llama-3-8B, far
// fewer than an H100's 132 SMs, so the keys are split over `splits` blocks per row (split-K).
// Split s owns the dense parts' 32-token units s, s + splits, ... and the selected slots
// s, s + splits, ...; within a unit, warp w takes tokens w, w + 4, ... With one split the block
// writes the output; with more, each writes its normalised partial (out_s, lse_s) to the
// workspace and a merge kernel combines them by log-sum-exp. Mass (the final probabilities)
// needs the final lse: with splits it is a third launch over the same grid.
//
// Decode reads each key once per q head and does little arithmetic per byte, so the kernel is
// bound by memory latency: a warp loads the K and V rows of kKeysInFlight keys before it
// reduces any score (independent loads in flight), with 16-byte loads where the rows are
// 16-byte aligned, and decode rows get up to kMaxSplits blocks each.
//
// head_dim is a template parameter D in {16, 32, 64, 128, 256} (LaneSplit below): a warp
// holds one q/K/V row, D / 32 elements per lane, or one element on lanes 0..D-1 when D < 32.
// sacc[kWarps][D] is 4 KiB of shared memory at D = 256.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvtier::kernels::cuda {
namespace {

constexpr int kWarps = 4;  // warps per block
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 32;        // dense tokens per split unit
constexpr int kMaxSplits = 32;   // offload/attention_backend.cc sizes workspaces with it
constexpr int kTargetBlocks = 1024;  // enough blocks to fill a large GPU several times over

// A row of D elements over the 32 lanes of a warp: lane l holds the E = max(1, D / 32)
// consecutive elements l*E .. l*E + E - 1. For D < 32 (the shipped kvtier-tiny has head_dim
// 16) lanes D..31 hold nothing: their q is 0, they load no K or V and store no accumulator,
// but they still take part in the warp shuffles (WarpSum needs all 32 lanes).
template <int D>
struct LaneSplit {
  static_assert(D == 16 || D == 32 || D == 64 || D == 128 || D == 256, "a head_dim the launcher dispatches");
  static constexpr int E = D < 32 ? 1 : D / 32;
  // Whether `lane` holds element lane*E + e. A constant true when D % 32 == 0, so the 64 and
  // 128 paths compile to the same instructions as before the guard existed.
  __device__ static __forceinline__ bool Holds(int lane, int e) { return D % 32 == 0 || lane * E + e < D; }
};

// Score of one key: scale * q.k, the warp's lanes each holding E consecutive elements.
template <typename T, int D>
__device__ __forceinline__ float WarpScore(const float (&q)[LaneSplit<D>::E], const T* k, int lane, float scale) {
  constexpr int E = LaneSplit<D>::E;
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (LaneSplit<D>::Holds(lane, e)) s = fmaf(q[e], LoadAsFloat(k + lane * E + e), s);
  return WarpSum(s) * scale;
}

// Keys a warp loads before it reduces the first score: at most 8 (a 32-token unit over 4
// warps), fewer where K and V rows of that many keys would not fit in registers.
template <int D>
struct KeysInFlight {
  static constexpr int U = LaneSplit<D>::E <= 4 ? 8 : 4;  // K and V rows in flight: at most 64 floats a lane
};

// This lane's E elements of a row, as floats. With `vec` (every row 16-byte aligned, which
// the launcher checks) they arrive in loads of up to 16 bytes; otherwise one element at a time.
template <typename T, int D>
__device__ __forceinline__ void LoadLane(const T* row, int lane, bool vec, float (&x)[LaneSplit<D>::E]) {
  constexpr int E = LaneSplit<D>::E;
  constexpr int kBytes = E * static_cast<int>(sizeof(T));
  const T* p = row + lane * E;
  if constexpr (D % 32 == 0 && (kBytes % 16 == 0 || kBytes == 8 || kBytes == 4)) {
    if (vec) {
      // Wide loads into a raw buffer, then memcpy to T: no type punning (the emulated build's
      // g++ would be free to reorder it); nvcc and g++ both keep it in registers.
      T t[E];
      if constexpr (kBytes % 16 == 0) {
        uint4 raw[kBytes / 16];
#pragma unroll
        for (int i = 0; i < kBytes / 16; ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];
        memcpy(t, raw, kBytes);
      } else if constexpr (kBytes == 8) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        memcpy(t, &raw, kBytes);
      } else {
        const unsigned raw = *reinterpret_cast<const unsigned*>(p);
        memcpy(t, &raw, kBytes);
      }
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = LoadAsFloat(t + e);
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = LaneSplit<D>::Holds(lane, e) ? LoadAsFloat(p + e) : 0.0f;
}

// The online softmax of one warp (running max m, sum l of exp(s - m), acc = sum exp(s - m) v)
// over the keys of one unit: n tokens from k/v (already offset to the kv head), token t at
// position pos0 + t, this warp's tokens warp, warp + kWarps, ... The K and V rows of
// KeysInFlight keys are loaded before any score is reduced.
template <typename T, int D>
__device__ __forceinline__ void AccumulateUnit(const T* k, const T* v, size_t row, int n, int64_t pos0,
                                               bool causal, int64_t qpos, const float (&q)[LaneSplit<D>::E],
                                               int warp, int lane, float scale, bool vec, float& m, float& l,
                                               float (&acc)[LaneSplit<D>::E]) {
  constexpr int E = LaneSplit<D>::E;
  constexpr int U = KeysInFlight<D>::U;
  for (int t0 = warp; t0 < n; t0 += U * kWarps) {
    float kr[U][E], vr[U][E];
    bool ok[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int t = t0 + j * kWarps;
      ok[j] = t < n && !(causal && pos0 + t > qpos);  // the same on every lane of the warp
      if (ok[j]) {
        LoadLane<T, D>(k + t * row, lane, vec, kr[j]);
        LoadLane<T, D>(v + t * row, lane, vec, vr[j]);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) kr[j][e] = vr[j][e] = 0.0f;
      }
    }
    float s[U];
    float m_new = m;
#pragma unroll
    for (int j = 0; j < U; ++j) {
      float d = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) d = fmaf(q[e], kr[j][e], d);
      s[j] = WarpSum(d) * scale;
      if (ok[j]) m_new = fmaxf(m_new, s[j]);
    }
    if (m_new == -INFINITY) continue;      // no visible key in this step (or every score -inf)
    const float corr = __expf(m - m_new);  // exp(-inf) = 0 on the first keys
    l *= corr;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= corr;
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (!ok[j]) continue;
      const float w = __expf(s[j] - m_new);
      l += w;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = fmaf(w, vr[j][e], acc[e]);
    }
    m = m_new;
  }
}

// Calls f(k_row, v_row, position, mass_or_null) for every key this warp of this split owns.
// Every lane of a warp sees the same keys in the same order (the shuffles need it).
template <typename T, typename F>
__device__ __forceinline__ void ForEachKey(const SlotAttentionParams& p, int kvh, int warp, int split, int splits,
                                           F&& f) {
  const size_t row = static_cast<size_t>(p.kv_heads) * p.head_dim;  // elements per token
  const size_t head = static_cast<size_t>(kvh) * p.head_dim;
  for (int part = 0; part < p.n_dense; ++part) {
    const DenseKv& d = p.dense[part];
    const T* kb = static_cast<const T*>(d.k);
    const T* vb = static_cast<const T*>(d.v);
    float* mass = d.mass ? d.mass + static_cast<size_t>(kvh) * d.n_tokens : nullptr;
    for (int t0 = split * kTile; t0 < d.n_tokens; t0 += splits * kTile) {
      const int t1 = min(d.n_tokens, t0 + kTile);
      for (int t = t0 + warp; t < t1; t += kWarps)
        f(kb + t * row + head, vb + t * row + head, d.first_position + t, mass ? mass + t : nullptr);
    }
  }
  const size_t slot_elems = row * p.slot_tokens;
  for (int i = split; i < p.n_slots; i += splits) {
    const int slot = p.slot_index[i];
    if (slot < 0 || slot >= p.pool_slots) continue;  // documented: skipped (the host cannot check)
    int n = p.slot_n_tokens ? p.slot_n_tokens[i] : p.slot_tokens;
    n = n < 0 ? 0 : (n > p.slot_tokens ? p.slot_tokens : n);
    const T* kb = static_cast<const T*>(p.pool_k) + slot * slot_elems;
    const T* vb = static_cast<const T*>(p.pool_v) + slot * slot_elems;
    float* mass = p.slot_mass ? p.slot_mass + (static_cast<size_t>(i) * p.kv_heads + kvh) * p.slot_tokens : nullptr;
    const int64_t pos0 = p.slot_first_position[i];
    for (int t = warp; t < n; t += kWarps) f(kb + t * row + head, vb + t * row + head, pos0 + t, mass ? mass + t : nullptr);
  }
}

__host__ __device__ inline bool WantsMass(const SlotAttentionParams& p) {
  bool want = p.slot_mass != nullptr;
  for (int i = 0; i < p.n_dense; ++i) want = want || p.dense[i].mass != nullptr;
  return want;
}

template <int D>
__device__ __forceinline__ void LoadQuery(const SlotAttentionParams& p, int h, int qi, int lane,
                                          float (&q)[LaneSplit<D>::E]) {
  constexpr int E = LaneSplit<D>::E;
  const float* qrow = p.q + (static_cast<size_t>(qi) * p.q_heads + h) * D;
#pragma unroll
  for (int e = 0; e < E; ++e) q[e] = LaneSplit<D>::Holds(lane, e) ? qrow[lane * E + e] : 0.0f;
}

// Adds exp(score - lse) of every owned, visible key to its mass (atomics: the q heads of a
// group and the queries add to the same key).
template <typename T, int D>
__device__ void AddMass(const SlotAttentionParams& p, float scale, int h, int qi, int split, int splits, float lse) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kvh = h / (p.q_heads / p.kv_heads);
  float q[LaneSplit<D>::E];
  LoadQuery<D>(p, h, qi, lane, q);
  const bool causal = p.causal;
  const int64_t qpos = causal ? p.q_positions[qi] : 0;
  ForEachKey<T>(p, kvh, warp, split, splits, [&](const T* k, const T*, int64_t pos, float* mass) {
    if (mass == nullptr || (causal && pos > qpos)) return;
    const float s = WarpScore<T, D>(q, k, lane, scale);
    if (lane == 0) atomicAdd(mass, __expf(s - lse));
  });
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    SlotAttentionKernel(const SlotAttentionParams p, float scale, int splits, bool vec, float* part_out,
                        float* part_lse) {
  constexpr int E = LaneSplit<D>::E;
  const int h = blockIdx.x, qi = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kvh = h / (p.q_heads / p.kv_heads);
  float q[E];
  LoadQuery<D>(p, h, qi, lane, q);
  const bool causal = p.causal;
  const int64_t qpos = causal ? p.q_positions[qi] : 0;

  // This warp's online softmax over the units this split owns (ForEachKey's order).
  float m = -INFINITY, l = 0.0f, acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.0f;
  const size_t row = static_cast<size_t>(p.kv_heads) * D;  // elements per token
  const size_t head = static_cast<size_t>(kvh) * D;
  for (int part = 0; part < p.n_dense; ++part) {
    const DenseKv& d = p.dense[part];
    const T* kb = static_cast<const T*>(d.k) + head;
    const T* vb = static_cast<const T*>(d.v) + head;
    for (int t0 = split * kTile; t0 < d.n_tokens; t0 += splits * kTile)
      AccumulateUnit<T, D>(kb + t0 * row, vb + t0 * row, row, min(kTile, d.n_tokens - t0),
                           d.first_position + t0, causal, qpos, q, warp, lane, scale, vec, m, l, acc);
  }
  const size_t slot_elems = row * p.slot_tokens;
  for (int i = split; i < p.n_slots; i += splits) {
    const int slot = p.slot_index[i];
    if (slot < 0 || slot >= p.pool_slots) continue;  // documented: skipped (the host cannot check)
    int n = p.slot_n_tokens ? p.slot_n_tokens[i] : p.slot_tokens;
    n = n < 0 ? 0 : (n > p.slot_tokens ? p.slot_tokens : n);
    AccumulateUnit<T, D>(static_cast<const T*>(p.pool_k) + slot * slot_elems + head,
                         static_cast<const T*>(p.pool_v) + slot * slot_elems + head, row, n,
                         p.slot_first_position[i], causal, qpos, q, warp, lane, scale, vec, m, l, acc);
  }

  // LSE merge of the warps' states.
  __shared__ float sm[kWarps], sl[kWarps], sacc[kWarps][D], s_lse;
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (LaneSplit<D>::Holds(lane, e)) sacc[warp][lane * E + e] = acc[e];
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w]);
  float L = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) L += sl[w] > 0.0f ? sl[w] * __expf(sm[w] - M) : 0.0f;
  const size_t out_row = static_cast<size_t>(qi) * p.q_heads + h;
  const size_t rows = static_cast<size_t>(p.n_queries) * p.q_heads;
  float* orow =
      splits == 1 ? p.out + out_row * D : part_out + (static_cast<size_t>(split) * rows + out_row) * D;
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
    if (splits > 1)
      part_lse[static_cast<size_t>(split) * rows + out_row] = lse;
    else if (p.lse)
      p.lse[out_row] = lse;
  }
  // One split: the final lse is known here, so the mass pass follows in this block.
  if (splits > 1 || !WantsMass(p) || !(L > 0.0f)) return;
  __syncthreads();
  AddMass<T, D>(p, scale, h, qi, 0, 1, s_lse);
}

// Combines the splits' normalised partials of one row by log-sum-exp.
__global__ void MergeSplitsKernel(int splits, int rows, int head_dim, const float* part_out, const float* part_lse,
                                  float* out, float* lse, float* final_lse) {
  const int r = blockIdx.x;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, part_lse[static_cast<size_t>(s) * rows + r]);
  float L = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float ls = part_lse[static_cast<size_t>(s) * rows + r];
    if (ls != -INFINITY) L += expf(ls - M);
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    if (L > 0.0f) {
      for (int s = 0; s < splits; ++s) {
        const float ls = part_lse[static_cast<size_t>(s) * rows + r];
        if (ls != -INFINITY) o += part_out[(static_cast<size_t>(s) * rows + r) * head_dim + d] * expf(ls - M);
      }
      o /= L;
    }
    out[static_cast<size_t>(r) * head_dim + d] = o;
  }
  if (threadIdx.x == 0) {
    const float v = L > 0.0f ? M + logf(L) : -INFINITY;
    if (lse) lse[r] = v;
    final_lse[r] = v;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) MassKernel(const SlotAttentionParams p, float scale, int splits,
                                                       const float* final_lse) {
  const int h = blockIdx.x, qi = blockIdx.y, split = blockIdx.z;
  const float lse = final_lse[static_cast<size_t>(qi) * p.q_heads + h];
  if (lse == -INFINITY) return;  // the row saw no key
  AddMass<T, D>(p, scale, h, qi, split, splits, lse);
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

// The split count: enough blocks for a large GPU, never more splits than key units.
int Splits(const SlotAttentionParams& p) {
  const int64_t rows = static_cast<int64_t>(p.q_heads) * p.n_queries;
  int units = p.n_slots;
  for (int i = 0; i < p.n_dense; ++i) units += (p.dense[i].n_tokens + kTile - 1) / kTile;
  const int64_t want = (kTargetBlocks + rows - 1) / rows;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, kMaxSplits, std::max(units, 1)})));
}

// Whether every K/V row starts 16-byte aligned (the vector loads of LoadLane): the bases, and
// the row pitch kv_heads * head_dim elements.
bool RowsAligned16(const SlotAttentionParams& p) {
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const size_t elem = p.dtype == DType::kF32 ? 4 : 2;
  if (p.head_dim * elem % 16 != 0) return false;
  for (int i = 0; i < p.n_dense; ++i)
    if (!aligned(p.dense[i].k) || !aligned(p.dense[i].v)) return false;
  return p.n_slots == 0 || (aligned(p.pool_k) && aligned(p.pool_v));
}

struct Workspace {
  size_t part_out = 0, part_lse = 0, final_lse = 0, total = 0;
};

Workspace Layout(const SlotAttentionParams& p, int splits) {
  Workspace w;
  if (splits <= 1) return w;
  const size_t rows = static_cast<size_t>(p.q_heads) * p.n_queries;
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  w.part_out = 0;
  w.part_lse = align(splits * rows * p.head_dim * sizeof(float));
  w.final_lse = w.part_lse + align(splits * rows * sizeof(float));
  w.total = w.final_lse + align(rows * sizeof(float));
  return w;
}

template <typename T, int D>
KernelError LaunchTyped(const SlotAttentionParams& p, float scale, int splits, char* ws, cudaStream_t s) {
  const dim3 grid(p.q_heads, p.n_queries, splits);
  const Workspace w = Layout(p, splits);
  float* part_out = splits > 1 ? reinterpret_cast<float*>(ws + w.part_out) : nullptr;
  float* part_lse = splits > 1 ? reinterpret_cast<float*>(ws + w.part_lse) : nullptr;
  LaunchKernel(&SlotAttentionKernel<T, D>, grid, kThreads, 0, s, p, scale, splits, RowsAligned16(p), part_out,
               part_lse);
  if (const KernelError e = CheckLaunch(); e != KernelError::kOk || splits == 1) return e;
  const int rows = p.q_heads * p.n_queries;
  float* final_lse = reinterpret_cast<float*>(ws + w.final_lse);
  LaunchKernel(&MergeSplitsKernel, rows, 128, 0, s, splits, rows, D, part_out, part_lse, p.out, p.lse,
               final_lse);
  if (const KernelError e = CheckLaunch(); e != KernelError::kOk || !WantsMass(p)) return e;
  LaunchKernel(&MassKernel<T, D>, grid, kThreads, 0, s, p, scale, splits, final_lse);
  return CheckLaunch();
}

template <typename T>
KernelError LaunchDType(const SlotAttentionParams& p, float scale, int splits, char* ws, cudaStream_t s) {
  switch (p.head_dim) {
    case 16: return LaunchTyped<T, 16>(p, scale, splits, ws, s);
    case 32: return LaunchTyped<T, 32>(p, scale, splits, ws, s);
    case 64: return LaunchTyped<T, 64>(p, scale, splits, ws, s);
    case 128: return LaunchTyped<T, 128>(p, scale, splits, ws, s);
    case 256: return LaunchTyped<T, 256>(p, scale, splits, ws, s);
  }
  return KernelError::kBadShape;  // LaunchSlotAttention refused it already
}

}  // namespace

size_t SlotAttentionWorkspaceBytes(const SlotAttentionParams& p) {
  if (CheckSlotAttentionParams(p) != KernelError::kOk || p.n_queries == 0) return 0;
  return Layout(p, Splits(p)).total;
}

KernelError LaunchSlotAttention(const SlotAttentionParams& p, void* workspace, size_t workspace_bytes, Stream stream) {
  if (const KernelError e = CheckSlotAttentionParams(p); e != KernelError::kOk) return e;
  if (!SlotAttentionHeadDimSupported(p.head_dim)) return KernelError::kBadShape;
  if (p.n_queries == 0) return KernelError::kOk;
  if (p.n_queries > 65535) return KernelError::kBadShape;  // grid.y limit
  const int splits = Splits(p);
  const size_t need = Layout(p, splits).total;
  if (need > 0 && (workspace == nullptr || workspace_bytes < need)) return KernelError::kWorkspace;
  const float scale = p.scale != 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  switch (p.dtype) {
    case DType::kF32: return LaunchDType<float>(p, scale, splits, ws, s);
    case DType::kF16: return LaunchDType<__half>(p, scale, splits, ws, s);
    case DType::kBF16: return LaunchDType<__nv_bfloat16>(p, scale, splits, ws, s);
  }
  return KernelError::kBadDType;
}

KernelError LaunchMergeAttentionStates(int rows, int head_dim, const float* out_a, const float* lse_a,
                                       const float* out_b, const float* lse_b, float* out, float* lse,
                                       Stream stream) {
  if (rows < 0 || head_dim <= 0) return KernelError::kBadShape;
  if (rows == 0) return KernelError::kOk;
  if (!out_a || !lse_a || !out_b || !lse_b || !out || !lse) return KernelError::kNullPointer;
  LaunchKernel(&MergeStatesKernel, rows, 128, 0, static_cast<cudaStream_t>(stream), rows, head_dim, out_a,
               lse_a, out_b, lse_b, out, lse);
  return CheckLaunch();
}

}  // namespace kvtier::kernels::cuda
