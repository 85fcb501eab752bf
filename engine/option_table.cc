#include "engine/option_table.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "kernels/dtype.h"
#include "offload/cold_tier.h"
#include "offload/representatives.h"

namespace kvtier {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// get/set of one member of a plain type (int, uint64_t, bool, double, std::string).
#define KVTIER_OPT_INT(T, m)                                                               \
  [](const T& o) -> OptionValue { return static_cast<int64_t>(o.m); },                     \
      [](T* o, const OptionValue& v) -> Status {                                           \
        o->m = static_cast<std::remove_reference_t<decltype(o->m)>>(std::get<int64_t>(v)); \
        return Status::Ok();                                                               \
      }
#define KVTIER_OPT_BOOL(T, m)                                                               \
  [](const T& o) -> OptionValue { return o.m; }, [](T* o, const OptionValue& v) -> Status { \
    o->m = std::get<bool>(v);                                                               \
    return Status::Ok();                                                                    \
  }
#define KVTIER_OPT_DOUBLE(T, m)                                                             \
  [](const T& o) -> OptionValue { return o.m; }, [](T* o, const OptionValue& v) -> Status { \
    o->m = std::get<double>(v);                                                             \
    return Status::Ok();                                                                    \
  }
#define KVTIER_OPT_STRING(T, m)                                                             \
  [](const T& o) -> OptionValue { return o.m; }, [](T* o, const OptionValue& v) -> Status { \
    o->m = std::get<std::string>(v);                                                        \
    return Status::Ok();                                                                    \
  }

using S = StoreOptions;
using R = RetrieverOptions;
using Se = SessionOptions;

}  // namespace

const char* OptionTypeName(OptionType type) {
  switch (type) {
    case OptionType::kInt:
      return "int";
    case OptionType::kBytes:
      return "bytes";
    case OptionType::kBool:
      return "bool";
    case OptionType::kDouble:
      return "double";
    case OptionType::kString:
      return "string";
    case OptionType::kChoice:
      return "choice";
  }
  return "unknown";
}

