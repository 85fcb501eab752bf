// `kvtier infinite`: ∞-Bench-style retrieval tasks (passkey, number_string,
// kv_retrieval) run end to end through the kvtier-llama model
// (integration/model/llama.h) with its KV memory in a TieredStore and
// retrieval inside the model:
//
//   kvtier infinite --weights FILE --task passkey|number_string|kv_retrieval --context N --samples S
//       [--probe act|mean --alloc entropy|topk --index Exact --budget TOKENS --policy P --sink N
//        --local N --chunk N --window N --positions infllm|absolute --seed N --json FILE]
//   kvtier infinite ... --compare --contexts 4096,16384
//       full attention, StreamingLLM, InfLLM and ActQKV on the same samples, one table.
//
// Each sample's prompt is prefilled in windows, then len(answer) bytes are
// decoded greedily; an exact match is correct.
#pragma once

#include <string>

#include "integration/cli/flags.h"

namespace kvtier {

/// --weights (a kvtier-llama safetensors file) and --task (passkey | number_string |
/// kv_retrieval, checked), as `kvtier infinite` and `kvtier trace` both take them.
void AddModelTaskFlags(cli::FlagSet* flags, std::string* weights, std::string* task);

/// The subcommand; argv holds the flags after "infinite". Returns the exit code (0 ok,
/// 2 bad flags or inputs, 1 other errors).
int RunInfinite(int argc, char** argv);

}  // namespace kvtier
