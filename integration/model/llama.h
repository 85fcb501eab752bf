// A small Llama-style decoder ("kvtier-llama") run in fp32 on the CPU, or on the GPU when
// its store's hot tier is "cuda" (llama_device.h), whose KV memory is a
// kvtier TieredStore. models/README.md fixes the architecture and
// the weight format; models/model.py is the reference implementation the
// forward pass here must reproduce.
//
//   KVTIER_ASSIGN_OR_RETURN(auto model, LlamaModel::Load("tiny.safetensors"));
//   KVTIER_ASSIGN_OR_RETURN(auto session, LlamaSession::Create(model.get(), store_options));
//   KVTIER_ASSIGN_OR_RETURN(std::vector<float> logits, session->Prefill(tokens, /*window=*/64));
//   KVTIER_ASSIGN_OR_RETURN(std::vector<float> next, session->Decode(token));
//
// Each window of tokens goes through the layers one by one: its keys (after
// RoPE, in the default kAbsolute mode) and values are appended to the store first, then its queries attend
// over the store's sinks, the sealed chunks a ChunkSelector picks (fetched
// with FetchChunks) and the local window, which holds the window's own keys
// (the kernel's causal mask uses positions). With the default selector every
// live sealed chunk is fetched: full attention through the store.
//
// Retrieval: EnableRetrieval puts a kvtier Retriever in place of the selector
// (per layer and step, the window's or decode token's queries build the probe
// and Select picks chunks under the budget; prefill windows also feed the
// store's representative-key statistics through ObserveQueries).
//
// Positions (PositionMode):
//  * kAbsolute (default): keys are stored after RoPE at their absolute
//    positions; with every chunk attended this is exactly the reference model.
//  * kInfLLM: the store holds keys BEFORE RoPE, and positions are applied at
//    attention time on copies (InfLLM, Xiao et al. 2024). With L0 = the first
//    position of the local window (the store's local ring after this step's
//    append) the attended keys are rotated at:
//      - local-window keys (positions >= L0): their true positions;
//      - retrieved chunks: all at L0 (memory units share one position, the
//        local window's start, i.e. a query at p sees memory at distance p - L0);
//      - sinks: at L0 as well once chunks separate them from the local window
//        (a gap: sinks.end < L0); while sinks and local window are contiguous
//        (nothing sealed yet: the whole sequence is sinks + local) they keep
//        their true positions, so short sequences equal kAbsolute exactly.
//    Queries always keep their true positions. The causal mask uses true
//    positions in both modes (memory is always in the past). Retrieval scores,
//    the probe and the representative statistics see the queries rotated by
//    (p - L0), so q.k_stored is the score a key gets as a memory unit.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/session_internal.h"
#include "integration/model/safetensors.h"
#include "kvtier/session.h"
#include "offload/tiered_store.h"
#include "retrieval/retriever.h"
#include "store/status.h"

namespace kvtier::model {

struct LlamaConfig {
  int vocab = 256;
  int d_model = 0;
  int n_layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int ffn_hidden = 0;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;

  int head_dim() const { return q_heads > 0 ? d_model / q_heads : 0; }
  /// Sizes positive, d_model % q_heads == 0, q_heads % kv_heads == 0, head_dim even, theta/eps > 0.
  Status Validate() const;
  /// From safetensors __metadata__ (model=kvtier-llama and the keys above, as strings); validates.
  static Result<LlamaConfig> FromMetadata(const std::map<std::string, std::string>& meta,
                                          const std::string& path);
  /// The KV geometry of this model with the given storage dtype.
  Geometry KvGeometry(DType dtype) const;
};

/// fp32 weights of one block, row-major [out, in].
struct LlamaLayer {
  std::vector<float> attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down;
};

class LlamaModel {
 public:
  /// Reads a kvtier-llama safetensors file (F32, F16 or BF16 tensors; converted
  /// to fp32). Every expected tensor must be present with its exact shape.
  static Result<std::unique_ptr<LlamaModel>> Load(const std::string& path);
  /// Same, from an already parsed file.
  static Result<std::unique_ptr<LlamaModel>> FromSafeTensors(const SafeTensors& st);

  const LlamaConfig& config() const { return config_; }
  const std::vector<float>& embed() const { return embed_; }
  const std::vector<LlamaLayer>& layers() const { return layers_; }
  const std::vector<float>& final_norm() const { return final_norm_; }
  const std::vector<float>& lm_head() const { return lm_head_; }

