#include "offload/attention_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <new>
#include <string>
#include <utility>

#include "kernels/cuda/kernels.h"  // no CUDA header: its head_dim list holds in every build
#include "kernels/dtype.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "offload/cuda_hot_tier.h"
#include "offload/device_sync_cuda.h"
#include "offload/pinned_staging.h"
#endif

namespace kvtier {

kernels::AttentionParams DenseAttentionParams(const Geometry& g, DType dtype, const float* q,
                                              const int64_t* positions, int n_queries,
                                              const kernels::KvSpan* parts, int n_parts, float* out) {
  kernels::AttentionParams p;
  p.q_heads = g.q_heads;
  p.kv_heads = g.kv_heads;
  p.head_dim = g.head_dim;
  p.dtype = dtype;
  p.scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
  p.n_queries = n_queries;
  p.q = q;
  p.q_positions = positions;
  p.parts = parts;
  p.n_parts = n_parts;
  p.out = out;
  return p;
}
namespace {

size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

// The launcher's head_dim refusal as a status, for the plan and for backend creation.
Status CudaHeadDimError(const std::string& who, int head_dim) {
  return InvalidArgument(who + ": head_dim " + std::to_string(head_dim) +
                         ": the CUDA attention kernel takes 16, 32, 64, 128 or 256");
}

Status PlanError(kernels::KernelError e, const std::string& what) {
  return InvalidArgument("attention plan: " + what + " (" + kernels::KernelErrorString(e) + ")");
}

}  // namespace

HotPoolView PoolOf(HotTier* hot) {
  HotPoolView v;
  v.capacity = hot->slot_capacity();
  v.slot_bytes = hot->slot_bytes();
  v.base = v.capacity > 0 ? hot->slot_data(0) : nullptr;
  return v;
}

Result<int32_t> SlotOfSpan(const HotPoolView& pool, const kernels::KvSpan& span, size_t index) {
  const std::string name = "attention plan: chunk span " + std::to_string(index);
  if (pool.base == nullptr || pool.capacity <= 0 || pool.slot_bytes == 0 || pool.slot_bytes % 2 != 0)
    return InvalidArgument(name + ": the hot tier has no slot pool of [K][V] slots");
  // Compared as integers: the span may point anywhere, and pointer arithmetic outside the
  // pool would be undefined.
  const auto base = reinterpret_cast<uintptr_t>(pool.base);
  const auto k = reinterpret_cast<uintptr_t>(span.k);
  const auto v = reinterpret_cast<uintptr_t>(span.v);
  const uintptr_t end = base + static_cast<uintptr_t>(pool.capacity) * pool.slot_bytes;
  if (k < base || k >= end || (k - base) % pool.slot_bytes != 0)
    return InvalidArgument(name +
                           ": K is not the start of a slot of the hot pool (a hot tier whose slots are not "
                           "one contiguous pool cannot be planned)");
  if (v != k + pool.slot_bytes / 2)
    return InvalidArgument(name + ": V is not the second half of the slot K starts");
  return static_cast<int32_t>((k - base) / pool.slot_bytes);
}

namespace {

// The rotation a plan asks for, as a named status (the kernels' check says only "bad shape").
Status CheckRope(const std::string& who, int head_dim, const double* inv_freq,
                 std::initializer_list<std::pair<std::string, int64_t>> positions) {
  for (const auto& [name, pos] : positions) {
    if (pos < kernels::kRopeAtKeyPositions)
      return InvalidArgument(
          who + ": " + name + " " + std::to_string(pos) +
          " (a rotation position is >= 0, or kRopeAtKeyPositions = -1 for each key's own)");
    if (inv_freq == nullptr && pos != kernels::kRopeAtKeyPositions)
      return InvalidArgument(who + ": " + name + " " + std::to_string(pos) +
                             " is set but rope_inv_freq is null (no rotation to place)");
  }
  if (inv_freq != nullptr && head_dim % 2 != 0)
    return InvalidArgument(who + ": head_dim " + std::to_string(head_dim) +
                           " is odd: keys rotate in pairs (rope_inv_freq is set)");
  return Status::Ok();
}

// The device slot list's fields, as named refusals (AttentionPlanInput::device_slot_index).
Status CheckDeviceSlots(const AttentionPlanInput& in) {
  const std::string who = "attention plan: ";
  if (in.device_slot_capacity < 0)
    return InvalidArgument(who + "device_slot_capacity " + std::to_string(in.device_slot_capacity) +
                           " is negative");
  if ((in.device_pool_k == nullptr) != (in.device_pool_v == nullptr) ||
      (in.device_pool_k != nullptr && in.device_pool_slots <= 0))
    return InvalidArgument(who +
                           "a device pool of its own needs both halves and device_pool_slots > 0 (got " +
                           std::to_string(in.device_pool_slots) + ")");
  if (in.device_slot_capacity == 0) {
    if (in.device_pool_k != nullptr) return InvalidArgument(who + "a device pool without a device slot list");
    if (in.device_slot_count != nullptr)
      return InvalidArgument(who +
                             "device_slot_count is set but device_slot_capacity is 0 (a device count needs "
                             "the capacity of its slot list)");
    if (in.device_slot_index != nullptr || in.device_slot_first_position != nullptr)
      return InvalidArgument(who + "a device slot list is set but device_slot_capacity is 0");
    return Status::Ok();
  }
  if (in.n_chunks > 0)
    return InvalidArgument(who + std::to_string(in.n_chunks) +
                           " host chunk spans and a device slot list: the chunks are one or the other");
  if (in.device_slot_count == nullptr)
    return InvalidArgument(who + "device_slot_capacity " + std::to_string(in.device_slot_capacity) +
                           " without device_slot_count (the count of its entries in use)");
  if (in.device_slot_index == nullptr) return InvalidArgument(who + "device_slot_index is null");
  if (in.device_slot_first_position == nullptr)
    return InvalidArgument(who + "device_slot_first_position is null");
  if (in.device_slot_capacity > INT32_MAX / 2)
    return InvalidArgument(who + "device_slot_capacity " + std::to_string(in.device_slot_capacity));
  if (in.pool.base == nullptr || in.pool.capacity <= 0 || in.pool.slot_bytes == 0 ||
      in.pool.slot_bytes % 2 != 0)
    return InvalidArgument(who + "a device slot list, but the hot tier has no slot pool of [K][V] slots");
  const size_t token_bytes = static_cast<size_t>(std::max(0, in.kv_heads)) *
                             static_cast<size_t>(std::max(0, in.head_dim)) * DTypeSize(in.dtype);
  if (token_bytes == 0 || (in.pool.slot_bytes / 2) % token_bytes != 0)
    return InvalidArgument(who + "the pool's slots of " + std::to_string(in.pool.slot_bytes) +
                           " bytes do not hold whole tokens of " + std::to_string(token_bytes) +
                           " bytes of K and V");
  return Status::Ok();
}

}  // namespace

Status AttentionPlan::Build(const AttentionPlanInput& in) {
  KVTIER_RETURN_IF_ERROR(CheckRope(
      "attention plan", in.head_dim, in.rope_inv_freq,
      {{"sinks_rope_position", in.sinks_rope_position}, {"chunks_rope_position", in.chunks_rope_position}}));
  if (in.n_local < 0 || in.n_local > kernels::kMaxDenseParts - 1)
    return InvalidArgument("attention plan: " + std::to_string(in.n_local) + " local runs (at most " +
                           std::to_string(kernels::kMaxDenseParts - 1) + " next to the sinks)");
  if (in.n_chunks > 0 && in.chunks == nullptr) return InvalidArgument("attention plan: chunk spans are null");
  if (in.q_rope_positions != nullptr && in.rope_inv_freq == nullptr)
    return InvalidArgument(
        "attention plan: q_rope_positions is set but rope_inv_freq is null (no rotation to "
        "apply to the queries)");
  KVTIER_RETURN_IF_ERROR(CheckDeviceSlots(in));
  if (in.n_chunks > static_cast<size_t>(INT32_MAX / 2))
    return InvalidArgument("attention plan: " + std::to_string(in.n_chunks) + " chunks");
  kernels::SlotAttentionParams p;
  p.q_heads = in.q_heads;
  p.kv_heads = in.kv_heads;
  p.head_dim = in.head_dim;
  p.dtype = in.dtype;
  p.scale = in.scale != 0.0f ? in.scale : 1.0f / std::sqrt(static_cast<float>(in.head_dim));
  p.causal = true;
  p.n_queries = in.n_queries;
  p.q = in.q;
  p.q_positions = in.positions;
  // Sinks | slots | local: the order Session::Attend concatenated its parts in.
  p.dense[0] = kernels::DenseKv{in.sinks.k, in.sinks.v, in.sinks.n_tokens, in.sinks.first_position, nullptr};
  for (int i = 0; i < in.n_local; ++i)
    p.dense[1 + i] = kernels::DenseKv{in.local[i].k, in.local[i].v, in.local[i].n_tokens,
                                      in.local[i].first_position, nullptr};
  p.n_dense = 1 + in.n_local;
  p.n_leading_dense = 1;
  p.rope_inv_freq = in.rope_inv_freq;
  p.q_rope_positions = in.q_rope_positions;
  p.dense[0].rope_position = in.sinks_rope_position;
  p.slot_rope_position = in.chunks_rope_position;
  slot_index_.resize(in.n_chunks);
  slot_first_.resize(in.n_chunks);
  const size_t half = in.pool.slot_bytes / 2;
  for (size_t i = 0; i < in.n_chunks; ++i) {
    KVTIER_ASSIGN_OR_RETURN(const int32_t slot, SlotOfSpan(in.pool, in.chunks[i], i));
    if (in.head_dim > 0 && in.kv_heads > 0 &&
        static_cast<size_t>(in.chunks[i].n_tokens) * in.kv_heads * in.head_dim * DTypeSize(in.dtype) != half)
      return InvalidArgument("attention plan: chunk span " + std::to_string(i) + " holds " +
                             std::to_string(in.chunks[i].n_tokens) + " tokens, not one full slot");
    slot_index_[i] = 2 * slot;
    slot_first_[i] = in.chunks[i].first_position;
  }
  p.n_slots = static_cast<int>(in.n_chunks);
  if (in.n_chunks > 0) {
    p.pool_k = in.pool.base;
    p.pool_v = in.pool.base + half;
    p.pool_slots = 2 * in.pool.capacity - 1;
    p.slot_tokens = in.chunks[0].n_tokens;
    p.slot_index = slot_index_.data();
    p.slot_first_position = slot_first_.data();
  }
  const bool device_slots = in.device_slot_capacity > 0;
  if (device_slots) {  // CheckDeviceSlots passed: whole tokens, one full slot per chunk
    p.n_slots = in.device_slot_capacity;
    p.n_slots_in_memory = in.device_slot_count;
    p.pool_k = in.pool.base;
    p.pool_v = in.pool.base + half;
    p.pool_slots = 2 * in.pool.capacity - 1;
    p.slot_tokens =
        static_cast<int>(half / (static_cast<size_t>(in.kv_heads) * in.head_dim * DTypeSize(in.dtype)));
    p.slot_index = in.device_slot_index;
    p.slot_first_position = in.device_slot_first_position;
    if (in.device_pool_k != nullptr) {  // CheckDeviceSlots checked the pair and the count
      p.pool_k = in.device_pool_k;
      p.pool_v = in.device_pool_v;
      p.pool_slots = in.device_pool_slots;
    }
  }
  p_ = p;
  slots_on_device_ = device_slots;
  return Status::Ok();
}

Status ValidateAttentionPlan(const kernels::SlotAttentionParams& p, bool cuda, bool slots_on_device) {
  using kernels::KernelError;
  if (p.q_heads <= 0 || p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0)
    return InvalidArgument("attention plan: q_heads (" + std::to_string(p.q_heads) +
                           ") must be a positive multiple of kv_heads (" + std::to_string(p.kv_heads) + ")");
  if (!kernels::HeadDimSupported(p.head_dim))
    return InvalidArgument("attention plan: head_dim " + std::to_string(p.head_dim) + " is not supported");
  if (cuda && !kernels::cuda::SlotAttentionHeadDimSupported(p.head_dim))
    return CudaHeadDimError("attention plan", p.head_dim);
  if (cuda && p.n_queries > 65535)
    return InvalidArgument("attention plan: " + std::to_string(p.n_queries) +
                           " queries: the CUDA attention kernel takes at most 65535 per call");
  for (int i = 0; i < std::clamp(p.n_dense, 0, kernels::kMaxDenseParts); ++i)
    KVTIER_RETURN_IF_ERROR(
        CheckRope("attention plan", p.head_dim, p.rope_inv_freq,
                  {{"dense[" + std::to_string(i) + "].rope_position", p.dense[i].rope_position}}));
  KVTIER_RETURN_IF_ERROR(CheckRope("attention plan", p.head_dim, p.rope_inv_freq,
                                   {{"slot_rope_position", p.slot_rope_position}}));
  if (p.q_rope_positions != nullptr && p.rope_inv_freq == nullptr)
    return InvalidArgument("attention plan: q_rope_positions is set but rope_inv_freq is null");
  if (p.n_slots_in_memory != nullptr && p.n_slots <= 0)
    return InvalidArgument(
        "attention plan: a slot count in memory (n_slots_in_memory) but no capacity (n_slots " +
        std::to_string(p.n_slots) + ")");
  if (slots_on_device && !cuda)
    return InvalidArgument(
        "attention plan: the slot list is in device memory; only the \"cuda\" backend runs it");
  if (slots_on_device && p.n_slots_in_memory == nullptr)
    return InvalidArgument("attention plan: a device slot list without its device count (n_slots_in_memory)");
  if (cuda && !slots_on_device && p.n_slots_in_memory != nullptr)
    return InvalidArgument(
        "attention plan: a slot count in host memory; the cuda backend reads a count on the device (a device "
        "slot list)");
  if (const KernelError e = kernels::CheckSlotAttentionParams(p); e != KernelError::kOk)
    return PlanError(e, "parameters rejected");
  if (slots_on_device) return Status::Ok();  // the list is device memory: the kernel skips a bad index
  int n_slots = p.n_slots;
  if (p.n_slots_in_memory != nullptr) {
    n_slots = *p.n_slots_in_memory;
    if (n_slots < 0 || n_slots > p.n_slots)
      return InvalidArgument("attention plan: slot count " + std::to_string(n_slots) + " outside [0, " +
                             std::to_string(p.n_slots) + "] (n_slots, the capacity)");
  }
  for (int i = 0; i < n_slots; ++i)
    if (p.slot_index[i] < 0 || p.slot_index[i] >= p.pool_slots)
      return InvalidArgument("attention plan: slot index " + std::to_string(p.slot_index[i]) + " (entry " +
                             std::to_string(i) + ") outside the pool's " + std::to_string(p.pool_slots));
  return Status::Ok();
}

CudaAttentionWorkspace LayoutCudaAttentionWorkspace(int n_queries, int q_heads, int head_dim, int n_slots,
                                                    int n_q_rope_positions) {
  const size_t m = static_cast<size_t>(std::max(0, n_queries));
  const size_t rows =
      m * static_cast<size_t>(std::max(0, q_heads)) * static_cast<size_t>(std::max(0, head_dim));
  const size_t n = static_cast<size_t>(std::max(0, n_slots));
  CudaAttentionWorkspace w;
  w.q = 0;
  w.positions = w.q + Align256(rows * sizeof(float));
  w.slot_index = w.positions + Align256(m * sizeof(int64_t));
  w.slot_first = w.slot_index + Align256(n * sizeof(int32_t));
  w.q_rope_positions = w.slot_first + Align256(n * sizeof(int64_t));
  w.out =
      w.q_rope_positions + Align256(static_cast<size_t>(std::max(0, n_q_rope_positions)) * sizeof(int64_t));
  w.total = w.out + Align256(rows * sizeof(float));
  return w;
}

size_t MaxSlotAttentionKernelBytes(int n_queries, int q_heads, int head_dim) {
  // kernels/cuda/attention.cu: at most 64 splits; the arrival counters (4 KiB), partial outputs,
  // partial lse, final lse.
  constexpr size_t kMaxSplits = 64, kArrivalBytes = 4096;
  const size_t rows = static_cast<size_t>(std::max(0, n_queries)) * static_cast<size_t>(std::max(0, q_heads));
  if (rows == 0) return 0;
  return kArrivalBytes +
         Align256(kMaxSplits * rows * static_cast<size_t>(std::max(0, head_dim)) * sizeof(float)) +
         Align256(kMaxSplits * rows * sizeof(float)) + Align256(rows * sizeof(float));
}

namespace {

// RunWithDenseMass attends a plan in two halves: the dense parts alone (their mass is the
// statistics' softmax) and the slots alone; the LSE merge of the two is the whole attention.
kernels::SlotAttentionParams DenseHalf(const kernels::SlotAttentionParams& p) {
  kernels::SlotAttentionParams d = p;
  d.n_slots = 0;
  d.n_slots_in_memory = nullptr;
  d.pool_k = d.pool_v = nullptr;
  d.pool_slots = 0;
  d.slot_index = nullptr;
  d.slot_first_position = nullptr;
  d.slot_n_tokens = nullptr;
  d.slot_mass = nullptr;
  d.n_leading_dense = -1;
  return d;
}

kernels::SlotAttentionParams SlotHalf(const kernels::SlotAttentionParams& p) {
  kernels::SlotAttentionParams c = p;
  for (int i = 0; i < kernels::kMaxDenseParts; ++i) c.dense[i] = kernels::DenseKv{};
  c.n_dense = 0;
  c.n_leading_dense = -1;
  return c;
}

size_t DenseMassElems(const kernels::SlotAttentionParams& p, int i) {
  return static_cast<size_t>(p.kv_heads) * static_cast<size_t>(std::max(0, p.dense[i].n_tokens));
}

class CpuAttentionBackend final : public AttentionBackend {
 public:
  const char* name() const override { return "cpu"; }
  Status Run(const AttentionPlan& plan, float* out) override {
    kernels::SlotAttentionParams p = plan.params();
    p.out = out;
    KVTIER_RETURN_IF_ERROR(ValidateAttentionPlan(p, /*cuda=*/false, plan.slots_on_device()));
    const kernels::KernelError e = kernels::SlotAttention(p);
    if (e != kernels::KernelError::kOk)
      return Internal(std::string("attention (cpu): ") + kernels::KernelErrorString(e));
    return Status::Ok();
  }

