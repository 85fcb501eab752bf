// CUDA attention over (dense parts | slot list) and the LSE merge. See kernels/cuda/kernels.h.
// The CPU twin (kernels/cpu/slot_attention) defines it; tests/kernels/kernel_backends_test.cc checks
// this against the twin, on a GPU and on the emulated device.
//
// One kernel serves decode and prefill windows alike (there is no separate prefill path):
// SlotAttentionKernel, grid (kv heads x head groups, queries, splits), kThreads threads a
// block. A block takes one query row, one kv head and up to kGroup of the q heads that share
// it (GQA; MHA is a group of 1, a group larger than kGroup takes ceil(G / kGroup) blocks), so
// each K/V row it reads is loaded and converted once for all of those heads. Decode is memory
// bound (little arithmetic per byte): a kernel that loads K/V once per q head reads the same
// bytes G times and stalls on each load.
//
// Keys come in tiles of N = TileKeys(head_dim, element bytes) rows (at most 8 KiB of K and as
// much of V; 32 keys at d128 bf16). A tile is read with coalesced 16-byte loads (one element at
// a time when a row is not 16-byte aligned, which the launcher checks) into registers and
// stored to shared memory, rows padded by 16 bytes so that the threads of a warp reading 32
// rows hit different banks. While a tile is computed, the next tile's loads are in flight in
// those registers (software double buffering; plain loads, no cp.async, so that the emulated
// build runs the same source). Per tile:
//   scores  the tile's group x N (key, q head) dots are spread over every thread: when they are
//           fewer than the threads, `lanes` adjacent lanes (DotLanes, a power of two) share one
//           dot, each over a slice of the row from shared memory with the q row (shared
//           memory, fp32) in four fma chains, and add by a warp butterfly (ScoreTile);
//   softmax warp g < group keeps head g's online softmax (running max m, sum l) across tiles;
//           the tile's probabilities replace its scores in shared memory;
//   P.V     a thread owns 8 bytes of output columns of one q head and reads the V rows from
//           shared memory (8-byte reads: whole banks), its fp32 accumulators in registers.
// The first tile's loads are issued before q is copied to shared memory (a store waits for its
// load: q first would put two memory latencies in a row). Causal masking is a prefix cut of a
// tile: key t of a tile is at position pos0 + t and a block has one query, so a tile keeps its
// first n = min(N, qpos - pos0 + 1) keys, and a tile with none is not loaded. The slot list is
// read one unit ahead (TileCursor): the next slot's id, length and position are in registers
// before its tile's address is needed, so a tile's loads never wait on a load of the list.
//
// Split-K: decode has kv_heads x 1 rows (8 for Llama-3-8B), so the keys are split over up to
// kMaxSplits blocks a row (Splits: about kTargetBlocks blocks in all). The work units are the
// dense parts' N-key tiles (parts in order), then each selected slot's N-key tiles; split s
// takes units s, s + splits, ... With one split the block writes the output; with more, each
// writes its normalised partial (out_s, lse_s) to the workspace, makes it visible
// (__threadfence) and counts its arrival at its row (an atomic on a per-(query, head group)
// counter at the start of the workspace). The block that arrives last merges the row's splits
// by log-sum-exp (MergeSplits, in the order of the merge kernel it replaced: the same bits) and
// resets the counter to 0, so the next launch on the workspace, or a replay of a captured
// graph, starts clean; the caller zeroes the counters once, when it allocates the workspace.
// No block waits for another, so the order in which blocks run does not matter. Mass (the
// final probabilities) needs the final lse: with one split the block makes a second pass over
// its tiles (K only); with more, MassKernel makes it over the same grid after this kernel (the
// final lse of a row exists only once all its splits are done; waiting for that inside one
// kernel would spin on blocks that may not be resident). Each key's exp(score - lse), summed
// over the block's heads, is added with one atomic.
//
// The slot count in memory (n_slots_in_memory): the grid, the split count and the workspace are
// decided on the host from n_slots, the capacity; every block reads the count and its cursor walks
// only the count's tiles (its units past them do not exist), so a split whose units all lie past the
// count writes an empty partial (lse -inf) and the merge weighs it 0. With the split count of a call
// with n_slots = the count, each split walks the same tiles in the same order: the same bits.
//
// Queries rotated in the kernel (q_rope_positions, only with rope_inv_freq): LoadQueries rotates
// the block's q rows as it copies them to shared memory; every later step reads them there.
//
// Keys rotated as they are read (rope_inv_freq set; kernels/cpu/slot_attention.h): a second
// instance of each kernel (kRope) widens the stored tile's visible keys to fp32 and rotates them
// into a padded fp32 tile in shared memory (RotateTile) before the score step, which then dots
// q with those rows; V and the P.V step are as without. A tile's keys share one rotation
// position (the part's, or the slots') or each sit at its own; the block keeps the cos/sin of
// the last one-position rotation, so a run of chunks at L0 computes them once. The kernels
// without rotation are the code they were (their shared memory has no rotated tile).
//
// head_dim is a template parameter D in {16, 32, 64, 128, 256}: with 2- or 4-byte elements a
// row is whole 16-byte chunks (32 bytes at least) and whole 8-byte column chunks. Shared
// memory per block is at most 2 x (8 KiB + N x 16) of K/V plus kGroup x D floats of q.
// __launch_bounds__(kThreads, kBlocksPerSm) holds the kernel to 64 registers, 4 blocks (50%
// occupancy) an SM. ptxas (nvcc 13, sm_90) spills nothing at d64 and d128 16-bit (decode's
// geometries) nor in any MassKernel; at most 12 bytes at d16, d32 and d256 16-bit, 32 at f32.
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

