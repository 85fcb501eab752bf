// CUDA kernels of kvtier: launchers over the same POD params as their CPU twins
// (kernels/cpu/slot_attention.h, chunk_score.h, entropy.h, probe.h, forward.h, rope.h), which define what
// each computes. FlashInfer style: a launcher takes params holding DEVICE pointers, a stream and caller-owned
// workspace (size from the matching ...WorkspaceBytes query), allocates nothing, checks what it can on the
// host (shapes, null pointers), enqueues, and returns a KernelError; kDeviceError carries the CUDA error in
// LastCudaError(). Nothing waits on the stream. Host planning (which chunks, which slots) stays outside, so a
// run step can be captured in a CUDA graph.
//
// This header includes no CUDA header: streams are passed as `void*` (a cudaStream_t;
// nullptr = the legacy default stream), so any C++ translation unit can include it. The
// functions exist only in builds with KVTIER_HAVE_CUDA (the .cu files compile then); its
// constexpr predicates exist in every build.
//
// STATUS: compiled with nvcc 13 for sm_90; NONE OF THESE KERNELS HAS EVER RUN ON A GPU.
// tests/kernels/kernel_backends_test.cc compares each with its CPU twin when a device is present.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/chunk_score.h"
#include "kernels/cpu/chunk_table.h"
#include "kernels/cpu/entropy.h"
#include "kernels/cpu/entropy_grant.h"
#include "kernels/cpu/forward.h"
#include "kernels/cpu/probe.h"
#include "kernels/cpu/representatives.h"
#include "kernels/cpu/slot_attention.h"