  Status RunWithDenseMass(const AttentionPlan& plan, float* out, float* const* dense_mass) override {
    kernels::SlotAttentionParams p = plan.params();
    p.out = out;
    KVTIER_RETURN_IF_ERROR(ValidateAttentionPlan(p, /*cuda=*/false, plan.slots_on_device()));
    const size_t rows = static_cast<size_t>(p.n_queries) * p.q_heads;
    const size_t out_elems = rows * static_cast<size_t>(p.head_dim);
    const bool slots = p.n_slots > 0;
    kernels::SlotAttentionParams d = DenseHalf(p);
    for (int i = 0; i < d.n_dense; ++i) {
      d.dense[i].mass = dense_mass != nullptr ? dense_mass[i] : nullptr;
      if (d.dense[i].mass != nullptr) std::fill_n(d.dense[i].mass, DenseMassElems(p, i), 0.0f);
    }
    if (slots) {
      out_dense_.resize(out_elems);
      lse_dense_.resize(rows);
      d.out = out_dense_.data();
      d.lse = lse_dense_.data();
    }
    kernels::KernelError e = kernels::SlotAttention(d);
    if (e != kernels::KernelError::kOk)
      return Internal(std::string("attention over the dense parts (cpu): ") + kernels::KernelErrorString(e));
    if (!slots) return Status::Ok();
    kernels::SlotAttentionParams c = SlotHalf(p);
    out_slots_.resize(out_elems);
    lse_slots_.resize(rows);
    lse_.resize(rows);
    c.out = out_slots_.data();
    c.lse = lse_slots_.data();
    e = kernels::SlotAttention(c);
    if (e != kernels::KernelError::kOk)
      return Internal(std::string("attention over the retrieved chunks (cpu): ") +
                      kernels::KernelErrorString(e));
    kernels::MergeAttentionStates(static_cast<int>(rows), p.head_dim, out_dense_.data(), lse_dense_.data(),
                                  out_slots_.data(), lse_slots_.data(), out, lse_.data());
    return Status::Ok();
  }