 private:
  LlamaConfig config_;
  std::vector<float> embed_, final_norm_, lm_head_;
  std::vector<LlamaLayer> layers_;
};

// Positions are the engine API's (include/kvtier/session.h), chunk selection the session's
// internal one (engine/session_internal.h): the forward pass is a kvtier::Session client.
using kvtier::ChunkSelector;
using kvtier::ParsePositionMode;
using kvtier::PositionMode;
using kvtier::PositionModeName;
using kvtier::SelectAllChunks;

class LlamaDeviceForward;  // integration/model/llama_device.h

/// One sequence decoded by a model over its own TieredStore.
class LlamaSession {
 public:
  /// Opens a store with `options`, its geometry replaced by the model's (keeping
  /// options.geometry.dtype: f32, f16 or bf16), and creates the sequence. Prefill
  /// windows must not exceed options.n_local, so a window's keys are still hot
  /// when its queries attend. The model must outlive the session.
  /// With options.device kCuda the forward runs on the GPU (llama_device.h: weights
  /// uploaded here, once per session), which needs kAbsolute positions;
  /// without a device, opening the store already answers Unavailable "no CUDA device".
  static Result<std::unique_ptr<LlamaSession>> Create(const LlamaModel* model, StoreOptions options,
                                                      PositionMode positions = PositionMode::kAbsolute);
  ~LlamaSession();

  /// Replaces the chunk selector (and turns retrieval off).
  Status SetChunkSelector(ChunkSelector selector);
  /// Selects chunks with a Retriever over this session's store from now on. Must
  /// come before the first token (the probe statistics run over every window);
  /// bad options are InvalidArgument naming them.
  Status EnableRetrieval(const RetrieverOptions& options);
  /// Keeps each layer's n most recent queries for session()->Compress (before the first token).
  Status KeepQueries(int n);
  Retriever* retriever() { return ImplOf(*session_).retriever(); }
  PositionMode position_mode() const { return session_->options().positions; }
  /// The engine-API session the forward pass drives (counters, Compress; ImplOf for Gather).
  Session* session() { return session_.get(); }
  /// Whether the forward runs on the GPU (the store's hot tier is "cuda").
  bool on_device() const { return device_ != nullptr; }

  /// Sees every layer's q, k and v of each step, right after they are computed and before
  /// anything is stored: q [m, q_heads, head_dim] and k [m, kv_heads, head_dim] after RoPE
  /// at the tokens' true positions first_position.. (in kInfLLM mode k is a rotated copy;
  /// the store still gets keys before RoPE), v [m, kv_heads, head_dim]; fp32, valid during
  /// the call. For recording real attention (`kvtier trace`); unset, it costs nothing, and
  /// set or not the forward pass computes the same bits.
  using QkvCapture = std::function<void(int layer, int64_t first_position, int m, const float* q,
                                        const float* k, const float* v)>;
  void SetQkvCapture(QkvCapture capture) { capture_ = std::move(capture); }
  /// Rotates x [m, heads, head_dim] fp32 in place with this model's RoPE at `positions`, exactly
  /// as the forward pass rotates queries and keys: turns keys read back from a kInfLLM store
  /// (stored before RoPE) into the keys the capture shows, for scoring at true positions.
  void ApplyRope(float* x, int m, int heads, const int64_t* positions) const;

  /// Chunk indices each layer attended in the last step (prefill window or decode), [layer].
  const std::vector<std::vector<uint64_t>>& last_chunks() const { return session_->last_chunks(); }
  /// Most chunks one layer attended in one step, and chunks attended summed over steps and layers.
  size_t max_layer_chunks() const { return session_->counters().max_layer_chunks; }
  uint64_t total_chunks() const { return session_->counters().chunks_attended; }

  /// Runs the tokens (bytes 0..vocab-1) at positions position()..position()+n-1
  /// through the model, `window` tokens at a time (1..n_local), and returns the
  /// logits of every token, [n, vocab] fp32.
  Result<std::vector<float>> Prefill(const std::vector<int32_t>& tokens, int window);
  /// One token; returns its logits [vocab] (the distribution of the next token).
  /// After a failed Prefill/Decode the session refuses further calls (FailedPrecondition).
  Result<std::vector<float>> Decode(int32_t token);
  /// Greedy: argmax of logits (lowest index on ties).
  static int32_t Argmax(const std::vector<float>& logits);

  /// Tokens run so far (the position of the next one).
  int64_t position() const { return position_; }
  TieredStore* store() { return store_.get(); }
  SequenceId sequence() const { return session_->sequence(); }

 private:
  LlamaSession(const LlamaModel* model, std::unique_ptr<TieredStore> store, std::unique_ptr<Session> session);
  /// A new Session over the same sequence with these options (before the first token only).
  Status ReplaceSession(SessionOptions options, ChunkSelector selector);
  /// Tokens [position_, position_+m) through every layer; writes logits [m, vocab]. `decode`: one
  /// generated token (the retriever's probe uses its query alone).
  Status Forward(const int32_t* tokens, int m, float* logits, bool decode);
  /// Forward, and marks the session broken when it fails after touching the store.
  Status Run(const int32_t* tokens, int m, float* logits, bool decode);

  const LlamaModel* model_;
  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<Session> session_;  // declared after store_: destroyed before it
  int64_t position_ = 0;
  Status broken_;  // set when a forward pass failed part-way: layers may hold different token counts
  QkvCapture capture_;
  std::vector<double> inv_freq_;                // [head_dim / 2] RoPE frequencies, double like the reference
  std::unique_ptr<LlamaDeviceForward> device_;  // set when the hot tier is "cuda"
};

}  // namespace kvtier::model
