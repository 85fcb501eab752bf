// The C API (include/kvtier/kvtier_c.h) over Store and Session. Every entry point
// checks its handles, pointers and enums, runs the C++ call inside a catch-all (bad_alloc
// -> ResourceExhausted, anything else -> Internal), and copies the Status into the
// caller's kvtier_error without allocating.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <unordered_set>

#include "engine/c_api_internal.h"
#include "engine/option_table.h"
#include "kvtier/kvtier.h"
#include "kvtier/kvtier_c.h"

struct kvtier_store {
  std::unique_ptr<kvtier::Store> store;
  std::atomic<int> open_sessions{0};  // session handles not yet destroyed
};

struct kvtier_session {
  std::unique_ptr<kvtier::Session> session;
  kvtier_store* owner = nullptr;
};

namespace {

using kvtier::Status;
using kvtier::StatusCode;

static_assert(KVTIER_OK == static_cast<int>(StatusCode::kOk));
static_assert(KVTIER_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument));
static_assert(KVTIER_NOT_FOUND == static_cast<int>(StatusCode::kNotFound));
static_assert(KVTIER_ALREADY_EXISTS == static_cast<int>(StatusCode::kAlreadyExists));
static_assert(KVTIER_FAILED_PRECONDITION == static_cast<int>(StatusCode::kFailedPrecondition));
static_assert(KVTIER_RESOURCE_EXHAUSTED == static_cast<int>(StatusCode::kResourceExhausted));
static_assert(KVTIER_CORRUPTION == static_cast<int>(StatusCode::kCorruption));
static_assert(KVTIER_IO_ERROR == static_cast<int>(StatusCode::kIOError));
static_assert(KVTIER_TIMED_OUT == static_cast<int>(StatusCode::kTimedOut));
static_assert(KVTIER_UNAVAILABLE == static_cast<int>(StatusCode::kUnavailable));
static_assert(KVTIER_INTERNAL == static_cast<int>(StatusCode::kInternal));
static_assert(KVTIER_PERMISSION_DENIED == static_cast<int>(StatusCode::kPermissionDenied));
static_assert(KVTIER_F32 == static_cast<int>(kvtier::DType::kF32));
static_assert(KVTIER_F16 == static_cast<int>(kvtier::DType::kF16));
static_assert(KVTIER_BF16 == static_cast<int>(kvtier::DType::kBF16));
static_assert(KVTIER_COMPRESSION_NONE == static_cast<int>(kvtier::Compression::kNone));
static_assert(KVTIER_COMPRESSION_LZ4 == static_cast<int>(kvtier::Compression::kLZ4));
static_assert(KVTIER_COMPRESSION_ZSTD == static_cast<int>(kvtier::Compression::kZSTD));
static_assert(KVTIER_DEVICE_CPU == static_cast<int>(kvtier::Device::kCpu));
static_assert(KVTIER_DEVICE_CUDA == static_cast<int>(kvtier::Device::kCuda));
static_assert(KVTIER_REPR_MASS == static_cast<int>(kvtier::ReprChoice::kMass));
static_assert(KVTIER_REPR_DIVERSE == static_cast<int>(kvtier::ReprChoice::kDiverse));
static_assert(KVTIER_REPR_CLUSTER == static_cast<int>(kvtier::ReprChoice::kCluster));
static_assert(KVTIER_REPR_HEADS_KV == static_cast<int>(kvtier::ReprHeads::kKv));
static_assert(KVTIER_REPR_HEADS_QUERY == static_cast<int>(kvtier::ReprHeads::kQuery));

void CopyString(char* dst, size_t size, const char* src) {
  if (size == 0) return;
  const size_t n = std::min(std::strlen(src), size - 1);
  std::memcpy(dst, src, n);
  dst[n] = '\0';
}

// Writes the outcome into *err (when given) and returns its code. Never allocates.
kvtier_code Report(kvtier_error* err, kvtier_code code, const char* message) {
  if (err != nullptr) {
    err->code = code;
    CopyString(err->message, sizeof(err->message), code == KVTIER_OK ? "" : message);
  }
  return code;
}

kvtier_code Report(kvtier_error* err, const Status& s) {
  return Report(err, static_cast<kvtier_code>(s.code()), s.message().c_str());
}

