// Plan on the host, run on a backend: the attention step of a Session as data.
//
// After probe -> search -> budget -> fetch, Session builds an AttentionPlan: the POD
// kernels::SlotAttentionParams that both the CPU twin (kernels/cpu/slot_attention.h) and the
// CUDA launcher (kernels/cuda/kernels.h) take, i.e. the queries, the dense runs (sinks, the
// local ring as one or two runs) and the retrieved chunks as an index list into the hot
// tier's slot pool (no gather copy), plus GQA geometry, dtype, scale and output. An
// AttentionBackend runs it where the hot tier's memory is:
//  * "cpu": kernels::SlotAttention over host memory. The plan puts the sinks before the
//    slots and the local runs after them (SlotAttentionParams::n_leading_dense), which is
//    the order Session::Attend always concatenated its parts in, so the CPU path is bit for
//    bit what it was (tests/offload/attention_backend_test.cc and session_test check it).
//  * "cuda" (builds with CUDA, a CudaHotTier): the plan's pointers are device pointers
//    (the tier's regions and slot pool); the host arrays (q, positions, slot list) are
//    staged in pinned memory and copied into one backend-owned device workspace (the
//    kernel's own workspace is a second one, its arrival counters zeroed once when allocated),
//    LaunchSlotAttention runs on the tier's stream; Run's host output comes back through
//    pinned memory with one wait per call, RunOnDevice's stays on the device with none.
//    Its host-side logic (slot mapping, workspace layout, plan validation) is tested here
//    without a device; the numbers it computes, on a GPU or the emulated device.
//
// Keys kept before RoPE (InfLLM positions) are rotated by the kernel as it reads them
// (AttentionPlanInput::rope_inv_freq; kernels/cpu/slot_attention.h says how): the plan carries
// the frequencies and a rotation position for the sinks and for the chunks, the local runs are
// rotated at their tokens' own positions, and the queries come rotated. The "cuda" backend
// keeps a device copy of the frequencies, uploaded when they change.
//
// A hot slot holds one chunk as [K chunk][V chunk] (TieredStore's layout), while the
// kernel reads K and V slots of one half each from two pools with the same index. So the
// pool is seen as 2 * capacity half-slots: pool_k = base, pool_v = base + half, hot slot s
// is index 2s in both (K at base + 2s*half, V at base + (2s+1)*half), pool_slots =
// 2 * capacity - 1 (the last index V may use is 2*(capacity-1), which is in range).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/slot_attention.h"
#include "offload/hot_tier.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

/// A slot pool as the kernel sees it: `capacity` slots of `slot_bytes` ([K][V] halves)
/// from `base`, contiguous (HostHotTier's SlotPool and CudaHotTier's cudaMalloc both are).
struct HotPoolView {
  const uint8_t* base = nullptr;
  int32_t capacity = 0;
  size_t slot_bytes = 0;
};
/// The pool of `hot` (slot_data(0), capacity, slot_bytes).
HotPoolView PoolOf(HotTier* hot);

/// The slot a chunk span (FetchHandle::spans) points at: k must be a slot start of `pool`
/// and v its second half. InvalidArgument naming the span otherwise (a tier whose slots are
/// not one contiguous pool cannot be planned: the kernel indexes a single base).
Result<int32_t> SlotOfSpan(const HotPoolView& pool, const kernels::KvSpan& span, size_t index);

/// kernels::Attention's parameters for `g`'s heads: n_queries queries q (fp32) at `positions`
/// over `parts`, whose K/V are in `dtype`, written to `out`; softmax scale 1/sqrt(head_dim),
/// causal, no log-sum-exp.
kernels::AttentionParams DenseAttentionParams(const Geometry& g, DType dtype, const float* q,
                                              const int64_t* positions, int n_queries,
                                              const kernels::KvSpan* parts, int n_parts, float* out);