  Status RunOnDevice(const AttentionPlan&, const float*, float*, float* const*) override {
    return FailedPrecondition(
        "attention (cpu): a host hot tier has no device memory (Run and RunWithDenseMass take its host "
        "pointers)");
  }

 private:
  std::vector<float> out_dense_, lse_dense_, out_slots_, lse_slots_, lse_;
};

#if KVTIER_HAVE_CUDA

std::string CudaMessage(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// One device workspace for the session, sized at creation for max_queries; a larger step (a
// longer prefill window than announced) grows it once, to that step's size, and then reuses it.
// The plan's host arrays travel through PinnedStaging; every copy and kernel runs on the tier's
// stream, in submission order, so a later step's copies into the workspace land after the
// earlier step's kernels read it.
class CudaAttentionBackend final : public AttentionBackend {
 public:
  explicit CudaAttentionBackend(CudaHotTier* hot) : hot_(hot) {}
  ~CudaAttentionBackend() override {
    if (ws_.ptr) device_memory::Free(ws_.ptr);
    if (kernel_ws_.ptr) device_memory::Free(kernel_ws_.ptr);
    if (side_.ptr) device_memory::Free(side_.ptr);
    if (rope_.ptr) device_memory::Free(rope_.ptr);
  }
  const char* name() const override { return "cuda"; }

  Status Reserve(size_t bytes) { return Grow(&ws_, bytes, "workspace"); }
  // The kernel's workspace: grown like the others, and its arrival counters zeroed on the stream
  // whenever it is (re)allocated (LaunchSlotAttention leaves them zero after each launch).
  Status ReserveKernel(size_t bytes) {
    const size_t before = kernel_ws_.bytes;
    KVTIER_RETURN_IF_ERROR(Grow(&kernel_ws_, bytes, "kernel workspace"));
    if (kernel_ws_.bytes == before) return Status::Ok();  // not reallocated
    const kernels::KernelError ke =
        kernels::cuda::ClearSlotAttentionWorkspace(kernel_ws_.ptr, kernel_ws_.bytes, stream());
    if (ke != kernels::KernelError::kOk)
      return KernelFailure("clearing the attention kernel's workspace", ke);
    return Status::Ok();
  }

  Status Run(const AttentionPlan& plan, float* out) override {
    KVTIER_ASSIGN_OR_RETURN(const float* out_dev, Launch(plan, nullptr, nullptr, nullptr));
    return CopyOutAndWait(plan.params(), out_dev, out);
  }

  Status RunWithDenseMass(const AttentionPlan& plan, float* out, float* const* dense_mass) override {
    KVTIER_ASSIGN_OR_RETURN(const float* out_dev, Launch(plan, nullptr, nullptr, dense_mass));
    return CopyOutAndWait(plan.params(), out_dev, out);
  }

  Status RunOnDevice(const AttentionPlan& plan, const float* q_device, float* out_device,
                     float* const* dense_mass) override {
    if (out_device == nullptr) return InvalidArgument("attention (cuda): the device output is null");
    return Launch(plan, q_device, out_device, dense_mass).status();
  }

 private:
  cudaStream_t stream() const { return static_cast<cudaStream_t>(hot_->stream()); }

  static Status KernelFailure(const std::string& what, kernels::KernelError e) {
    return Internal(what + ": " + kernels::KernelErrorString(e) + " (" +
                    kernels::cuda::LastCudaErrorString() + ")");
  }

  // Runs `plan` on the tier's stream and returns the device output it wrote: `out_device` when
  // given, else the workspace's. q comes from `q_device` when given, else the plan's host q is
  // staged. With dense_mass (RunWithDenseMass's contract) the dense parts and the chunks are
  // attended apart and merged, and the mass is copied to the host and waited for; without it
  // nothing is waited for.
  //
  // The mass variant: the dense half writes its mass into one zeroed device array (part i at
  // mass_offset[i]), its output into the output and its lse beside; the slot half writes beside
  // those; the merge folds the slot half into the dense half in place.
  Result<const float*> Launch(const AttentionPlan& plan, const float* q_device, float* out_device,
                              float* const* dense_mass) {
    kernels::SlotAttentionParams p = plan.params();
    float host_out_marker = 0.0f;  // ValidateAttentionPlan checks out as non-null on the host
    p.out = out_device != nullptr ? out_device : &host_out_marker;
    if (q_device != nullptr) p.q = q_device;
    KVTIER_RETURN_IF_ERROR(ValidateAttentionPlan(p, /*cuda=*/true, plan.slots_on_device()));
    bool any_mass = false;
    for (int i = 0; dense_mass != nullptr && i < p.n_dense; ++i) any_mass |= dense_mass[i] != nullptr;
    if (p.n_queries == 0) {
      for (int i = 0; any_mass && i < p.n_dense; ++i)
        if (dense_mass[i] != nullptr) std::fill_n(dense_mass[i], DenseMassElems(p, i), 0.0f);
      return static_cast<const float*>(out_device);
    }
    cudaStream_t s = stream();
    if (!any_mass) {
      const size_t kernel_bytes = kernels::cuda::SlotAttentionWorkspaceBytes(p);
      KVTIER_ASSIGN_OR_RETURN(kernels::SlotAttentionParams d,
                              CopyPlanIn(p, plan.slots_on_device(), q_device, out_device, kernel_bytes));
      const kernels::KernelError ke = kernels::cuda::LaunchSlotAttention(d, kernel_ws_.ptr, kernel_bytes, s);
      if (ke != kernels::KernelError::kOk) return KernelFailure("attention (cuda)", ke);
      return static_cast<const float*>(d.out);
    }
    const kernels::SlotAttentionParams dense_half = DenseHalf(p), slot_half = SlotHalf(p);
    const bool slots = p.n_slots > 0;
    size_t mass_elems = 0, mass_offset[kernels::kMaxDenseParts] = {};
    for (int i = 0; i < p.n_dense; ++i) {
      mass_offset[i] = mass_elems;
      mass_elems += dense_mass[i] != nullptr ? DenseMassElems(p, i) : 0;
    }
    const size_t kernel_bytes =
        std::max(kernels::cuda::SlotAttentionWorkspaceBytes(dense_half),
                 slots ? kernels::cuda::SlotAttentionWorkspaceBytes(slot_half) : size_t{0});
    KVTIER_ASSIGN_OR_RETURN(kernels::SlotAttentionParams d,
                            CopyPlanIn(p, plan.slots_on_device(), q_device, out_device, kernel_bytes));
    const size_t rows = static_cast<size_t>(p.n_queries) * p.q_heads;
    const size_t out_bytes = Align256(rows * p.head_dim * sizeof(float));
    const size_t lse_bytes = Align256(rows * sizeof(float));
    const size_t slots_out = 0, dense_lse = slots_out + out_bytes, slots_lse = dense_lse + lse_bytes,
                 mass = slots_lse + lse_bytes;
    KVTIER_RETURN_IF_ERROR(Grow(&side_, mass + mass_elems * sizeof(float), "mass buffer"));
    auto* side = static_cast<uint8_t*>(side_.ptr);
    auto* mass_dev = reinterpret_cast<float*>(side + mass);
    cudaError_t e = mass_elems ? cudaMemsetAsync(mass_dev, 0, mass_elems * sizeof(float), s) : cudaSuccess;
    if (e != cudaSuccess) return Internal("attention (cuda): clearing the mass: " + CudaMessage(e));
    kernels::SlotAttentionParams dd = DenseHalf(d);
    for (int i = 0; i < dd.n_dense; ++i)
      dd.dense[i].mass = dense_mass[i] != nullptr ? mass_dev + mass_offset[i] : nullptr;
    dd.lse = slots ? reinterpret_cast<float*>(side + dense_lse) : nullptr;
    kernels::KernelError ke = kernels::cuda::LaunchSlotAttention(dd, kernel_ws_.ptr, kernel_bytes, s);
    if (ke != kernels::KernelError::kOk) return KernelFailure("attention over the dense parts (cuda)", ke);
    if (slots) {
      kernels::SlotAttentionParams cc = SlotHalf(d);
      cc.out = reinterpret_cast<float*>(side + slots_out);
      cc.lse = reinterpret_cast<float*>(side + slots_lse);
      ke = kernels::cuda::LaunchSlotAttention(cc, kernel_ws_.ptr, kernel_bytes, s);
      if (ke != kernels::KernelError::kOk)
        return KernelFailure("attention over the retrieved chunks (cuda)", ke);
      ke = kernels::cuda::LaunchMergeAttentionStates(static_cast<int>(rows), p.head_dim, d.out, dd.lse,
                                                     cc.out, cc.lse, d.out, dd.lse, s);
      if (ke != kernels::KernelError::kOk) return KernelFailure("attention merge (cuda)", ke);
    }
    // The mass goes to the store's host arrays through one staging entry and one wait.
    KVTIER_ASSIGN_OR_RETURN(uint8_t * staged, staging_.Take(mass_elems * sizeof(float), "key mass"));
    if (mass_elems > 0)
      e = device_sync::CopyAsync(staged, mass_dev, mass_elems * sizeof(float), cudaMemcpyDeviceToHost, s,
                                 device_sync::HostMemory::kPinned);
    if (e != cudaSuccess) return Internal("attention (cuda): copying the mass out: " + CudaMessage(e));
    KVTIER_RETURN_IF_ERROR(staging_.Done(s));
    KVTIER_RETURN_IF_ERROR(staging_.Wait());
    const auto* staged_mass = reinterpret_cast<const float*>(staged);
    for (int i = 0; i < p.n_dense; ++i)
      if (dense_mass[i] != nullptr)
        std::copy_n(staged_mass + mass_offset[i], DenseMassElems(p, i), dense_mass[i]);
    return static_cast<const float*>(d.out);
  }

  // Copies the plan's host arrays (q unless q_device is given, positions, the slot list unless it
  // is on the device already, the queries' rotation positions) into the workspace through one
  // staging entry, sizing the kernel's workspace (kernel_ws_) for `kernel_bytes`, and
  // returns the plan with device pointers and, as out, `out_device` or the workspace's output. K/V
  // pointers (and a device slot list with its count) are the tier's already.
  Result<kernels::SlotAttentionParams> CopyPlanIn(const kernels::SlotAttentionParams& p, bool slots_on_device,
                                                  const float* q_device, float* out_device,
                                                  size_t kernel_bytes) {
    const int staged_slots = slots_on_device ? 0 : p.n_slots;
    const int rope_positions = p.q_rope_positions != nullptr ? p.n_queries : 0;
    const CudaAttentionWorkspace w =
        LayoutCudaAttentionWorkspace(p.n_queries, p.q_heads, p.head_dim, staged_slots, rope_positions);
    KVTIER_RETURN_IF_ERROR(Reserve(w.total));
    KVTIER_RETURN_IF_ERROR(ReserveKernel(kernel_bytes));
    auto* ws = static_cast<uint8_t*>(ws_.ptr);
    const size_t q_bytes =
        q_device ? 0 : static_cast<size_t>(p.n_queries) * p.q_heads * p.head_dim * sizeof(float);
    // The workspace's layout up to `out` is what is staged: one copy of w.out bytes (the gaps
    // between the arrays travel too, unread).
    KVTIER_ASSIGN_OR_RETURN(uint8_t * staged, staging_.Take(w.out, "attention plan"));
    if (q_bytes) std::memcpy(staged + w.q, p.q, q_bytes);
    std::memcpy(staged + w.positions, p.q_positions, p.n_queries * sizeof(int64_t));
    if (staged_slots > 0) {
      std::memcpy(staged + w.slot_index, p.slot_index, staged_slots * sizeof(int32_t));
      std::memcpy(staged + w.slot_first, p.slot_first_position, staged_slots * sizeof(int64_t));
    }
    if (rope_positions > 0)
      std::memcpy(staged + w.q_rope_positions, p.q_rope_positions, rope_positions * sizeof(int64_t));
    cudaStream_t s = stream();
    // With device queries the copy starts at the positions (w.q == 0 precedes them).
    const size_t from = q_device ? w.positions : 0;
    const cudaError_t e = device_sync::CopyAsync(ws + from, staged + from, w.out - from,
                                                 cudaMemcpyHostToDevice, s, device_sync::HostMemory::kPinned);
    if (e != cudaSuccess) return Internal("attention (cuda): copying the plan in: " + CudaMessage(e));
    KVTIER_RETURN_IF_ERROR(staging_.Done(s));
    kernels::SlotAttentionParams d = p;
    d.q = q_device ? q_device : reinterpret_cast<const float*>(ws + w.q);
    d.q_positions = reinterpret_cast<const int64_t*>(ws + w.positions);
    if (staged_slots > 0) {
      d.slot_index = reinterpret_cast<const int32_t*>(ws + w.slot_index);
      d.slot_first_position = reinterpret_cast<const int64_t*>(ws + w.slot_first);
    }
    if (rope_positions > 0) d.q_rope_positions = reinterpret_cast<const int64_t*>(ws + w.q_rope_positions);
    d.out = out_device ? out_device : reinterpret_cast<float*>(ws + w.out);
    if (p.rope_inv_freq != nullptr) {
      KVTIER_ASSIGN_OR_RETURN(d.rope_inv_freq, DeviceInvFreq(p.rope_inv_freq, p.head_dim / 2));
    }
    return d;
  }

  // The device copy of `half` inverse frequencies: uploaded when they differ from the last
  // ones (a session passes the same table every step), on the tier's stream, so kernels
  // queued before still read the values they were launched with.
  Result<const double*> DeviceInvFreq(const double* host, int half) {
    const size_t bytes = static_cast<size_t>(half) * sizeof(double);
    if (rope_host_.size() == static_cast<size_t>(half) && std::memcmp(rope_host_.data(), host, bytes) == 0)
      return static_cast<const double*>(rope_.ptr);
    KVTIER_RETURN_IF_ERROR(Grow(&rope_, bytes, "rotation frequency table"));
    try {
      rope_host_.assign(host, host + half);
    } catch (const std::bad_alloc&) {
      return ResourceExhausted("attention (cuda): out of memory copying the rotation frequencies");
    }
    // Pageable: the runtime stages it before returning (counted once per new table).
    const cudaError_t e = device_sync::CopyAsync(rope_.ptr, rope_host_.data(), bytes, cudaMemcpyHostToDevice,
                                                 stream(), device_sync::HostMemory::kPageable);
    if (e != cudaSuccess) {
      rope_host_.clear();
      return Internal("attention (cuda): copying the rotation frequencies in: " + CudaMessage(e));
    }
    return static_cast<const double*>(rope_.ptr);
  }

  // One wait per host-output layer step: the output through a staging entry, then copied to `out`.
  Status CopyOutAndWait(const kernels::SlotAttentionParams& p, const float* out_dev, float* out) {
    const size_t q_bytes = static_cast<size_t>(p.n_queries) * p.q_heads * p.head_dim * sizeof(float);
    if (q_bytes == 0) return Status::Ok();
    KVTIER_ASSIGN_OR_RETURN(uint8_t * staged, staging_.Take(q_bytes, "attention output"));
    const cudaError_t e = device_sync::CopyAsync(staged, out_dev, q_bytes, cudaMemcpyDeviceToHost, stream(),
                                                 device_sync::HostMemory::kPinned);
    if (e != cudaSuccess) return Internal("attention (cuda): copying the output out: " + CudaMessage(e));
    KVTIER_RETURN_IF_ERROR(staging_.Done(stream()));
    KVTIER_RETURN_IF_ERROR(staging_.Wait());
    std::memcpy(out, staged, q_bytes);
    return Status::Ok();
  }

  // A device buffer that grows on demand to the largest step and is then reused. Earlier
  // steps' kernels may still read it: the tier's stream finishes them before it is replaced.
  struct DeviceBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  Status Grow(DeviceBuffer* b, size_t bytes, const char* what) {
    if (bytes <= b->bytes) return Status::Ok();
    if (b->ptr) {
      device_sync::SyncStream(stream());
      device_memory::Free(b->ptr);
      *b = DeviceBuffer{};
    }
    const cudaError_t e = device_memory::Malloc(&b->ptr, bytes, DeviceMemoryOwner::kAttention);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      b->ptr = nullptr;
      return ResourceExhausted("attention (cuda): cudaMalloc of a " + std::to_string(bytes) + "-byte " +
                               what + " failed (" + CudaMessage(e) + ")");
    }
    b->bytes = bytes;
    return Status::Ok();
  }

  CudaHotTier* hot_;
  DeviceBuffer ws_;         // the plan's arrays and the output (CopyPlanIn)
  DeviceBuffer side_;       // RunWithDenseMass: the slot half's output, both lse, the mass
  DeviceBuffer rope_;       // the rotation's inverse frequencies (DeviceInvFreq)
  DeviceBuffer kernel_ws_;  // LaunchSlotAttention's workspace: its arrival counters first, kept zero
  PinnedStaging staging_{16, "attention (cuda)"};  // the host side of every copy in and out
  std::vector<double> rope_host_;                  // what rope_ holds (empty: nothing uploaded)
};

#endif  // KVTIER_HAVE_CUDA

}  // namespace

Result<std::unique_ptr<AttentionBackend>> MakeAttentionBackend(HotTier* hot, const Geometry& geometry,
                                                               int max_queries) {
  if (hot == nullptr) return InvalidArgument("attention backend: no hot tier");
  const Device device = hot->device();
  if (device == Device::kCpu) return std::unique_ptr<AttentionBackend>(new CpuAttentionBackend());
  if (device == Device::kCuda) {
#if KVTIER_HAVE_CUDA
    auto* cuda = dynamic_cast<CudaHotTier*>(hot);
    if (cuda == nullptr)
      return Unavailable(
          "attention backend: a \"cuda\" hot tier that is not kvtier's CudaHotTier (its stream and "
          "memory are unknown to the attention backend)");
    if (!kernels::cuda::SlotAttentionHeadDimSupported(geometry.head_dim))
      return CudaHeadDimError("attention backend (cuda)", geometry.head_dim);
    auto backend = std::make_unique<CudaAttentionBackend>(cuda);
    // Sized now for the largest step announced, with every slot of the pool attended.
    const int m = std::max(1, max_queries);
    const CudaAttentionWorkspace w =
        LayoutCudaAttentionWorkspace(m, geometry.q_heads, geometry.head_dim, hot->slot_capacity(), m);
    KVTIER_RETURN_IF_ERROR(backend->Reserve(w.total));
    KVTIER_RETURN_IF_ERROR(
        backend->ReserveKernel(MaxSlotAttentionKernelBytes(m, geometry.q_heads, geometry.head_dim)));
    return std::unique_ptr<AttentionBackend>(std::move(backend));
#else
    (void)geometry;
    (void)max_queries;
    return Unavailable(
        "attention backend: the hot tier is on \"cuda\" and this build has no CUDA (KVTIER_CUDA=off)");
#endif
  }
  return Unavailable(std::string("attention backend: no backend for hot tier device \"") +
                     DeviceName(device) + "\"");
}

}  // namespace kvtier