constexpr int kThreads = 256;          // threads per block: 8 warps
constexpr int kGroup = kThreads / 32;  // q heads a block scores at most: one warp each in the softmax step
constexpr int kMaxSplits = 64;         // offload/attention_backend.cc sizes workspaces with it
constexpr int kTargetBlocks = 1024;    // enough blocks to fill a large GPU twice over
constexpr int kBlocksPerSm = 4;        // 64 registers a thread at most: 50% occupancy
constexpr int kTileBytes = 8192;       // K bytes of a tile at most (as many of V)

// Keys per tile: kTileBytes of K, at most 64 (the softmax step reads two keys a lane).
__host__ __device__ constexpr int TileKeys(int head_dim, int elem_bytes) {
  return kTileBytes / (head_dim * elem_bytes) < 64 ? kTileBytes / (head_dim * elem_bytes) : 64;
}

template <typename T, int D>
struct Geometry {
  static_assert(D == 16 || D == 32 || D == 64 || D == 128 || D == 256, "a head_dim the launcher dispatches");
  static constexpr int kElem = static_cast<int>(sizeof(T));
  static constexpr int N = TileKeys(D, kElem);  // keys per tile: 8 .. 64
  static constexpr int V16 = 16 / kElem;        // elements per 16-byte chunk
  static constexpr int C = D / V16;             // chunks per row (>= 2)
  static constexpr int CP = C + 1;              // padded row pitch in chunks (C is even: CP odd)
  static constexpr int kLoads = (N * C + kThreads - 1) / kThreads;         // K chunks a thread loads per tile
  static constexpr int W = 8 / kElem;                                      // elements per P.V read (8 bytes)
  static constexpr int kCols = D / W;                                      // column chunks per head
  static constexpr int kOwn = (kGroup * kCols + kThreads - 1) / kThreads;  // column chunks a thread owns
  static constexpr int SP = N + 1;   // pitch of a head's scores (heads of one warp in other banks)
  static constexpr int KRP = D + 4;  // pitch of a rotated fp32 key row (16 bytes of padding)
};

// What a block that rotates keys keeps besides (kRope): the tile's keys rotated in fp32, and
// the cos/sin of the last one-position rotation it computed (rope_pos; -1 = none yet).
template <typename T, int D, bool kRope>
struct RopeSmem {};
template <typename T, int D>
struct RopeSmem<T, D, true> {
  using G = Geometry<T, D>;
  alignas(16) float kr[G::N * G::KRP];
  float rc[D / 2], rs[D / 2];
  int64_t rope_pos;
};

// kRope = false is the layout of a block that reads keys as stored (RopeSmem is empty).
template <typename T, int D, bool kRope>
struct Smem : RopeSmem<T, D, kRope> {
  using G = Geometry<T, D>;
  uint4 k[G::N * G::CP];
  uint4 v[G::N * G::CP];
  float q[kGroup * D];
  float s[kGroup * G::SP];  // scores, then probabilities
  float m[kGroup], l[kGroup], corr[kGroup];
  int merges;  // splits > 1: whether this block arrived last at its row and merges the splits
};

// One tile: its first row at the block's kv head, its visible rows (the causal cut made), and
// where its mass goes (null: none).
template <typename T>
struct Tile {
  const T* k;
  const T* v;
  float* mass;
  int n;
  int64_t rope_pos;  // with rope_inv_freq: where key 0 is rotated
  bool rope_each;    // key t at rope_pos + t (else every key at rope_pos)
};

// The selected slots: n_slots, or the count in memory clamped into [0, n_slots] (the capacity).
__device__ __forceinline__ int SlotCount(const SlotAttentionParams& p) {
  if (p.n_slots_in_memory == nullptr) return p.n_slots;
  const int32_t count = *p.n_slots_in_memory;
  return count < 0 ? 0 : (count > p.n_slots ? p.n_slots : count);
}

// The tiles of one split in order (see the header comment). Every thread of a block walks the
// same tiles: n and the pointers are block-uniform.
//
// The slot list is loaded one unit ahead: the entry (slot id, filled tokens, first position) of
// the split's next slot unit is read into registers when the unit before it is handed out, so
// the address of a tile's K/V never waits on a dependent load of the slot list; the tile's
// compute hides that load. The look-ahead is bounded by the capacity n_slots (memory the caller
// provides), the walk by the count in memory, so the first entry's load does not wait for the
// count either.
template <typename T, int N>
struct TileCursor {
  const SlotAttentionParams* p;
  int kvh;
  int64_t qpos;
  int u, step, dense_units, slot_tiles, total;
  int ahead_slot, ahead_ns;  // the entry of the split's next slot unit (LoadAhead)
  int64_t ahead_pos;

  __device__ TileCursor(const SlotAttentionParams& params, int kv_head, int64_t q_position, int split,
                        int splits)
      : p(&params), kvh(kv_head), qpos(q_position), u(split), step(splits) {
    dense_units = 0;
    for (int i = 0; i < params.n_dense; ++i) dense_units += (params.dense[i].n_tokens + N - 1) / N;
    slot_tiles = params.n_slots > 0 ? (params.slot_tokens + N - 1) / N : 0;
    // The split's first slot unit: the first of split, split + splits, ... at or past the dense units.
    const int first_slot_unit = u >= dense_units ? u : u + (dense_units - u + step - 1) / step * step;
    LoadAhead(first_slot_unit);
    total = dense_units + SlotCount(params) * slot_tiles;
  }

  // Issues the loads of slot unit `unit`'s entry (nothing past the capacity n_slots).
  __device__ __forceinline__ void LoadAhead(int unit) {
    ahead_slot = -1;
    ahead_ns = 0;
    ahead_pos = 0;
    if (unit >= dense_units + p->n_slots * slot_tiles) return;
    const int i = (unit - dense_units) / slot_tiles;
    ahead_slot = p->slot_index[i];
    ahead_ns = p->slot_n_tokens ? p->slot_n_tokens[i] : p->slot_tokens;
    ahead_pos = p->slot_first_position[i];
  }