kvtier_code Invalid(kvtier_error* err, const char* fn, const char* what) {
  char buf[KVTIER_ERROR_MESSAGE_SIZE];
  std::snprintf(buf, sizeof(buf), "%s: %s", fn, what);
  return Report(err, KVTIER_INVALID_ARGUMENT, buf);
}

// Runs body (returning a Status) with no exception escaping.
template <typename F>
kvtier_code Guard(kvtier_error* err, const char* fn, F&& body) noexcept {
  char buf[KVTIER_ERROR_MESSAGE_SIZE];
  try {
    return Report(err, body());
  } catch (const std::bad_alloc&) {
    std::snprintf(buf, sizeof(buf), "%s: out of memory", fn);
    return Report(err, KVTIER_RESOURCE_EXHAUSTED, buf);
  } catch (const std::exception& e) {
    std::snprintf(buf, sizeof(buf), "%s: unexpected exception: %s", fn, e.what());
    return Report(err, KVTIER_INTERNAL, buf);
  } catch (...) {
    std::snprintf(buf, sizeof(buf), "%s: unexpected exception", fn);
    return Report(err, KVTIER_INTERNAL, buf);
  }
}

// A C caller may pass any int where an enum is expected; in C++ reading an enum object
// whose value is outside the enum's range is undefined, so enums coming from C are read
// through their object representation and checked as ints.
template <typename E>
long long Raw(const E& e) {
  static_assert(std::is_enum_v<E>);
  std::underlying_type_t<E> v;
  std::memcpy(&v, &e, sizeof v);
  return static_cast<long long>(v);
}

bool ValidDType(long long d) { return d == KVTIER_F32 || d == KVTIER_F16 || d == KVTIER_BF16; }

// An append's dtype from C: KVTIER_OK, or KVTIER_INVALID_ARGUMENT naming the bad value.
kvtier_code CheckAppendDType(kvtier_error* err, const char* fn, long long raw_dtype) {
  if (ValidDType(raw_dtype)) return KVTIER_OK;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "dtype %lld is not a kvtier_dtype (KVTIER_F32, KVTIER_F16, KVTIER_BF16)",
                raw_dtype);
  return Invalid(err, fn, buf);
}

void AttendStatsToC(const kvtier::AttendStats& st, kvtier_attend_stats* out) {
  out->probe_ms = st.probe_ms;
  out->search_ms = st.search_ms;
  out->alloc_ms = st.alloc_ms;
  out->fetch_ms = st.fetch_ms;
  out->attention_ms = st.attention_ms;
  out->entropy = st.entropy;
  out->chunks = st.chunks;
  out->chunks_clipped = st.chunks_clipped;
  out->reused = st.reused ? 1 : 0;
  out->sliced = st.sliced ? 1 : 0;
  out->first_stage_bytes = st.first_stage_bytes;
  out->rescoring_bytes = st.rescoring_bytes;
  out->attention_bytes = st.attention_bytes;
}

// A string the C structs point at after kvtier_*_options_set or _default: kept for the
// life of the process (one copy per distinct text), so the caller's buffer may go away.
const char* Intern(const std::string& text) {
  static std::mutex mu;
  static std::unordered_set<std::string> strings;
  const std::lock_guard<std::mutex> lock(mu);
  return strings.insert(text).first->c_str();
}

const char* OrEmpty(const char* s) { return s != nullptr ? s : ""; }

