/* kvtier's C API: the engine API of kvtier/kvtier.h (TieredStore + Session) for C
 * and for any language with a C FFI. C99; compiles as C and as C++. No C++ type
 * crosses it: handles are opaque, options and results are plain C structs.
 *
 *   kvtier_store_options so = kvtier_store_options_default();
 *   so.layers = 2; so.q_heads = 8; so.kv_heads = 2; so.head_dim = 64; so.dtype = KVTIER_F32;
 *   (or by name, every option: kvtier_store_options_set(&so, "dtype", "fp16", &err))
 *   kvtier_error err;
 *   kvtier_store* store;
 *   if (kvtier_store_open(&so, &store, &err) != KVTIER_OK) { puts(err.message); ... }
 *   kvtier_session_options o = kvtier_session_options_default();
 *   kvtier_session* s;
 *   kvtier_session_open(store, &o, &s, &err);
 *   per step: kvtier_session_begin_step(s, KVTIER_STEP_DECODE, &err);
 *             per layer: kvtier_session_append(s, layer, k, v, 1, KVTIER_F32, &err);
 *                        kvtier_session_attend(s, layer, q, &pos, 1, out, NULL, &err);
 *   kvtier_session_destroy(s);
 *   kvtier_store_close(store, &err);
 *   (K/V, q and out in GPU memory, on a "cuda" hot tier: kvtier_session_append_device and
 *   kvtier_session_attend_device, ordered on the engine's CUDA stream.)
 *
 * Errors. Every fallible function returns a kvtier_code (KVTIER_OK = 0; the other
 * values equal kvtier::StatusCode's) and, when its last argument `err` is not NULL,
 * fills *err with the same code and the message of the underlying kvtier::Status
 * ("Session::Attend: layer 5 outside [0, 2)"), truncated to fit and always
 * NUL-terminated; on success err->code = KVTIER_OK and err->message is "". The error
 * lives in caller memory, so there is no hidden per-thread or per-handle state.
 * Every pointer, handle, size, shape, enum value, layer index, position and K/V/query
 * value (NaN and infinity are refused) the API can check is checked: a bad one is
 * KVTIER_INVALID_ARGUMENT with a message, never a crash. What
 * the API cannot check is the length of a buffer behind a pointer (each function
 * says how many elements it reads or writes) or a handle that was already freed. No
 * C++ exception leaves the API: running out of memory is KVTIER_RESOURCE_EXHAUSTED,
 * anything else unexpected KVTIER_INTERNAL.
 *
 * Threading: as kvtier::Session (kvtier/session.h). A session handle is driven by one
 * thread at a time; different sessions may run concurrently on different threads over
 * one store. The store functions (kvtier_store_get_counters, kvtier_session_open,
 * kvtier_store_wait_durable) may be called from any thread at any time, except
 * kvtier_store_close, which must not run concurrently with any other call on the
 * store or its sessions.
 *
 * Lifetimes: a session handle lives from kvtier_session_open to
 * kvtier_session_destroy; kvtier_session_close and kvtier_session_drop change the
 * sequence, not the handle (its counters stay readable). kvtier_store_close refuses
 * (KVTIER_FAILED_PRECONDITION, the store stays open) while any session handle of the
 * store is not destroyed.
 */
#ifndef KVTIER_KVTIER_C_H_
#define KVTIER_KVTIER_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ------------------------------------------------------------------ */

/* Equal to kvtier::StatusCode (store/status.h), value for value. */
typedef enum kvtier_code {
  KVTIER_OK = 0,
  KVTIER_INVALID_ARGUMENT = 1, /* caller passed something malformed (shape, size, NULL, enum) */
  KVTIER_NOT_FOUND = 2,        /* sequence / chunk / file does not exist */
  KVTIER_ALREADY_EXISTS = 3,
  KVTIER_FAILED_PRECONDITION = 4, /* wrong state (dropped, closed, step not begun, sessions open) */
  KVTIER_RESOURCE_EXHAUSTED = 5,  /* a tier is full, or out of memory */
  KVTIER_CORRUPTION = 6,          /* stored bytes failed a checksum or format check */
  KVTIER_IO_ERROR = 7,            /* the disk tier or file system failed */
  KVTIER_TIMED_OUT = 8,
  KVTIER_UNAVAILABLE = 9,       /* a backend (e.g. CUDA) is not present */
  KVTIER_INTERNAL = 10,         /* a kvtier bug */
  KVTIER_PERMISSION_DENIED = 11 /* a backend refused the credentials (Redis AUTH, ACL): not retried */
} kvtier_code;