  __device__ bool Next(Tile<T>* t) {
    while (u < total) {
      int unit = u;
      u += step;
      int n, t0;
      int64_t pos0;
      const T *kb, *vb;
      float* mass;
      int64_t rope;  // the part's rotation position (kRopeAtKeyPositions: each key at its own)
      if (unit < dense_units) {
        int part = 0;
        for (; part + 1 < p->n_dense; ++part) {
          const int tiles = (p->dense[part].n_tokens + N - 1) / N;
          if (unit < tiles) break;
          unit -= tiles;
        }
        const DenseKv& d = p->dense[part];
        t0 = unit * N;
        n = min(N, d.n_tokens - t0);
        pos0 = d.first_position + t0;
        kb = static_cast<const T*>(d.k);
        vb = static_cast<const T*>(d.v);
        mass = d.mass ? d.mass + static_cast<size_t>(kvh) * d.n_tokens + t0 : nullptr;
        rope = d.rope_position;
      } else {
        // This unit's entry was loaded one unit ahead (a split walks its units in order, and a
        // unit within the count is within the capacity); take it, then load the next one's.
        const int slot = ahead_slot;
        int ns = ahead_ns;
        const int64_t first = ahead_pos;
        LoadAhead(unit + step);
        unit -= dense_units;
        const int i = unit / slot_tiles;
        t0 = (unit % slot_tiles) * N;
        if (slot < 0 || slot >= p->pool_slots) continue;  // documented: skipped (the host cannot check)
        ns = ns < 0 ? 0 : (ns > p->slot_tokens ? p->slot_tokens : ns);
        n = min(N, ns - t0);
        pos0 = first + t0;
        const size_t slot_elems = static_cast<size_t>(p->kv_heads) * p->head_dim * p->slot_tokens;
        kb = static_cast<const T*>(p->pool_k) + slot * slot_elems;
        vb = static_cast<const T*>(p->pool_v) + slot * slot_elems;
        mass = p->slot_mass
                   ? p->slot_mass + (static_cast<size_t>(i) * p->kv_heads + kvh) * p->slot_tokens + t0
                   : nullptr;
        rope = p->slot_rope_position;
      }
      if (p->causal && qpos - pos0 + 1 < n) n = qpos - pos0 + 1 < 0 ? 0 : static_cast<int>(qpos - pos0 + 1);
      if (n <= 0) continue;
      const size_t row = static_cast<size_t>(p->kv_heads) * p->head_dim;
      const size_t head = static_cast<size_t>(kvh) * p->head_dim;
      t->k = kb + t0 * row + head;
      t->v = vb + t0 * row + head;
      t->mass = mass;
      t->n = n;
      t->rope_each = rope == kRopeAtKeyPositions;
      t->rope_pos = t->rope_each ? pos0 : rope;
      return true;
    }
    return false;
  }
};

// 16 bytes of a row: one load where the rows are 16-byte aligned, else element by element
// (copied through memcpy: no type punning).
template <typename T>
__device__ __forceinline__ uint4 LoadChunk(const T* src, bool vec) {
  if (vec) return *reinterpret_cast<const uint4*>(src);
  constexpr int V16 = 16 / static_cast<int>(sizeof(T));
  T t[V16];
#pragma unroll
  for (int e = 0; e < V16; ++e) t[e] = src[e];
  uint4 raw;
  memcpy(static_cast<void*>(&raw), t, 16);
  return raw;
}

// A tile's K (and V) chunks this thread loads: chunk j = threadIdx.x + r * kThreads is row
// j / C, chunk j % C, so a warp reads whole rows. Rows past t.n are zero.
template <typename T, int D, bool kWithV>
struct Stage {
  using G = Geometry<T, D>;
  uint4 k[G::kLoads];
  uint4 v[kWithV ? G::kLoads : 1];

  __device__ __forceinline__ void Load(const Tile<T>& t, size_t row, bool vec) {
#pragma unroll
    for (int r = 0; r < G::kLoads; ++r) {
      const int j = threadIdx.x + r * kThreads;
      const int key = j / G::C, c = j % G::C;
      k[r] = v[kWithV ? r : 0] = make_uint4(0, 0, 0, 0);
      if ((G::N * G::C % kThreads == 0 || j < G::N * G::C) && key < t.n) {
        const size_t off = key * row + c * G::V16;
        k[r] = LoadChunk(t.k + off, vec);
        if (kWithV) v[r] = LoadChunk(t.v + off, vec);
      }
    }
  }
  template <bool kRope>
  __device__ __forceinline__ void Store(Smem<T, D, kRope>& sh) const {
#pragma unroll
    for (int r = 0; r < G::kLoads; ++r) {
      const int j = threadIdx.x + r * kThreads;
      if (G::N * G::C % kThreads == 0 || j < G::N * G::C) {
        const int key = j / G::C, c = j % G::C;
        sh.k[key * G::CP + c] = k[r];
        if (kWithV) sh.v[key * G::CP + c] = v[r];
      }
    }
  }
};

// The elements of 16 (or 8) bytes of row storage, as floats.
template <typename T, int kCount, typename Raw>
__device__ __forceinline__ void ToFloats(const Raw& raw, float (&x)[kCount]) {
  static_assert(sizeof(Raw) == kCount * sizeof(T), "whole elements");
  T t[kCount];
  memcpy(static_cast<void*>(t), &raw, sizeof(Raw));
#pragma unroll
  for (int e = 0; e < kCount; ++e) x[e] = LoadAsFloat(t + e);
}