// The C store options as kvtier::StoreOptions and back: the one place that names the C
// fields. Enums are checked as ints (a C caller may pass any int); bad ones are named.
Status StoreOptionsFromC(const kvtier_store_options& c, kvtier::StoreOptions* so) {
  if (!ValidDType(Raw(c.dtype)))
    return kvtier::InvalidArgument(
        "options->dtype is not a kvtier_dtype (KVTIER_F32, KVTIER_F16, KVTIER_BF16)");
  const long long compression = Raw(c.compression);
  if (compression < KVTIER_COMPRESSION_NONE || compression > KVTIER_COMPRESSION_ZSTD)
    return kvtier::InvalidArgument("options->compression is not a kvtier_compression (NONE, LZ4, ZSTD)");
  const long long device = Raw(c.device);
  if (device != KVTIER_DEVICE_CPU && device != KVTIER_DEVICE_CUDA)
    return kvtier::InvalidArgument("options->device is not a kvtier_device (CPU, CUDA)");
  const long long repr = Raw(c.repr_choice);
  if (repr < KVTIER_REPR_MASS || repr > KVTIER_REPR_CLUSTER)
    return kvtier::InvalidArgument(
        "options->repr_choice is not a kvtier_repr_choice (MASS, DIVERSE, CLUSTER)");
  const long long repr_heads = Raw(c.repr_heads);
  if (repr_heads != KVTIER_REPR_HEADS_KV && repr_heads != KVTIER_REPR_HEADS_QUERY)
    return kvtier::InvalidArgument("options->repr_heads is not a kvtier_repr_heads (KV, QUERY)");
  so->geometry.layers = c.layers;
  so->geometry.q_heads = c.q_heads;
  so->geometry.kv_heads = c.kv_heads;
  so->geometry.head_dim = c.head_dim;
  so->geometry.dtype = static_cast<kvtier::DType>(Raw(c.dtype));
  so->n_sink = c.n_sink;
  so->n_local = c.n_local;
  so->chunk_size = c.chunk_size;
  so->repr_topk = c.repr_topk;
  so->hot_bytes = c.hot_bytes;
  so->warm_bytes = c.warm_bytes;
  so->data_dir = OrEmpty(c.data_dir);
  so->compression = static_cast<kvtier::Compression>(compression);
  so->remote = OrEmpty(c.remote);
  so->device = static_cast<kvtier::Device>(device);
  so->repr_choice = static_cast<kvtier::ReprChoice>(repr);
  so->index_bytes = c.index_bytes;
  so->sync_writes = c.sync_writes != 0;
  so->write_through = c.write_through != 0;
  so->pin_timeout_ms = c.pin_timeout_ms;
  so->pin_wait_ms = c.pin_wait_ms;
  so->hot_policy = OrEmpty(c.hot_policy);
  so->warm_policy = OrEmpty(c.warm_policy);
  so->transfer_threads = c.transfer_threads;
  so->max_landing_chunks = c.max_landing_chunks;
  so->accept_lost_chunks = c.accept_lost_chunks != 0;
  so->remote_namespace = OrEmpty(c.remote_namespace);
  so->repr_heads = static_cast<kvtier::ReprHeads>(repr_heads);
  return Status::Ok();
}

// Strings are interned; an empty data_dir, remote or remote_namespace is NULL (= none).
void StoreOptionsToC(const kvtier::StoreOptions& so, kvtier_store_options* c) {
  auto optional = [](const std::string& s) -> const char* { return s.empty() ? nullptr : Intern(s); };
  c->layers = so.geometry.layers;
  c->q_heads = so.geometry.q_heads;
  c->kv_heads = so.geometry.kv_heads;
  c->head_dim = so.geometry.head_dim;
  c->dtype = static_cast<kvtier_dtype>(so.geometry.dtype);
  c->n_sink = so.n_sink;
  c->n_local = so.n_local;
  c->chunk_size = so.chunk_size;
  c->repr_topk = so.repr_topk;
  c->hot_bytes = so.hot_bytes;
  c->warm_bytes = so.warm_bytes;
  c->data_dir = optional(so.data_dir);
  c->compression = static_cast<kvtier_compression>(so.compression);
  c->remote = optional(so.remote);
  c->device = static_cast<kvtier_device>(so.device);
  c->repr_choice = static_cast<kvtier_repr_choice>(so.repr_choice);
  c->index_bytes = so.index_bytes;
  c->sync_writes = so.sync_writes ? 1 : 0;
  c->write_through = so.write_through ? 1 : 0;
  c->pin_timeout_ms = so.pin_timeout_ms;
  c->pin_wait_ms = so.pin_wait_ms;
  c->hot_policy = Intern(so.hot_policy);
  c->warm_policy = Intern(so.warm_policy);
  c->transfer_threads = so.transfer_threads;
  c->max_landing_chunks = so.max_landing_chunks;
  c->accept_lost_chunks = so.accept_lost_chunks ? 1 : 0;
  c->remote_namespace = optional(so.remote_namespace);
  c->repr_heads = static_cast<kvtier_repr_heads>(so.repr_heads);
}