const std::vector<StoreOptionDesc>& StoreOptionTable() {
  static const std::vector<StoreOptionDesc> table = {
      {"layers", "geometry.layers", "", OptionType::kInt, "32", "transformer layers of the model's KV cache",
       1, 1 << 16, "", KVTIER_OPT_INT(S, geometry.layers)},
      {"q_heads", "geometry.q_heads", "", OptionType::kInt, "32", "query heads (a multiple of kv_heads)", 1,
       1 << 16, "", KVTIER_OPT_INT(S, geometry.q_heads)},
      {"kv_heads", "geometry.kv_heads", "", OptionType::kInt, "8", "kv heads (GQA)", 1, 1 << 16, "",
       KVTIER_OPT_INT(S, geometry.kv_heads)},
      {"head_dim", "geometry.head_dim", "", OptionType::kInt, "128", "dimension of one head", 1, 1 << 16, "",
       KVTIER_OPT_INT(S, geometry.head_dim)},
      {"dtype", "geometry.dtype", "dtype", OptionType::kChoice, "f16", "storage dtype of K and V", 0, 0,
       "f16|bf16|f32", [](const S& o) -> OptionValue { return std::string(DTypeName(o.geometry.dtype)); },
       [](S* o, const OptionValue& v) -> Status {
         if (!ParseDType(std::get<std::string>(v).c_str(), &o->geometry.dtype))
           return InvalidArgument("unknown dtype '" + std::get<std::string>(v) + "'");
         return Status::Ok();
       }},
      {"n_sink", "n_sink", "sink", OptionType::kInt, "64", "attention-sink tokens kept hot", 0, 1 << 20, "",
       KVTIER_OPT_INT(S, n_sink)},
      {"n_local", "n_local", "local", OptionType::kInt, "512",
       "local window kept hot (a multiple of chunk_size)", 1, 1 << 24, "", KVTIER_OPT_INT(S, n_local)},
      {"chunk_size", "chunk_size", "chunk", OptionType::kInt, "32", "tokens per chunk", 1, 1 << 16, "",
       KVTIER_OPT_INT(S, chunk_size)},
      {"repr_topk", "repr_topk", "repr-topk", OptionType::kInt, "4", "representative keys per head per chunk",
       1, 1 << 16, "", KVTIER_OPT_INT(S, repr_topk)},
      {"repr_choice", "repr_choice", "repr-choice", OptionType::kChoice, "mass",
       "how representatives are chosen from the attention their keys got: mass (InfLLM: the most attended), "
       "diverse (the most attended, then by attention minus cosine to those taken) or cluster (diverse's "
       "keys as seeds; each representative the mean of the keys closest in angle to its seed)",
       0, 0, "mass|diverse|cluster",
       [](const S& o) -> OptionValue { return std::string(ReprChoiceName(o.repr_choice)); },
       [](S* o, const OptionValue& v) -> Status {
         if (!ParseReprChoice(std::get<std::string>(v), &o->repr_choice))
           return InvalidArgument("unknown repr_choice '" + std::get<std::string>(v) +
                                  "' (mass|diverse|cluster)");
         return Status::Ok();
       }},
      {"hot_bytes", "hot_bytes", "hot-bytes", OptionType::kBytes, "67108864",
       "hot slot pool for retrieved chunks (sinks and local ring are extra, reported in hot bytes)", 1,
       kInt64Max, "", KVTIER_OPT_INT(S, hot_bytes)},
      {"warm_bytes", "warm_bytes", "warm-bytes", OptionType::kBytes, "268435456", "warm tier capacity", 1,
       kInt64Max, "", KVTIER_OPT_INT(S, warm_bytes)},
      {"index_bytes", "index_bytes", "index-bytes", OptionType::kBytes, "0",
       "retrieval index memory per session, all layers (0 = unbounded; past it the oldest chunks are kept as "
       "int8 codes, then evicted; Exact index only)",
       0, kInt64Max, "", KVTIER_OPT_INT(S, index_bytes)},
      {"data_dir", "data_dir", "data-dir", OptionType::kString, "",
       "cold tier (RocksDB) directory; none if empty (a full warm tier is then ResourceExhausted)", 0, 0, "",
       KVTIER_OPT_STRING(S, data_dir)},
      {"compression", "compression", "compression", OptionType::kChoice, "lz4", "cold tier block compression",
       0, 0, "none|lz4|zstd",
       [](const S& o) -> OptionValue { return std::string(CompressionName(o.compression)); },
       [](S* o, const OptionValue& v) -> Status {
         if (!ParseCompression(std::get<std::string>(v), &o->compression))
           return InvalidArgument("unknown compression '" + std::get<std::string>(v) + "'");
         return Status::Ok();
       }},
      {"sync_writes", "sync_writes", "sync", OptionType::kBool, "false",
       "fsync every cold write (power-loss durability; process-kill durability holds either way)", 0, 0, "",
       KVTIER_OPT_BOOL(S, sync_writes)},
      {"write_through", "write_through", "", OptionType::kBool, "true",
       "write each chunk to cold when it is sealed: crash-safe, and demotion from warm is then free", 0, 0,
       "", KVTIER_OPT_BOOL(S, write_through)},
      {"pin_timeout_ms", "pin_timeout_ms", "", OptionType::kInt, "30000",
       "lease of a pinned chunk; a forgotten pin stops protecting after it", 1, kInt32Max, "",
       KVTIER_OPT_INT(S, pin_timeout_ms)},
      {"pin_wait_ms", "pin_wait_ms", "", OptionType::kInt, "10000",
       "longest a fetch waits for hot slots other sessions hold pinned (0 = fail at once); counted in "
       "pin_waits, "
       "pin_wait_us",
       0, kInt32Max, "", KVTIER_OPT_INT(S, pin_wait_ms)},
      {"hot_policy", "hot_policy", "", OptionType::kString, "lru",
       "demotion policy of the hot slot pool (factory string)", 0, 0, "", KVTIER_OPT_STRING(S, hot_policy)},
      {"warm_policy", "warm_policy", "", OptionType::kString, "lru",
       "demotion policy of the warm tier (factory string)", 0, 0, "", KVTIER_OPT_STRING(S, warm_policy)},
      {"transfer_threads", "transfer_threads", "", OptionType::kInt, "2",
       "concurrency of the oneTBB transfer arena (capped at the cores available)", 1, 1024, "",
       KVTIER_OPT_INT(S, transfer_threads)},
      {"max_landing_chunks", "max_landing_chunks", "", OptionType::kInt, "8",
       "sealed chunks per (sequence, layer) whose download from the local window may be in flight "
       "(asynchronous on "
       "a device hot tier); one more waits for the oldest",
       1, 1 << 16, "", KVTIER_OPT_INT(S, max_landing_chunks)},
      {"device", "device", "device", OptionType::kChoice, "cpu",
       "where the hot tier's memory is (cuda: GPU memory, needs a CUDA build and a device)", 0, 0, "cpu|cuda",
       [](const S& o) -> OptionValue { return std::string(DeviceName(o.device)); },
       [](S* o, const OptionValue& v) -> Status {
         KVTIER_ASSIGN_OR_RETURN(o->device, ParseDevice(std::get<std::string>(v)));
         return Status::Ok();
       }},
      {"accept_lost_chunks", "accept_lost_chunks", "", OptionType::kBool, "false",
       "open a store whose acknowledged chunks did not come back (a damaged WAL) anyway: they become holes "
       "for good, "
       "LostChunks() lists them",
       0, 0, "", KVTIER_OPT_BOOL(S, accept_lost_chunks)},
      {"remote", "remote", "remote", OptionType::kString, "",
       "remote tier on Redis, redis://[USER:PASSWORD@]host:port[,host:port...][?wait=N&timeout_ms=N&...] "
       "(one server or any nodes of a cluster; credentials and options: docs/cli.md); none if empty",
       0, 0, "", KVTIER_OPT_STRING(S, remote)},
      {"remote_namespace", "remote_namespace", "", OptionType::kString, "",
       "key namespace of this store's chunks in Redis; empty = a fresh one per Open (host, pid, time)", 0, 0,
       "", KVTIER_OPT_STRING(S, remote_namespace)},
  };
  return table;
}