#define KVTIER_ERROR_MESSAGE_SIZE 1024

/* Written by every fallible call whose `err` argument is not NULL. */
typedef struct kvtier_error {
  kvtier_code code;
  char message[KVTIER_ERROR_MESSAGE_SIZE]; /* NUL-terminated; "" on success */
} kvtier_error;

/* "OK", "InvalidArgument", ..., as kvtier::StatusCodeName; "Unknown" for other values. */
const char* kvtier_code_name(kvtier_code code);
/* The library's version, "major.minor.patch". */
const char* kvtier_version(void);

/* ---- enums ------------------------------------------------------------------- */

typedef enum kvtier_dtype { KVTIER_F32 = 0, KVTIER_F16 = 1, KVTIER_BF16 = 2 } kvtier_dtype;
typedef enum kvtier_compression {
  KVTIER_COMPRESSION_NONE = 0,
  KVTIER_COMPRESSION_LZ4 = 1,
  KVTIER_COMPRESSION_ZSTD = 2
} kvtier_compression;
/* Where the hot tier keeps its memory (kvtier::Device): KVTIER_DEVICE_CUDA needs a CUDA build
 * and a device, else kvtier_store_open is KVTIER_UNAVAILABLE. */
typedef enum kvtier_device { KVTIER_DEVICE_CPU = 0, KVTIER_DEVICE_CUDA = 1 } kvtier_device;
/* How a chunk's representative keys are chosen (kvtier::ReprChoice). */
typedef enum kvtier_repr_choice {
  KVTIER_REPR_MASS = 0,
  KVTIER_REPR_DIVERSE = 1,
  KVTIER_REPR_CLUSTER = 2
} kvtier_repr_choice;
/* Whose heads representatives belong to (kvtier::ReprHeads): per kv head, or per query head as
 * InfLLM keeps them ([repr_topk, q_heads, head_dim] per chunk). */
typedef enum kvtier_repr_heads { KVTIER_REPR_HEADS_KV = 0, KVTIER_REPR_HEADS_QUERY = 1 } kvtier_repr_heads;
/* See kvtier/session.h: keys and queries after RoPE (absolute) or before it (infllm). */
typedef enum kvtier_positions { KVTIER_POSITIONS_ABSOLUTE = 0, KVTIER_POSITIONS_INFLLM = 1 } kvtier_positions;
typedef enum kvtier_step_kind {
  KVTIER_STEP_PREFILL = 0, /* a window of m >= 1 prompt tokens */
  KVTIER_STEP_DECODE = 1   /* one generated token: attend takes m = 1 */
} kvtier_step_kind;

/* ---- store ------------------------------------------------------------------- */

typedef struct kvtier_store kvtier_store;