// The C session options as kvtier::SessionOptions: the preset's retrieval, then every field
// over it (probe, alloc and index only where not NULL).
Status SessionOptionsFromC(const kvtier_session_options& c, kvtier::SessionOptions* so) {
  const long long positions = Raw(c.positions);
  if (positions != KVTIER_POSITIONS_ABSOLUTE && positions != KVTIER_POSITIONS_INFLLM)
    return kvtier::InvalidArgument("options->positions is not a kvtier_positions (ABSOLUTE, INFLLM)");
  KVTIER_ASSIGN_OR_RETURN(kvtier::RetrievalPreset preset,
                          kvtier::MakeRetrievalPreset(c.preset ? c.preset : "kvtier"));
  so->retrieval = preset.retrieval;
  if (c.probe != nullptr) so->retrieval.probe = c.probe;
  if (c.alloc != nullptr) so->retrieval.alloc = c.alloc;
  if (c.index != nullptr) so->retrieval.index = c.index;
  so->retrieval.budget_tokens = c.budget_tokens;
  so->retrieval.reuse_cosine = c.reuse_cosine;
  so->retrieval.screen_period = c.screen_period;
  so->positions =
      positions == KVTIER_POSITIONS_INFLLM ? kvtier::PositionMode::kInfLLM : kvtier::PositionMode::kAbsolute;
  so->rope_theta = c.rope_theta;
  so->keep_queries = c.keep_queries;
  so->retrieve = c.retrieve != 0;
  so->observe_prefill = c.observe_prefill != 0;
  so->defer_cold_chunks = c.defer_cold_chunks != 0;
  return Status::Ok();
}

// Every field but preset, probe, alloc and index (which stay as they are: NULL follows the
// preset).
void SessionOptionsToC(const kvtier::SessionOptions& so, kvtier_session_options* c) {
  c->budget_tokens = so.retrieval.budget_tokens;
  c->reuse_cosine = so.retrieval.reuse_cosine;
  c->screen_period = so.retrieval.screen_period;
  c->positions =
      so.positions == kvtier::PositionMode::kInfLLM ? KVTIER_POSITIONS_INFLLM : KVTIER_POSITIONS_ABSOLUTE;
  c->rope_theta = so.rope_theta;
  c->keep_queries = so.keep_queries;
  c->retrieve = so.retrieve ? 1 : 0;
  c->observe_prefill = so.observe_prefill ? 1 : 0;
  c->defer_cold_chunks = so.defer_cold_chunks ? 1 : 0;
}

std::string KnownNames() {
  std::string out;
  auto add = [&](const auto& table) {
    for (const auto& d : table) out += (out.empty() ? "" : ", ") + std::string(d.name);
  };
  add(kvtier::StoreOptionTable());
  return out;
}

std::string KnownSessionNames() {
  std::string out = "preset";
  auto add = [&](const auto& table) {
    for (const auto& d : table) out += ", " + std::string(d.name);
  };
  add(kvtier::RetrieverOptionTable());
  add(kvtier::SessionOptionTable());
  return out;
}

// Parses `value` by the row and writes it into *o (range and choices checked): errors name
// the option.
template <typename Options>
Status SetByText(const kvtier::OptionDesc<Options>& d, const char* value, Options* o) {
  KVTIER_ASSIGN_OR_RETURN(kvtier::OptionValue v, kvtier::ParseOptionText(d, value));
  return kvtier::SetOption(d, o, std::move(v));
}

Status CopyText(const std::string& text, char* buf, size_t size, const char* name) {
  if (text.size() + 1 > size)
    return kvtier::InvalidArgument(std::string("option '") + name + "': its value needs " +
                                   std::to_string(text.size() + 1) + " bytes, buf has " +
                                   std::to_string(size));
  std::memcpy(buf, text.c_str(), text.size() + 1);
  return Status::Ok();
}

}  // namespace

