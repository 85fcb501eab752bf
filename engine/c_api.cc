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
#include <new>
#include <string>
#include <type_traits>

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

}  // namespace

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
    const kvtier::StoreOptions so;
    o.layers = so.geometry.layers;
    o.q_heads = so.geometry.q_heads;
    o.kv_heads = so.geometry.kv_heads;
    o.head_dim = so.geometry.head_dim;
    o.dtype = static_cast<kvtier_dtype>(so.geometry.dtype);
    o.n_sink = so.n_sink;
    o.n_local = so.n_local;
    o.chunk_size = so.chunk_size;
    o.repr_topk = so.repr_topk;
    o.hot_bytes = so.hot_bytes;
    o.warm_bytes = so.warm_bytes;
    o.data_dir = nullptr;
    o.remote = nullptr;
    o.compression = static_cast<kvtier_compression>(so.compression);
  } catch (...) {
  }
  return o;
}

kvtier_code kvtier_store_open(const kvtier_store_options* options, kvtier_store** out, kvtier_error* err) {
  static const char* fn = "kvtier_store_open";
  if (out == nullptr) return Invalid(err, fn, "out must not be NULL");
  *out = nullptr;
  if (options == nullptr) return Invalid(err, fn, "options must not be NULL");
  if (!ValidDType(Raw(options->dtype)))
    return Invalid(err, fn, "options->dtype is not a kvtier_dtype (KVTIER_F32, KVTIER_F16, KVTIER_BF16)");
  const long long compression = Raw(options->compression);
  if (compression != KVTIER_COMPRESSION_NONE && compression != KVTIER_COMPRESSION_LZ4 &&
      compression != KVTIER_COMPRESSION_ZSTD)
    return Invalid(err, fn, "options->compression is not a kvtier_compression (NONE, LZ4, ZSTD)");
  return Guard(err, fn, [&]() -> Status {
    kvtier::StoreOptions so;
    so.geometry.layers = options->layers;
    so.geometry.q_heads = options->q_heads;
    so.geometry.kv_heads = options->kv_heads;
    so.geometry.head_dim = options->head_dim;
    so.geometry.dtype = static_cast<kvtier::DType>(Raw(options->dtype));
    so.n_sink = options->n_sink;
    so.n_local = options->n_local;
    so.chunk_size = options->chunk_size;
    so.repr_topk = options->repr_topk;
    so.hot_bytes = options->hot_bytes;
    so.warm_bytes = options->warm_bytes;
    so.data_dir = options->data_dir ? options->data_dir : "";
    so.remote = options->remote ? options->remote : "";
    so.compression = static_cast<kvtier::Compression>(compression);
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
    const kvtier::StoreCounters c = store->store->counters();
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
    return Status::Ok();
  });
}

// ---- session -------------------------------------------------------------------------

kvtier_session_options kvtier_session_options_default(void) {
  kvtier_session_options o;
  std::memset(&o, 0, sizeof(o));
  try {
    const kvtier::SessionOptions so;
    o.preset = nullptr;
    o.budget_tokens = so.retrieval.budget_tokens;
    o.positions =
        so.positions == kvtier::PositionMode::kInfLLM ? KVTIER_POSITIONS_INFLLM : KVTIER_POSITIONS_ABSOLUTE;
    o.rope_theta = so.rope_theta;
    o.keep_queries = so.keep_queries;
    o.reuse_cosine = so.retrieval.reuse_cosine;
    o.screen_period = so.retrieval.screen_period;
  } catch (...) {
  }
  return o;
}

kvtier_code kvtier_session_open(kvtier_store* store, const kvtier_session_options* options,
                                kvtier_session** out, kvtier_error* err) {
  static const char* fn = "kvtier_session_open";
  if (out == nullptr) return Invalid(err, fn, "out must not be NULL");
  *out = nullptr;
  if (store == nullptr) return Invalid(err, fn, "store must not be NULL");
  if (options == nullptr) return Invalid(err, fn, "options must not be NULL");
  const long long positions = Raw(options->positions);
  if (positions != KVTIER_POSITIONS_ABSOLUTE && positions != KVTIER_POSITIONS_INFLLM)
    return Invalid(err, fn, "options->positions is not a kvtier_positions (ABSOLUTE, INFLLM)");
  if (options->budget_tokens <= 0) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), "options->budget_tokens must be > 0 (got %d)", options->budget_tokens);
    return Invalid(err, fn, buf);
  }
  return Guard(err, fn, [&]() -> Status {
    KVTIER_ASSIGN_OR_RETURN(kvtier::RetrievalPreset preset,
                            kvtier::MakeRetrievalPreset(options->preset ? options->preset : "kvtier"));
    kvtier::SessionOptions so;
    so.retrieval = preset.retrieval;
    so.retrieval.budget_tokens = options->budget_tokens;
    so.retrieval.reuse_cosine = options->reuse_cosine;  // Session::Open validates them
    so.retrieval.screen_period = options->screen_period;
    so.positions = positions == KVTIER_POSITIONS_INFLLM ? kvtier::PositionMode::kInfLLM
                                                        : kvtier::PositionMode::kAbsolute;
    so.rope_theta = options->rope_theta;
    so.keep_queries = options->keep_queries;
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
  if (!ValidDType(raw_dtype)) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), "dtype %lld is not a kvtier_dtype (KVTIER_F32, KVTIER_F16, KVTIER_BF16)",
                  raw_dtype);
    return Invalid(err, fn, buf);
  }
  return Guard(err, fn, [&]() -> Status {
    return session->session->Append(layer, k, v, n, static_cast<kvtier::DType>(raw_dtype));
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
    if (stats != nullptr) {
      stats->probe_ms = st.probe_ms;
      stats->search_ms = st.search_ms;
      stats->alloc_ms = st.alloc_ms;
      stats->fetch_ms = st.fetch_ms;
      stats->attention_ms = st.attention_ms;
      stats->entropy = st.entropy;
      stats->chunks = st.chunks;
      stats->chunks_clipped = st.chunks_clipped;
      stats->reused = st.reused ? 1 : 0;
      stats->sliced = st.sliced ? 1 : 0;
    }
    return Status::Ok();
  });
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
    out->selections_reused = c.selections_reused;
    out->selections_sliced = c.selections_sliced;
    out->probe_ms = c.probe_ms;
    out->search_ms = c.search_ms;
    out->alloc_ms = c.alloc_ms;
    out->fetch_ms = c.fetch_ms;
    out->attention_ms = c.attention_ms;
    return Status::Ok();
  });
}

uint64_t kvtier_session_sequence(const kvtier_session* session) {
  return session == nullptr ? 0 : session->session->sequence();
}

}  // extern "C"