typedef struct kvtier_store_options {
  /* geometry of the model's KV cache */
  int layers, q_heads, kv_heads, head_dim; /* q_heads a multiple of kv_heads */
  kvtier_dtype dtype;                      /* storage dtype of K and V */
  /* tiers */
  int n_sink;                     /* attention-sink tokens kept hot per (sequence, layer) */
  int n_local;                    /* most recent tokens kept hot (the local window) */
  int chunk_size;                 /* tokens per chunk */
  int repr_topk;                  /* representative keys per kv head per chunk (presets "actqkv" and
                                     "infllm" are written with 4; a session cannot change it) */
  uint64_t hot_bytes;             /* hot slot pool for retrieved chunks */
  uint64_t warm_bytes;            /* warm tier (host memory) capacity */
  const char* data_dir;           /* cold tier (RocksDB) directory, copied at open; NULL or "" = none */
  kvtier_compression compression; /* cold tier compression */
  const char* remote;             /* remote tier spec, redis://[USER:PASSWORD@]host:port[,...][?...]
                                     (docs/cli.md), copied at open; NULL or "" = none. A refused
                                     password is KVTIER_PERMISSION_DENIED; no message holds it */
  /* The rest of kvtier::StoreOptions, one field each (docs/options.md has every meaning). */
  kvtier_device device;           /* where the hot tier's memory is */
  kvtier_repr_choice repr_choice; /* how representatives are chosen */
  uint64_t index_bytes;           /* retrieval index memory per session (0 = unbounded) */
  int sync_writes;                /* 1: fsync every cold write */
  int write_through;              /* 1: write each chunk to cold when it is sealed */
  int pin_timeout_ms;             /* lease of a pinned chunk */
  int pin_wait_ms;                /* longest a fetch waits for pinned hot slots (0 = fail at once) */
  const char* hot_policy;         /* demotion policy of the hot slot pool, copied at open */
  const char* warm_policy;        /* demotion policy of the warm tier, copied at open */
  int transfer_threads;           /* concurrency of the transfer arena */
  int max_landing_chunks;         /* sealed chunks per (sequence, layer) landing at once */
  int accept_lost_chunks;         /* 1: open a store whose acknowledged chunks did not come back */
  const char* remote_namespace;   /* key namespace in the remote tier, copied at open; NULL or "" = fresh */
  kvtier_repr_heads repr_heads;   /* representatives per kv head (default) or per query head */
} kvtier_store_options;

/* kvtier::StoreOptions' defaults (geometry 32,32,8,128:f16, sinks 64, local 512, chunks of
 * 32, 4 representatives, hot 64 MiB, warm 256 MiB, no cold tier, lz4, cpu, ...): read off a
 * default-constructed kvtier::StoreOptions, so the two never disagree. */
kvtier_store_options kvtier_store_options_default(void);

/* Sets the option `name` (docs/options.md's names: "n_sink", "hot_bytes", "device", "dtype",
 * ...) from text, as the CLI and Python take it: integers, sizes with an optional K/M/G suffix,
 * true|false|1|0, numbers, or one of the option's choices (a dtype takes f16, fp16, float16,
 * half; bf16, bfloat16; f32, fp32, float32). The value is checked against the option's range
 * or choices; an unknown name or a bad value is KVTIER_INVALID_ARGUMENT naming the option
 * ("option 'n_sink': -1 is outside [0, 1048576]") and leaves *options as it was. A string
 * option's text is copied into memory the library keeps for the life of the process. */
kvtier_code kvtier_store_options_set(kvtier_store_options* options, const char* name, const char* value,
                                     kvtier_error* err);
/* Writes the option `name`'s value as text (as kvtier_store_options_set takes it) into
 * buf[size], NUL-terminated; KVTIER_INVALID_ARGUMENT for an unknown name or a value that does
 * not fit. */
kvtier_code kvtier_store_options_get(const kvtier_store_options* options, const char* name, char* buf,
                                     size_t size, kvtier_error* err);

/* Opens (and, with a data_dir holding an earlier store, recovers) a store. On success
 * *out is the handle; on failure *out is NULL. */
kvtier_code kvtier_store_open(const kvtier_store_options* options, kvtier_store** out, kvtier_error* err);
/* Frees the store (pending cold writes finish first). KVTIER_FAILED_PRECONDITION, and
 * nothing happens, while session handles of this store are not destroyed;
 * KVTIER_INVALID_ARGUMENT for NULL. */
kvtier_code kvtier_store_close(kvtier_store* store, kvtier_error* err);
/* Waits until every write-through cold write issued so far is acknowledged. */
kvtier_code kvtier_store_wait_durable(kvtier_store* store, kvtier_error* err);