namespace kvtier {

void StoreCountersToC(const StoreCounters& c, kvtier_store_counters* out) {
  out->hot_chunks = c.hot_chunks;
  out->hot_bytes = c.hot_bytes;
  out->warm_chunks = c.warm_chunks;
  out->warm_bytes = c.warm_bytes;
  out->cold_chunks = c.cold_chunks;
  out->cold_bytes = c.cold_bytes;
  out->promotions = c.promotions;
  out->demotions = c.demotions;
  out->hits = c.hits;
  out->misses = c.misses;
  out->bytes_moved = c.bytes_moved;
  out->cold_writes = c.cold_writes;
  out->cold_reads = c.cold_reads;
  out->lease_expired = c.lease_expired;
  out->chunks_sealed = c.chunks_sealed;
  out->dropped_chunks = c.dropped_chunks;
  out->chunks_landing = c.chunks_landing;
}

}  // namespace kvtier

extern "C" {

const char* kvtier_code_name(kvtier_code code) {
  const long long c = Raw(code);
  if (c < KVTIER_OK || c > KVTIER_PERMISSION_DENIED) return "Unknown";
  return kvtier::StatusCodeName(static_cast<StatusCode>(c));
}

const char* kvtier_version(void) { return kvtier::Version(); }

// ---- store ---------------------------------------------------------------------------

kvtier_store_options kvtier_store_options_default(void) {
  kvtier_store_options o;
  std::memset(&o, 0, sizeof(o));
  // Read off the C++ defaults so that the two never disagree (constructing StoreOptions
  // allocates only its small policy strings and the clock: effectively never fails).
  try {
    StoreOptionsToC(kvtier::StoreOptions{}, &o);
  } catch (...) {
  }
  return o;
}

kvtier_code kvtier_store_options_set(kvtier_store_options* options, const char* name, const char* value,
                                     kvtier_error* err) {
  static const char* fn = "kvtier_store_options_set";
  if (options == nullptr) return Invalid(err, fn, "options must not be NULL");
  if (name == nullptr || value == nullptr) return Invalid(err, fn, "name and value must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    const kvtier::StoreOptionDesc* d = kvtier::FindOption(kvtier::StoreOptionTable(), name);
    if (d == nullptr)
      return kvtier::InvalidArgument(std::string("unknown store option '") + name +
                                     "' (known: " + KnownNames() + ")");
    kvtier::StoreOptions so;
    KVTIER_RETURN_IF_ERROR(StoreOptionsFromC(*options, &so));
    KVTIER_RETURN_IF_ERROR(SetByText(*d, value, &so));
    StoreOptionsToC(so, options);
    return Status::Ok();
  });
}

kvtier_code kvtier_store_options_get(const kvtier_store_options* options, const char* name, char* buf,
                                     size_t size, kvtier_error* err) {
  static const char* fn = "kvtier_store_options_get";
  if (options == nullptr) return Invalid(err, fn, "options must not be NULL");
  if (name == nullptr || buf == nullptr) return Invalid(err, fn, "name and buf must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    const kvtier::StoreOptionDesc* d = kvtier::FindOption(kvtier::StoreOptionTable(), name);
    if (d == nullptr)
      return kvtier::InvalidArgument(std::string("unknown store option '") + name +
                                     "' (known: " + KnownNames() + ")");
    kvtier::StoreOptions so;
    KVTIER_RETURN_IF_ERROR(StoreOptionsFromC(*options, &so));
    return CopyText(kvtier::FormatOptionValue(d->get(so)), buf, size, name);
  });
}

kvtier_code kvtier_store_open(const kvtier_store_options* options, kvtier_store** out, kvtier_error* err) {
  static const char* fn = "kvtier_store_open";
  if (out == nullptr) return Invalid(err, fn, "out must not be NULL");
  *out = nullptr;
  if (options == nullptr) return Invalid(err, fn, "options must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    kvtier::StoreOptions so;
    Status st = StoreOptionsFromC(*options, &so);
    if (!st.ok()) return kvtier::InvalidArgument(std::string(fn) + ": " + st.message());
    auto handle = std::make_unique<kvtier_store>();
    KVTIER_ASSIGN_OR_RETURN(handle->store, kvtier::Store::Open(so));
    *out = handle.release();
    return Status::Ok();
  });
}

