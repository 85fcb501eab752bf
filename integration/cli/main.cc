// The `kvtier` command line: `kvtier run` (the main job), `kvtier stress`
// (offload stress test), `kvtier infinite` (retrieval tasks through the
// kvtier-llama model, integration/cli/infinite.h), `kvtier help`.
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
#ifdef __GLIBC__
#include <malloc.h>  // mallopt
#endif

#include "integration/cli/check.h"
#include "integration/cli/compile_tables.h"
#include "integration/cli/flags.h"
#include "integration/cli/infinite.h"
#include "integration/cli/option_flags.h"
#include "integration/cli/paths.h"
#include "integration/cli/trace.h"
#include "integration/json.h"
#include "integration/policy_eval.h"
#include "integration/retriever_flags.h"
#include "integration/run_job.h"
#include "integration/stress_job.h"
#include "offload/demotion_policy.h"
#include "offload/policy/scoring_policy.h"
#include "retrieval/exact_index.h"

namespace kvtier {
namespace {

using cli::BytesFlag;
using cli::DoubleFlag;
using cli::Fail;
using cli::FlagSet;
using cli::IntFlag;
using cli::ParseIntList;
using cli::WithDefault;

// The value a factory spec gives `key` (what the preset chose), or `fallback` when it sets none.
std::string SpecOr(const std::string& spec, const std::string& key, const std::string& fallback) {
  std::string v = SpecKey(spec, key);
  return v.empty() ? fallback : v;
}

// --kv-budget of `kvtier run --compare-policies` when the flag is not given (per kv head).
constexpr int64_t kComparePoliciesKvBudget = 1024;

// Where a run's or a stress test's data go: a temporary directory unless --data-dir is given
// ('none': no cold tier), and its sequences dropped at the end unless --keep.
struct DataPlace {
  bool keep = false;
  std::unique_ptr<cli::ScratchDir> scratch;  ///< the temporary --data-dir, removed at exit
};

// Each command sets its own defaults in `o` before calling this: --help shows those. An
// empty o->data_dir means the temporary directory (PrepareDataDir).
void AddStoreFlags(FlagSet* f, StoreOptions* o, DataPlace* place) {
  const Geometry& g = o->geometry;
  f->Add("geometry", "L,Hq,Hkv,D model KV shape",
         WithDefault(std::to_string(g.layers) + "," + std::to_string(g.q_heads) + "," +
                         std::to_string(g.kv_heads) + "," + std::to_string(g.head_dim),
                     [o](const std::string& s) { return o->geometry.ParseShape(s); }));
  const auto& t = StoreOptionTable();
  cli::AddOptionFlag(f, t, "dtype", o);
  cli::AddOptionFlag(f, t, "chunk_size", o);
  cli::AddOptionFlag(f, t, "n_sink", o);
  cli::AddOptionFlag(f, t, "n_local", o);
  cli::AddOptionFlag(f, t, "repr_topk", o);
  cli::AddOptionFlag(f, t, "repr_choice", o);
  cli::AddOptionFlag(f, t, "repr_heads", o);
  cli::AddOptionFlag(f, t, "hot_bytes", o);
  cli::AddOptionFlag(f, t, "device", o);
  cli::AddOptionFlag(f, t, "warm_bytes", o);
  cli::AddOptionFlag(f, t, "index_bytes", o);
  const auto& data_dir = cli::OptionRow(t, "data_dir");
  f->Add(data_dir.flag,
         cli::OptionHelp(data_dir) + "; 'none' here: no cold tier (then --remote is the lower tier)",
         WithDefault(o->data_dir.empty() ? "a new directory under $TMPDIR, removed at exit" : o->data_dir,
                     [o](const std::string& s) {
                       if (s.empty()) return InvalidArgument("empty path");
                       o->data_dir = s == "none" ? "" : s;
                       return Status::Ok();
                     }));
  const auto& remote = cli::OptionRow(t, "remote");
  f->Add(remote.flag,
         cli::OptionHelp(remote) +
             "; chunks are written through to it as well and fetched from it "
             "when no local tier holds them",
         WithDefault("none", [o](const std::string& s) {
           auto r = ParseRemoteSpec(s);
           if (!r.ok()) return r.status();
           o->remote = s;
           return Status::Ok();
         }));
  cli::AddOptionFlag(f, t, "compression", o);
  f->Add("policy",
         "demotion policy of the hot and warm tiers: lru, or a scoring policy's factory string, "
         "e.g. h2o or gkv:form=max (see 'kvtier policies')",
         WithDefault(o->warm_policy, [o](const std::string& s) {
           auto p = MakeDemotionPolicy(s);
           if (!p.ok()) return p.status();
           o->hot_policy = o->warm_policy = s;
           return Status::Ok();
         }));
  cli::AddOptionFlag(f, t, "sync_writes", o);
  f->Add(
      "keep",
      "keep the sequences in --data-dir (and --remote) at the end; without it they are dropped, so "
      "nothing is left behind",
      [place](const std::string& s) {
        place->keep = s != "0";
        return Status::Ok();
      },
      true);
}

// After parsing: without --data-dir the cold tier goes to a fresh temporary directory.
Status PrepareDataDir(const FlagSet& f, const char* prefix, StoreOptions* o, DataPlace* place) {
  if (f.given("data-dir")) return Status::Ok();
  if (place->keep && o->remote.empty())
    return InvalidArgument(
        "--keep needs --data-dir DIR (or --remote): without it the data go to a temporary "
        "directory that is removed at exit");
  place->scratch = std::make_unique<cli::ScratchDir>(prefix);
  if (place->scratch->path().empty()) return IOError(place->scratch->error());
  o->data_dir = place->scratch->path();
  return Status::Ok();
}

// One line on where the data went: the temporary directory, the user's --data-dir, Redis.
std::string DataNote(const StoreOptions& o, const DataPlace& place, bool dropped, const char* what) {
  std::string t = "data: ";
  if (place.scratch) {
    t += "temporary directory " + o.data_dir + ", removed at exit (--data-dir DIR --keep keeps the data)";
  } else if (o.data_dir.empty()) {
    t += "no cold tier (--data-dir none)";
  } else if (dropped) {
    t += std::string(what) + " dropped from " + o.data_dir + " at the end (--keep keeps them)";
  } else {
    t += std::string(what) + " kept in " + o.data_dir + " ('kvtier check --data-dir " + o.data_dir +
         "' lists them)";
  }
  if (!o.remote.empty())
    t += std::string("; remote tier ") + RedactRemoteSpec(o.remote) + (dropped ? ": dropped" : ": kept");
  return t + "\n";
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return false;
  f << text << "\n";
  return static_cast<bool>(f);
}

// `kvtier run --compare-policies`: every scoring policy on the same data (see
// integration/policy_eval.h), at one budget or a sweep of budgets.
int ComparePolicies(const RunOptions& run, int64_t budget, const std::vector<int64_t>& sweep,
                    const std::vector<std::string>& policies, const std::string& json) {
  PolicyEvalOptions o;
  o.geometry = run.store.geometry;
  o.geometry.dtype = DType::kF32;
  o.workload = run.workload;
  o.trace = run.trace;
  o.observe = run.observe;
  o.sink_tokens = run.store.n_sink;
  o.local_tokens = std::min<int64_t>(run.store.n_local, 256);
  o.policies = policies;
  std::vector<PolicyEvalRow> rows;
  const std::vector<int64_t> budgets = sweep.empty() ? std::vector<int64_t>{budget} : sweep;
  for (int64_t b : budgets) {
    o.budget = b;
    if (run.progress) std::fprintf(stderr, "compare-policies: budget %lld ...\n", static_cast<long long>(b));
    auto r = EvaluatePolicies(o);
    if (!r.ok()) return Fail(r.status());
    rows.insert(rows.end(), r->begin(), r->end());
  }
  std::printf(
      "kvtier run --compare-policies — context %lld tokens, geometry %s, %d decode steps, observation "
      "window %d queries, sinks %lld, local %lld (per kv head)\n\n%s",
      static_cast<long long>(o.workload.context), o.geometry.ToString().c_str(), o.workload.decode_steps,
      o.observe, static_cast<long long>(o.sink_tokens), static_cast<long long>(o.local_tokens),
      PolicyEvalTable(rows).c_str());
  std::printf(
      "\nneedle kept: share of the sought needle's tokens in the cache during decoding; recall: full "
      "attention's mass on the kept keys;\nout.err: |o - o_full| / |o_full|; pf.score, dec.score: policy "
      "time "
      "/ attention time of the same step (prefill end, decode); comp: compressions per layer.\n");
  if (!json.empty()) {
    JsonWriter w;
    w.BeginObject().Key("context").Int(o.workload.context).Key("decode_steps").Int(o.workload.decode_steps);
    w.Key("rows").BeginArray();
    for (const PolicyEvalRow& r : rows) {
      w.BeginObject().Key("policy").String(r.spec).Key("budget").Int(r.budget);
      w.Key("needle_retention").Double(r.needle_retention).Key("attention_recall").Double(r.attention_recall);
      w.Key("output_error").Double(r.output_error).Key("prefill_scoring_ms").Double(r.prefill_scoring_ms);
      w.Key("prefill_attention_ms")
          .Double(r.prefill_attention_ms)
          .Key("decode_scoring_ms")
          .Double(r.decode_scoring_ms);
      w.Key("decode_attention_ms").Double(r.decode_attention_ms).Key("compressions").Int(r.compressions);
      w.Key("mean_cache_tokens").Double(r.mean_cache_tokens).Key("peak_state_bytes").Uint(r.peak_state_bytes);
      w.EndObject();
    }
    w.EndArray().EndObject();
    if (!WriteFile(json, w.str())) return Fail(IOError("could not write --json file '" + json + "'"));
  }
  return 0;
}

int CmdPolicies(int argc, char** argv) {
  (void)argv;
  if (argc > 0 && std::string(argv[0]) != "--help" && std::string(argv[0]) != "-h")
    return Fail(InvalidArgument("'kvtier policies' takes no arguments"));
  std::printf(
      "scoring policies (factory string: name or name:key=value,...; e.g. --policy "
      "gkv:form=max,alpha=0.8)\n");
  for (const PolicyInfo& p : ListScoringPolicies()) {
    std::printf("\n%s — %s\n  source: %s\n", p.name.c_str(), p.summary.c_str(), p.source.c_str());
    for (const PolicyParam& k : p.params)
      std::printf("  %-14s default %-10s %s\n", k.key.c_str(), k.default_value.c_str(), k.meaning.c_str());
    auto made = MakeScoringPolicy(p.name);
    if (made.ok()) std::printf("  defaults: %s\n", (*made)->ToString().c_str());
  }
  return 0;
}

int CmdRun(int argc, char** argv) {
  RunOptions o;
  // Defaults of the main job: a small model shape so 128K tokens stream
  // through two cores in about a minute, with a warm tier a quarter of the
  // context's KV so the cold tier is exercised. The hot tier keeps the
  // library's default (StoreOptions::hot_bytes), as an embedding engine gets it.
  o.store.geometry = Geometry{8, 8, 2, 64, DType::kF16};
  o.store.warm_bytes = 128ull << 20;
  o.store.data_dir.clear();  // a temporary directory unless --data-dir (PrepareDataDir)
  o.workload.context = 131072;
  DataPlace place;
  std::string json;
  bool compare_policies = false, kv_budget_set = false;
  std::vector<int64_t> sweep;
  std::vector<std::string> policy_list;
  FlagSet f;
  f.Add("context", "tokens of context", IntFlag(&o.workload.context, 1, int64_t{1} << 32));
  AddStoreFlags(&f, &o.store, &place);
  const auto& budget = cli::OptionRow(RetrieverOptionTable(), "budget_tokens");
  f.Add(budget.flag, cli::OptionHelp(budget), IntFlag(&o.budget, budget.lo, budget.hi));
  f.Add("window", "prefill window in tokens", IntFlag(&o.window, 1, 1 << 20));
  f.Add("stat-stride", "every N-th prefill query feeds representative-key statistics",
        IntFlag(&o.stat_stride, 1, 1 << 20));
  f.Add("decode-steps", "decode steps after the context", IntFlag(&o.workload.decode_steps, 1, 1 << 20));
  f.Add("question-len", "question-window tokens at the end of the context",
        IntFlag(&o.workload.question_len, 1, 1 << 20));
  f.Add("needles", "needles planted", IntFlag(&o.workload.needle_count, 1, 1 << 16));
  f.Add("needle-len", "tokens per needle", IntFlag(&o.workload.needle_len, 1, 1 << 16));
  f.Add("depth", "depth of the first needle in [0,1)", DoubleFlag(&o.workload.needle_depth));
  f.Add("anchor", "needle/question shared-direction strength", DoubleFlag(&o.workload.anchor_strength));
  f.Add("noise", "noise scale on q and k", DoubleFlag(&o.workload.noise));
  f.Add("key-spectrum",
        std::string("anisotropic synthetic keys: off, calibrated (") + kKeySpectrumCalibrated +
            ", measured on kvtier-tiny's trace) or decay=A[,outliers=K][,scale=S]: the key noise's std on "
            "rotary pair p is ~ (1 + p)^-A, times S on the first K pairs, its power kept",
        WithDefault("off", [&o](const std::string& s) { return ParseKeySpectrum(s, &o.workload); }));
  f.Add("seed", "random seed", IntFlag(&o.workload.seed, 0, INT64_MAX));
  // --index/--alloc set the specs; --rerank, --rerank-min, --head-merge and --rank-by are
  // shorthands for one key of them, in any order (RetrieverSpecFlags).
  {
    Status st = cli::AddPresetFlag(&f, argc, argv, &o.retrieval, &o.store.repr_topk, &o.store.repr_heads);
    if (!st.ok()) return Fail(st);
  }
  RetrieverSpecFlags rf(&o.retrieval);
  const ExactIndexOptions exact;
  const auto& rt = RetrieverOptionTable();
  f.Add("probe", cli::OptionHelp(cli::OptionRow(rt, "probe")),
        WithDefault(o.retrieval.probe, [&o](const std::string& s) {
          o.retrieval.probe = s;
          return Status::Ok();
        }));
  f.Add("alloc", cli::OptionHelp(cli::OptionRow(rt, "alloc")),
        WithDefault(o.retrieval.alloc, [&rf](const std::string& s) { return rf.SetAlloc(s); }));
  f.Add("index", cli::OptionHelp(cli::OptionRow(rt, "index")),
        WithDefault(o.retrieval.index, [&rf](const std::string& s) { return rf.SetIndex(s); }));
  cli::AddOptionFlag(&f, rt, "reuse_cosine", &o.retrieval);
  cli::AddOptionFlag(&f, rt, "screen_period", &o.retrieval);
  f.Add("rerank",
        "Exact index: > 0 screens with int8 codes and rescores the chunks the screen's error bound "
        "cannot rule out plus the best F x take; 0 = one full pass over every representative "
        "(index key rerank=F)",
        WithDefault(SpecOr(o.retrieval.index, "rerank", std::to_string(exact.rerank_factor)),
                    [&rf](const std::string& s) { return rf.SetIndexKey("rerank", s); }));
  f.Add("rerank-min",
        "Exact index: at least this many of the screen's best are rescored too (index key rerank_min=N)",
        WithDefault(SpecOr(o.retrieval.index, "rerank_min", std::to_string(exact.rerank_min)),
                    [&rf](const std::string& s) { return rf.SetIndexKey("rerank_min", s); }));
  f.Add("head-merge",
        "Exact index: per-kv-head chunk scores summed (sum) or the best head decides (max) "
        "(index key heads=)",
        WithDefault(SpecOr(o.retrieval.index, "heads", SpecKey(exact.ToString(), "heads")),
                    [&rf](const std::string& s) { return rf.SetIndexKey("heads", s); }));
  f.Add("rank-by",
        "entropy allocator: take chunks by Eq. 10 cosine (cosine, Algorithm 1) or by logit "
        "(allocator key rank=)",
        WithDefault(SpecOr(o.retrieval.alloc, "rank", ChunkRankName(EntropyBudgetOptions{}.rank)),
                    [&rf](const std::string& s) { return rf.SetAllocKey("rank", s); }));
  f.Add(
      "compare", "compare StreamingLLM, InfLLM, ActQKV w/o cut-off and ActQKV on the same data",
      [&o](const std::string& s) {
        o.compare = s != "0";
        return Status::Ok();
      },
      true);
  f.Add("spearman-windows", "prefill windows sampled for probe-to-oracle Spearman rho (0 = off)",
        IntFlag(&o.spearman_windows, 0, 1 << 16));
  f.Add("question-anchors", "only every N-th question-window query seeks the needle (1 = all)",
        IntFlag(&o.workload.question_anchor_every, 1, 1 << 20));
  f.Add("needle-echo", "filler tokens after a needle that look back at it",
        IntFlag(&o.workload.needle_echo, 0, 1 << 20));
  f.Add("compress",
        "compression mode: this scoring policy drops chunks at prefill end (see 'kvtier policies')",
        [&o](const std::string& s) {
          o.compress = s;
          return Status::Ok();
        });
  f.Add("kv-budget",
        "tokens kept per layer (compression), or per kv head and layer with --compare-policies, "
        "where it defaults to " +
            std::to_string(kComparePoliciesKvBudget) + " instead",
        WithDefault(std::to_string(o.kv_budget), [&o, &kv_budget_set](const std::string& s) {
          kv_budget_set = true;
          return IntFlag(&o.kv_budget, 1, int64_t{1} << 40)(s);
        }));
  f.Add("observe", "prompt queries whose attention over every key the scoring policy observes",
        IntFlag(&o.observe, 1, 1 << 16));
  f.Add(
      "compare-policies",
      "run every scoring policy on the same data at the same budget (token-level, exact; "
      "use --context 8192..32768) and print one table",
      [&compare_policies](const std::string& s) {
        compare_policies = s != "0";
        return Status::Ok();
      },
      true);
  f.Add("sweep", "with --compare-policies: comma-separated budgets, e.g. 256,512,1024,2048",
        [&sweep](const std::string& s) { return ParseIntList(s, 1, int64_t{1} << 40, &sweep); });
  f.Add("policies", "with --compare-policies: factory strings separated by ';'",
        WithDefault("every policy with its defaults", [&policy_list](const std::string& s) {
          policy_list.clear();
          size_t pos = 0;
          while (pos <= s.size()) {
            const size_t semi = s.find(';', pos);
            const std::string item =
                s.substr(pos, semi == std::string::npos ? std::string::npos : semi - pos);
            if (item.empty()) return InvalidArgument("empty policy in list '" + s + "'");
            policy_list.push_back(item);
            if (semi == std::string::npos) break;
            pos = semi + 1;
          }
          return Status::Ok();
        }));
  f.Add(
      "host-calls",
      "on a cuda tier, drive the decode steps through Append/Attend with host pointers instead of the "
      "device-pointer calls an engine uses (AppendDevice/AttendDevice)",
      [&o](const std::string& s) {
        o.host_calls = s != "0";
        return Status::Ok();
      },
      true);
  f.Add(
      "defer-cold-chunks",
      "on a cuda tier's device lane, skip a chosen chunk with no warm copy for a step (counted, brought back "
      "to warm with no wait) instead of waiting for it on the host path (SessionOptions::defer_cold_chunks)",
      [&o](const std::string& s) {
        o.defer_cold_chunks = s != "0";
        return Status::Ok();
      },
      true);
  f.Add(
      "no-baseline", "skip the full-attention comparison",
      [&o](const std::string& s) {
        o.baseline = s == "0";
        return Status::Ok();
      },
      true);
  f.Add(
      "no-bandwidth",
      "skip the streaming-bandwidth measurement (a fraction of a second) that each step's byte floor divides "
      "by",
      [&o](const std::string& s) {
        o.measure_bandwidth = s == "0";
        return Status::Ok();
      },
      true);
  f.Add(
      "quiet", "no progress on stderr",
      [&o](const std::string& s) {
        o.progress = s == "0";
        return Status::Ok();
      },
      true);
  f.Add("json", "write the full report as JSON to this file (checked writable before the run)",
        cli::OutputPathFlag(&json));
  std::string trace;
  f.Add("trace",
        "replay this trace ('kvtier trace') instead of the synthetic workload: a real model's Q/K/V; "
        "geometry, context and decode steps come from it",
        cli::PathFlag(&trace));
  Status st = f.Parse("run", argc, argv);
  if (!st.ok()) return Fail(st);
  if (f.help()) {
    f.PrintHelp(
        "usage: kvtier run [flags]\n\nStreams a synthetic long context (a needle at a chosen depth, a "
        "question\n"
        "window at the end) through the tiered store, decodes with retrieval, and\ncompares with full "
        "attention on the same data."
        " --trace FILE replays a model's recorded\nattention ('kvtier trace') instead.");
    return 0;
  }
  if (!trace.empty()) {
    st = UseTraceForRun(trace, f, &o);
    if (!st.ok()) return Fail(st);
  }
  if (compare_policies)
    return ComparePolicies(o, kv_budget_set ? o.kv_budget : kComparePoliciesKvBudget, sweep, policy_list,
                           json);
  st = PrepareDataDir(f, "kvtier-run", &o.store, &place);
  if (!st.ok()) return Fail(st);
  o.drop_at_end = !place.keep;
  auto rep = RunJob(o);
  if (!rep.ok()) return Fail(rep.status());
  std::printf("%s", rep->ToTable().c_str());
  std::printf("%s", DataNote(o.store, place, rep->sequence_dropped, "the run's sequence").c_str());
  if (!json.empty()) {
    if (!WriteFile(json, rep->ToJson())) return Fail(IOError("could not write --json file '" + json + "'"));
    std::printf("report: %s\n", json.c_str());
  }
  return 0;
}

int CmdStress(int argc, char** argv) {
  StressOptions o;
  // Tiny tiers so chunks move all the time.
  o.store.geometry = Geometry{2, 4, 2, 32, DType::kF16};
  o.store.n_sink = 16;
  o.store.n_local = 64;
  o.store.chunk_size = 16;
  o.store.warm_bytes = 64 * o.store.chunk_bytes();
  o.store.hot_bytes = 32 * o.store.chunk_bytes();
  o.store.data_dir.clear();  // a temporary directory unless --data-dir (PrepareDataDir)
  DataPlace place;
  std::string json;
  FlagSet f;
  AddStoreFlags(&f, &o.store, &place);
  f.Add("sequences", "sequences in total", IntFlag(&o.sequences, 1, 1 << 20));
  f.Add("threads", "driver threads", IntFlag(&o.threads, 1, 1024));
  f.Add("tokens", "tokens per sequence and layer", IntFlag(&o.tokens, 1, int64_t{1} << 32));
  f.Add("fetch-prob", "chance of a random fetch after each append", DoubleFlag(&o.fetch_probability));
  f.Add("seed", "random seed", IntFlag(&o.seed, 0, INT64_MAX));
  f.Add("json", "write the report as JSON to this file (checked writable before the test)",
        cli::OutputPathFlag(&json));
  Status st = f.Parse("stress", argc, argv);
  if (!st.ok()) return Fail(st);
  if (f.help()) {
    f.PrintHelp(
        "usage: kvtier stress [flags]\n\nMany sequences appended concurrently into tiny tiers, random "
        "promotions,\n"
        "then every chunk verified bit for bit, before and after reopening the store.");
    return 0;
  }
  st = PrepareDataDir(f, "kvtier-stress", &o.store, &place);
  if (!st.ok()) return Fail(st);
  o.drop_at_end = !place.keep;
  auto rep = RunStress(o);
  if (!rep.ok()) return Fail(rep.status());
  std::printf("%s", rep->ToTable(o).c_str());
  std::printf("%s", DataNote(o.store, place, rep->sequences_dropped, "the sequences").c_str());
  if (!json.empty() && !WriteFile(json, rep->ToJson(o)))
    return Fail(IOError("could not write --json file '" + json + "'"));
  return rep->errors == 0 ? 0 : 1;
}

void Usage() {
  std::printf(
      "usage: kvtier <command> [flags]\n\n"
      "commands:\n"
      "  run       long-sequence run on a synthetic ∞-Bench-style workload, compared with full attention\n"
      "  stress    offload stress test: concurrent appends, tiny tiers, bit-for-bit verification\n"
      "  policies  the scoring policies (demotion and compression) with their parameters and defaults\n"
      "  compile-tables  CompilerKV's offline compiler: record traces, fit the tables (conservative "
      "Q-learning)\n"
      "  infinite  passkey / number_string / kv_retrieval through the kvtier-llama model with retrieval "
      "inside\n"
      "            it (--compare: full attention, StreamingLLM, InfLLM, ActQKV by context length)\n"
      "  trace     record the kvtier-llama model's real Q/K/V on one prompt, for 'kvtier run --trace FILE'\n"
      "  check     is a store's data directory whole: every acknowledged chunk present (names the lost "
      "ones; read-only)\n"
      "  repair    RocksDB's repair of a damaged store, into a copy or in place, then the same check\n"
      "  help      this text\n\n"
      "'kvtier <command> --help' lists a command's flags.\n");
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) {
  using namespace kvtier;
#ifdef __GLIBC__
  // glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB); blocks
  // below it then come from the heap and leave holes there that stay resident once freed. A
  // run over a long context grows and frees arrays of that size (the index's first build, the
  // sync's batches, RocksDB's arenas): at 1M tokens the holes held about 100 MiB of RSS. A
  // fixed threshold maps every block of 1 MiB or more on its own and unmaps it when freed.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
  if (argc < 2) {
    Usage();
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "run") return CmdRun(argc - 2, argv + 2);
  if (cmd == "stress") return CmdStress(argc - 2, argv + 2);
  if (cmd == "policies") return CmdPolicies(argc - 2, argv + 2);
  if (cmd == "compile-tables") return RunCompileTables(argc - 2, argv + 2);
  if (cmd == "infinite") return RunInfinite(argc - 2, argv + 2);
  if (cmd == "trace") return RunTrace(argc - 2, argv + 2);
  if (cmd == "check") return RunCheck(argc - 2, argv + 2);
  if (cmd == "repair") return RunRepair(argc - 2, argv + 2);
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    Usage();
    return 0;
  }
  std::fprintf(stderr,
               "kvtier: error: unknown command '%s' (run | stress | policies | compile-tables | infinite | "
               "trace | check | repair | help)\n",
               cmd.c_str());
  return 2;
}
