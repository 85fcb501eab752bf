#include "integration/model/trace_capture.h"

#include <algorithm>
#include <cstdio>
#include <random>

#include "integration/model/tasks.h"

namespace kvtier::model {
Status TraceCaptureOptions::Validate() const {
  KVTIER_RETURN_IF_ERROR(CheckTask(task));
  if (context < 1) return InvalidArgument("context must be >= 1 (got " + std::to_string(context) + ")");
  if (decode_steps < 0 || decode_steps > (1 << 20))
    return InvalidArgument("decode_steps must be in [0, 1048576] (got " + std::to_string(decode_steps) + ")");
  if (window < 1 || window > 512)
    return InvalidArgument("window must be in [1, 512] (the capture's local window) (got " +
                           std::to_string(window) + ")");
  return Status::Ok();
}

Result<KvTrace> CaptureKvTrace(const LlamaModel& model, const TraceCaptureOptions& o) {
  KVTIER_RETURN_IF_ERROR(o.Validate());
  // The same draw as `kvtier infinite` (its first sample at this context and seed).
  std::mt19937_64 rng = SampleRng(o.seed, o.context);
  KVTIER_ASSIGN_OR_RETURN(Sample sample, MakeSample(o.task, o.context, rng));
  const int64_t prompt = static_cast<int64_t>(sample.prompt.size());
  const size_t last_line = sample.prompt.rfind('\n');
  if (last_line == std::string::npos || static_cast<int64_t>(last_line) + 1 >= prompt)
    return Internal("trace: the " + o.task + " prompt has no question line after its last newline");
  const int decode = o.decode_steps > 0 ? o.decode_steps : static_cast<int>(sample.answer.size());
  const int64_t total = prompt + decode;

  const LlamaConfig& c = model.config();
  KvTrace t;
  t.layers = c.n_layers;
  t.q_heads = c.q_heads;
  t.kv_heads = c.kv_heads;
  t.head_dim = c.head_dim();
  t.context = prompt;
  t.question_begin = static_cast<int64_t>(last_line) + 1;
  t.needles = {TokenRange{sample.answer_begin, sample.answer_end}};
  t.answer = sample.answer;
  const size_t qt = static_cast<size_t>(t.q_heads) * t.head_dim,
               kt = static_cast<size_t>(t.kv_heads) * t.head_dim;
  t.q.assign(t.layers, std::vector<float>(static_cast<size_t>(total) * qt));
  t.k.assign(t.layers, std::vector<float>(static_cast<size_t>(total) * kt));
  t.v.assign(t.layers, std::vector<float>(static_cast<size_t>(total) * kt));

  // Full attention through an fp32 store (so the keys and values attended are exactly the
  // ones recorded): the warm tier holds every chunk, the hot pool one layer's chunks.
  StoreOptions so;
  so.geometry = c.KvGeometry(DType::kF32);
  so.n_sink = 64;
  so.n_local = 512;
  so.chunk_size = 32;
  so.repr_topk = 4;
  so.transfer_threads = 2;
  const uint64_t chunks = static_cast<uint64_t>(total / so.chunk_size + 2);
  so.warm_bytes = static_cast<uint64_t>(c.n_layers) * chunks * so.chunk_bytes();
  so.hot_bytes = chunks * so.chunk_bytes();
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<LlamaSession> session,
                          LlamaSession::Create(&model, so, o.positions));
  session->SetQkvCapture([&t, qt, kt](int layer, int64_t first, int m, const float* q, const float* k,
                                      const float* v) {
    const size_t l = static_cast<size_t>(layer), at = static_cast<size_t>(first), n = static_cast<size_t>(m);
    std::copy(q, q + n * qt, t.q[l].begin() + at * qt);
    std::copy(k, k + n * kt, t.k[l].begin() + at * kt);
    std::copy(v, v + n * kt, t.v[l].begin() + at * kt);
  });

  t.tokens.resize(static_cast<size_t>(prompt));
  for (int64_t i = 0; i < prompt; ++i)
    t.tokens[i] = static_cast<unsigned char>(sample.prompt[static_cast<size_t>(i)]);
  KVTIER_ASSIGN_OR_RETURN(std::vector<float> logits, session->Prefill(t.tokens, o.window));
  std::vector<float> last(logits.end() - c.vocab, logits.end());
  std::string output;
  for (int s = 0; s < decode; ++s) {
    const int32_t next = LlamaSession::Argmax(last);
    t.tokens.push_back(next);
    output.push_back(static_cast<char>(next));
    KVTIER_ASSIGN_OR_RETURN(last, session->Decode(next));
  }

  const char* verdict = output.size() < sample.answer.size() ? "fewer steps than the answer"
                        : output.compare(0, sample.answer.size(), sample.answer) == 0 ? "correct"
                                                                                      : "wrong";
  t.source = "kvtier-llama " + (o.weights.empty() ? std::string("(weights)") : o.weights) + ", task " +
             o.task + ", context " + std::to_string(o.context) + ", seed " + std::to_string(o.seed) +
             ", positions " + PositionModeName(o.positions) + "; output \"" + Printable(output) +
             "\", answer \"" + Printable(sample.answer) + "\" (" + verdict + ")";
  KVTIER_RETURN_IF_ERROR(t.Validate());
  return t;
}

}  // namespace kvtier::model