/// What a plan is built from: the parts Session::Gather produced, in attention order.
struct AttentionPlanInput {
  int q_heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kF16;
  float scale = 0.0f;  ///< 0 = 1 / sqrt(head_dim)
  int n_queries = 0;
  const float* q = nullptr;                 ///< [n_queries, q_heads, head_dim] fp32, host
  const int64_t* positions = nullptr;       ///< [n_queries], host
  kernels::KvSpan sinks;                    ///< may hold 0 tokens
  const kernels::KvSpan* chunks = nullptr;  ///< [n_chunks] spans into `pool`
  size_t n_chunks = 0;
  const kernels::KvSpan* local = nullptr;  ///< [n_local] runs, oldest first
  int n_local = 0;                         ///< 0 .. kMaxDenseParts - 1
  HotPoolView pool;                        ///< where the chunks live
  /// Keys rotated as the kernel reads them: [head_dim / 2] inverse frequencies
  /// (kernels::RopeInvFreq), HOST memory, read while Build and Run run; null = keys as stored.
  /// With it, head_dim must be even and q must hold the queries already rotated.
  const double* rope_inv_freq = nullptr;
  /// Where the sinks' keys are rotated: kernels::kRopeAtKeyPositions (each at its own position)
  /// or one position >= 0 for all (InfLLM: L0 = the local window's start, once chunks separate
  /// the sinks from it). Must stay kRopeAtKeyPositions without rope_inv_freq.
  int64_t sinks_rope_position = kernels::kRopeAtKeyPositions;
  /// Where every retrieved chunk's keys are rotated, as sinks_rope_position (InfLLM: L0).
  int64_t chunks_rope_position = kernels::kRopeAtKeyPositions;
  // The local runs are rotated at their tokens' own positions.
  /// Queries rotated by the kernel: [n_queries] positions, HOST memory, read while Build and
  /// Run/RunOnDevice run (the "cuda" backend stages them with the plan, no wait); query row t is
  /// rotated at q_rope_positions[t] as kernels::Rope rotates (SlotAttentionParams::
  /// q_rope_positions), and q (or RunOnDevice's q_device) then holds the queries unrotated.
  /// Needs rope_inv_freq. null = q comes rotated.
  const int64_t* q_rope_positions = nullptr;
  /// The chunk half as DEVICE arrays (a device-side selection the host never sees; "cuda"
  /// only), instead of chunks/n_chunks (which must then be empty): device_slot_capacity entries
  /// of device_slot_index (KERNEL pool indices: KernelSlotIndex(hot slot) = 2 * hot slot, each
  /// chunk one full slot of `pool`) and device_slot_first_position (each chunk's first absolute
  /// position), of which the first *device_slot_count (one device int32, in
  /// [0, device_slot_capacity]; the kernel clamps it there) are attended. An index outside the
  /// pool is skipped by the kernel. The capacity sizes the launch (its split count); the output
  /// equals that of a host plan of the same count's chunks launched with the same split count.
  const int32_t* device_slot_index = nullptr;
  const int64_t* device_slot_first_position = nullptr;
  const int32_t* device_slot_count = nullptr;
  int device_slot_capacity = 0;  ///< >= 0; > 0 needs all three device arrays
  /// With a device slot list only: the chunks live in a pool of their own instead of `pool`'s
  /// [K][V] slots (a session's device lane, engine/device_lane.h): K of slot s at
  /// device_pool_k + s * half and V at device_pool_v + s * half (half = pool.slot_bytes / 2, so
  /// `pool` still gives the chunk's size), device_pool_slots slots, and device_slot_index then
  /// holds these slot numbers (not KernelSlotIndex). Null: the chunks are in `pool`.
  const uint8_t* device_pool_k = nullptr;
  const uint8_t* device_pool_v = nullptr;
  int32_t device_pool_slots = 0;
};

/// The index of hot slot `hot_slot` in AttentionPlan's slot list (and in a device slot list):
/// the kernel reads a [K][V] slot as two halves of one pool (see the top of this file).
constexpr int32_t KernelSlotIndex(int32_t hot_slot) { return 2 * hot_slot; }

/// One layer step's attention. The slot lists live in the plan (host memory) and params()
/// points at them; reuse one plan across steps so that building allocates nothing once the
/// vectors have grown to the largest step.
class AttentionPlan {
 public:
  AttentionPlan() = default;
  AttentionPlan(const AttentionPlan&) = delete;
  AttentionPlan& operator=(const AttentionPlan&) = delete;

  /// Fills the plan from `in` (out is left null: the backend sets it). InvalidArgument for
  /// a chunk span outside the pool or too many local runs.
  Status Build(const AttentionPlanInput& in);
  const kernels::SlotAttentionParams& params() const { return p_; }
  const std::vector<int32_t>& slot_index() const { return slot_index_; }
  const std::vector<int64_t>& slot_first_position() const { return slot_first_; }
  /// Whether params()' slot list, first positions and count (n_slots_in_memory) are device
  /// pointers (AttentionPlanInput::device_slot_index): only the "cuda" backend runs such a plan.
  bool slots_on_device() const { return slots_on_device_; }