// Lanes per dot in the score step: the most, a power of two, with pairs x lanes <= kThreads and
// at most `parts` (whole 16-byte chunks, or float4s, of a row each), so that every thread of
// the block has a share of the tile's dots (group x N pairs alone would leave threads idle:
// 128 of 256 at d128 bf16 with a group of 4, 224 with a group of 1). A power of two <= 32
// (parts <= 64 and pairs >= 8): the lanes of one dot lie in one warp, aligned.
__device__ __forceinline__ int DotLanes(int pairs, int parts) {
  int lanes = 1;
  while (lanes < parts && lanes < 32 && pairs * lanes * 2 <= kThreads) lanes *= 2;
  return lanes;
}

// The sum of a dot's partials over its `lanes` adjacent lanes (a power of two): xor butterfly,
// every lane of the group gets the sum. Called by whole warps (lanes is block-uniform).
__device__ __forceinline__ float DotLanesSum(float x, int lanes) {
  for (int o = 1; o < lanes; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// scale * q_g . k_key for every (key, head) pair of the tile, into sh.s (keys past n: -inf).
// Each pair's dot is shared by `lanes` adjacent threads (DotLanes): work item
// i = threadIdx.x + r * kThreads is part i % lanes of pair i / lanes, pair j being key j % N of
// head j / N; a part dots C / lanes consecutive chunks of the row with four fma chains, and the
// parts add by a butterfly (DotLanesSum). The loop runs over whole warps (the shuffles need
// every lane): items past the pairs compute a harmless dot and write nothing.
template <typename T, int D, bool kRope>
__device__ __forceinline__ void ScoreTile(Smem<T, D, kRope>& sh, int group, int n, float scale) {
  using G = Geometry<T, D>;
  const int pairs = group * G::N;
  const int lanes = DotLanes(pairs, G::C);
  const int chunks = G::C / lanes;  // both powers of two
  const int items = pairs * lanes;
  const int span = (items + 31) / 32 * 32;
  for (int i = threadIdx.x; i < span; i += kThreads) {
    const bool valid = i < items;
    const int pair = valid ? i / lanes : 0, part = i % lanes;
    const int key = pair % G::N, g = pair / G::N;
    const uint4* krow = sh.k + key * G::CP + part * chunks;
    const float* q = sh.q + g * D + part * chunks * G::V16;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four chains: the fma latency is not one chain of D
#pragma unroll 4
    for (int c = 0; c < chunks; ++c) {
      float x[G::V16];
      ToFloats<T, G::V16>(krow[c], x);
#pragma unroll
      for (int e = 0; e < G::V16; e += 4) {
        const float4 qv = *reinterpret_cast<const float4*>(q + c * G::V16 + e);
        d[0] = fmaf(qv.x, x[e], d[0]);
        d[1] = fmaf(qv.y, x[e + 1], d[1]);
        d[2] = fmaf(qv.z, x[e + 2], d[2]);
        d[3] = fmaf(qv.w, x[e + 3], d[3]);
      }
    }
    const float dot = DotLanesSum((d[0] + d[1]) + (d[2] + d[3]), lanes);
    if (valid && part == 0) sh.s[g * G::SP + key] = key < n ? dot * scale : -INFINITY;
  }
}

// ScoreTile over the tile's rotated fp32 rows (sh.kr, RotateTile): the same split of each dot
// over lanes (a part dots D / 4 / lanes float4s), the same four fma chains.
template <typename T, int D>
__device__ __forceinline__ void ScoreRotatedTile(Smem<T, D, true>& sh, int group, int n, float scale) {
  using G = Geometry<T, D>;
  const int pairs = group * G::N;
  const int lanes = DotLanes(pairs, D / 4);
  const int width = D / lanes;  // floats a part dots, a multiple of 4
  const int items = pairs * lanes;
  const int span = (items + 31) / 32 * 32;
  for (int i = threadIdx.x; i < span; i += kThreads) {
    const bool valid = i < items;
    const int pair = valid ? i / lanes : 0, part = i % lanes;
    const int key = pair % G::N, g = pair / G::N;
    const float* krow = sh.kr + key * G::KRP + part * width;
    const float* q = sh.q + g * D + part * width;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int e = 0; e < width; e += 4) {
      const float4 kv = *reinterpret_cast<const float4*>(krow + e);
      const float4 qv = *reinterpret_cast<const float4*>(q + e);
      d[0] = fmaf(qv.x, kv.x, d[0]);
      d[1] = fmaf(qv.y, kv.y, d[1]);
      d[2] = fmaf(qv.z, kv.z, d[2]);
      d[3] = fmaf(qv.w, kv.w, d[3]);
    }
    const float dot = DotLanesSum((d[0] + d[1]) + (d[2] + d[3]), lanes);
    if (valid && part == 0) sh.s[g * G::SP + key] = key < n ? dot * scale : -INFINITY;
  }
}

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Loads the block's q rows (heads kvh * G + g0 .. + group - 1 of query qi) into sh.q, rotated at
// q_rope_positions[qi] when that is set (only with rope_inv_freq: the kRope instances) as
// LaunchRope rotates (kernels/cuda/forward.cu): angle in double, cos and sin rounded to fp32 once,
// each product and the sum rounded apart (no FMA), which is kernels::Rope's arithmetic.
template <typename T, int D, bool kRope>
__device__ __forceinline__ void LoadQueries(const SlotAttentionParams& p, Smem<T, D, kRope>& sh, int h0,
                                            int group, int qi) {
  const float* q = p.q + (static_cast<size_t>(qi) * p.q_heads + h0) * D;  // the group's rows are consecutive
  if constexpr (kRope) {
    if (p.q_rope_positions != nullptr) {  // block-uniform
      constexpr int H = D / 2;
      const double pos = static_cast<double>(p.q_rope_positions[qi]);
      for (int i = threadIdx.x; i < group * H; i += kThreads) {
        const int g = i / H, j = i % H;
        const double a = pos * p.rope_inv_freq[j];
        const float c = static_cast<float>(cos(a)), s = static_cast<float>(sin(a));
        const float x1 = q[g * D + j], x2 = q[g * D + j + H];
        sh.q[g * D + j] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(-x2, s));
        sh.q[g * D + j + H] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
      }
      return;
    }
  }
  for (int i = threadIdx.x; i < group * D; i += kThreads) sh.q[i] = q[i];
}