kvtier_code kvtier_store_close(kvtier_store* store, kvtier_error* err) {
  static const char* fn = "kvtier_store_close";
  if (store == nullptr) return Invalid(err, fn, "store must not be NULL");
  const int open = store->open_sessions.load();
  if (open > 0) {
    char buf[KVTIER_ERROR_MESSAGE_SIZE];
    std::snprintf(
        buf, sizeof(buf),
        "%s: %d session handle(s) of this store are not destroyed; kvtier_session_destroy them first "
        "(the store stays open)",
        fn, open);
    return Report(err, KVTIER_FAILED_PRECONDITION, buf);
  }
  return Guard(err, fn, [&]() -> Status {
    delete store;
    return Status::Ok();
  });
}

kvtier_code kvtier_store_wait_durable(kvtier_store* store, kvtier_error* err) {
  static const char* fn = "kvtier_store_wait_durable";
  if (store == nullptr) return Invalid(err, fn, "store must not be NULL");
  return Guard(err, fn, [&]() -> Status { return store->store->WaitForDurable(); });
}

kvtier_code kvtier_store_get_counters(const kvtier_store* store, kvtier_store_counters* out,
                                      kvtier_error* err) {
  static const char* fn = "kvtier_store_get_counters";
  if (store == nullptr) return Invalid(err, fn, "store must not be NULL");
  if (out == nullptr) return Invalid(err, fn, "out must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    kvtier::StoreCountersToC(store->store->counters(), out);
    return Status::Ok();
  });
}

// ---- session -------------------------------------------------------------------------

kvtier_session_options kvtier_session_options_default(void) {
  kvtier_session_options o;
  std::memset(&o, 0, sizeof(o));
  try {
    SessionOptionsToC(kvtier::SessionOptions{}, &o);  // preset, probe, alloc, index: NULL ("kvtier")
  } catch (...) {
  }
  return o;
}

kvtier_code kvtier_session_options_set(kvtier_session_options* options, const char* name, const char* value,
                                       kvtier_error* err) {
  static const char* fn = "kvtier_session_options_set";
  if (options == nullptr) return Invalid(err, fn, "options must not be NULL");
  if (name == nullptr || value == nullptr) return Invalid(err, fn, "name and value must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    const std::string n = name;
    if (n == "preset") {
      KVTIER_RETURN_IF_ERROR(kvtier::MakeRetrievalPreset(value).status());
      options->preset = Intern(value);
      return Status::Ok();
    }
    kvtier::SessionOptions so;
    KVTIER_RETURN_IF_ERROR(SessionOptionsFromC(*options, &so));
    if (const auto* d = kvtier::FindOption(kvtier::RetrieverOptionTable(), n)) {
      KVTIER_RETURN_IF_ERROR(SetByText(*d, value, &so.retrieval));
      if (n == "probe") options->probe = Intern(so.retrieval.probe);
      if (n == "alloc") options->alloc = Intern(so.retrieval.alloc);
      if (n == "index") options->index = Intern(so.retrieval.index);
    } else if (const auto* r = kvtier::FindOption(kvtier::SessionOptionTable(), n)) {
      KVTIER_RETURN_IF_ERROR(SetByText(*r, value, &so));
    } else {
      return kvtier::InvalidArgument("unknown session option '" + n + "' (known: " + KnownSessionNames() +
                                     ")");
    }
    SessionOptionsToC(so, options);
    return Status::Ok();
  });
}

kvtier_code kvtier_session_options_get(const kvtier_session_options* options, const char* name, char* buf,
                                       size_t size, kvtier_error* err) {
  static const char* fn = "kvtier_session_options_get";
  if (options == nullptr) return Invalid(err, fn, "options must not be NULL");
  if (name == nullptr || buf == nullptr) return Invalid(err, fn, "name and buf must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    const std::string n = name;
    if (n == "preset") return CopyText(options->preset ? options->preset : "kvtier", buf, size, name);
    kvtier::SessionOptions so;
    KVTIER_RETURN_IF_ERROR(SessionOptionsFromC(*options, &so));
    if (const auto* d = kvtier::FindOption(kvtier::RetrieverOptionTable(), n))
      return CopyText(kvtier::FormatOptionValue(d->get(so.retrieval)), buf, size, name);
    if (const auto* r = kvtier::FindOption(kvtier::SessionOptionTable(), n))
      return CopyText(kvtier::FormatOptionValue(r->get(so)), buf, size, name);
    return kvtier::InvalidArgument("unknown session option '" + n + "' (known: " + KnownSessionNames() + ")");
  });
}

