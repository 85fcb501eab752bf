// `kvtier compile-tables` (see compile_tables.h).
#include "integration/cli/compile_tables.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "integration/cli/flags.h"
#include "integration/cli/paths.h"
#include "integration/policy_eval.h"
#include "integration/workload.h"
#include "offload/policy/compilerkv.h"

namespace kvtier {
namespace {

struct CompileFlags {
  std::string traces, out, out_traces;
  int64_t record_synthetic = 0;
  CompilerKvFitOptions fit;
  CompilerKvRecordOptions record;
  int layers = 4, q_heads = 8, kv_heads = 2, head_dim = 64;
  int64_t context = 2048;
  int64_t window = 32;
  std::vector<int64_t> budgets = {256};
  int64_t sink = 4, local = 32;
  int64_t seed = 1;
  bool quiet = false;
};

using cli::DoubleFlag;
using cli::Fail;
using cli::FlagSet;
using cli::IntFlag;
using cli::ParseDoubleList;
using cli::ParseInt;
using cli::ParseIntList;
using cli::PathFlag;
using cli::SplitComma;
using cli::WithDefault;

const char* kUsage =
    "usage: kvtier compile-tables --traces FILE --out TABLES [--alpha-cql X --steps N --lr X]\n"
    "       kvtier compile-tables --record-synthetic N --out-traces FILE [--out TABLES] [flags]\n\n"
    "Compiles CompilerKV's head reliability table W_head and risk threshold table T_gate by\n"
    "conservative Q-learning (Eq. 4) over (state, action, reward) traces, or records such traces\n"
    "from the synthetic workload (exact attention of the last --window queries, every layer;\n"
    "reward = -attention-output error - beta/T * (|I_cand| - B), the Eq. 2 proxy). Use the tables\n"
    "with the policy spec compilerkv:tables=TABLES.";

// "0.8,0.85,1": a list default as --help shows it.
template <typename T>
std::string JoinNumbers(const std::vector<T>& v) {
  std::string out;
  for (const T& x : v) out += (out.empty() ? "" : ",") + cli::FormatNumber(static_cast<double>(x));
  return out;
}

Status ParseFlags(int argc, char** argv, CompileFlags* f, bool* help) {
  FlagSet flags;
  flags.Add("traces", "traces file to compile tables from", PathFlag(&f->traces));
  flags.Add("out", "write the compiled tables to this file", cli::OutputPathFlag(&f->out));
  flags.Add("alpha-cql", "conservatism alpha of Eq. 4", DoubleFlag(&f->fit.alpha_cql));
  flags.Add("steps", "gradient steps", IntFlag(&f->fit.steps, 0, 1 << 24));
  flags.Add("lr", "gradient step size", DoubleFlag(&f->fit.lr));
  flags.Add("record-synthetic", "record traces from N synthetic sequences",
            IntFlag(&f->record_synthetic, 1, 1 << 20));
  flags.Add("out-traces", "write recorded traces to this file", cli::OutputPathFlag(&f->out_traces));
  flags.Add("geometry", "L,Hq,Hkv,D model shape for recording",
            WithDefault(std::to_string(f->layers) + "," + std::to_string(f->q_heads) + "," +
                            std::to_string(f->kv_heads) + "," + std::to_string(f->head_dim),
                        [f](const std::string& s) {
                          const std::vector<std::string> p = SplitComma(s);
                          if (p.size() != 4) return InvalidArgument("expected L,Hq,Hkv,D, got '" + s + "'");
                          int64_t v[4];
                          for (int i = 0; i < 4; ++i)
                            KVTIER_RETURN_IF_ERROR(ParseInt(p[i], 1, 1 << 16, &v[i]));
                          f->layers = static_cast<int>(v[0]);
                          f->q_heads = static_cast<int>(v[1]);
                          f->kv_heads = static_cast<int>(v[2]);
                          f->head_dim = static_cast<int>(v[3]);
                          return Status::Ok();
                        }));
  flags.Add("context", "tokens per synthetic sequence", IntFlag(&f->context, 2, int64_t{1} << 24));
  flags.Add("window", "observation window: the last W queries", IntFlag(&f->window, 1, 1 << 16));
  flags.Add("budget", "budget(s) B per layer, comma-separated",
            WithDefault(JoinNumbers(f->budgets), [f](const std::string& s) {
              return ParseIntList(s, 0, int64_t{1} << 40, &f->budgets);
            }));
  flags.Add("sink", "attention-sink tokens protected", IntFlag(&f->sink, 0, 1 << 20));
  flags.Add("local", "local-window tokens protected", IntFlag(&f->local, 0, 1 << 20));
  flags.Add("seed", "seed of the first sequence; sequence i uses seed + i", IntFlag(&f->seed, 0, INT64_MAX));
  flags.Add("beta", "beta of lambda = beta / T in the gate reward, Eq. 14", DoubleFlag(&f->record.beta));
  flags.Add("tau-actions", "comma-separated tau actions in units of mean alpha",
            WithDefault(JoinNumbers(f->record.tau_actions),
                        [f](const std::string& s) { return ParseDoubleList(s, &f->record.tau_actions); }));
  flags.Add("weight-actions", "comma-separated head weight actions",
            WithDefault(JoinNumbers(f->record.weight_actions),
                        [f](const std::string& s) { return ParseDoubleList(s, &f->record.weight_actions); }));
  flags.Add("ent-bins", "entropy bins", IntFlag(&f->record.bins.ent_bins, 1, 1000));
  flags.Add("ppl-bins", "perplexity bins", IntFlag(&f->record.bins.ppl_bins, 1, 100));
  flags.Add("budget-bins", "log2 budget buckets", IntFlag(&f->record.bins.budget_bins, 1, 64));
  flags.Add("nll-step", "perplexity bin width in nats", DoubleFlag(&f->record.bins.nll_step));
  flags.Add(
      "quiet", "no progress on stderr",
      [f](const std::string& s) {
        f->quiet = s != "0";
        return Status::Ok();
      },
      true);

  KVTIER_RETURN_IF_ERROR(flags.Parse("compile-tables", argc, argv));
  *help = flags.help();
  if (*help) flags.PrintHelp(kUsage);
  return Status::Ok();
}

// Exact causal softmax attention of the last `window` queries over all `context` keys of every
// layer, recorded for each budget.
Status RecordSynthetic(const CompileFlags& f, CompilerKvTraces* traces) {
  PolicyGeometry pg;
  pg.layers = f.layers;
  pg.q_heads = f.q_heads;
  pg.kv_heads = f.kv_heads;
  pg.head_dim = f.head_dim;
  pg.sink_tokens = f.sink;
  pg.local_tokens = f.local;
  KVTIER_RETURN_IF_ERROR(pg.Validate());
  if (f.window >= f.context)
    return InvalidArgument("--window " + std::to_string(f.window) + " must be smaller than --context " +
                           std::to_string(f.context));
  Geometry geo{f.layers, f.q_heads, f.kv_heads, f.head_dim, DType::kF32};
  const int64_t T = f.context, W = f.window;
  const int D = f.head_dim, Hq = f.q_heads, Hkv = f.kv_heads;
  std::vector<int64_t> key_pos(T), query_pos(W);
  for (int64_t t = 0; t < T; ++t) key_pos[t] = t;
  for (int64_t i = 0; i < W; ++i) query_pos[i] = T - W + i;
  std::vector<float> q(static_cast<size_t>(W) * Hq * D), k(static_cast<size_t>(T) * Hkv * D);
  std::vector<std::vector<float>> attn(f.layers), vals(f.layers);
  for (int64_t s = 0; s < f.record_synthetic; ++s) {
    // Vary the prompts so the risk state (entropy bin) varies: needle count, depth, anchor
    // strength and how many window queries seek a needle.
    WorkloadOptions wo;
    wo.context = T;
    wo.question_len = static_cast<int>(W);
    wo.decode_steps = 0;
    wo.needle_count = 1 + static_cast<int>(s % 3);
    wo.needle_depth = std::fmod(0.1 + 0.37 * static_cast<double>(s), 0.8);
    wo.anchor_strength = static_cast<float>(std::array<double, 3>{2.0, 3.3, 4.5}[(s / 3) % 3]);
    wo.question_anchor_every = std::array<int, 3>{1, 2, 4}[(s / 9) % 3];
    wo.seed = static_cast<uint64_t>(f.seed + s);
    KVTIER_ASSIGN_OR_RETURN(Workload w, Workload::Create(geo, wo));
    std::vector<AttentionObservation> obs(f.layers);
    for (int l = 0; l < f.layers; ++l) {
      attn[l].resize(static_cast<size_t>(Hq) * W * T);
      vals[l].resize(static_cast<size_t>(T) * Hkv * D);
      w.Generate(l, T - W, T, q.data(), nullptr, nullptr);
      w.Generate(l, 0, T, nullptr, k.data(), vals[l].data());
      ExactAttentionRows(geo, q.data(), query_pos.data(), static_cast<int>(W), k.data(), nullptr, T,
                         attn[l].data());
      AttentionObservation& ob = obs[l];
      ob.layer = l;
      ob.n_queries = static_cast<int>(W);
      ob.n_keys = T;
      ob.key_positions = key_pos.data();
      ob.query_positions = query_pos.data();
      ob.attention = attn[l].data();
      ob.values = vals[l].data();
    }
    for (int64_t b : f.budgets) KVTIER_RETURN_IF_ERROR(RecordCompilerKvTraces(pg, obs, b, f.record, traces));
    if (!f.quiet)
      std::fprintf(stderr, "\rcompile-tables: recorded %lld / %lld sequences (%zu records)",
                   static_cast<long long>(s + 1), static_cast<long long>(f.record_synthetic),
                   traces->records.size());
  }
  if (!f.quiet) std::fprintf(stderr, "\n");
  return Status::Ok();
}

void PrintFit(const CompilerKvFitResult& r, const CompilerKvTraces& t, const std::string& out) {
  std::printf(
      "compiled %s from %zu records: %lld gate states and %lld head states fitted, Eq. 4 objective %.6g\n",
      out.c_str(), t.records.size(), static_cast<long long>(r.gate_states_fitted),
      static_cast<long long>(r.head_states_fitted), r.objective);
  std::printf("W_head (layers x kv heads):\n");
  for (int l = 0; l < r.tables.layers; ++l) {
    std::printf("  layer %3d:", l);
    for (int h = 0; h < r.tables.heads; ++h) std::printf(" %6g", r.tables.weight(l, h));
    std::printf("\n");
  }
  std::map<float, int64_t> hist;
  for (size_t s = 0; s < r.tables.tau.size(); ++s)
    if (r.n_gate[s] > 0) ++hist[r.tables.tau[s]];
  std::printf("tau over fitted risk states:");
  for (const auto& [tau, n] : hist) std::printf(" %g x%lld", tau, static_cast<long long>(n));
  std::printf("\n");
}

}  // namespace

int RunCompileTables(int argc, char** argv) {
  CompileFlags f;
  bool help = false;
  Status st = ParseFlags(argc, argv, &f, &help);
  if (!st.ok()) return Fail(st);
  if (help) return 0;
  CompilerKvTraces traces;
  if (f.record_synthetic > 0) {
    if (!f.traces.empty()) return Fail(InvalidArgument("--traces and --record-synthetic exclude each other"));
    if (f.out_traces.empty()) return Fail(InvalidArgument("--record-synthetic needs --out-traces FILE"));
    st = f.record.Validate();
    if (!st.ok()) return Fail(InvalidArgument("recording options: " + st.message()));
    st = RecordSynthetic(f, &traces);
    if (!st.ok()) return Fail(st);
    if (traces.records.empty())
      return Fail(
          InvalidArgument("no records: every --budget is at least --context, so nothing was dropped"));
    st = SaveCompilerKvTraces(traces, f.out_traces);
    if (!st.ok()) return Fail(st);
    std::printf("wrote %zu records from %lld sequences to %s\n", traces.records.size(),
                static_cast<long long>(f.record_synthetic), f.out_traces.c_str());
    if (f.out.empty()) return 0;
  } else {
    if (f.traces.empty() || f.out.empty())
      return Fail(
          InvalidArgument("need --traces FILE --out TABLES, or --record-synthetic N --out-traces FILE "
                          "(see 'kvtier compile-tables --help')"));
    if (!f.out_traces.empty()) return Fail(InvalidArgument("--out-traces only goes with --record-synthetic"));
    auto loaded = LoadCompilerKvTraces(f.traces);
    if (!loaded.ok()) return Fail(loaded.status());
    traces = std::move(loaded).value();
  }
  auto fit = FitCompilerKvTables(traces, f.fit);
  if (!fit.ok()) return Fail(fit.status());
  st = SaveCompilerKvTables(fit->tables, f.out);
  if (!st.ok()) return Fail(st);
  PrintFit(*fit, traces, f.out);
  return 0;
}

}  // namespace kvtier