/* kvtier::StoreCounters: a consistent snapshot. */
typedef struct kvtier_store_counters {
  uint64_t hot_chunks, hot_bytes;   /* chunk slots in use (+ sinks/local bytes in hot_bytes) */
  uint64_t warm_chunks, warm_bytes; /* chunks resident in the warm tier */
  uint64_t cold_chunks, cold_bytes; /* chunks acknowledged by the cold tier */
  uint64_t promotions;              /* chunk copies to a higher tier */
  uint64_t demotions;               /* chunks that left a tier for a lower one */
  uint64_t hits;                    /* fetched chunks already hot */
  uint64_t misses;                  /* fetched chunks that had to be promoted */
  uint64_t bytes_moved;             /* bytes copied between tiers */
  uint64_t cold_writes, cold_reads;
  uint64_t lease_expired;  /* pins that ran past their lease */
  uint64_t chunks_sealed;  /* chunks formed from the local window */
  uint64_t dropped_chunks; /* chunks removed for good by compression */
  uint64_t chunks_landing; /* chunks sealed whose copy into the warm tier has not landed yet */
} kvtier_store_counters;

kvtier_code kvtier_store_get_counters(const kvtier_store* store, kvtier_store_counters* out,
                                      kvtier_error* err);

/* ---- session: one sequence --------------------------------------------------- */

typedef struct kvtier_session kvtier_session;

typedef struct kvtier_session_options {
  const char* preset; /* retrieval preset: "kvtier" | "kvtier-fast" | "actqkv" | "infllm"; NULL = "kvtier" */
  int budget_tokens;  /* retrieved tokens per layer and step (0 = sinks and local only) */
  kvtier_positions positions; /* see kvtier/session.h */
  double rope_theta;          /* KVTIER_POSITIONS_INFLLM: RoPE base */
  int keep_queries;           /* most recent queries kept per layer for compress (0 = none) */
  double reuse_cosine;        /* rescore a layer's last search's shortlist instead of every chunk
                                 while its probe keeps this cosine and no chunk landed (0 = search
                                 every step; in [0, 1]) */
  int screen_period;          /* a decode step screens a rotating 1/screen_period of a layer's
                                 chunks and rescores its shortlist (1 = every chunk every step) */
  /* The rest of kvtier::SessionOptions (docs/options.md has every meaning). */
  const char* probe;     /* probe builder spec; NULL = the preset's */
  const char* alloc;     /* budget allocator spec; NULL = the preset's */
  const char* index;     /* chunk index spec; NULL = the preset's */
  int retrieve;          /* 0: attend every live chunk (full attention through the store) */
  int observe_prefill;   /* 1: prefill attends feed representative-key statistics */
  int defer_cold_chunks; /* 1: the device lane skips a chosen chunk with no warm copy for a step
                          * (counted in chunks_deferred) instead of waiting for it on the host path */
} kvtier_session_options;

/* kvtier::SessionOptions' defaults: preset "kvtier", 2048 tokens (0 = sinks and local window
 * only), absolute positions, rope_theta 10000, keep_queries 0, reuse_cosine 0,
 * screen_period 1, the preset's probe, alloc and index, retrieve 1, observe_prefill 1,
 * defer_cold_chunks 0. */
kvtier_session_options kvtier_session_options_default(void);

/* As kvtier_store_options_set, for the session's options ("budget_tokens", "alloc",
 * "positions", "rope_theta", ...) and "preset". */
kvtier_code kvtier_session_options_set(kvtier_session_options* options, const char* name, const char* value,
                                       kvtier_error* err);
/* As kvtier_store_options_get; probe, alloc and index read the preset's when NULL. */
kvtier_code kvtier_session_options_get(const kvtier_session_options* options, const char* name, char* buf,
                                       size_t size, kvtier_error* err);

/* Creates a new sequence in `store` and a session over it. On failure *out is NULL.
 * KVTIER_RESOURCE_EXHAUSTED when the hot pool cannot hold this session's budget (in chunks)
 * beside those of the sessions open on the store (see kvtier/session.h). */
kvtier_code kvtier_session_open(kvtier_store* store, const kvtier_session_options* options,
                                kvtier_session** out, kvtier_error* err);
/* Persists the sinks and local window; the sequence becomes read-only. */
kvtier_code kvtier_session_close(kvtier_session* session, kvtier_error* err);
/* Removes the sequence from every tier. Afterwards every kvtier_code-returning call on the
 * session except kvtier_session_get_counters fails with KVTIER_FAILED_PRECONDITION, a second
 * kvtier_session_drop included; kvtier_session_destroy still frees the handle. */