__host__ __device__ inline bool WantsMass(const SlotAttentionParams& p) {
  bool want = p.slot_mass != nullptr;
  for (int i = 0; i < p.n_dense; ++i) want = want || p.dense[i].mass != nullptr;
  return want;
}

// Which (kv head, first q head, heads) blockIdx.x stands for.
struct HeadGroup {
  int kvh, h0, group;
};
__device__ __forceinline__ HeadGroup BlockHeads(const SlotAttentionParams& p) {
  const int g = p.q_heads / p.kv_heads;
  const int groups = (g + kGroup - 1) / kGroup;
  HeadGroup hg;
  hg.kvh = blockIdx.x / groups;
  const int first = (blockIdx.x % groups) * kGroup;
  hg.h0 = hg.kvh * g + first;
  hg.group = min(kGroup, g - first);
  return hg;
}

// Rotates the tile's visible keys (sh.k, storage dtype) into sh.kr in fp32 as kernels::Rope
// does: pairs (j, j + D/2), angle position * inv_freq[j] in double, cos and sin rounded to fp32
// once. A one-position tile reuses the block's cos/sin when its position is the last one
// computed (InfLLM's chunks all sit at L0). Called by every thread of the block once the tile
// is in shared memory and synchronised; returns synchronised.
template <typename T, int D>
__device__ void RotateTile(const SlotAttentionParams& p, Smem<T, D, true>& sh, const Tile<T>& t) {
  using G = Geometry<T, D>;
  constexpr int H = D / 2;
  if (!t.rope_each && sh.rope_pos != t.rope_pos) {  // block-uniform
    __syncthreads();                                // every thread has read rope_pos
    for (int j = threadIdx.x; j < H; j += kThreads) {
      const double a = static_cast<double>(t.rope_pos) * p.rope_inv_freq[j];
      sh.rc[j] = static_cast<float>(cos(a));
      sh.rs[j] = static_cast<float>(sin(a));
    }
    if (threadIdx.x == 0) sh.rope_pos = t.rope_pos;
    __syncthreads();
  }
  for (int i = threadIdx.x; i < t.n * H; i += kThreads) {  // keys past n: ScoreTile masks them
    const int key = i / H, j = i % H;
    float c, s;
    if (t.rope_each) {
      const double a = static_cast<double>(t.rope_pos + key) * p.rope_inv_freq[j];
      c = static_cast<float>(cos(a));
      s = static_cast<float>(sin(a));
    } else {
      c = sh.rc[j];
      s = sh.rs[j];
    }
    const T* krow = reinterpret_cast<const T*>(sh.k + key * G::CP);
    const float x1 = LoadAsFloat(krow + j), x2 = LoadAsFloat(krow + j + H);
    float* out = sh.kr + key * G::KRP;
    out[j] = x1 * c + (-x2) * s;
    out[j + H] = x2 * c + x1 * s;
  }
  __syncthreads();
}

// The mass pass: for each visible key of this split's tiles, adds sum over the block's heads
// of exp(score - lse_g) (sh.l holds lse_g; -inf: the head saw no key and adds nothing).
// Called by every thread of the block (it synchronises).
template <typename T, int D, bool kRope>
__device__ void MassPass(const SlotAttentionParams& p, Smem<T, D, kRope>& sh, const HeadGroup& hg,
                         int64_t qpos, float scale, int split, int splits, bool vec) {
  using G = Geometry<T, D>;
  TileCursor<T, G::N> cursor(p, hg.kvh, qpos, split, splits);
  const size_t row = static_cast<size_t>(p.kv_heads) * D;
  Tile<T> t;
  while (cursor.Next(&t)) {
    if (t.mass == nullptr) continue;  // block-uniform
    Stage<T, D, false> st;
    st.Load(t, row, vec);
    __syncthreads();  // the previous tile's readers are done
    st.Store(sh);
    __syncthreads();
    if constexpr (kRope) {
      RotateTile<T, D>(p, sh, t);
      ScoreRotatedTile<T, D>(sh, hg.group, t.n, scale);
    } else {
      ScoreTile<T, D>(sh, hg.group, t.n, scale);
    }
    __syncthreads();
    for (int key = threadIdx.x; key < t.n; key += kThreads) {
      float sum = 0.0f;
      for (int g = 0; g < hg.group; ++g) {
        const float lse = sh.l[g];
        if (lse != -INFINITY) sum += __expf(sh.s[g * G::SP + key] - lse);
      }
      atomicAdd(t.mass + key, sum);
    }
  }
}

