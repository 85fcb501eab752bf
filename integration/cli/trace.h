// `kvtier trace`: records a real model's attention for `kvtier run --trace`.
//
//   kvtier trace --weights models/kvtier-tiny.safetensors --task passkey|number_string|kv_retrieval
//       --context N --seed S [--decode-steps D] --out FILE [--positions absolute|infllm] [--window N]
//
// One prompt (the first sample `kvtier infinite` draws for the task, context and seed)
// runs through the kvtier-llama model with full attention, D tokens are decoded
// greedily, and every layer's q/k/v of every token goes to FILE (integration/kv_trace.h;
// what is recorded: integration/model/trace_capture.h).
#pragma once

#include <string>

#include "integration/cli/flags.h"
#include "integration/run_job.h"

namespace kvtier {

/// The subcommand; argv holds the flags after "trace". Returns the exit code.
int RunTrace(int argc, char** argv);

/// `kvtier run --trace FILE`: reads the trace into `run` and adopts its geometry and lengths.
/// InvalidArgument naming the flag when the file is unreadable or corrupt, when a flag the
/// user gave conflicts with the trace (--geometry, --context, --decode-steps, --question-len),
/// or when a synthetic-workload knob (--needles, --depth, --seed, ...) was given.
Status UseTraceForRun(const std::string& path, const cli::FlagSet& flags, RunOptions* run);

}  // namespace kvtier