kvtier_code kvtier_session_drop(kvtier_session* session, kvtier_error* err);
/* Frees the handle (the sequence stays in the store unless dropped). NULL is a no-op. */
void kvtier_session_destroy(kvtier_session* session);

/* Appends n > 0 tokens to one layer: k and v each [n, kv_heads, head_dim] elements of
 * `dtype`, which must be the store's. KVTIER_POSITIONS_INFLLM: keys before RoPE. Every
 * element must be finite: a NaN or infinity in k or v is KVTIER_INVALID_ARGUMENT naming the
 * layer, tensor, token, kv head and value, and nothing of the call is appended. */
kvtier_code kvtier_session_append(kvtier_session* session, int layer, const void* k, const void* v, int n,
                                  kvtier_dtype dtype, kvtier_error* err);
/* Starts a step over all layers; then attend layer 0, 1, ..., layers-1 in that order. */
kvtier_code kvtier_session_begin_step(kvtier_session* session, kvtier_step_kind kind, kvtier_error* err);

/* One attend call's times and chunk count. */
typedef struct kvtier_attend_stats {
  double probe_ms, search_ms, alloc_ms, fetch_ms, attention_ms;
  double entropy;          /* the entropy allocator's layer entropy, when it computed one */
  uint64_t chunks;         /* chunks attended */
  uint64_t chunks_clipped; /* chunks granted and left out: beyond the hot slot pool, or, when the pool
                              is short, beyond the session's reservation (kvtier/session.h) */
  int reused;              /* 1: the chunks came from the layer's last search (reuse_cosine) */
  int sliced;              /* 1: the search screened a slice of the chunks (screen_period) */
  /* bytes the layer step read, counted (kvtier::AttendStats): the search's first stage over the
     chunks, the chunks rescored from their stored keys, the K/V of every token attended */
  uint64_t first_stage_bytes, rescoring_bytes, attention_bytes;
} kvtier_attend_stats;

/* One layer's memory step: probe, chunk search, budget, fetch, attention over sinks |
 * chunks | local window. q [m, q_heads, head_dim] fp32 at `positions` [m], out [m, q_heads,
 * head_dim] fp32. A decode step takes m = 1. The positions are the layer's last m tokens:
 * with N tokens appended to the layer (by any session over the sequence), exactly N - m,
 * ..., N - 1, so a window's K/V are appended before its queries attend. A layer holding no
 * tokens is KVTIER_FAILED_PRECONDITION ("layer L holds no tokens"); other positions are
 * KVTIER_INVALID_ARGUMENT naming what the layer holds ("layer L holds positions 0..N-1"), as
 * are a negative or non-increasing position and a NaN or infinity in q; out is not written
 * then. `stats` may be NULL. */
kvtier_code kvtier_session_attend(kvtier_session* session, int layer, const float* q,
                                  const int64_t* positions, int m, float* out, kvtier_attend_stats* stats,
                                  kvtier_error* err);

/* The device-pointer twins of kvtier_session_append and kvtier_session_attend
 * (kvtier::Session::AppendDevice and AttendDevice), for an engine whose K/V, queries and
 * outputs live on the GPU. They need a store opened with device KVTIER_DEVICE_CUDA
 * (kvtier_store_options_set(&so, "device", "cuda", &err)); on a cpu hot tier they are
 * KVTIER_FAILED_PRECONDITION naming the "cuda" tier, and nothing is appended or written. Same
 * arguments, checks and results as the host twins, except that k, v, q and out are device
 * pointers (positions and stats stay in host memory) and the work is ordered on the engine's
 * CUDA stream `stream`: its cudaStream_t passed as void* (no kvtier header includes a CUDA
 * header; NULL is the legacy default stream). kvtier's copies and kernels of the call start
 * after everything the engine submitted to `stream` before the call, and whatever the engine
 * submits to `stream` after the call starts after them; that ordering is made on the device,
 * never by blocking the host. So the engine may write k, v and q on its stream and call at once,
 * and read out (or overwrite k, v and q) on its stream after the call without synchronising.
 * K/V on the device are not scanned for NaN or infinity (a non-finite value gives non-finite
 * outputs); q is, in the host copy kvtier_session_attend_device takes of it.
 * What the host still waits for, each wait counted in kvtier_session_counters.host_syncs:
 * kvtier_session_append_device, in steady decode, for nothing (a chunk sealed out of the local
 * window lands without a wait too). kvtier_session_attend_device, in a decode step whose chunks
 * are selected on the device (the Exact index on a cuda tier, no search reuse), for nothing: the
 * step runs on the session's device lane, and its chunks (stats->chunks is 0 there, the
 * counters' chunks_attended) are known one step late or after kvtier_session_wait_for_device;
 * a step that seals a chunk waits for nothing either (the lane scores the chunk still landing).
 * Elsewhere for the queries' download
 * (the probe, the chunk search and the budget run on the host), for the selection's download,
 * for a fetch of chunks that are not hot, and in a prefill window for the representative-key
 * statistics; the attention itself and its output add none. */