// The merge of the splits (more than one), folded into SlotAttentionKernel: run by the block of
// a (query, head group) whose split arrived last, over the normalised partials (out_s, lse_s) of
// its group's rows in the workspace, by log-sum-exp. Warp g weighs row g's splits: lse = M +
// log(L), M the largest lse_s, L = sum exp(lse_s - M), w_s = exp(lse_s - M) / L (a split that saw
// no key, lse_s = -inf, weighs 0 and its partial is not read; every split empty: out 0, lse
// -inf). Then each output element is sum_s w_s out_s, added in the order of the separate merge
// kernel this replaces (kMergeChains chains, chain c over splits c, c + kMergeChains, ..., then
// the chains in order), so the output keeps that kernel's bits. The partials are read through
// volatile loads: other blocks of this launch wrote them, so this SM's L1 must not answer.
// The weights live in sh.k (every tile is done).
template <typename T, int D, bool kRope>
__device__ void MergeSplits(const SlotAttentionParams& p, Smem<T, D, kRope>& sh, int group, int splits,
                            size_t rows, size_t row0, const float* part_out, const float* part_lse,
                            float* final_lse) {
  static_assert(kMaxSplits <= 64, "a lane weighs two splits");
  static_assert(sizeof(sh.k) >= sizeof(float) * kGroup * kMaxSplits, "the weights fit in the K tile");
  constexpr int kMergeChains = 512 / D;       // 2 .. 32
  float* w = reinterpret_cast<float*>(sh.k);  // [kGroup][kMaxSplits]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < group) {  // warp-uniform
    const size_t r = row0 + warp;
    const volatile float* lse_s = part_lse;
    const float l0 = lane < splits ? lse_s[static_cast<size_t>(lane) * rows + r] : -INFINITY;
    const float l1 = lane + 32 < splits ? lse_s[static_cast<size_t>(lane + 32) * rows + r] : -INFINITY;
    const float M = WarpMax(fmaxf(l0, l1));
    const float e0 = l0 == -INFINITY ? 0.0f : expf(l0 - M), e1 = l1 == -INFINITY ? 0.0f : expf(l1 - M);
    const float L = WarpSum(e0 + e1);
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    if (lane < splits) w[warp * kMaxSplits + lane] = e0 * inv;
    if (lane + 32 < splits) w[warp * kMaxSplits + lane + 32] = e1 * inv;
    if (lane == 0) {
      const float v = L > 0.0f ? M + logf(L) : -INFINITY;
      if (p.lse) p.lse[r] = v;
      final_lse[r] = v;  // the mass kernel's
    }
  }
  __syncthreads();
  const volatile float* parts = part_out;
  for (int o = threadIdx.x; o < group * D; o += kThreads) {
    const int g = o / D, d = o % D;
    const float* wg = w + g * kMaxSplits;
    const size_t at = (row0 + g) * D + d;  // the element in out, and in split 0's partial
    float sum = 0.0f;
    for (int c = 0; c < kMergeChains; ++c) {
      float acc = 0.0f;
#pragma unroll 4
      for (int s = c; s < splits; s += kMergeChains) {
        const float ws = wg[s];
        const float v = ws > 0.0f ? parts[static_cast<size_t>(s) * rows * D + at] : 0.0f;
        acc = fmaf(v, ws, acc);
      }
      sum += acc;
    }
    p.out[at] = sum;
  }
}

