#include "integration/model/llama_device.h"

#include <cstring>
#include <string>

#include "kernels/cpu/rope.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "offload/cuda_hot_tier.h"
#include "offload/device_sync_cuda.h"
#endif

namespace kvtier::model {
namespace {

size_t AlignUp(size_t n) { return (n + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment; }

// Appends a tensor of `bytes` at the next aligned offset.
DeviceTensor Place(size_t* cursor, size_t bytes) {
  DeviceTensor t;
  t.offset = AlignUp(*cursor);
  t.bytes = bytes;
  *cursor = t.offset + bytes;
  return t;
}

size_t F32(int64_t elements) { return static_cast<size_t>(elements) * sizeof(float); }

}  // namespace

DeviceWeightLayout PlanDeviceWeights(const LlamaConfig& c) {
  const int64_t d = c.d_model, hd = c.head_dim(), qd = c.q_heads * hd, kvd = c.kv_heads * hd,
                f = c.ffn_hidden;
  DeviceWeightLayout w;
  size_t at = 0;
  w.embed = Place(&at, F32(int64_t{c.vocab} * d));
  w.final_norm = Place(&at, F32(d));
  w.lm_head = Place(&at, F32(int64_t{c.vocab} * d));
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (DeviceWeightLayout::Layer& L : w.layers) {
    L.attn_norm = Place(&at, F32(d));
    L.wq = Place(&at, F32(qd * d));
    L.wk = Place(&at, F32(kvd * d));
    L.wv = Place(&at, F32(kvd * d));
    L.wo = Place(&at, F32(d * qd));
    L.mlp_norm = Place(&at, F32(d));
    L.w_gate = Place(&at, F32(f * d));
    L.w_up = Place(&at, F32(f * d));
    L.w_down = Place(&at, F32(d * f));
  }
  w.inv_freq = Place(&at, static_cast<size_t>(hd / 2) * sizeof(double));
  w.total = AlignUp(at);
  return w;
}

Result<std::vector<uint8_t>> PackDeviceWeights(const LlamaModel& model, const DeviceWeightLayout& layout,
                                               const std::vector<double>& inv_freq) {
  const LlamaConfig& c = model.config();
  if (inv_freq.size() != static_cast<size_t>(c.head_dim() / 2))
    return InvalidArgument("PackDeviceWeights: inv_freq holds " + std::to_string(inv_freq.size()) +
                           " values, the model's head_dim / 2 is " + std::to_string(c.head_dim() / 2));
  if (layout.layers.size() != model.layers().size())
    return InvalidArgument("PackDeviceWeights: the layout has " + std::to_string(layout.layers.size()) +
                           " layers, the model " + std::to_string(model.layers().size()));
  std::vector<uint8_t> image(layout.total, 0);
  Status bad;
  auto put = [&](const DeviceTensor& t, const void* src, size_t bytes, const char* name) {
    if (!bad.ok()) return;
    if (bytes != t.bytes || t.offset + t.bytes > image.size()) {
      bad = InvalidArgument(std::string("PackDeviceWeights: tensor '") + name + "' has " +
                            std::to_string(bytes) + " bytes, the layout places " + std::to_string(t.bytes) +
                            " at offset " + std::to_string(t.offset) + " of " + std::to_string(image.size()));
      return;
    }
    if (bytes) std::memcpy(image.data() + t.offset, src, bytes);
  };
  auto put_f = [&](const DeviceTensor& t, const std::vector<float>& v, const char* name) {
    put(t, v.data(), v.size() * sizeof(float), name);
  };
  put_f(layout.embed, model.embed(), "embed");
  put_f(layout.final_norm, model.final_norm(), "final_norm");
  put_f(layout.lm_head, model.lm_head(), "lm_head");
  for (size_t l = 0; l < model.layers().size(); ++l) {
    const LlamaLayer& L = model.layers()[l];
    const DeviceWeightLayout::Layer& P = layout.layers[l];
    put_f(P.attn_norm, L.attn_norm, "attn_norm");
    put_f(P.wq, L.wq, "wq");
    put_f(P.wk, L.wk, "wk");
    put_f(P.wv, L.wv, "wv");
    put_f(P.wo, L.wo, "wo");
    put_f(P.mlp_norm, L.mlp_norm, "mlp_norm");
    put_f(P.w_gate, L.w_gate, "w_gate");
    put_f(P.w_up, L.w_up, "w_up");
    put_f(P.w_down, L.w_down, "w_down");
  }
  put(layout.inv_freq, inv_freq.data(), inv_freq.size() * sizeof(double), "inv_freq");
  if (!bad.ok()) return bad;
  return image;
}

Result<DeviceActivationLayout> PlanDeviceActivations(const LlamaConfig& c, int max_tokens, DType kv_dtype) {
  if (Status st = c.Validate(); !st.ok()) return InvalidArgument("device forward: " + st.message());
  if (max_tokens < 1)
    return InvalidArgument("device forward: max_tokens must be >= 1 (got " + std::to_string(max_tokens) +
                           ")");
  if (kv_dtype != DType::kF32 && kv_dtype != DType::kF16 && kv_dtype != DType::kBF16)
    return InvalidArgument("device forward: the KV dtype must be f32, f16 or bf16 (got " +
                           std::to_string(static_cast<int>(kv_dtype)) + ")");
  const int64_t m = max_tokens, d = c.d_model, hd = c.head_dim(), qd = c.q_heads * hd, kvd = c.kv_heads * hd,
                f = c.ffn_hidden;
  DeviceActivationLayout a;
  a.max_tokens = max_tokens;
  a.kv_dtype = kv_dtype;
  size_t at = 0;
  a.tokens = Place(&at, static_cast<size_t>(m) * sizeof(int32_t));
  a.positions = Place(&at, static_cast<size_t>(m) * sizeof(int64_t));
  a.x = Place(&at, F32(m * d));
  a.h = Place(&at, F32(m * d));
  a.q = Place(&at, F32(m * qd));
  a.k = Place(&at, F32(m * kvd));
  a.v = Place(&at, F32(m * kvd));
  a.att = Place(&at, F32(m * qd));
  a.gate = Place(&at, F32(m * f));
  a.up = Place(&at, F32(m * f));
  // f32 K/V are appended from k and v directly: no conversion buffers.
  const size_t kv_store = kv_dtype == DType::kF32 ? 0 : static_cast<size_t>(m * kvd) * DTypeSize(kv_dtype);
  a.k_store = Place(&at, kv_store);
  a.v_store = Place(&at, kv_store);
  a.logits = Place(&at, F32(m * c.vocab));
  a.total = AlignUp(at);
  return a;
}

#if !KVTIER_HAVE_CUDA

Result<std::unique_ptr<LlamaDeviceForward>> LlamaDeviceForward::Create(const LlamaModel*, HotTier*, int,
                                                                       DType, PositionMode,
                                                                       const std::vector<double>&) {
  return Unavailable(
      "device forward: no CUDA device: this build has no CUDA (KVTIER_CUDA=off or nvcc not found)");
}
LlamaDeviceForward::~LlamaDeviceForward() = default;
Status LlamaDeviceForward::Forward(Session*, const int32_t*, const int64_t*, int, bool, float*,
                                   const LlamaSession::QkvCapture&) {
  return Unavailable("device forward: no CUDA device: this build has no CUDA");
}

#else  // KVTIER_HAVE_CUDA

namespace {

namespace kc = kernels::cuda;

std::string CudaMessage(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// A launcher's KernelError as a Status naming the layer (-1: outside the layers) and the step.
Status Launched(kernels::KernelError e, int layer, const char* step, bool blas = false) {
  if (e == kernels::KernelError::kOk) return Status::Ok();
  const std::string where = layer >= 0 ? "layer " + std::to_string(layer) + ": " : std::string();
  const std::string detail =
      e == kernels::KernelError::kDeviceError
          ? std::string(" (") + (blas ? kc::LastBlasStatusString() : kc::LastCudaErrorString()) + ")"
          : std::string();
  return Internal("device forward: " + where + step + ": " + kernels::KernelErrorString(e) + detail);
}

Status Cuda(cudaError_t e, int layer, const char* step) {
  if (e == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();
  const std::string where = layer >= 0 ? "layer " + std::to_string(layer) + ": " : std::string();
  return Internal("device forward: " + where + step + ": " + CudaMessage(e));
}

}  // namespace

Result<std::unique_ptr<LlamaDeviceForward>> LlamaDeviceForward::Create(const LlamaModel* model, HotTier* hot,
                                                                       int max_tokens, DType kv_dtype,
                                                                       PositionMode positions,
                                                                       const std::vector<double>& inv_freq) {
  if (model == nullptr) return InvalidArgument("device forward: model is null");
  if (positions != PositionMode::kAbsolute && positions != PositionMode::kInfLLM)
    return InvalidArgument(std::string("device forward: unknown position mode ") +
                           std::to_string(static_cast<int>(positions)));
  auto* tier = dynamic_cast<CudaHotTier*>(hot);
  if (tier == nullptr)
    return Unavailable(
        "device forward: no CUDA device: the store's hot tier is not kvtier's CudaHotTier (its "
        "stream and device memory are what the forward runs on)");
  const LlamaConfig& c = model->config();
  KVTIER_ASSIGN_OR_RETURN(DeviceActivationLayout acts, PlanDeviceActivations(c, max_tokens, kv_dtype));
  DeviceWeightLayout weights = PlanDeviceWeights(c);
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> image, PackDeviceWeights(*model, weights, inv_freq));

  auto f = std::unique_ptr<LlamaDeviceForward>(new LlamaDeviceForward(model, std::move(weights), acts));
  f->stream_ = tier->stream();
  f->infllm_ = positions == PositionMode::kInfLLM;
  f->inv_freq_ = inv_freq;
  cudaStream_t s = static_cast<cudaStream_t>(f->stream_);
  auto alloc = [](size_t bytes, void** p, const char* what) -> Status {
    const cudaError_t e = device_memory::Malloc(p, bytes, DeviceMemoryOwner::kModelForward);
    if (e == cudaSuccess) return Status::Ok();
    (void)cudaGetLastError();
    *p = nullptr;
    return ResourceExhausted(std::string("device forward: cudaMalloc of ") + std::to_string(bytes) +
                             " bytes for " + what + " failed (" + CudaMessage(e) + ")");
  };
  KVTIER_RETURN_IF_ERROR(alloc(f->weights_.total, reinterpret_cast<void**>(&f->weight_mem_), "the weights"));
  KVTIER_RETURN_IF_ERROR(alloc(f->acts_.total, reinterpret_cast<void**>(&f->act_mem_), "the activations"));
  KVTIER_RETURN_IF_ERROR(alloc(kc::GemmWorkspaceBytes(), &f->blas_workspace_, "the cuBLAS workspace"));
  KVTIER_RETURN_IF_ERROR(Launched(kc::CreateBlasHandle(&f->blas_), -1, "cuBLAS handle", /*blas=*/true));
  // One upload of the packed image; synchronised because `image` is freed on return.
  KVTIER_RETURN_IF_ERROR(
      Cuda(device_sync::CopyAsync(f->weight_mem_, image.data(), image.size(), cudaMemcpyHostToDevice, s,
                                  device_sync::HostMemory::kPageable),
           -1, "weights up"));
  KVTIER_RETURN_IF_ERROR(Cuda(device_sync::SyncStream(s), -1, "weights up"));
  const int hd = c.head_dim();
  const size_t rows = static_cast<size_t>(max_tokens);
  f->q_host_.resize(rows * c.q_heads * hd);
  return f;
}

LlamaDeviceForward::~LlamaDeviceForward() {
  // Work on the stream may still read these buffers: finish it before freeing (cudaFree would
  // synchronise the device anyway; this says why).
  if (stream_) device_sync::SyncStream(static_cast<cudaStream_t>(stream_));
  kc::DestroyBlasHandle(blas_);
  if (blas_workspace_) device_memory::Free(blas_workspace_);
  if (act_mem_) device_memory::Free(act_mem_);
  if (weight_mem_) device_memory::Free(weight_mem_);
}

// Ordering: every launch and copy below is on the hot tier's stream, the stream the tier's
// Upload/Download and the cuda attention backend use, so stream order alone sequences the
// device work; the session's device calls take the stream too. The host reads device results
// at two points, each preceded by a synchronisation of that stream: the capture's q/k/v and
// the logits at the end (the session downloads q for its retrieval itself). Host -> device
// copies from pageable memory (tokens, positions) return once the source has been staged, so
// the host buffers may be reused right after.
Status LlamaDeviceForward::Forward(Session* session, const int32_t* tokens, const int64_t* positions, int m,
                                   bool decode, float* logits, const LlamaSession::QkvCapture& capture) {
  if (session == nullptr) return InvalidArgument("device forward: session is null");
  if (m < 1 || m > acts_.max_tokens)
    return InvalidArgument("device forward: a window of " + std::to_string(m) +
                           " tokens; this session's device " + "buffers hold 1.." +
                           std::to_string(acts_.max_tokens));
  if (tokens == nullptr || positions == nullptr || logits == nullptr)
    return InvalidArgument("device forward: tokens, positions and logits must not be null");
  const LlamaConfig& c = model_->config();
  const int d = c.d_model, hd = c.head_dim(), qd = c.q_heads * hd, kvd = c.kv_heads * hd, f = c.ffn_hidden;
  const DType dtype = acts_.kv_dtype;
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  auto W = [&](const DeviceTensor& t) { return reinterpret_cast<const float*>(weight_mem_ + t.offset); };
  auto A = [&](const DeviceTensor& t) { return reinterpret_cast<float*>(act_mem_ + t.offset); };
  int32_t* d_tokens = reinterpret_cast<int32_t*>(act_mem_ + acts_.tokens.offset);
  int64_t* d_positions = reinterpret_cast<int64_t*>(act_mem_ + acts_.positions.offset);
  float *x = A(acts_.x), *h = A(acts_.h), *q = A(acts_.q), *k = A(acts_.k), *v = A(acts_.v),
        *att = A(acts_.att);
  float *gate = A(acts_.gate), *up = A(acts_.up), *d_logits = A(acts_.logits);
  const size_t md = static_cast<size_t>(m);

  // The caller's host arrays, and below the captures' vectors: pageable.
  constexpr device_sync::HostMemory kPageable = device_sync::HostMemory::kPageable;
  KVTIER_RETURN_IF_ERROR(Cuda(
      device_sync::CopyAsync(d_tokens, tokens, md * sizeof(int32_t), cudaMemcpyHostToDevice, s, kPageable),
      -1, "tokens up"));
  KVTIER_RETURN_IF_ERROR(Cuda(device_sync::CopyAsync(d_positions, positions, md * sizeof(int64_t),
                                                     cudaMemcpyHostToDevice, s, kPageable),
                              -1, "positions up"));
  {
    kernels::EmbeddingParams p;
    p.m = m;
    p.d = d;
    p.vocab = c.vocab;
    p.tokens = d_tokens;
    p.table = W(weights_.embed);
    p.out = x;
    KVTIER_RETURN_IF_ERROR(Launched(kc::LaunchEmbedding(p, s), -1, "Embedding"));
  }
  KVTIER_RETURN_IF_ERROR(session->BeginStep(decode ? StepKind::kDecode : StepKind::kPrefill));

  auto gemm = [&](const float* in, int k_in, const float* w, int out, float* y, bool accumulate, int layer,
                  const char* step) {
    kernels::GemmParams p;
    p.m = m;
    p.k = k_in;
    p.n_out = out;
    p.x = in;
    p.w = w;
    p.y = y;
    p.accumulate = accumulate;
    return Launched(kc::LaunchGemm(p, blas_, blas_workspace_, kc::GemmWorkspaceBytes(), s), layer, step,
                    /*blas=*/true);
  };
  auto rms = [&](const float* in, const float* w, float* out, int layer, const char* step) {
    kernels::RmsNormParams p;
    p.m = m;
    p.d = d;
    p.eps = c.norm_eps;
    p.x = in;
    p.w = w;
    p.out = out;
    return Launched(kc::LaunchRmsNorm(p, s), layer, step);
  };
  auto rope = [&](float* io, int heads, int layer, const char* step) {
    kc::RopeParams p;
    p.m = m;
    p.heads = heads;
    p.head_dim = hd;
    p.x = io;
    p.positions = d_positions;
    p.inv_freq = reinterpret_cast<const double*>(weight_mem_ + weights_.inv_freq.offset);
    return Launched(kc::LaunchRope(p, s), layer, step);
  };
  auto convert = [&](const float* src, DeviceTensor dst, int layer, const char* step) {
    kernels::ConvertToStoreParams p;
    p.n = md * kvd;
    p.dtype = dtype;
    p.src = src;
    p.dst = act_mem_ + dst.offset;
    return Launched(kc::LaunchConvertToStore(p, s), layer, step);
  };
  auto down = [&](float* host, const float* dev, size_t n, int layer, const char* step) {
    Status st =
        Cuda(device_sync::CopyAsync(host, dev, n * sizeof(float), cudaMemcpyDeviceToHost, s, kPageable),
             layer, step);
    if (st.ok()) st = Cuda(device_sync::SyncStream(s), layer, step);
    return st;
  };

  for (int l = 0; l < c.n_layers; ++l) {
    const DeviceWeightLayout::Layer& L = weights_.layers[static_cast<size_t>(l)];
    KVTIER_RETURN_IF_ERROR(rms(x, W(L.attn_norm), h, l, "RmsNorm attn_norm"));
    KVTIER_RETURN_IF_ERROR(gemm(h, d, W(L.wq), qd, q, false, l, "Gemm wq"));
    KVTIER_RETURN_IF_ERROR(gemm(h, d, W(L.wk), kvd, k, false, l, "Gemm wk"));
    KVTIER_RETURN_IF_ERROR(gemm(h, d, W(L.wv), kvd, v, false, l, "Gemm wv"));
    // kAbsolute: the forward applies RoPE; kInfLLM: the session's attention kernel does, and the
    // store keeps keys before RoPE.
    if (!infllm_) {
      KVTIER_RETURN_IF_ERROR(rope(q, c.q_heads, l, "Rope q"));
      KVTIER_RETURN_IF_ERROR(rope(k, c.kv_heads, l, "Rope k"));
    }
    const void* k_append = k;
    const void* v_append = v;
    if (dtype != DType::kF32) {  // f32 K/V are stored as they are (FromFloat's f32 case is a copy)
      KVTIER_RETURN_IF_ERROR(convert(k, acts_.k_store, l, "ConvertToStore k"));
      KVTIER_RETURN_IF_ERROR(convert(v, acts_.v_store, l, "ConvertToStore v"));
      k_append = act_mem_ + acts_.k_store.offset;
      v_append = act_mem_ + acts_.v_store.offset;
    }
    // The session reads q and the window's K/V where they are and writes the attention output
    // into `att`, all ordered on this stream (Session::AppendDevice / AttendDevice); it brings q
    // down once itself for the host's retrieval.
    if (capture) {
      q_host_.resize(md * qd);
      KVTIER_RETURN_IF_ERROR(down(q_host_.data(), q, md * qd, l, "q down (capture)"));
    }
    if (capture) {
      k_host_.resize(md * kvd);
      v_host_.resize(md * kvd);
      KVTIER_RETURN_IF_ERROR(down(k_host_.data(), k, md * kvd, l, "k down (capture)"));
      KVTIER_RETURN_IF_ERROR(down(v_host_.data(), v, md * kvd, l, "v down (capture)"));
      if (infllm_) {
        // The capture sees queries and keys at their true positions in both modes (as the
        // host forward's): rotated copies, the stream's work on them done by the downs above.
        capture_q_.assign(q_host_.begin(), q_host_.begin() + static_cast<ptrdiff_t>(md * qd));
        kernels::Rope(capture_q_.data(), m, c.q_heads, hd, positions, inv_freq_.data());
        kernels::Rope(k_host_.data(), m, c.kv_heads, hd, positions, inv_freq_.data());
        capture(l, positions[0], m, capture_q_.data(), k_host_.data(), v_host_.data());
      } else {
        capture(l, positions[0], m, q_host_.data(), k_host_.data(), v_host_.data());
      }
    }
    // The window's K/V go into the store first, so its queries find them in the local window.
    Status st = session->AppendDevice(l, k_append, v_append, m, dtype, s);
    if (!st.ok())
      return Status(st.code(), "device forward: layer " + std::to_string(l) + ": Append: " + st.message());
    st = session->AttendDevice(l, q, positions, m, att, s);
    if (!st.ok()) return Status(st.code(), "layer " + std::to_string(l) + ": " + st.message());

    KVTIER_RETURN_IF_ERROR(gemm(att, qd, W(L.wo), d, x, true, l, "Gemm wo"));
    KVTIER_RETURN_IF_ERROR(rms(x, W(L.mlp_norm), h, l, "RmsNorm mlp_norm"));
    KVTIER_RETURN_IF_ERROR(gemm(h, d, W(L.w_gate), f, gate, false, l, "Gemm w_gate"));
    KVTIER_RETURN_IF_ERROR(gemm(h, d, W(L.w_up), f, up, false, l, "Gemm w_up"));
    kernels::SwiGluParams sg;  // gate = SiLU(gate) * up
    sg.n = md * f;
    sg.gate = gate;
    sg.up = up;
    KVTIER_RETURN_IF_ERROR(Launched(kc::LaunchSwiGlu(sg, s), l, "SwiGlu"));
    KVTIER_RETURN_IF_ERROR(gemm(gate, f, W(L.w_down), d, x, true, l, "Gemm w_down"));
  }
  KVTIER_RETURN_IF_ERROR(rms(x, W(weights_.final_norm), h, -1, "RmsNorm final_norm"));
  KVTIER_RETURN_IF_ERROR(gemm(h, d, W(weights_.lm_head), c.vocab, d_logits, false, -1, "Gemm lm_head"));
  return down(logits, d_logits, md * c.vocab, -1, "logits down");
}

#endif  // KVTIER_HAVE_CUDA

}  // namespace kvtier::model
