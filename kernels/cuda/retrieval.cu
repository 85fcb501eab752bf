// CUDA chunk scoring, per-layer top-k (CUB), Eq. 11 entropy and the ActQKV probe (Eq. 7-9).
// See kernels/cuda/kernels.h. The CPU twins
// (kernels/cpu/chunk_score, entropy, probe) define what each computes.
#include <cuda_runtime.h>

#include <cmath>
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvtier::kernels::cuda {
namespace {

// ---- chunk scoring ------------------------------------------------------------------------

constexpr int kScoreWarps = 8;
constexpr int kDotLanes = 8;                // Dot's eight partial sums (kernels/cpu/dot.h)
constexpr int kDotGroups = 32 / kDotLanes;  // representatives a warp dots at once

// Dot (kernels/cpu/dot.h) in its exact order on the 8 lanes of a group: lane j sums elements
// j, j+8, ... below n8 = n - n % 8 with fmaf into its own partial (Dot's lane j); every lane
// of the group then sums the tail with fmaf from 0 and adds the 8 partials in lane order, as
// Dot does, so each lane of the group holds Dot's bits. Every lane of the warp must call it
// (the shuffles span the warp).
template <typename T>
__device__ __forceinline__ float GroupDot(const T* k, const float* p, int n, int j) {
  const int n8 = n - n % kDotLanes;
  float acc = 0.0f;
  for (int i = j; i < n8; i += kDotLanes) acc = __fmaf_rn(LoadAsFloat(k + i), p[i], acc);
  float s = 0.0f;
  for (int i = n8; i < n; ++i) s = __fmaf_rn(LoadAsFloat(k + i), p[i], s);
#pragma unroll
  for (int l = 0; l < kDotLanes; ++l) s = __fadd_rn(s, __shfl_sync(0xffffffffu, acc, l, kDotLanes));
  return s;
}

// std::max's choice, (a < b) ? b : a: the first argument on ties (-0 vs +0) and against NaN.
__device__ __forceinline__ float StdMax(float a, float b) { return a < b ? b : a; }

// One warp per chunk, four representatives at a time (one per 8-lane group), and the same
// arithmetic as the twin (ScoreChunksOneHead, HeadFold) in the same order, so the scores are
// the twin's bit for bit: Dot's order for every dot and the probe norm, IEEE sqrt and divide
// for InverseNorm (not rsqrtf), the representatives folded in order 0..R-1 with std::max's tie
// rule, (dot * inv_norm) * inv_p, heads in order 0..H-1. The cosine sum fold is an FMA because
// that is what the twin's `cos + best_cos * share` compiles to (GCC -O3 -march=native contracts
// it: vfmadd213ss in ScoreChunks); a build that does not contract it differs in the last bit.
// What bit equality costs: each of Dot's 8 partial sums is one sequential fmaf chain, so one
// thread owns it, and a group reads 8 consecutive elements per step (16 bytes of f16 keys,
// half a 32-byte sector; full sectors for f32). The scan stays memory-bound either way.
template <typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) ScoreChunksKernel(const ChunkScoreParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / kDotLanes, j = lane % kDotLanes;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kScoreWarps + warp;
  if (c >= p.n_chunks) return;  // the whole warp: the shuffles below stay converged
  const int D = p.head_dim, R = p.repr, H = p.kv_heads;
  const size_t stride = static_cast<size_t>(p.chunk_stride > 0 ? p.chunk_stride : p.n_chunks);  // ChunkStride
  const bool max_fold = p.fold == HeadFold::Kind::kMax;
  const float cos_share = max_fold ? 1.0f : __fdiv_rn(1.0f, static_cast<float>(H));
  float raw = max_fold ? -INFINITY : 0.0f, cosv = raw;
  const T* keys = static_cast<const T*>(p.keys);
  for (int h = 0; h < H; ++h) {
    const float* probe = p.probe + static_cast<size_t>(h) * D;
    const float pn2 = GroupDot(probe, probe, D, j);  // every group the same bits
    const float inv_p = pn2 > 0.0f ? __fdiv_rn(1.0f, __fsqrt_rn(pn2)) : 0.0f;
    const size_t row = (static_cast<size_t>(h) * stride + c) * R;  // representative 0 of (h, c)
    float best = -INFINITY, best_cos = -1.0f;
    for (int r0 = 0; r0 < R; r0 += kDotGroups) {
      // Group g dots representative r0 + g (the last one again past R, to stay converged).
      const int r = min(r0 + group, R - 1);
      const float dot = GroupDot(keys + (row + r) * D, probe, D, j);
      for (int g = 0; g < kDotGroups && r0 + g < R; ++g) {  // in order, as the twin
        const float d = __shfl_sync(0xffffffffu, dot, g * kDotLanes);
        best = StdMax(best, d);
        best_cos = StdMax(best_cos, __fmul_rn(__fmul_rn(d, p.inv_norm[row + r0 + g]), inv_p));
      }
    }
    raw = max_fold ? StdMax(raw, best) : __fadd_rn(raw, best);
    cosv = max_fold ? StdMax(cosv, best_cos) : __fmaf_rn(best_cos, cos_share, cosv);
  }
  if (lane == 0) {
    p.logit[c] = raw;
    p.cosine[c] = cosv;
  }
}

// ---- top-k ----------------------------------------------------------------------------------

// Keys for the sort with -0.0 turned into +0.0 (the twin compares them equal; the radix sort
// orders bit patterns), and the values: each element's global index.
__global__ void TopKPrepareKernel(const float* scores, int32_t total, float* keys, int32_t* values) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  keys[i] = scores[i] + 0.0f;
  values[i] = i;
}