kvtier_code kvtier_session_open(kvtier_store* store, const kvtier_session_options* options,
                                kvtier_session** out, kvtier_error* err) {
  static const char* fn = "kvtier_session_open";
  if (out == nullptr) return Invalid(err, fn, "out must not be NULL");
  *out = nullptr;
  if (store == nullptr) return Invalid(err, fn, "store must not be NULL");
  if (options == nullptr) return Invalid(err, fn, "options must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    kvtier::SessionOptions so;
    Status st = SessionOptionsFromC(*options, &so);
    if (!st.ok()) return Status(st.code(), std::string(fn) + ": " + st.message());
    auto handle = std::make_unique<kvtier_session>();
    KVTIER_ASSIGN_OR_RETURN(handle->session, kvtier::Session::Open(store->store.get(), so));
    handle->owner = store;
    store->open_sessions.fetch_add(1);
    *out = handle.release();
    return Status::Ok();
  });
}

kvtier_code kvtier_session_close(kvtier_session* session, kvtier_error* err) {
  static const char* fn = "kvtier_session_close";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  return Guard(err, fn, [&]() -> Status { return session->session->Close(); });
}

kvtier_code kvtier_session_drop(kvtier_session* session, kvtier_error* err) {
  static const char* fn = "kvtier_session_drop";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  return Guard(err, fn, [&]() -> Status { return session->session->Drop(); });
}

void kvtier_session_destroy(kvtier_session* session) {
  if (session == nullptr) return;
  kvtier_store* owner = session->owner;
  try {
    delete session;  // ~Session frees memory only
  } catch (...) {
  }
  if (owner) owner->open_sessions.fetch_sub(1);
}

kvtier_code kvtier_session_append(kvtier_session* session, int layer, const void* k, const void* v, int n,
                                  kvtier_dtype dtype, kvtier_error* err) {
  static const char* fn = "kvtier_session_append";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  if (k == nullptr || v == nullptr) return Invalid(err, fn, "k and v must not be NULL");
  const long long raw_dtype = Raw(dtype);
  if (const kvtier_code c = CheckAppendDType(err, fn, raw_dtype); c != KVTIER_OK) return c;
  return Guard(err, fn, [&]() -> Status {
    return session->session->Append(layer, k, v, n, static_cast<kvtier::DType>(raw_dtype));
  });
}

kvtier_code kvtier_session_append_device(kvtier_session* session, int layer, const void* k, const void* v,
                                         int n, kvtier_dtype dtype, void* stream, kvtier_error* err) {
  static const char* fn = "kvtier_session_append_device";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  if (k == nullptr || v == nullptr) return Invalid(err, fn, "k and v (device pointers) must not be NULL");
  const long long raw_dtype = Raw(dtype);
  if (const kvtier_code c = CheckAppendDType(err, fn, raw_dtype); c != KVTIER_OK) return c;
  return Guard(err, fn, [&]() -> Status {
    return session->session->AppendDevice(layer, k, v, n, static_cast<kvtier::DType>(raw_dtype), stream);
  });
}

kvtier_code kvtier_session_begin_step(kvtier_session* session, kvtier_step_kind kind, kvtier_error* err) {
  static const char* fn = "kvtier_session_begin_step";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  const long long raw_kind = Raw(kind);
  if (raw_kind != KVTIER_STEP_PREFILL && raw_kind != KVTIER_STEP_DECODE) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), "kind %lld is not a kvtier_step_kind (PREFILL, DECODE)", raw_kind);
    return Invalid(err, fn, buf);
  }
  return Guard(err, fn, [&]() -> Status {
    return session->session->BeginStep(raw_kind == KVTIER_STEP_DECODE ? kvtier::StepKind::kDecode
                                                                      : kvtier::StepKind::kPrefill);
  });
}