 private:
  kernels::SlotAttentionParams p_;
  bool slots_on_device_ = false;
  std::vector<int32_t> slot_index_;
  std::vector<int64_t> slot_first_;
};

/// Host-side checks of a plan for a backend, as a named status: what CheckSlotAttentionParams
/// finds, slot indices outside the pool, the rotation (an odd head_dim, a rotation position set
/// without frequencies or below kRopeAtKeyPositions, query positions without frequencies), and
/// for "cuda" the launcher's limits (head_dim 16, 32, 64, 128 or 256, at most 65535 queries).
/// Needs no device and reads no K/V memory. With slots_on_device (AttentionPlan::
/// slots_on_device) the slot list and its count are device memory and are not read: such a plan
/// needs cuda and a count (n_slots_in_memory), and a count needs them on the device.
Status ValidateAttentionPlan(const kernels::SlotAttentionParams& p, bool cuda, bool slots_on_device = false);

/// The CUDA backend's device workspace of a plan, laid out on the host: the plan's host arrays
/// copied in, then the output; every offset 256-aligned. The kernel's own workspace is a buffer
/// apart (its arrival counters stay where the launcher put them, zeroed once: kernels/cuda/kernels.h).
struct CudaAttentionWorkspace {
  size_t q = 0, positions = 0, slot_index = 0, slot_first = 0, q_rope_positions = 0, out = 0;
  size_t total = 0;
};
/// Layout for n_queries queries of q_heads x head_dim, n_slots slots staged from the host (0 for a
/// device slot list) and n_q_rope_positions query rotation positions (0 or n_queries; 0 takes no
/// bytes, so the other offsets are those of a plan without).
CudaAttentionWorkspace LayoutCudaAttentionWorkspace(int n_queries, int q_heads, int head_dim, int n_slots,
                                                    int n_q_rope_positions = 0);
/// An upper bound of SlotAttentionWorkspaceBytes for n_queries (the launcher splits a row's
/// keys 64 ways at most; its arrival counters, then per split head_dim + 1 floats per row, plus
/// the final lse),
/// so a backend can size its workspace at creation for the largest step it expects.
size_t MaxSlotAttentionKernelBytes(int n_queries, int q_heads, int head_dim);

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  /// "cpu" or "cuda": the device of the hot tier it reads.
  virtual const char* name() const = 0;
  /// Runs `plan`, writing [n_queries, q_heads, head_dim] fp32 to host `out`; the result is
  /// in place on return. A failed check is InvalidArgument, a failed kernel Internal. A plan whose
  /// slots are on the device (slots_on_device) is FailedPrecondition on "cpu".
  virtual Status Run(const AttentionPlan& plan, float* out) = 0;
  /// Runs `plan` as Run does and also hands back the representative-key statistics of its dense
  /// parts: dense_mass[i] (host, [kv_heads, n_tokens] of params().dense[i], for every
  /// i < params().n_dense; null skips that part) is set to the attention mass each key gets from
  /// the queries in a softmax over the dense parts only (the sinks and the local window: the
  /// definition ObserveQueries computes, offload/observe_queries.h). The dense parts and the chunks are
  /// attended apart and merged by log-sum-exp (kernels::MergeAttentionStates), so the output is the attention
  /// over all the keys and no key is read twice.
  virtual Status RunWithDenseMass(const AttentionPlan& plan, float* out, float* const* dense_mass) = 0;
  /// Runs `plan` with the queries and the output in the hot tier's device memory ("cuda"): q from
  /// `q_device` (null: the plan's host q, uploaded), [n_queries, q_heads, head_dim] fp32 written to
  /// `out_device`, both ordered on the tier's stream, and returns once the work is submitted: no
  /// host wait, unless `dense_mass` (null, or RunWithDenseMass's array) asks for the mass, which
  /// comes back to the host and is waited for. The caller orders its own stream around the tier's
  /// (CudaHotTier::WaitForStream, MakeStreamWait). FailedPrecondition on "cpu" (host memory is the
  /// tier's memory there: Run and RunWithDenseMass are the calls).
  virtual Status RunOnDevice(const AttentionPlan& plan, const float* q_device, float* out_device,
                             float* const* dense_mass) = 0;
};

/// The backend for `hot`'s device: "cpu" for a host tier, "cuda" for a CudaHotTier (with
/// its workspace allocated now for up to `max_queries` queries at `geometry`). Unavailable
/// for a device this build cannot run.
Result<std::unique_ptr<AttentionBackend>> MakeAttentionBackend(HotTier* hot, const Geometry& geometry,
                                                               int max_queries);

}  // namespace kvtier