template <typename T, int D, bool kRope>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    SlotAttentionKernel(const SlotAttentionParams p, float scale, int splits, bool vec, float* part_out,
                        float* part_lse, float* final_lse, int* arrivals) {
  using G = Geometry<T, D>;
  __shared__ Smem<T, D, kRope> sh;
  const HeadGroup hg = BlockHeads(p);
  const int qi = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t qpos = p.causal ? p.q_positions[qi] : 0;
  const size_t row = static_cast<size_t>(p.kv_heads) * D;  // elements per token

  // This thread's column chunks: chunk o = threadIdx.x + r * kThreads is columns
  // (o % kCols) * W .. + W - 1 of head o / kCols.
  float acc[G::kOwn][G::W];
#pragma unroll
  for (int r = 0; r < G::kOwn; ++r)
#pragma unroll
    for (int w = 0; w < G::W; ++w) acc[r][w] = 0.0f;

  TileCursor<T, G::N> cursor(p, hg.kvh, qpos, split, splits);
  Tile<T> cur;
  bool have = cursor.Next(&cur);
  Stage<T, D, true> st;
  if (have) st.Load(cur, row, vec);
  // After the first tile's loads are issued: storing q waits for q to arrive.
  LoadQueries<T, D>(p, sh, hg.h0, hg.group, qi);
  if (threadIdx.x < kGroup) {
    sh.m[threadIdx.x] = -INFINITY;
    sh.l[threadIdx.x] = 0.0f;
  }
  if constexpr (kRope) {
    if (threadIdx.x == 0) sh.rope_pos = -1;  // no cos/sin computed yet
  }
  while (have) {
    __syncthreads();  // the previous tile's readers are done (and sh.q, sh.m, sh.l are set)
    st.Store(sh);
    __syncthreads();
    Tile<T> next;
    const bool have_next = cursor.Next(&next);
    if (have_next) st.Load(next, row, vec);  // in flight while this tile is computed
    if constexpr (kRope) {
      RotateTile<T, D>(p, sh, cur);
      ScoreRotatedTile<T, D>(sh, hg.group, cur.n, scale);
    } else {
      ScoreTile<T, D>(sh, hg.group, cur.n, scale);
    }
    __syncthreads();
    if (warp < hg.group) {  // warp-uniform: warp g updates head g's online softmax
      float* s = sh.s + warp * G::SP;
      const float s0 = lane < G::N ? s[lane] : -INFINITY;
      const float s1 = lane + 32 < G::N ? s[lane + 32] : -INFINITY;
      const float m_old = sh.m[warp];
      const float m_new = fmaxf(m_old, WarpMax(fmaxf(s0, s1)));
      // No visible score yet (every one -inf): probabilities 0, nothing rescaled.
      const bool none = m_new == -INFINITY;
      const float p0 = none ? 0.0f : __expf(s0 - m_new), p1 = none ? 0.0f : __expf(s1 - m_new);
      if (lane < G::N) s[lane] = p0;
      if (lane + 32 < G::N) s[lane + 32] = p1;
      const float sum = WarpSum(p0 + p1);
      if (lane == 0) {
        const float corr = none ? 1.0f : __expf(m_old - m_new);  // exp(-inf) = 0 on the first keys
        sh.corr[warp] = corr;
        sh.l[warp] = sh.l[warp] * corr + sum;
        sh.m[warp] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < G::kOwn; ++r) {
      const int o = threadIdx.x + r * kThreads;
      if (o >= hg.group * G::kCols) continue;
      const int g = o / G::kCols, col = o % G::kCols;
      const float corr = sh.corr[g];
#pragma unroll
      for (int w = 0; w < G::W; ++w) acc[r][w] *= corr;
      const float* pr = sh.s + g * G::SP;
      const uint2* vcol = reinterpret_cast<const uint2*>(sh.v) + col;
#pragma unroll 4
      for (int key = 0; key < cur.n; ++key) {
        const float pk = pr[key];
        float x[G::W];
        ToFloats<T, G::W>(vcol[key * G::CP * 2], x);
#pragma unroll
        for (int w = 0; w < G::W; ++w) acc[r][w] = fmaf(pk, x[w], acc[r][w]);
      }
    }
    cur = next;
    have = have_next;
  }
  __syncthreads();  // sh.l, sh.m final (also when this split had no tile)

  const size_t rows = static_cast<size_t>(p.n_queries) * p.q_heads;
  const size_t row0 = static_cast<size_t>(qi) * p.q_heads + hg.h0;  // output row of head 0 of the group
#pragma unroll
  for (int r = 0; r < G::kOwn; ++r) {
    const int o = threadIdx.x + r * kThreads;
    if (o >= hg.group * G::kCols) continue;
    const int g = o / G::kCols, col = o % G::kCols;
    const float l = sh.l[g];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float* orow =
        splits == 1 ? p.out + (row0 + g) * D : part_out + (static_cast<size_t>(split) * rows + row0 + g) * D;
#pragma unroll
    for (int w = 0; w < G::W; ++w) orow[col * G::W + w] = acc[r][w] * inv;
  }
  __syncthreads();  // every l read before the lse replaces it
  if (static_cast<int>(threadIdx.x) < hg.group) {
    const int g = threadIdx.x;
    const float l = sh.l[g];
    const float lse = l > 0.0f ? sh.m[g] + logf(l) : -INFINITY;
    sh.l[g] = lse;  // the mass pass reads it there
    if (splits > 1)
      part_lse[static_cast<size_t>(split) * rows + row0 + g] = lse;
    else if (p.lse)
      p.lse[row0 + g] = lse;
  }
  // One split: the final lse is known here, so the mass pass follows in this block.
  if (splits == 1) {
    if (!WantsMass(p)) return;  // block-uniform
    __syncthreads();
    MassPass<T, D>(p, sh, hg, qpos, scale, 0, 1, vec);
    return;
  }
  // More: the last split of the row to finish merges (MergeSplits); the others are done.
  __threadfence();  // this thread's partials are visible device-wide before the block arrives
  __syncthreads();
  if (threadIdx.x == 0) {
    int* arrived = arrivals + static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x;
    const bool last = atomicAdd(arrived, 1) == splits - 1;
    // Every split of the row has arrived: the counter goes back to 0 for the next launch (or a
    // replay of a captured graph); no block of this launch reads it again.
    if (last) atomicExch(arrived, 0);
    sh.merges = last;
  }
  __syncthreads();
  if (!sh.merges) return;  // block-uniform
  __threadfence();         // the other splits' partials, made visible before their arrival
  MergeSplits<T, D, kRope>(p, sh, hg.group, splits, rows, row0, part_out, part_lse, final_lse);
}

// The mass pass after the merge (more than one split): the same grid, the final lse of each row.
template <typename T, int D, bool kRope>
__global__ void __launch_bounds__(kThreads)
    MassKernel(const SlotAttentionParams p, float scale, int splits, bool vec, const float* final_lse) {
  __shared__ Smem<T, D, kRope> sh;
  const HeadGroup hg = BlockHeads(p);
  const int qi = blockIdx.y, split = blockIdx.z;
  const int64_t qpos = p.causal ? p.q_positions[qi] : 0;
  LoadQueries<T, D>(p, sh, hg.h0, hg.group, qi);
  const int g = threadIdx.x;
  if (g < hg.group) sh.l[g] = final_lse[static_cast<size_t>(qi) * p.q_heads + hg.h0 + g];
  if constexpr (kRope) {
    if (threadIdx.x == 0) sh.rope_pos = -1;  // no cos/sin computed yet
  }
  __syncthreads();
  MassPass<T, D>(p, sh, hg, qpos, scale, split, splits, vec);
}

__global__ void MergeStatesKernel(int rows, int head_dim, const float* out_a, const float* lse_a,
                                  const float* out_b, const float* lse_b, float* out, float* lse) {
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

// Heads blocks of one kv head (q heads over kGroup).
int HeadGroups(const SlotAttentionParams& p) { return (p.q_heads / p.kv_heads + kGroup - 1) / kGroup; }

// The split count: about kTargetBlocks blocks, never more splits than tiles.
int Splits(const SlotAttentionParams& p) {
  const int elem = p.dtype == DType::kF32 ? 4 : 2;
  const int64_t n = std::max(1, TileKeys(p.head_dim, elem));
  const int64_t rows = static_cast<int64_t>(p.kv_heads) * HeadGroups(p) * p.n_queries;
  int64_t units = 0;
  for (int i = 0; i < p.n_dense; ++i) units += (p.dense[i].n_tokens + n - 1) / n;
  if (p.n_slots > 0) units += static_cast<int64_t>(p.n_slots) * ((p.slot_tokens + n - 1) / n);
  const int64_t want = (kTargetBlocks + rows - 1) / rows;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({want, kMaxSplits, std::max<int64_t>(units, 1)})));
}

// Whether every K/V row starts 16-byte aligned (the 16-byte loads of LoadChunk): the bases,
// and the row pitch kv_heads * head_dim elements.
bool RowsAligned16(const SlotAttentionParams& p) {
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const size_t elem = p.dtype == DType::kF32 ? 4 : 2;
  if (p.head_dim * elem % 16 != 0) return false;
  for (int i = 0; i < p.n_dense; ++i)
    if (!aligned(p.dense[i].k) || !aligned(p.dense[i].v)) return false;
  return p.n_slots == 0 || (aligned(p.pool_k) && aligned(p.pool_v));
}