kvtier_code kvtier_session_attend(kvtier_session* session, int layer, const float* q,
                                  const int64_t* positions, int m, float* out, kvtier_attend_stats* stats,
                                  kvtier_error* err) {
  static const char* fn = "kvtier_session_attend";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  if (q == nullptr) return Invalid(err, fn, "q must not be NULL");
  if (positions == nullptr) return Invalid(err, fn, "positions must not be NULL");
  if (out == nullptr) return Invalid(err, fn, "out must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    kvtier::AttendStats st;
    KVTIER_RETURN_IF_ERROR(session->session->Attend(layer, q, positions, m, out, &st));
    if (stats != nullptr) AttendStatsToC(st, stats);
    return Status::Ok();
  });
}

kvtier_code kvtier_session_attend_device(kvtier_session* session, int layer, const float* q,
                                         const int64_t* positions, int m, float* out, void* stream,
                                         kvtier_attend_stats* stats, kvtier_error* err) {
  static const char* fn = "kvtier_session_attend_device";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  if (q == nullptr) return Invalid(err, fn, "q (a device pointer) must not be NULL");
  if (positions == nullptr) return Invalid(err, fn, "positions (host memory) must not be NULL");
  if (out == nullptr) return Invalid(err, fn, "out (a device pointer) must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    kvtier::AttendStats st;
    KVTIER_RETURN_IF_ERROR(session->session->AttendDevice(layer, q, positions, m, out, stream, &st));
    if (stats != nullptr) AttendStatsToC(st, stats);
    return Status::Ok();
  });
}

kvtier_code kvtier_session_wait_for_device(kvtier_session* session, kvtier_error* err) {
  static const char* fn = "kvtier_session_wait_for_device";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  return Guard(err, fn, [&]() -> Status { return session->session->WaitForDevice(); });
}

kvtier_code kvtier_session_compress(kvtier_session* session, const char* policy_spec, int64_t kv_budget,
                                    int n_queries, kvtier_compress_report* report, kvtier_error* err) {
  static const char* fn = "kvtier_session_compress";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  if (policy_spec == nullptr) return Invalid(err, fn, "policy_spec must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    KVTIER_ASSIGN_OR_RETURN(kvtier::CompressReport r,
                            session->session->Compress(policy_spec, kv_budget, n_queries));
    if (report != nullptr) {
      CopyString(report->policy, sizeof(report->policy), r.policy.c_str());
      report->dropped_chunks = r.dropped_chunks;
      report->kept_tokens = r.kept_tokens;
      report->compress_every = r.compress_every;
    }
    return Status::Ok();
  });
}

kvtier_code kvtier_session_get_counters(const kvtier_session* session, kvtier_session_counters* out,
                                        kvtier_error* err) {
  static const char* fn = "kvtier_session_get_counters";
  if (session == nullptr) return Invalid(err, fn, "session must not be NULL");
  if (out == nullptr) return Invalid(err, fn, "out must not be NULL");
  return Guard(err, fn, [&]() -> Status {
    const kvtier::SessionCounters c = session->session->counters();
    out->steps = c.steps;
    out->attends = c.attends;
    out->tokens_appended = c.tokens_appended;
    out->chunks_attended = c.chunks_attended;
    out->max_layer_chunks = c.max_layer_chunks;
    out->compressions = c.compressions;
    out->dropped_chunks = c.dropped_chunks;
    out->chunks_clipped = c.chunks_clipped;
    out->chunks_deferred = c.chunks_deferred;
    out->selections_reused = c.selections_reused;
    out->selections_sliced = c.selections_sliced;
    out->first_stage_bytes = c.first_stage_bytes;
    out->rescoring_bytes = c.rescoring_bytes;
    out->attention_bytes = c.attention_bytes;
    out->probe_ms = c.probe_ms;
    out->search_ms = c.search_ms;
    out->alloc_ms = c.alloc_ms;
    out->fetch_ms = c.fetch_ms;
    out->attention_ms = c.attention_ms;
    out->host_syncs = c.host_syncs;
    out->worker_host_syncs = c.worker_host_syncs;
    return Status::Ok();
  });
}

uint64_t kvtier_session_sequence(const kvtier_session* session) {
  return session == nullptr ? 0 : session->session->sequence();
}

}  // extern "C"