kvtier_code kvtier_session_append_device(kvtier_session* session, int layer, const void* k, const void* v,
                                         int n, kvtier_dtype dtype, void* stream, kvtier_error* err);
kvtier_code kvtier_session_attend_device(kvtier_session* session, int layer, const float* q,
                                         const int64_t* positions, int m, float* out, void* stream,
                                         kvtier_attend_stats* stats, kvtier_error* err);
/* Reads what the device lane still holds of the decode steps so far (one wait when it is not
 * done), so that the counters cover every step; the first error it names (a query that was not
 * finite) is returned. KVTIER_OK and no wait when nothing is pending. */
kvtier_code kvtier_session_wait_for_device(kvtier_session* session, kvtier_error* err);

/* What one compress did. */
typedef struct kvtier_compress_report {
  char policy[256];        /* the policy, canonically spelled (truncated to fit, NUL-terminated) */
  uint64_t dropped_chunks; /* over every layer */
  uint64_t kept_tokens;    /* per layer, mean over layers, after the compression */
  int64_t compress_every;  /* the policy's decode-time recompression period (0 = once) */
} kvtier_compress_report;

/* Compression (kvtier::Session::Compress): the last n_queries kept queries (0 = all;
 * needs keep_queries > 0) attend exactly over every held key, the scoring policy
 * `policy_spec` ("h2o", "snapkv", "streaming", ...) keeps kv_budget tokens per layer
 * (sinks and local window included), and the other chunks leave the store for good.
 * `report` may be NULL. */
kvtier_code kvtier_session_compress(kvtier_session* session, const char* policy_spec, int64_t kv_budget,
                                    int n_queries, kvtier_compress_report* report, kvtier_error* err);

/* kvtier::SessionCounters: totals over the session's life. */
typedef struct kvtier_session_counters {
  uint64_t steps;            /* begin_step calls */
  uint64_t attends;          /* attend calls (layer steps) */
  uint64_t tokens_appended;  /* summed over layers */
  uint64_t chunks_attended;  /* summed over layer steps */
  uint64_t max_layer_chunks; /* most chunks one layer attended in one step */
  uint64_t compressions;     /* compress calls that ran */
  uint64_t dropped_chunks;   /* chunks compress removed */
  double probe_ms, search_ms, alloc_ms, fetch_ms, attention_ms;
  uint64_t chunks_clipped;    /* chunks granted and left out (kvtier_attend_stats.chunks_clipped) */
  uint64_t selections_reused; /* attend calls whose chunks came from the last search */
  uint64_t selections_sliced; /* attend calls that screened a slice of the chunks */
  uint64_t first_stage_bytes, rescoring_bytes, attention_bytes; /* kvtier_attend_stats', summed */
  uint64_t
      host_syncs; /* blocking host waits on the device on the calling thread during the session's calls */
  uint64_t chunks_deferred;   /* chunks a device-lane step chose and did not attend (no warm copy) */
  uint64_t worker_host_syncs; /* the same waits on worker threads during the session's calls */
} kvtier_session_counters;

kvtier_code kvtier_session_get_counters(const kvtier_session* session, kvtier_session_counters* out,
                                        kvtier_error* err);
/* The session's sequence id in its store (0 for NULL). */
uint64_t kvtier_session_sequence(const kvtier_session* session);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVTIER_KVTIER_C_H_ */