__global__ void TopKEmitKernel(const SegmentedTopKParams p, const float* keys_sorted,
                               const int32_t* values_sorted) {
  const int s = blockIdx.x;
  const int32_t begin = p.offsets[s], n = p.offsets[s + 1] - begin;
  const int32_t take = min(n, p.k[s]);
  for (int j = threadIdx.x; j < p.k_max; j += blockDim.x) {
    const size_t o = static_cast<size_t>(s) * p.k_max + j;
    p.out_index[o] = j < take ? values_sorted[begin + j] - begin : -1;
    if (p.out_score) p.out_score[o] = j < take ? keys_sorted[begin + j] : -INFINITY;
  }
}

struct TopKLayout {
  size_t keys = 0, keys_out = 0, values = 0, values_out = 0, cub = 0, cub_bytes = 0, total = 0;
};

size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

KernelError TopKPlan(const SegmentedTopKParams& p, int32_t total, TopKLayout* l) {
  size_t cub_bytes = 0;
  // Size query only (null temp storage): CUB computes it from the problem size.
  const cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, cub_bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), total, p.n_segments, p.offsets,
      p.offsets + 1);
  if (e != cudaSuccess) return CheckCall(e);
  const size_t n = static_cast<size_t>(total);
  l->keys = 0;
  l->keys_out = Align256(n * sizeof(float));
  l->values = l->keys_out + Align256(n * sizeof(float));
  l->values_out = l->values + Align256(n * sizeof(int32_t));
  l->cub = l->values_out + Align256(n * sizeof(int32_t));
  l->cub_bytes = cub_bytes;
  l->total = l->cub + Align256(cub_bytes);
  return KernelError::kOk;
}

// ---- entropy --------------------------------------------------------------------------------

constexpr int kEntropyThreads = 256;

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__global__ void __launch_bounds__(kEntropyThreads) EntropyKernel(const EntropyParams p) {
  using ReduceF = cub::BlockReduce<float, kEntropyThreads>;
  using ReduceD = cub::BlockReduce<double, kEntropyThreads>;
  __shared__ union {
    typename ReduceF::TempStorage f;
    typename ReduceD::TempStorage d;
  } tmp;
  __shared__ float s_max;
  __shared__ double s_z;
  const int seg = blockIdx.x;
  const int32_t begin = p.offsets[seg], n = p.offsets[seg + 1] - begin;
  if (n <= 0) {
    if (threadIdx.x == 0) {
      p.entropy[seg] = 0.0;
      if (p.non_finite) p.non_finite[seg] = 0;
    }
    return;
  }
  const float* s = p.scores + begin;
  float mx = -INFINITY;
  for (int32_t i = threadIdx.x; i < n; i += kEntropyThreads) mx = fmaxf(mx, s[i]);
  mx = ReduceF(tmp.f).Reduce(mx, MaxOp());
  if (threadIdx.x == 0) s_max = mx;
  __syncthreads();
  if (p.non_finite) {  // the twin's count of scores Eq. 11 is not defined for
    using ReduceI = cub::BlockReduce<int, kEntropyThreads>;
    __shared__ typename ReduceI::TempStorage tmp_i;
    int bad = 0;
    for (int32_t i = threadIdx.x; i < n; i += kEntropyThreads) bad += isfinite(s[i]) ? 0 : 1;
    bad = ReduceI(tmp_i).Sum(bad);
    if (threadIdx.x == 0) p.non_finite[seg] = bad;
  }
  const double m = s_max;
  double z = 0.0, ez = 0.0;
  for (int32_t i = threadIdx.x; i < n; i += kEntropyThreads) {
    const double x = static_cast<double>(s[i]) - m;
    const double e = exp(x);
    z += e;
    ez += e * x;
  }
  z = ReduceD(tmp.d).Sum(z);
  if (threadIdx.x == 0) s_z = z;
  __syncthreads();
  ez = ReduceD(tmp.d).Sum(ez);
  if (threadIdx.x == 0) {
    // Eq. 11: Theta = log Z - sum_i e_i (s_i - M) / Z, never negative.
    const double h = log(s_z) - ez / s_z;
    p.entropy[seg] = h > 0.0 ? h : 0.0;
  }
}