const std::vector<RetrieverOptionDesc>& RetrieverOptionTable() {
  static const std::vector<RetrieverOptionDesc> table = {
      {"probe", "probe", "probe", OptionType::kString, "act",
       "probe builder: act[:eps=..] | mean | question[:base=..,weight=..]", 0, 0, "",
       KVTIER_OPT_STRING(R, probe)},
      {"alloc", "alloc", "alloc", OptionType::kString, "entropy",
       "budget allocator: entropy[:min=M,rank=cosine|logit] | topk", 0, 0, "", KVTIER_OPT_STRING(R, alloc)},
      {"index", "index", "index", OptionType::kString, "Exact",
       "chunk index: Exact[:heads=sum|max,rerank=F,rerank_min=N] or a FAISS kind (Flat, HNSW32, IVF<n>,Flat)",
       0, 0, "", KVTIER_OPT_STRING(R, index)},
      {"budget_tokens", "budget_tokens", "budget", OptionType::kInt, "2048",
       "retrieved tokens per layer and step (budget_tokens / chunk_size chunks; the hot pool must hold them)",
       0, 1 << 24, "", KVTIER_OPT_INT(R, budget_tokens)},
      {"reuse_cosine", "reuse_cosine", "reuse", OptionType::kDouble, "0",
       "while no chunk landed and each kv head's probe keeps this cosine with the one searched for, "
       "rescore the layer's last search's shortlist instead of every chunk (0 = search every step)",
       0, 0, "", KVTIER_OPT_DOUBLE(R, reuse_cosine)},
      {"screen_period", "screen_period", "screen", OptionType::kInt, "1",
       "a decode step screens a rotating 1/R of a layer's chunks and rescores its shortlist, instead of "
       "screening every chunk (1 = every chunk every step; needs alloc=entropy and the Exact index)",
       1, 1 << 20, "", KVTIER_OPT_INT(R, screen_period)},
  };
  return table;
}