namespace kvtier::kernels::cuda {

using Stream = void*;  ///< a cudaStream_t

/// Number of visible CUDA devices (0 when the driver finds none; never an error).
int DeviceCount();
/// The last CUDA error a launcher of this thread saw (a cudaError_t value; 0 = none).
int LastCudaError();
/// Its name and description ("cudaErrorNoDevice: no CUDA-capable device is detected").
const char* LastCudaErrorString();

// ---- attention over (dense parts | slot list) -----------------------------------------
/// Blocks per (kv head and up to 8 of its q heads, query) x split: each streams K/V of its share
/// of the dense parts' tiles and of the selected slots' tiles through slot_index (no gather
/// copy) into shared memory once for all the q heads of its group, with an online softmax in
/// fp32; splits (split-K, so that decode's few rows fill the GPU) merge by LSE in the same kernel:
/// the last split of a row to finish merges it (kernels/cuda/attention.cu says how). head_dim 16, 32, 64, 128
/// or 256 (SlotAttentionHeadDimSupported; kBadShape otherwise), f32/f16/bf16. A slot_index entry outside [0,
/// pool_slots) is skipped (the host cannot see device memory; the CPU twin rejects it). Mass: a pass after
/// the final lse adds exp(score - lse) with atomics (their order makes mass non-deterministic in the last
/// bits). With mass and more than one split, a second kernel follows (the mass pass needs the final lse).
/// Rotation (p.rope_inv_freq, a DEVICE array of head_dim / 2 doubles): each tile's keys are
/// widened to fp32 and rotated in shared memory before the score step, at the part's
/// DenseKv::rope_position or slot_rope_position (kRopeAtKeyPositions: each key at its own), as
/// the twin does; the mass pass scores the same rotated keys. V is not rotated.
/// Slot count in memory (p.n_slots_in_memory, a DEVICE int32): n_slots is the capacity; the grid,
/// the split count and the workspace are decided from it, blocks read the count and walk only its
/// slots' tiles (a count outside [0, n_slots] is clamped into it), so nothing past the count is
/// read. out and lse equal bit for bit those of a launch with n_slots = the count when the two
/// take the same SlotAttentionSplits (the split count grows with n_slots up to kMaxSplits, so it
/// is the same when the count's keys already fill the splits, or when there is one split).
/// Rotated queries (p.q_rope_positions, a DEVICE [n_queries] array, with rope_inv_freq): each
/// block rotates its q rows as it loads them, with LaunchRope's arithmetic, so the result is that
/// of a launch whose q was rotated by LaunchRope first, bit for bit (and that of kernels::Rope on
/// the host wherever its cos/sin and rounded products agree with the device's: everywhere on the
/// emulated device when the host compiler does not contract Rope's products into FMAs).
/// Workspace: the splits' arrival counters (its first SlotAttentionArrivalBytes(), the same place
/// for every shape), then their partials; 0 bytes when one split suffices; kWorkspace when short.
/// The counters must be zero before the first launch that splits: clear a workspace once when it
/// is allocated (ClearSlotAttentionWorkspace, or a zeroed allocation). Every launch leaves them
/// zero (the block that merges a row resets its counter), so launches of any shape may follow on
/// one workspace, in stream order, and a captured launch replays from zero. Two launches that
/// run at the same time need two workspaces (as for the partials).
/// The head_dims LaunchSlotAttention has a kernel for (one template instance each). Inline, so
/// host code of any build (ValidateAttentionPlan) states the same list without CUDA.
constexpr bool SlotAttentionHeadDimSupported(int head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}
size_t SlotAttentionWorkspaceBytes(const SlotAttentionParams& p);
/// The number of splits LaunchSlotAttention takes for p (0 when p is refused or has no query).
int SlotAttentionSplits(const SlotAttentionParams& p);
/// Bytes at the start of a workspace that hold the arrival counters (4 KiB, for every shape).
size_t SlotAttentionArrivalBytes();
/// Zeroes the arrival counters of a new workspace of `workspace_bytes` bytes (cudaMemsetAsync of
/// its first min(workspace_bytes, SlotAttentionArrivalBytes()) bytes on s; no wait). 0 bytes: kOk.
KernelError ClearSlotAttentionWorkspace(void* workspace, size_t workspace_bytes, Stream s);
KernelError LaunchSlotAttention(const SlotAttentionParams& p, void* workspace, size_t workspace_bytes,
                                Stream s);

/// MergeAttentionStates on the device (out/lse may alias out_a/lse_a).
KernelError LaunchMergeAttentionStates(int rows, int head_dim, const float* out_a, const float* lse_a,
                                       const float* out_b, const float* lse_b, float* out, float* lse,
                                       Stream s);

// ---- retrieval ---------------------------------------------------------------------------
/// ScoreChunks: one warp per chunk, four representatives at a time on 8-lane groups, each dot
/// in Dot's order (8 fmaf partials, the tail, the partials in order), IEEE sqrt/divide for the
/// inverse norms, std::max's tie rule, heads in order 0..H-1: the twin's scores bit for bit
/// where the host compiler contracts the twin's cosine sum fold into an FMA (GCC -O3
/// -march=native does). keys and inv_norm step heads by ChunkStride(p) (a mirror grown by
/// doubling: retrieval/device_scorer.h).
KernelError LaunchScoreChunks(const ChunkScoreParams& p, Stream s);

/// SegmentedTopK with CUB's stable segmented radix sort (descending; -0.0 made +0.0 first,
/// so ties keep the lower index as the twin does). Needs p.offsets[n_segments] (the total)
/// on the host: pass it as `total`. The query asks CUB for its temporary bytes, which needs
/// a device (kDeviceError without one).
KernelError SegmentedTopKWorkspaceBytes(const SegmentedTopKParams& p, int32_t total, size_t* bytes);
KernelError LaunchSegmentedTopK(const SegmentedTopKParams& p, int32_t total, void* workspace,
                                size_t workspace_bytes, Stream s);

/// SegmentEntropy (Eq. 11): one block per segment, fp64 sums; non_finite (when set) counted
/// with a block reduction.
KernelError LaunchSegmentEntropy(const EntropyParams& p, Stream s);

/// MeanPoolProbe, ActMergeWindow (Eq. 8) and ActWeightedProbe (Eq. 7, 9) on device arrays;
/// n_old and count are host values (the host keeps the count).
KernelError LaunchMeanPoolProbe(const ProbeShape& shape, const float* q, int m, float* probe, Stream s);
KernelError LaunchActMergeWindow(const ProbeShape& shape, const float* q, int m, int64_t n_old, double* mean,
                                 double* m2, Stream s);
/// CountNonFinite (kernels/cpu/probe.h) of n fp32 values on the device into count and first
/// (device int32s, written, not added to): one block, no atomics.
KernelError LaunchCountNonFinite(const float* x, int32_t n, int32_t* count, int32_t* first, Stream s);
size_t ActWeightedProbeWorkspaceBytes(const ProbeShape& shape, int m);
KernelError LaunchActWeightedProbe(const ProbeShape& shape, const float* q, int m, const double* mean,
                                   const double* m2, int64_t count, double eps, float* probe, void* workspace,
                                   size_t workspace_bytes, Stream s);

// ---- the model's forward outside attention (twins: kernels/cpu/forward.h, rope.h) ---------
/// An opaque cublasHandle_t. The GEMM launcher needs one; creating it allocates, so the caller
/// does that once (per thread or stream) and passes it to every launch.
using BlasHandle = void*;
/// cublasCreate with CUBLAS_PEDANTIC_MATH (no TF32: fp32 GEMMs stay fp32). kDeviceError on
/// failure, with the cuBLAS status in LastBlasStatus().
KernelError CreateBlasHandle(BlasHandle* handle);
void DestroyBlasHandle(BlasHandle handle);  ///< null is a no-op
/// The last cuBLAS status a launcher of this thread saw (a cublasStatus_t; 0 = success), and
/// its name and description.
int LastBlasStatus();
const char* LastBlasStatusString();

/// Embedding: one block per token. tokens is a device array the host cannot check: a token
/// outside [0, vocab) fills its row with NaN (the twin returns kBadShape and writes nothing).
KernelError LaunchEmbedding(const EmbeddingParams& p, Stream s);
/// RmsNorm: one block per row, the sum of squares in double as the twin.
KernelError LaunchRmsNorm(const RmsNormParams& p, Stream s);

/// kernels::Rope (kernels/cpu/rope.h) over device arrays: x [m, heads, head_dim] in place,
/// token t at positions[t], inv_freq [head_dim / 2] (RopeInvFreq, uploaded once).
struct RopeParams {
  int m = 0;                           ///< tokens, >= 0
  int heads = 0;                       ///< > 0
  int head_dim = 0;                    ///< > 0, even
  float* x = nullptr;                  ///< [m, heads, head_dim], device
  const int64_t* positions = nullptr;  ///< [m], device
  const double* inv_freq = nullptr;    ///< [head_dim / 2], device
};
/// One block per token; angles in double, cos/sin rounded to fp32 once, as the twin.
KernelError LaunchRope(const RopeParams& p, Stream s);
/// SwiGlu in place, grid-stride.
KernelError LaunchSwiGlu(const SwiGluParams& p, Stream s);

/// Gemm (y = or += x . W^T, row-major) with cublasGemmEx, fp32 in and out,
/// CUBLAS_COMPUTE_32F_PEDANTIC. The launcher sets the handle's stream and points cuBLAS at the
/// caller's workspace (at least GemmWorkspaceBytes(), 32 MiB as NVIDIA recommends for sm_90;
/// kWorkspace when short), so cuBLAS allocates nothing in the call.
size_t GemmWorkspaceBytes();
KernelError LaunchGemm(const GemmParams& p, BlasHandle handle, void* workspace, size_t workspace_bytes,
                       Stream s);
/// ConvertToStore (kernels/cpu/forward.h) on device arrays: the model's K/V, fp32, to the store's
/// dtype before a device-side Append. Grid-stride; the element conversion is
/// kernels/cuda/store_convert.h, which equals the twin (kvtier::FromFloat) in every bit,
/// NaN payloads included. f32 is a device-to-device cudaMemcpyAsync.
KernelError LaunchConvertToStore(const ConvertToStoreParams& p, Stream s);

// ---- transfers -----------------------------------------------------------------------------
struct GatherParams {
  int n_copies = 0;               ///< >= 0
  size_t bytes = 0;               ///< bytes of every copy (one chunk's K or V)
  const uint64_t* src = nullptr;  ///< [n_copies] device-visible addresses (mapped pinned host memory)
  const uint64_t* dst = nullptr;  ///< [n_copies] device addresses
  // src and dst are device-readable arrays (device or mapped pinned memory): the plan is
  // written by the host, the run step only reads it.
};
/// One block per copy; 16-byte loads when `bytes` is a multiple of 16, and then every src and
/// dst address must be 16-byte aligned (slot and pinned-slab addresses are 256- and 4096-aligned).
KernelError LaunchGatherCopies(const GatherParams& p, Stream s);

/// cudaMemcpyBatchAsync (CUDA >= 12.8) of `count` host-to-device copies, one attribute for
/// all (source accessed in stream order). dsts/srcs/sizes are host arrays. On the legacy default
/// stream (s == nullptr), which the batch call refuses, one cudaMemcpyAsync per copy.
KernelError MemcpyBatchAsync(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                             Stream s);

// ---- device chunk table ----------------------------------------------------------------------
/// ChunkTableAssign (kernels/cpu/chunk_table.h states the rule) on device memory: one block; its
/// threads stamp the hits, then one thread walks the entries in selection order (each miss's
/// victim depends on the ones before), then the block stamps the listed slots. Reads *n_rows on
/// the device; the twin's outputs and table bit for bit. The host checks the params
/// (CheckChunkTableAssignParams) and nothing else.
KernelError LaunchChunkTableAssign(const ChunkTableParams& p, Stream s);
/// ChunkTableGather on the device: grid (max_rows, parts of a chunk, K | V), blocks past
/// *n_misses (read on the device) exit; each block copies its parts of one miss's half from the
/// source (mapped pinned host memory, read through UVA) to its slot, 16 bytes per load when the
/// chunk size and both addresses are 16-byte aligned, bytes otherwise.
KernelError LaunchChunkTableGather(const ChunkTableParams& p, Stream s);

// ---- representatives of sealed chunks ------------------------------------------------------
/// InfLLM's mass rule (twin: MassRepresentatives, kernels/cpu/representatives.h, which each
/// thread runs for one chunk and out head): the chosen keys and their inverse norms written in
/// an Exact index mirror's layout, so that a chunk sealed on the device is scored at once.
/// Host checks as MassRepresentativesCheck.
KernelError LaunchChooseMassRepresentatives(const MassRepresentativesParams& p, Stream s);

// ---- Eq. 12 grant on the device ------------------------------------------------------------
/// ActQKV Eq. 12 / Algorithm 1 for one layer (twin: EntropyGrantStep, kernels/cpu/entropy_grant.h,
/// which says what each field means and the flow's order): one thread reads the layer's n,
/// Theta (SegmentEntropy's output) and non-finite count from device memory, writes min(grant,
/// cap) to p.take and, on success, updates the state in device memory, so that the next layer's
/// grant needs no host wait. A failure writes take 0 and its code (kEntropyGrant...) to p.error.
/// Host checks as EntropyGrantCheck (kBadShape, kNullPointer). p.fixed_k >= 1: topk,
/// take = min(fixed_k, n, cap).
KernelError LaunchEntropyGrant(const EntropyGrantParams& p, Stream s);
/// EntropyGrantBeginStep on a device state: B_kv = L * k, the step's Theta sum and count reset.
/// k >= 1 (kBadShape), and >= the state's min_chunks (the caller checks, as
/// EntropyBudget::BeginStep does; a smaller k makes the step's grants fail with
/// kEntropyGrantBoundsCross).
KernelError LaunchEntropyGrantBeginStep(EntropyGrantState* state, int k, Stream s);

}  // namespace kvtier::kernels::cuda
