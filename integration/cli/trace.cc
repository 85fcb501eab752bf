// `kvtier trace` and the trace side of `kvtier run --trace` (see trace.h).
#include "integration/cli/trace.h"

#include <chrono>
#include <cstdio>
#include <memory>

#include "integration/cli/infinite.h"
#include "integration/cli/paths.h"
#include "integration/kv_source.h"
#include "integration/model/llama.h"
#include "integration/model/tasks.h"
#include "integration/model/trace_capture.h"

namespace kvtier {

using cli::Fail;
using cli::FlagSet;
using cli::IntFlag;
using cli::PathFlag;

int RunTrace(int argc, char** argv) {
  model::TraceCaptureOptions o;
  std::string out;
  FlagSet f;
  AddModelTaskFlags(&f, &o.weights, &o.task);
  f.Add("context", "prompt + answer bytes (= tokens), as 'kvtier infinite --context'",
        IntFlag(&o.context, 1, int64_t{1} << 30));
  f.Add("seed", "the sample's seed: the prompt is 'kvtier infinite's first sample for it",
        IntFlag(&o.seed, 0, INT64_MAX));
  f.Add("decode-steps", "tokens decoded greedily after the prompt, each recorded",
        cli::WithDefault("the answer's length", IntFlag(&o.decode_steps, 1, 1 << 20)));
  f.Add("positions",
        "absolute (the reference model) | infllm (the model runs with InfLLM's memory positions; "
        "keys are still recorded at their true positions)",
        cli::WithDefault(model::PositionModeName(o.positions), [&o](const std::string& s) {
          auto m = model::ParsePositionMode(s);
          if (!m.ok()) return m.status();
          o.positions = *m;
          return Status::Ok();
        }));
  f.Add("window", "prefill window in tokens, 1..512", IntFlag(&o.window, 1, 512));
  f.Add("out", "the trace file to write (required; checked writable before the model runs)",
        cli::OutputPathFlag(&out));
  Status st = f.Parse("trace", argc, argv);
  if (!st.ok()) return Fail(st);
  if (f.help()) {
    f.PrintHelp(
        "usage: kvtier trace --weights FILE --task passkey|number_string|kv_retrieval --context N --seed S "
        "[--decode-steps D] --out FILE\n\n"
        "Runs one prompt through the kvtier-llama model with full attention, decodes D tokens greedily, and\n"
        "writes every layer's q, k (both after RoPE) and v of every token, fp32, to FILE. 'kvtier run "
        "--trace\n"
        "FILE' replays it: retrieval, budgets and policies then run on the model's real attention. The\n"
        "question window is the prompt's last line; the needle is the answer's first copy in the prompt.");
    return 0;
  }
  if (o.weights.empty())
    return Fail(InvalidArgument("--weights FILE is required (a kvtier-llama safetensors file)"));
  if (out.empty()) return Fail(InvalidArgument("--out FILE is required (where the trace goes)"));
  auto loaded = model::LlamaModel::Load(o.weights);
  if (!loaded.ok())
    return Fail(InvalidArgument("cannot load --weights '" + o.weights + "': " + loaded.status().message()));
  const auto t0 = std::chrono::steady_clock::now();
  auto trace = model::CaptureKvTrace(**loaded, o);
  if (!trace.ok()) return Fail(trace.status());
  st = WriteKvTrace(out, *trace);
  if (!st.ok()) return Fail(st);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const KvTrace& t = *trace;
  std::printf(
      "kvtier trace — %s: %lld tokens (prompt %lld + %lld decoded), geometry %d,%d,%d,%d fp32, "
      "%.1f MiB of q/k/v, %.1f s\n",
      out.c_str(), static_cast<long long>(t.n_tokens()), static_cast<long long>(t.context),
      static_cast<long long>(t.decode_steps()), t.layers, t.q_heads, t.kv_heads, t.head_dim,
      t.qkv_bytes() / 1048576.0, s);
  std::printf("source: %s\n", t.source.c_str());
  std::printf(
      "question window [%lld, %lld) (the prompt's last line); needle [%lld, %lld) (the answer's first "
      "copy)\n",
      static_cast<long long>(t.question_begin), static_cast<long long>(t.context),
      static_cast<long long>(t.needles[0].begin), static_cast<long long>(t.needles[0].end));
  std::printf("replay: kvtier run --trace %s [--sink N --local N --budget N --compare ...]\n", out.c_str());
  return 0;
}

Status UseTraceForRun(const std::string& path, const cli::FlagSet& flags, RunOptions* run) {
  auto read = ReadKvTrace(path);
  if (!read.ok()) return InvalidArgument("--trace: " + read.status().message());
  auto trace = std::make_shared<const KvTrace>(std::move(*read));
  // A trace brings its own data: the synthetic workload's knobs would be silently ignored.
  for (const char* knob :
       {"needles", "needle-len", "depth", "anchor", "noise", "question-anchors", "needle-echo", "seed"})
    if (flags.given(knob))
      return InvalidArgument(std::string("--") + knob +
                             " shapes the synthetic workload; it does not apply to --trace");
  const Geometry& g = run->store.geometry;
  if (flags.given("geometry") && (g.layers != trace->layers || g.q_heads != trace->q_heads ||
                                  g.kv_heads != trace->kv_heads || g.head_dim != trace->head_dim))
    return InvalidArgument("--geometry " + std::to_string(g.layers) + "," + std::to_string(g.q_heads) + "," +
                           std::to_string(g.kv_heads) + "," + std::to_string(g.head_dim) +
                           " conflicts with the trace's geometry " + trace->shape() +
                           " (leave --geometry out: the trace sets it)");
  auto conflict = [&](const char* flag, int64_t given, int64_t traced) -> Status {
    if (flags.given(flag) && given != traced)
      return InvalidArgument(std::string("--") + flag + " " + std::to_string(given) +
                             " conflicts with the trace's " + std::to_string(traced) +
                             " (leave it out: the trace sets it)");
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(conflict("context", run->workload.context, trace->context));
  KVTIER_RETURN_IF_ERROR(conflict("decode-steps", run->workload.decode_steps, trace->decode_steps()));
  KVTIER_RETURN_IF_ERROR(
      conflict("question-len", run->workload.question_len, trace->context - trace->question_begin));
  AdoptTrace(*trace, &run->store.geometry, &run->workload);
  run->trace = std::move(trace);
  return Status::Ok();
}

}  // namespace kvtier
