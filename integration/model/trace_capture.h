// Recording a KvTrace (integration/kv_trace.h) from the kvtier-llama model: one
// ∞-Bench-style prompt (tasks.h) runs through the model with full attention (every
// chunk, LlamaSession's default selector), then `decode_steps` tokens are decoded
// greedily, and every layer's q/k/v of every token is captured (LlamaSession::
// SetQkvCapture): q and k after RoPE at their true positions, fp32.
//
// What the trace marks (kvtier run --trace reads it):
//   context         the prompt's length; the generated tokens are the decode steps
//   question_begin  the first byte of the prompt's last line, the question ("What is
//                   the pass key? The pass key is "): the question window
//   needles         one range, the answer's first copy inside the needle
//                   (Sample::answer_begin/end): the tokens a model copies the answer from
// The prompt is the first sample `kvtier infinite` draws for the same task, context
// and seed, so a trace can be matched with an infinite run.
//
// Positions: kAbsolute (default) is the reference model exactly. With kInfLLM the model
// runs as InfLLM places memory (so its hidden states and outputs are those of that
// run), but the trace still holds keys rotated at their TRUE positions, like the
// queries: a replay's "full attention" is then absolute-position attention over those
// vectors, not the arithmetic the InfLLM run did.
#pragma once

#include <cstdint>
#include <string>

#include "integration/kv_trace.h"
#include "integration/model/llama.h"
#include "store/status.h"

namespace kvtier::model {

struct TraceCaptureOptions {
  std::string task = "passkey";  ///< passkey | number_string | kv_retrieval
  int64_t context = 4096;        ///< prompt + answer bytes, as `kvtier infinite --context`
  uint64_t seed = 1;             ///< the sample's seed (the same draw as `kvtier infinite`)
  int decode_steps = 0;          ///< tokens decoded greedily after the prompt; 0 = the answer's length
  PositionMode positions = PositionMode::kAbsolute;
  int window = 128;     ///< prefill window (the result does not depend on it beyond rounding)
  std::string weights;  ///< the weights' path, for the trace's provenance line
  Status Validate() const;
};

/// Runs the model over one prompt and records it. InvalidArgument for bad options (naming
/// the field) or a context too short for the task.
Result<KvTrace> CaptureKvTrace(const LlamaModel& model, const TraceCaptureOptions& options);

}  // namespace kvtier::model