// ---- probe ----------------------------------------------------------------------------------

// Mean pooling: thread per (kv head, d), summing in the twin's order (query, then head).
__global__ void MeanPoolKernel(const ProbeShape s, const float* q, int m, float* probe) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int D = s.head_dim, G = s.q_heads / s.kv_heads;
  if (idx >= s.kv_heads * D) return;
  const int g = idx / D, d = idx % D;
  const float w = 1.0f / static_cast<float>(m * G);
  float acc = 0.0f;
  for (int i = 0; i < m; ++i)
    for (int h = g * G; h < g * G + G; ++h) acc += w * q[(static_cast<size_t>(i) * s.q_heads + h) * D + d];
  probe[idx] = acc;
}

// Eq. 8 merge: thread per (q head, d); the window's two-pass mean and M2, then Chan's update.
__global__ void ActMergeKernel(const ProbeShape s, const float* q, int m, int64_t n_old, double* mean,
                               double* m2) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int D = s.head_dim;
  if (idx >= s.q_heads * D) return;
  const size_t row = static_cast<size_t>(s.q_heads) * D;
  const float* qh = q + idx;  // (h * D + d) of query 0
  double wmean = 0.0;
  for (int j = 0; j < m; ++j) wmean += qh[j * row];
  wmean /= m;
  double wm2 = 0.0;
  for (int j = 0; j < m; ++j) {
    const double dev = qh[j * row] - wmean;
    wm2 += dev * dev;
  }
  const int64_t n_all = n_old + m;
  const double fb = static_cast<double>(m) / static_cast<double>(n_all);
  const double fab = static_cast<double>(n_old) * static_cast<double>(m) / static_cast<double>(n_all);
  const double delta = wmean - mean[idx];
  mean[idx] += delta * fb;
  m2[idx] += wm2 + delta * delta * fab;
}

constexpr int kProbeThreads = 128;

// Eq. 7: ||phi_j||_1 of every query j of q head blockIdx.x into l1[h * m + j]; Eq. 9's
// ||Phi||_1 summed in j order into total[h].
__global__ void __launch_bounds__(kProbeThreads)
    ActPhiKernel(const ProbeShape s, const float* q, int m, const double* mean, const double* m2,
                 int64_t count, double eps, double* l1, double* total) {
  using Reduce = cub::BlockReduce<double, kProbeThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int h = blockIdx.x, D = s.head_dim;
  const size_t row = static_cast<size_t>(s.q_heads) * D;
  for (int j = 0; j < m; ++j) {
    double part = 0.0;
    for (int d = threadIdx.x; d < D; d += kProbeThreads) {
      const double var = m2[h * D + d] / static_cast<double>(count - 1);  // ActVariance
      if (!(var > eps)) continue;
      const double dev = q[j * row + h * D + d] - mean[h * D + d];
      part += dev * dev / var;
    }
    const double sum = Reduce(tmp).Sum(part);
    if (threadIdx.x == 0) l1[static_cast<size_t>(h) * m + j] = sum;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int j = 0; j < m; ++j) t += l1[static_cast<size_t>(h) * m + j];
    total[h] = t;
  }
}

// Eq. 9 and GQA pooling: thread per (kv head, d), heads of the group then queries, in fp64.
__global__ void ActCombineKernel(const ProbeShape s, const float* q, int m, const double* l1,
                                 const double* total, float* probe) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int D = s.head_dim, G = s.q_heads / s.kv_heads;
  if (idx >= s.kv_heads * D) return;
  const int g = idx / D, d = idx % D;
  const size_t row = static_cast<size_t>(s.q_heads) * D;
  double acc = 0.0;
  for (int h = g * G; h < g * G + G; ++h) {
    const bool uniform = !(total[h] > 0.0);
    for (int j = 0; j < m; ++j) {
      const double w = (uniform ? 1.0 / m : l1[static_cast<size_t>(h) * m + j] / total[h]) / G;
      if (w == 0.0) continue;
      acc += w * q[j * row + static_cast<size_t>(h) * D + d];
    }
  }
  probe[idx] = static_cast<float>(acc);
}

