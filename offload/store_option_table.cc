#include "offload/store_option_table.h"

#include <cstdint>
#include <limits>
#include <string>

#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"
#include "offload/cold_tier.h"
#include "offload/representatives.h"

namespace kvtier {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// Geometry's bound on layers and query heads (Geometry::Validate: "implausibly large").
constexpr int64_t kMaxHeads = 4096;

using S = StoreOptions;

}  // namespace

const std::vector<StoreOptionDesc>& StoreOptionTable() {
  static const std::vector<StoreOptionDesc> table = {
      {.name = "layers",
       .field = "geometry.layers",
       .meaning = "transformer layers of the model's KV cache",
       .lo = 1,
       .hi = kMaxHeads,
       KVTIER_OPT_INT(S, geometry.layers)},
      {.name = "q_heads",
       .field = "geometry.q_heads",
       .meaning = "query heads (a multiple of kv_heads)",
       .lo = 1,
       .hi = kMaxHeads,
       KVTIER_OPT_INT(S, geometry.q_heads)},
      {.name = "kv_heads",
       .field = "geometry.kv_heads",
       .meaning = "kv heads (GQA)",
       .lo = 1,
       .hi = kMaxHeads,
       KVTIER_OPT_INT(S, geometry.kv_heads)},
      {.name = "head_dim",
       .field = "geometry.head_dim",
       .meaning = "dimension of one head (what the attention kernel supports)",
       .lo = 1,
       .hi = kernels::kMaxHeadDim,
       KVTIER_OPT_INT(S, geometry.head_dim)},
      {.name = "dtype",
       .field = "geometry.dtype",
       .flag = "dtype",
       .type = OptionType::kChoice,
       .meaning = "storage dtype of K and V",
       .choices = DTypeSpellings(),
       .get = [](const S& o) -> OptionValue { return std::string(DTypeName(o.geometry.dtype)); },
       .set = [](S* o, const OptionValue& v) -> Status {
         if (!ParseDType(std::get<std::string>(v).c_str(), &o->geometry.dtype))
           return InvalidArgument("unknown dtype '" + std::get<std::string>(v) + "' (" + DTypeSpellings() +
                                  ")");
         return Status::Ok();
       }},
      {.name = "n_sink",
       .field = "n_sink",
       .flag = "sink",
       .meaning = "attention-sink tokens kept hot",
       .lo = 0,
       .hi = 1 << 20,
       KVTIER_OPT_INT(S, n_sink)},
      {.name = "n_local",
       .field = "n_local",
       .flag = "local",
       .meaning = "local window kept hot (a multiple of chunk_size)",
       .lo = 1,
       .hi = 1 << 30,
       KVTIER_OPT_INT(S, n_local)},
      {.name = "chunk_size",
       .field = "chunk_size",
       .flag = "chunk",
       .meaning = "tokens per chunk",
       .lo = 1,
       .hi = 1 << 16,
       KVTIER_OPT_INT(S, chunk_size)},
      {.name = "repr_topk",
       .field = "repr_topk",
       .flag = "repr-topk",
       .meaning = "representative keys per head per chunk (at most chunk_size)",
       .lo = 1,
       .hi = 1 << 16,
       KVTIER_OPT_INT(S, repr_topk)},
      {.name = "repr_choice",
       .field = "repr_choice",
       .flag = "repr-choice",
       .type = OptionType::kChoice,
       .meaning =
           "how representatives are chosen from the attention their keys got: mass (InfLLM: the most "
           "attended), diverse (the most attended, then by attention minus cosine to those taken) or "
           "cluster (diverse's keys as seeds; each representative the mean of the keys closest in angle "
           "to its seed)",
       .choices = "mass|diverse|cluster",
       .get = [](const S& o) -> OptionValue { return std::string(ReprChoiceName(o.repr_choice)); },
       .set = [](S* o, const OptionValue& v) -> Status {
         if (!ParseReprChoice(std::get<std::string>(v), &o->repr_choice))
           return InvalidArgument("unknown repr_choice '" + std::get<std::string>(v) +
                                  "' (mass|diverse|cluster)");
         return Status::Ok();
       }},
      {.name = "repr_heads",
       .field = "repr_heads",
       .flag = "repr-heads",
       .type = OptionType::kChoice,
       .meaning =
           "whose heads the representatives belong to: kv (per kv head, chosen by the mass summed over "
           "its query heads) or query (InfLLM: per query head, chosen by that head's own mass; "
           "[repr_topk, q_heads, head_dim] per chunk, scored by per-query-head probes)",
       .choices = "kv|query",
       .get = [](const S& o) -> OptionValue { return std::string(ReprHeadsName(o.repr_heads)); },
       .set = [](S* o, const OptionValue& v) -> Status {
         if (!ParseReprHeads(std::get<std::string>(v), &o->repr_heads))
           return InvalidArgument("unknown repr_heads '" + std::get<std::string>(v) + "' (kv|query)");
         return Status::Ok();
       }},
      {.name = "hot_bytes",
       .field = "hot_bytes",
       .flag = "hot-bytes",
       .type = OptionType::kBytes,
       .meaning =
           "hot slot pool for retrieved chunks (sinks and local ring are extra, reported in hot bytes)",
       .lo = 1,
       .hi = kInt64Max,
       KVTIER_OPT_INT(S, hot_bytes)},
      {.name = "warm_bytes",
       .field = "warm_bytes",
       .flag = "warm-bytes",
       .type = OptionType::kBytes,
       .meaning = "warm tier capacity",
       .lo = 1,
       .hi = kInt64Max,
       KVTIER_OPT_INT(S, warm_bytes)},
      {.name = "index_bytes",
       .field = "index_bytes",
       .flag = "index-bytes",
       .type = OptionType::kBytes,
       .meaning =
           "retrieval index memory per session, all layers (0 = unbounded, else at least 1 MiB; past it "
           "the oldest chunks are kept as int8 codes, then evicted; Exact index only)",
       .lo = 0,
       .hi = kInt64Max,
       KVTIER_OPT_INT(S, index_bytes)},
      {.name = "data_dir",
       .field = "data_dir",
       .flag = "data-dir",
       .type = OptionType::kString,
       .meaning = "cold tier (RocksDB) directory; none if empty (a full warm tier is then ResourceExhausted)",
       KVTIER_OPT_STRING(S, data_dir)},
      {.name = "compression",
       .field = "compression",
       .flag = "compression",
       .type = OptionType::kChoice,
       .meaning = "cold tier block compression",
       .choices = "none|lz4|zstd",
       .get = [](const S& o) -> OptionValue { return std::string(CompressionName(o.compression)); },
       .set = [](S* o, const OptionValue& v) -> Status {
         if (!ParseCompression(std::get<std::string>(v), &o->compression))
           return InvalidArgument("unknown compression '" + std::get<std::string>(v) + "'");
         return Status::Ok();
       }},
      {.name = "sync_writes",
       .field = "sync_writes",
       .flag = "sync",
       .type = OptionType::kBool,
       .meaning = "fsync every cold write (power-loss durability; process-kill durability holds either way)",
       KVTIER_OPT_BOOL(S, sync_writes)},
      {.name = "write_through",
       .field = "write_through",
       .type = OptionType::kBool,
       .meaning =
           "write each chunk to cold when it is sealed: crash-safe, and demotion from warm is then free",
       KVTIER_OPT_BOOL(S, write_through)},
      {.name = "pin_timeout_ms",
       .field = "pin_timeout_ms",
       .meaning = "lease of a pinned chunk; a forgotten pin stops protecting after it",
       .lo = 1,
       .hi = kInt32Max,
       KVTIER_OPT_INT(S, pin_timeout_ms)},
      {.name = "pin_wait_ms",
       .field = "pin_wait_ms",
       .meaning =
           "longest a fetch waits for hot slots other sessions hold pinned (0 = fail at once); counted "
           "in pin_waits, pin_wait_us",
       .lo = 0,
       .hi = kInt32Max,
       KVTIER_OPT_INT(S, pin_wait_ms)},
      {.name = "hot_policy",
       .field = "hot_policy",
       .type = OptionType::kString,
       .meaning = "demotion policy of the hot slot pool (factory string)",
       KVTIER_OPT_STRING(S, hot_policy)},
      {.name = "warm_policy",
       .field = "warm_policy",
       .type = OptionType::kString,
       .meaning = "demotion policy of the warm tier (factory string)",
       KVTIER_OPT_STRING(S, warm_policy)},
      {.name = "transfer_threads",
       .field = "transfer_threads",
       .meaning = "concurrency of the oneTBB transfer arena (capped at the cores available)",
       .lo = 1,
       .hi = 1024,
       KVTIER_OPT_INT(S, transfer_threads)},
      {.name = "max_landing_chunks",
       .field = "max_landing_chunks",
       .meaning = "sealed chunks per (sequence, layer) whose download from the local window may be in flight "
                  "(asynchronous on a device hot tier); one more waits for the oldest",
       .lo = 1,
       .hi = 1 << 16,
       KVTIER_OPT_INT(S, max_landing_chunks)},
      {.name = "device",
       .field = "device",
       .flag = "device",
       .type = OptionType::kChoice,
       .meaning = "where the hot tier's memory is (cuda: GPU memory, needs a CUDA build and a device)",
       .choices = "cpu|cuda",
       .get = [](const S& o) -> OptionValue { return std::string(DeviceName(o.device)); },
       .set = [](S* o, const OptionValue& v) -> Status {
         KVTIER_ASSIGN_OR_RETURN(o->device, ParseDevice(std::get<std::string>(v)));
         return Status::Ok();
       }},
      {.name = "accept_lost_chunks",
       .field = "accept_lost_chunks",
       .type = OptionType::kBool,
       .meaning =
           "open a store whose acknowledged chunks did not come back (a damaged WAL) anyway: they become "
           "holes for good, LostChunks() lists them",
       KVTIER_OPT_BOOL(S, accept_lost_chunks)},
      {.name = "remote",
       .field = "remote",
       .flag = "remote",
       .type = OptionType::kString,
       .meaning =
           "remote tier on Redis, redis://[USER:PASSWORD@]host:port[,host:port...][?wait=N&timeout_ms=N&...] "
           "(one server or any nodes of a cluster; credentials and options: docs/cli.md); none if empty",
       KVTIER_OPT_STRING(S, remote)},
      {.name = "remote_namespace",
       .field = "remote_namespace",
       .type = OptionType::kString,
       .meaning =
           "key namespace of this store's chunks in Redis; empty = a fresh one per Open (host, pid, time)",
       KVTIER_OPT_STRING(S, remote_namespace)},
  };
  return table;
}

const std::vector<NotAnOption>& StoreOptionsNotOptions() {
  // Every field is an option: what tests and tools plug in (a hot tier of their own, the
  // lease clock, a cold-tier fault injector) is offload/store_hooks.h's StoreHooks.
  static const std::vector<NotAnOption> list = {};
  return list;
}

}  // namespace kvtier
