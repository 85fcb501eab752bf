// The kvtier-llama forward on the GPU: what LlamaSession runs when its store's hot
// tier is "cuda" (`kvtier infinite --device cuda`).
//
// Per window of m tokens (Prefill) or one token (Decode), on the hot tier's CUDA stream:
//   token ids and positions up -> Embedding -> per layer: RmsNorm, Q/K/V GEMMs, RoPE at the
//   absolute positions, K/V converted to the store dtype ON THE DEVICE (LaunchConvertToStore,
//   whose twin is kvtier::FromFloat) and appended with Session::AppendDevice (the K/V never
//   visit the host), Session::AttendDevice reading q and writing the attention output on the
//   device (it brings q down for its retrieval itself), Wo GEMM with the
//   residual, RmsNorm, gate/up GEMMs, SwiGLU, down GEMM with the residual -> final RmsNorm,
//   lm_head -> logits down.
// Every step is a launcher of kernels/cuda/kernels.h whose CPU twin is what the CPU forward
// (llama.cc) runs, so the two forwards compute the same function; they differ by summation
// order (cuBLAS vs the twin's 8 accumulators, the device attention's split-K), i.e. by fp32
// rounding, not bit for bit.
//
// Memory: the weights live in ONE device allocation (fp32, every tensor 256-byte aligned,
// laid out by PlanDeviceWeights and packed on the host by PackDeviceWeights so that the upload
// is a single copy); the activations of the largest window in another (PlanDeviceActivations).
// One cuBLAS handle and its 32 MiB workspace per session. All are freed with the session.
//
// Positions: absolute (the forward rotates q and k with RoPE before Append and Attend) or
// InfLLM (q and k go out unrotated: the store keeps keys before RoPE and the Session's attention
// kernel rotates them where memory puts them, on the device).
//
// The host-side planning (layouts, packing, argument checks) is tested on CPU in
// tests/integration/model_test.cc; the comparison with the CPU forward (DeviceForwardMatchesCpuForward)
// runs on a GPU or the emulated device and skips without either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "integration/model/llama.h"
#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"
#include "kvtier/session.h"
#include "offload/hot_tier.h"
#include "offload/tiered_store.h"
#include "store/status.h"

namespace kvtier::model {

/// A tensor's place in a device allocation.
struct DeviceTensor {
  size_t offset = 0;  ///< bytes from the allocation's base, a multiple of kDeviceAlignment
  size_t bytes = 0;
};

/// Alignment of every tensor in the device allocations (cudaMalloc's own alignment, and what
/// cuBLAS and the vectorised kernels want).
inline constexpr size_t kDeviceAlignment = 256;

/// The weight allocation: fp32 tensors of the model in file order, then RoPE's inverse
/// frequencies (fp64, [head_dim / 2], what LaunchRope reads).
struct DeviceWeightLayout {
  struct Layer {
    DeviceTensor attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down;
  };
  DeviceTensor embed, final_norm, lm_head;
  std::vector<Layer> layers;
  DeviceTensor inv_freq;
  size_t total = 0;  ///< bytes of the allocation
};
/// Needs a valid config (LlamaConfig::Validate).
DeviceWeightLayout PlanDeviceWeights(const LlamaConfig& c);
/// The host image of the weight allocation: each tensor at its offset, the padding zero.
/// `inv_freq` must hold head_dim / 2 values (InvalidArgument otherwise).
Result<std::vector<uint8_t>> PackDeviceWeights(const LlamaModel& model, const DeviceWeightLayout& layout,
                                               const std::vector<double>& inv_freq);

/// The activation allocation for windows of up to max_tokens tokens: token ids (int32),
/// positions (int64), x (the residual stream), h (normed), q, k, v, att (attention output),
/// gate, up (fp32), k_store and v_store (K/V in the store dtype; with f32 they are unused and 0
/// bytes: k and v are appended as they are), logits (fp32).
struct DeviceActivationLayout {
  int max_tokens = 0;
  DType kv_dtype = DType::kF32;
  DeviceTensor tokens, positions, x, h, q, k, v, att, gate, up, k_store, v_store, logits;
  size_t total = 0;
};
/// InvalidArgument for max_tokens < 1, a dtype other than f32/f16/bf16 or an invalid config.
Result<DeviceActivationLayout> PlanDeviceActivations(const LlamaConfig& c, int max_tokens, DType kv_dtype);

/// One session's device forward: its weights, activations, cuBLAS handle and workspace, on the
/// hot tier's stream.
class LlamaDeviceForward {
 public:
  /// Uploads the model's weights to the device of `hot` (a CudaHotTier: its stream orders every
  /// launch after the tier's own copies) for windows of up to max_tokens tokens. Unavailable
  /// "no CUDA device: ..." in a build without CUDA or when the tier is not kvtier's CudaHotTier;
  /// InvalidArgument for bad sizes or positions other than kAbsolute; ResourceExhausted when
  /// device memory runs out. `inv_freq` is RopeInvFreq(head_dim, rope_theta).
  static Result<std::unique_ptr<LlamaDeviceForward>> Create(const LlamaModel* model, HotTier* hot,
                                                            int max_tokens, DType kv_dtype,
                                                            PositionMode positions,
                                                            const std::vector<double>& inv_freq);
  ~LlamaDeviceForward();
  LlamaDeviceForward(const LlamaDeviceForward&) = delete;
  LlamaDeviceForward& operator=(const LlamaDeviceForward&) = delete;

  /// Runs tokens (checked against the vocabulary by the caller) at `positions` through the
  /// model, appending each layer's K/V to `session` and attending through it, in one step
  /// (BeginStep(kDecode or kPrefill) first); writes logits [m, vocab] fp32 to host memory.
  /// `capture`, when set, gets q, k, v of each layer downloaded to the host (fp32, after RoPE).
  /// Errors name the layer and the step ("device forward: layer 2: Gemm wq: ...").
  Status Forward(Session* session, const int32_t* tokens, const int64_t* positions, int m, bool decode,
                 float* logits, const LlamaSession::QkvCapture& capture);

  const DeviceWeightLayout& weights() const { return weights_; }
  const DeviceActivationLayout& activations() const { return acts_; }

 private:
  LlamaDeviceForward(const LlamaModel* model, DeviceWeightLayout weights, DeviceActivationLayout acts)
      : model_(model), weights_(std::move(weights)), acts_(acts) {}

  const LlamaModel* model_;
  DeviceWeightLayout weights_;
  DeviceActivationLayout acts_;
  void* stream_ = nullptr;                       // the hot tier's cudaStream_t (not owned)
  uint8_t* weight_mem_ = nullptr;                // device: weights_.total bytes
  uint8_t* act_mem_ = nullptr;                   // device: acts_.total bytes
  void* blas_ = nullptr;                         // cublasHandle_t
  void* blas_workspace_ = nullptr;               // device: kernels::cuda::GemmWorkspaceBytes()
  std::vector<float> q_host_, k_host_, v_host_;  // per window: the capture's copies
  bool infllm_ = false;                          // keys and queries leave unrotated
  std::vector<double> inv_freq_;                 // host copy: the capture's rotations
  std::vector<float> capture_q_;                 // kInfLLM capture: q at its true positions
};

}  // namespace kvtier::model