constexpr int kCheckThreads = 256;

struct MinIndexOp {
  __device__ int32_t operator()(int32_t a, int32_t b) const { return a < b ? a : b; }
};

// CountNonFinite: one block strides over x; the count and the lowest index reduce in the block.
__global__ void __launch_bounds__(kCheckThreads)
    CountNonFiniteKernel(const float* x, int32_t n, int32_t* count, int32_t* first) {
  using ReduceI = cub::BlockReduce<int32_t, kCheckThreads>;
  __shared__ typename ReduceI::TempStorage tmp;
  int32_t c = 0, f = INT32_MAX;
  for (int32_t i = threadIdx.x; i < n; i += kCheckThreads)
    if (!isfinite(x[i])) {
      if (c == 0) f = i;  // a thread's indices rise, so its first is its lowest
      ++c;
    }
  const int32_t total = ReduceI(tmp).Sum(c);
  __syncthreads();  // tmp is reused
  const int32_t lowest = ReduceI(tmp).Reduce(f, MinIndexOp());
  if (threadIdx.x == 0) {
    *count = total;
    *first = lowest;
  }
}

bool ShapeOk(const ProbeShape& s) {
  return s.q_heads > 0 && s.kv_heads > 0 && s.head_dim > 0 && s.q_heads % s.kv_heads == 0;
}

int Blocks(int64_t n, int threads) { return static_cast<int>((n + threads - 1) / threads); }

}  // namespace

KernelError LaunchScoreChunks(const ChunkScoreParams& p, Stream stream) {
  if (const KernelError e = CheckChunkScoreParams(p); e != KernelError::kOk) return e;
  if (p.n_chunks == 0) return KernelError::kOk;
  const int blocks = Blocks(p.n_chunks, kScoreWarps);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kF32:
      LaunchKernel(&ScoreChunksKernel<float>, blocks, kScoreWarps * 32, 0, s, p);
      break;
    case DType::kF16:
      LaunchKernel(&ScoreChunksKernel<__half>, blocks, kScoreWarps * 32, 0, s, p);
      break;
    case DType::kBF16:
      LaunchKernel(&ScoreChunksKernel<__nv_bfloat16>, blocks, kScoreWarps * 32, 0, s, p);
      break;
  }
  return CheckLaunch();
}

KernelError SegmentedTopKWorkspaceBytes(const SegmentedTopKParams& p, int32_t total, size_t* bytes) {
  if (bytes == nullptr) return KernelError::kNullPointer;
  if (const KernelError e = CheckSegmentedTopKParams(p); e != KernelError::kOk) return e;
  if (total < 0) return KernelError::kBadShape;
  *bytes = 0;
  if (p.n_segments == 0 || total == 0) return KernelError::kOk;
  TopKLayout l;
  if (const KernelError e = TopKPlan(p, total, &l); e != KernelError::kOk) return e;
  *bytes = l.total;
  return KernelError::kOk;
}

KernelError LaunchSegmentedTopK(const SegmentedTopKParams& p, int32_t total, void* workspace,
                                size_t workspace_bytes, Stream stream) {
  if (const KernelError e = CheckSegmentedTopKParams(p); e != KernelError::kOk) return e;
  if (total < 0) return KernelError::kBadShape;
  if (p.n_segments == 0 || p.k_max == 0) return KernelError::kOk;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (total == 0) {  // every segment empty: only the padding
    LaunchKernel(&TopKEmitKernel, p.n_segments, 128, 0, s, p, nullptr, nullptr);
    return CheckLaunch();
  }
  if (p.scores == nullptr) return KernelError::kNullPointer;
  TopKLayout l;
  if (const KernelError e = TopKPlan(p, total, &l); e != KernelError::kOk) return e;
  if (workspace == nullptr || workspace_bytes < l.total) return KernelError::kWorkspace;
  char* ws = static_cast<char*>(workspace);
  float* keys = reinterpret_cast<float*>(ws + l.keys);
  float* keys_out = reinterpret_cast<float*>(ws + l.keys_out);
  int32_t* values = reinterpret_cast<int32_t*>(ws + l.values);
  int32_t* values_out = reinterpret_cast<int32_t*>(ws + l.values_out);
  LaunchKernel(&TopKPrepareKernel, Blocks(total, 256), 256, 0, s, p.scores, total, keys, values);
  if (const KernelError e = CheckLaunch(); e != KernelError::kOk) return e;
  size_t cub_bytes = l.cub_bytes;
  if (const KernelError e = CheckCall(cub::DeviceSegmentedRadixSort::SortPairsDescending(
          ws + l.cub, cub_bytes, keys, keys_out, values, values_out, total, p.n_segments, p.offsets,
          p.offsets + 1, 0, static_cast<int>(sizeof(float) * 8), s));
      e != KernelError::kOk)
    return e;
  LaunchKernel(&TopKEmitKernel, p.n_segments, 128, 0, s, p, keys_out, values_out);
  return CheckLaunch();
}