const std::vector<SessionOptionDesc>& SessionOptionTable() {
  static const std::vector<SessionOptionDesc> table = {
      {"retrieve", "retrieve", "", OptionType::kBool, "true",
       "false: attend every live chunk (full attention through the store)", 0, 0, "",
       KVTIER_OPT_BOOL(Se, retrieve)},
      {"positions", "positions", "", OptionType::kChoice, "absolute",
       "keys after RoPE (absolute: the engine applies it) or before it (infllm: the session rotates)", 0, 0,
       "absolute|infllm",
       [](const Se& o) -> OptionValue { return std::string(PositionModeName(o.positions)); },
       [](Se* o, const OptionValue& v) -> Status {
         KVTIER_ASSIGN_OR_RETURN(o->positions, ParsePositionMode(std::get<std::string>(v)));
         return Status::Ok();
       }},
      {"rope_theta", "rope_theta", "", OptionType::kDouble, "10000",
       "infllm positions: RoPE base (rotate-half, Hugging Face Llama)", 0, 0, "",
       KVTIER_OPT_DOUBLE(Se, rope_theta)},
      {"observe_prefill", "observe_prefill", "", OptionType::kBool, "true",
       "prefill Attend feeds representative-key statistics", 0, 0, "", KVTIER_OPT_BOOL(Se, observe_prefill)},
      {"keep_queries", "keep_queries", "", OptionType::kInt, "0",
       "most recent queries kept per layer for Compress (0 = none)", 0, 1 << 20, "",
       KVTIER_OPT_INT(Se, keep_queries)},
  };
  return table;
}

const std::vector<NotAnOption>& StoreOptionsNotOptions() {
  // Every field is an option: what tests and tools plug in (a hot tier of their own, the
  // lease clock, a cold-tier fault injector) is offload/store_hooks.h's StoreHooks.
  static const std::vector<NotAnOption> list = {};
  return list;
}

const std::vector<NotAnOption>& SessionOptionsNotOptions() {
  static const std::vector<NotAnOption> list = {
      {"retrieval", "a RetrieverOptions: its fields are RetrieverOptionTable's rows"},
  };
  return list;
}

std::string FormatOptionValue(const OptionValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const auto* d = std::get_if<double>(&v)) {
    // Whole numbers in full ("10000", not "1e+04"), others the shortest text that reads back.
    if (std::trunc(*d) == *d && std::fabs(*d) < 1e15) return std::to_string(static_cast<int64_t>(*d));
    char buf[32];
    for (int digits = 1; digits <= 17; ++digits) {
      std::snprintf(buf, sizeof(buf), "%.*g", digits, *d);
      if (std::strtod(buf, nullptr) == *d) break;
    }
    return buf;
  }
  return std::get<std::string>(v);
}

Status CheckOptionValue(OptionType type, const char* name, int64_t lo, int64_t hi, const char* choices,
                        const OptionValue& v) {
  const std::string opt = std::string("option '") + name + "': ";
  switch (type) {
    case OptionType::kInt:
    case OptionType::kBytes: {
      const auto* i = std::get_if<int64_t>(&v);
      if (i == nullptr) return InvalidArgument(opt + "expected an int");
      if (*i < lo || *i > hi)
        return InvalidArgument(opt + std::to_string(*i) + " is outside [" + std::to_string(lo) + ", " +
                               std::to_string(hi) + "]");
      return Status::Ok();
    }
    case OptionType::kBool:
      if (!std::holds_alternative<bool>(v)) return InvalidArgument(opt + "expected a bool");
      return Status::Ok();
    case OptionType::kDouble: {
      const auto* d = std::get_if<double>(&v);
      if (d == nullptr) return InvalidArgument(opt + "expected a number");
      if (!std::isfinite(*d)) return InvalidArgument(opt + "expected a finite number");
      return Status::Ok();
    }
    case OptionType::kString:
      if (!std::holds_alternative<std::string>(v)) return InvalidArgument(opt + "expected a str");
      return Status::Ok();
    case OptionType::kChoice: {
      const auto* s = std::get_if<std::string>(&v);
      if (s == nullptr) return InvalidArgument(opt + "expected a str");
      const std::string_view all = choices;
      size_t pos = 0;
      while (pos <= all.size()) {
        const size_t bar = all.find('|', pos);
        const std::string_view c =
            all.substr(pos, bar == std::string_view::npos ? std::string_view::npos : bar - pos);
        if (c == *s) return Status::Ok();
        if (bar == std::string_view::npos) break;
        pos = bar + 1;
      }
      return InvalidArgument(opt + "expected " + choices + " (got '" + *s + "')");
    }
  }
  return InvalidArgument(opt + "unknown option type");
}

}  // namespace kvtier