// The workspace of a launch with splits > 1: the arrival counters first, at a place and size that
// do not depend on the launch's shape (kArrivalBytes: one int32 per (query, head group) block row,
// fewer than kTargetBlocks whenever Splits gives more than one), so that launches of any shape
// on one workspace find them zero, as each leaves them; then the partials and the final lse.
constexpr size_t kArrivalBytes = kTargetBlocks * sizeof(int32_t);
static_assert(kArrivalBytes % 256 == 0, "the partials stay 256-byte aligned");

struct Workspace {
  size_t arrivals = 0, part_out = 0, part_lse = 0, final_lse = 0, total = 0;
};

Workspace Layout(const SlotAttentionParams& p, int splits) {
  Workspace w;
  if (splits <= 1) return w;
  const size_t rows = static_cast<size_t>(p.q_heads) * p.n_queries;
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  w.arrivals = 0;
  w.part_out = kArrivalBytes;
  w.part_lse = w.part_out + align(splits * rows * p.head_dim * sizeof(float));
  w.final_lse = w.part_lse + align(splits * rows * sizeof(float));
  w.total = w.final_lse + align(rows * sizeof(float));
  return w;
}

// One launch: SlotAttentionKernel, whose last split of a row merges the row (no merge kernel);
// with mass and more than one split, MassKernel after it (it needs every row's final lse, known
// only once all of a row's splits are done: one kernel could only wait for that by spinning on
// blocks that may not be resident).
template <typename T, int D, bool kRope>
KernelError LaunchTyped(const SlotAttentionParams& p, float scale, int splits, char* ws, cudaStream_t s) {
  const dim3 grid(p.kv_heads * HeadGroups(p), p.n_queries, splits);
  const Workspace w = Layout(p, splits);
  const bool vec = RowsAligned16(p);
  float* part_out = splits > 1 ? reinterpret_cast<float*>(ws + w.part_out) : nullptr;
  float* part_lse = splits > 1 ? reinterpret_cast<float*>(ws + w.part_lse) : nullptr;
  float* final_lse = splits > 1 ? reinterpret_cast<float*>(ws + w.final_lse) : nullptr;
  int* arrivals = splits > 1 ? reinterpret_cast<int*>(ws + w.arrivals) : nullptr;
  if (splits > 1 && static_cast<size_t>(grid.x) * grid.y * sizeof(int32_t) > kArrivalBytes)
    return KernelError::kBadShape;  // Splits gives one split to this many rows: unreachable
  LaunchKernel(&SlotAttentionKernel<T, D, kRope>, grid, kThreads, 0, s, p, scale, splits, vec, part_out,
               part_lse, final_lse, arrivals);
  if (const KernelError e = CheckLaunch(); e != KernelError::kOk || splits == 1 || !WantsMass(p)) return e;
  LaunchKernel(&MassKernel<T, D, kRope>, grid, kThreads, 0, s, p, scale, splits, vec,
               static_cast<const float*>(final_lse));
  return CheckLaunch();
}

// The kernels for head_dim D: keys rotated as they are read, or as stored.
template <typename T, int D>
KernelError LaunchHeadDim(const SlotAttentionParams& p, float scale, int splits, char* ws, cudaStream_t s) {
  return p.rope_inv_freq != nullptr ? LaunchTyped<T, D, true>(p, scale, splits, ws, s)
                                    : LaunchTyped<T, D, false>(p, scale, splits, ws, s);
}

template <typename T>
KernelError LaunchDType(const SlotAttentionParams& p, float scale, int splits, char* ws, cudaStream_t s) {
  switch (p.head_dim) {
    case 16:
      return LaunchHeadDim<T, 16>(p, scale, splits, ws, s);
    case 32:
      return LaunchHeadDim<T, 32>(p, scale, splits, ws, s);
    case 64:
      return LaunchHeadDim<T, 64>(p, scale, splits, ws, s);
    case 128:
      return LaunchHeadDim<T, 128>(p, scale, splits, ws, s);
    case 256:
      return LaunchHeadDim<T, 256>(p, scale, splits, ws, s);
  }
  return KernelError::kBadShape;  // LaunchSlotAttention refused it already
}

}  // namespace

int SlotAttentionSplits(const SlotAttentionParams& p) {
  if (CheckSlotAttentionParams(p) != KernelError::kOk || p.n_queries == 0) return 0;
  return Splits(p);
}

size_t SlotAttentionWorkspaceBytes(const SlotAttentionParams& p) {
  if (CheckSlotAttentionParams(p) != KernelError::kOk || p.n_queries == 0) return 0;
  return Layout(p, Splits(p)).total;
}

KernelError LaunchSlotAttention(const SlotAttentionParams& p, void* workspace, size_t workspace_bytes,
                                Stream stream) {
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
    case DType::kF32:
      return LaunchDType<float>(p, scale, splits, ws, s);
    case DType::kF16:
      return LaunchDType<__half>(p, scale, splits, ws, s);
    case DType::kBF16:
      return LaunchDType<__nv_bfloat16>(p, scale, splits, ws, s);
  }
  return KernelError::kBadDType;
}

size_t SlotAttentionArrivalBytes() { return kArrivalBytes; }

KernelError ClearSlotAttentionWorkspace(void* workspace, size_t workspace_bytes, Stream stream) {
  if (workspace_bytes == 0) return KernelError::kOk;
  if (workspace == nullptr) return KernelError::kNullPointer;
  return CheckCall(cudaMemsetAsync(workspace, 0, std::min(workspace_bytes, kArrivalBytes),
                                   static_cast<cudaStream_t>(stream)));
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