KernelError LaunchSegmentEntropy(const EntropyParams& p, Stream stream) {
  if (p.n_segments < 0) return KernelError::kBadShape;
  if (p.n_segments == 0) return KernelError::kOk;
  if (p.offsets == nullptr || p.entropy == nullptr || p.scores == nullptr) return KernelError::kNullPointer;
  LaunchKernel(&EntropyKernel, p.n_segments, kEntropyThreads, 0, static_cast<cudaStream_t>(stream), p);
  return CheckLaunch();
}

KernelError LaunchMeanPoolProbe(const ProbeShape& shape, const float* q, int m, float* probe, Stream stream) {
  if (!ShapeOk(shape) || m < 1) return KernelError::kBadShape;
  if (q == nullptr || probe == nullptr) return KernelError::kNullPointer;
  const int n = shape.kv_heads * shape.head_dim;
  LaunchKernel(&MeanPoolKernel, Blocks(n, 128), 128, 0, static_cast<cudaStream_t>(stream), shape, q, m,
               probe);
  return CheckLaunch();
}

KernelError LaunchActMergeWindow(const ProbeShape& shape, const float* q, int m, int64_t n_old, double* mean,
                                 double* m2, Stream stream) {
  if (!ShapeOk(shape) || m < 1 || n_old < 0) return KernelError::kBadShape;
  if (q == nullptr || mean == nullptr || m2 == nullptr) return KernelError::kNullPointer;
  const int n = shape.q_heads * shape.head_dim;
  LaunchKernel(&ActMergeKernel, Blocks(n, 128), 128, 0, static_cast<cudaStream_t>(stream), shape, q, m, n_old,
               mean, m2);
  return CheckLaunch();
}

KernelError LaunchCountNonFinite(const float* x, int32_t n, int32_t* count, int32_t* first, Stream stream) {
  if (n < 0) return KernelError::kBadShape;
  if ((n > 0 && x == nullptr) || count == nullptr || first == nullptr) return KernelError::kNullPointer;
  LaunchKernel(&CountNonFiniteKernel, 1, kCheckThreads, 0, static_cast<cudaStream_t>(stream), x, n, count,
               first);
  return CheckLaunch();
}

size_t ActWeightedProbeWorkspaceBytes(const ProbeShape& shape, int m) {
  if (!ShapeOk(shape) || m < 1) return 0;
  return static_cast<size_t>(shape.q_heads) * (static_cast<size_t>(m) + 1) * sizeof(double);
}

KernelError LaunchActWeightedProbe(const ProbeShape& shape, const float* q, int m, const double* mean,
                                   const double* m2, int64_t count, double eps, float* probe, void* workspace,
                                   size_t workspace_bytes, Stream stream) {
  if (!ShapeOk(shape) || m < 1 || count < m) return KernelError::kBadShape;
  if (q == nullptr || probe == nullptr) return KernelError::kNullPointer;
  if (count < 2) return LaunchMeanPoolProbe(shape, q, m, probe, stream);  // sigma^2 undefined (twin)
  if (mean == nullptr || m2 == nullptr) return KernelError::kNullPointer;
  if (workspace == nullptr || workspace_bytes < ActWeightedProbeWorkspaceBytes(shape, m))
    return KernelError::kWorkspace;
  double* l1 = static_cast<double*>(workspace);
  double* total = l1 + static_cast<size_t>(shape.q_heads) * m;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  LaunchKernel(&ActPhiKernel, shape.q_heads, kProbeThreads, 0, s, shape, q, m, mean, m2, count, eps, l1,
               total);
  if (const KernelError e = CheckLaunch(); e != KernelError::kOk) return e;
  const int n = shape.kv_heads * shape.head_dim;
  LaunchKernel(&ActCombineKernel, Blocks(n, 128), 128, 0, s, shape, q, m, l1, total, probe);
  return CheckLaunch();
}

}  // namespace kvtier::kernels::cuda
