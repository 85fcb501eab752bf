/* The C API (kvtier/kvtier_c.h) driven from C99: a store and sessions, prefill and decode
 * steps over enough tokens that chunks are sealed, spilled and retrieved; counters; one
 * attend output of a session whose budget covers every chunk against attention computed
 * here over every key; compression; and every bad input (NULLs, shapes, a negative
 * position, positions other than the layer's last appended tokens, NaN/inf in K/V or q, calls
 * on a dropped session) answered by its error code and a message. Prints each failed check
 * and exits non-zero if there was one.
 *   kvtier_c_api_test [DATA_DIR]   (DATA_DIR: the cold tier's directory; none without it)
 *   kvtier_c_api_test --remote SPEC WRONG_SPEC SECRET
 *     (tests/engine/c_api_remote_test.sh: a store whose lower tier is the Redis of SPEC,
 *     credentials included, drives a session; WRONG_SPEC, the same servers with a wrong
 *     password, is KVTIER_PERMISSION_DENIED; no message holds SECRET) */
#include <kvtier/kvtier_c.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;
static int checks = 0;

#define CHECK(cond, ...)                                                \
  do {                                                                  \
    ++checks;                                                           \
    if (!(cond)) {                                                      \
      ++failures;                                                       \
      fprintf(stderr, "FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                     \
      fputc('\n', stderr);                                              \
    }                                                                   \
  } while (0)

/* A call that must succeed; prints the error otherwise. */
#define OK(call)                                                                                           \
  do {                                                                                                     \
    kvtier_code ok_code_ = (call);                                                                         \
    CHECK(ok_code_ == KVTIER_OK && err.code == KVTIER_OK && err.message[0] == '\0', "%s -> %s: %s", #call, \
          kvtier_code_name(ok_code_), err.message);                                                        \
  } while (0)

/* A call that must fail with `want` and say why. */
#define EXPECT_ERROR(call, want)                                                            \
  do {                                                                                      \
    kvtier_code got_ = (call);                                                              \
    CHECK(got_ == (want) && err.code == (want) && err.message[0] != '\0',                   \
          "%s -> %s (err.code %s, message \"%s\"), want %s", #call, kvtier_code_name(got_), \
          kvtier_code_name(err.code), err.message, kvtier_code_name(want));                 \
    if (got_ == (want)) printf("  ok: %-16s %s\n", kvtier_code_name(got_), err.message);    \
  } while (0)

enum { LAYERS = 2, QH = 4, KVH = 2, D = 16, SINK = 16, LOCAL = 64, CHUNK = 16 };
enum { PREFILL = 512, WINDOW = 64, DECODE = 32, T = PREFILL + DECODE };
enum { KV_TOK = KVH * D, Q_TOK = QH * D };

static float K[LAYERS][T][KV_TOK], V[LAYERS][T][KV_TOK], Q[LAYERS][T][Q_TOK];

static unsigned long long rng_state = 42;
static float uniform(void) { /* [-1, 1) */
  rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Attention of Q[layer][pos] over keys 0..pos (causal, absolute positions), in double. */
static void full_attention(int layer, int pos, double* out) {
  static double logits[T];
  const double scale = 1.0 / sqrt((double)D);
  for (int h = 0; h < QH; ++h) {
    const int kvh = h / (QH / KVH);
    const float* q = &Q[layer][pos][h * D];
    double mx = -1e300, sum = 0.0;
    for (int t = 0; t <= pos; ++t) {
      double dot = 0.0;
      for (int i = 0; i < D; ++i) dot += (double)q[i] * K[layer][t][kvh * D + i];
      logits[t] = dot * scale;
      if (logits[t] > mx) mx = logits[t];
    }
    for (int i = 0; i < D; ++i) out[h * D + i] = 0.0;
    for (int t = 0; t <= pos; ++t) {
      const double w = exp(logits[t] - mx);
      sum += w;
      for (int i = 0; i < D; ++i) out[h * D + i] += w * V[layer][t][kvh * D + i];
    }
    for (int i = 0; i < D; ++i) out[h * D + i] /= sum;
  }
}

/* Prefill in windows, then decode one token per step; the last step's outputs go to
 * last_out [LAYERS][Q_TOK] and its stats to last_stats [LAYERS]. */
static void drive(kvtier_session* s, const char* name, float last_out[LAYERS][Q_TOK],
                  kvtier_attend_stats last_stats[LAYERS]) {
  kvtier_error err;
  static float out[WINDOW * Q_TOK];
  int64_t positions[WINDOW];
  for (int p0 = 0; p0 < T; p0 += (p0 < PREFILL ? WINDOW : 1)) {
    const int m = p0 < PREFILL ? WINDOW : 1;
    kvtier_code c = kvtier_session_begin_step(s, m > 1 ? KVTIER_STEP_PREFILL : KVTIER_STEP_DECODE, &err);
    CHECK(c == KVTIER_OK, "%s: begin_step at %d: %s", name, p0, err.message);
    for (int i = 0; i < m; ++i) positions[i] = p0 + i;
    for (int layer = 0; c == KVTIER_OK && layer < LAYERS; ++layer) {
      kvtier_attend_stats st;
      c = kvtier_session_append(s, layer, K[layer][p0], V[layer][p0], m, KVTIER_F32, &err);
      if (c == KVTIER_OK) c = kvtier_session_attend(s, layer, Q[layer][p0], positions, m, out, &st, &err);
      CHECK(c == KVTIER_OK, "%s: layer %d at %d: %s: %s", name, layer, p0, kvtier_code_name(c), err.message);
      if (c == KVTIER_OK && p0 == T - 1) {
        memcpy(last_out[layer], out, sizeof(float) * Q_TOK);
        last_stats[layer] = st;
      }
    }
    if (c != KVTIER_OK) return;
  }
}

/* The remote tier with credentials: see the header comment. */
static int run_remote(const char* spec, const char* wrong, const char* secret) {
  kvtier_error err;
  memset(&err, 0, sizeof(err));
  kvtier_store_options so = kvtier_store_options_default();
  CHECK(so.remote == NULL, "default remote is NULL");
  so.layers = LAYERS;
  so.q_heads = QH;
  so.kv_heads = KVH;
  so.head_dim = D;
  so.dtype = KVTIER_F32;
  so.n_sink = SINK;
  so.n_local = LOCAL;
  so.chunk_size = CHUNK;
  so.hot_bytes = 1u << 20;
  so.warm_bytes = 64u << 10; /* a fraction of the chunks: the rest live only in Redis */
  so.remote = spec;
  kvtier_store* store = NULL;
  OK(kvtier_store_open(&so, &store, &err));
  CHECK(strstr(err.message, secret) == NULL, "message holds the secret");
  if (store == NULL) return 1;
  kvtier_session_options ao = kvtier_session_options_default();
  ao.budget_tokens = 4 * CHUNK;
  kvtier_session* a = NULL;
  OK(kvtier_session_open(store, &ao, &a, &err));
  if (a == NULL) return 1;
  static float out[LAYERS][Q_TOK];
  kvtier_attend_stats st[LAYERS];
  drive(a, "remote", out, st);
  OK(kvtier_store_wait_durable(store, &err));
  kvtier_store_counters c;
  OK(kvtier_store_get_counters(store, &c, &err));
  CHECK(c.cold_writes > 0 && c.demotions > 0 && c.cold_chunks == 0,
        "Redis acknowledged the chunks: %llu writes, %llu demotions, %llu on a disk",
        (unsigned long long)c.cold_writes, (unsigned long long)c.demotions,
        (unsigned long long)c.cold_chunks);
  printf("remote: %llu chunks written through, %llu demoted to Redis, %llu fetched back\n",
         (unsigned long long)c.cold_writes, (unsigned long long)c.demotions,
         (unsigned long long)c.cold_reads);
  OK(kvtier_session_drop(a, &err));
  kvtier_session_destroy(a);
  OK(kvtier_store_close(store, &err));

  /* The same servers, a wrong password: refused as such, not as an outage, and not echoed. */
  so.remote = wrong;
  store = (kvtier_store*)&err;
  EXPECT_ERROR(kvtier_store_open(&so, &store, &err), KVTIER_PERMISSION_DENIED);
  CHECK(store == NULL, "store_open failed but left *out set");
  CHECK(strstr(err.message, secret) == NULL && strstr(err.message, "WRONGPASS") != NULL, "message \"%s\"",
        err.message);
  /* A malformed spec holding the password: invalid, quoted redacted. */
  {
    static char bad[512];
    snprintf(bad, sizeof(bad), "redis://u:%s@h:0", secret);
    so.remote = bad;
    EXPECT_ERROR(kvtier_store_open(&so, &store, &err), KVTIER_INVALID_ARGUMENT);
    CHECK(strstr(err.message, secret) == NULL && strstr(err.message, "redis://u:***@h:0") != NULL,
          "message \"%s\"", err.message);
  }
  if (failures) {
    fprintf(stderr, "%d of %d checks failed\n", failures, checks);
    return 1;
  }
  printf("all %d checks passed\n", checks);
  return 0;
}

int main(int argc, char** argv) {
  const char* data_dir = argc > 1 ? argv[1] : NULL;
  kvtier_error err;
  memset(&err, 0, sizeof(err));
  for (int l = 0; l < LAYERS; ++l)
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < KV_TOK; ++i) K[l][t][i] = uniform();
      for (int i = 0; i < KV_TOK; ++i) V[l][t][i] = uniform();
      for (int i = 0; i < Q_TOK; ++i) Q[l][t][i] = 2.0f * uniform();
    }
  if (argc == 5 && strcmp(argv[1], "--remote") == 0) return run_remote(argv[2], argv[3], argv[4]);

  printf("kvtier %s\n", kvtier_version());
  CHECK(kvtier_version()[0] != '\0', "empty version");
  CHECK(strcmp(kvtier_code_name(KVTIER_OK), "OK") == 0, "%s", kvtier_code_name(KVTIER_OK));
  CHECK(strcmp(kvtier_code_name(KVTIER_INVALID_ARGUMENT), "InvalidArgument") == 0, "%s",
        kvtier_code_name(KVTIER_INVALID_ARGUMENT));
  CHECK(strcmp(kvtier_code_name(KVTIER_INTERNAL), "Internal") == 0, "%s", kvtier_code_name(KVTIER_INTERNAL));
  CHECK(strcmp(kvtier_code_name(KVTIER_PERMISSION_DENIED), "PermissionDenied") == 0, "%s",
        kvtier_code_name(KVTIER_PERMISSION_DENIED));
  CHECK(strcmp(kvtier_code_name((kvtier_code)12), "Unknown") == 0, "%s", kvtier_code_name((kvtier_code)12));
  CHECK(strcmp(kvtier_code_name((kvtier_code)99), "Unknown") == 0, "%s", kvtier_code_name((kvtier_code)99));

  /* ---- store ---- */
  kvtier_store_options so = kvtier_store_options_default();
  CHECK(so.layers > 0 && so.n_local > 0 && so.chunk_size > 0 && so.data_dir == NULL, "defaults %d %d %d",
        so.layers, so.n_local, so.chunk_size);
  so.layers = LAYERS;
  so.q_heads = QH;
  so.kv_heads = KVH;
  so.head_dim = D;
  so.dtype = KVTIER_F32;
  so.n_sink = SINK;
  so.n_local = LOCAL;
  so.chunk_size = CHUNK;
  so.hot_bytes = 1u << 20;
  /* With a cold tier the warm tier holds a fraction of the chunks, so some spill to disk. */
  so.warm_bytes = data_dir ? 64u << 10 : 16u << 20;
  so.data_dir = data_dir;

  kvtier_store* store = (kvtier_store*)&err; /* must be set to NULL on failure */
  printf("bad store options:\n");
  EXPECT_ERROR(kvtier_store_open(NULL, &store, &err), KVTIER_INVALID_ARGUMENT);
  CHECK(store == NULL, "store_open failed but left *out set");
  EXPECT_ERROR(kvtier_store_open(&so, NULL, &err), KVTIER_INVALID_ARGUMENT);
  {
    kvtier_store_options bad = so;
    bad.kv_heads = 3; /* 4 q heads are not a multiple of 3 kv heads */
    EXPECT_ERROR(kvtier_store_open(&bad, &store, &err), KVTIER_INVALID_ARGUMENT);
    bad = so;
    bad.dtype = (kvtier_dtype)7;
    EXPECT_ERROR(kvtier_store_open(&bad, &store, &err), KVTIER_INVALID_ARGUMENT);
    bad = so;
    bad.n_local = 70; /* not a multiple of the chunk size */
    EXPECT_ERROR(kvtier_store_open(&bad, &store, &err), KVTIER_INVALID_ARGUMENT);
    bad = so;
    bad.compression = (kvtier_compression)9;
    EXPECT_ERROR(kvtier_store_open(&bad, &store, &err), KVTIER_INVALID_ARGUMENT);
    bad = so;
    bad.device = (kvtier_device)4;
    EXPECT_ERROR(kvtier_store_open(&bad, &store, &err), KVTIER_INVALID_ARGUMENT);
    /* Every option by name: the usual dtype spellings, sizes with suffixes, named errors. */
    bad = so;
    OK(kvtier_store_options_set(&bad, "dtype", "fp16", &err));
    CHECK(bad.dtype == KVTIER_F16, "dtype fp16 -> %d", (int)bad.dtype);
    OK(kvtier_store_options_set(&bad, "dtype", "bfloat16", &err));
    CHECK(bad.dtype == KVTIER_BF16, "dtype bfloat16 -> %d", (int)bad.dtype);
    OK(kvtier_store_options_set(&bad, "dtype", "float32", &err));
    CHECK(bad.dtype == KVTIER_F32, "dtype float32 -> %d", (int)bad.dtype);
    EXPECT_ERROR(kvtier_store_options_set(&bad, "dtype", "fp8", &err), KVTIER_INVALID_ARGUMENT);
    CHECK(strstr(err.message, "f16|fp16|float16|half|bf16|bfloat16|f32|fp32|float32") != NULL, "%s",
          err.message);
    OK(kvtier_store_options_set(&bad, "warm_policy", "lru", &err));
    OK(kvtier_store_options_set(&bad, "pin_wait_ms", "0", &err));
    CHECK(bad.pin_wait_ms == 0, "pin_wait_ms %d", bad.pin_wait_ms);
    EXPECT_ERROR(kvtier_store_options_set(&bad, "n_sink", "-1", &err), KVTIER_INVALID_ARGUMENT);
    CHECK(strcmp(err.message, "option 'n_sink': -1 is outside [0, 1048576]") == 0, "%s", err.message);
    {
      char text[64];
      OK(kvtier_store_options_get(&bad, "device", text, sizeof text, &err));
      CHECK(strcmp(text, "cpu") == 0, "device %s", text);
    }
    /* A data dir the OS will not stat (a component over 255 bytes): an I/O error naming the
       OS error, never an abort or Internal. */
    static char long_dir[400];
    memset(long_dir, 'd', sizeof(long_dir) - 1);
    memcpy(long_dir, "/tmp/", 5);
    bad = so;
    bad.data_dir = long_dir;
    EXPECT_ERROR(kvtier_store_open(&bad, &store, &err), KVTIER_IO_ERROR);
    CHECK(strstr(err.message, "File name too long") != NULL, "message \"%s\"", err.message);
    CHECK(store == NULL, "store_open failed but left *out set");
  }
  OK(kvtier_store_open(&so, &store, &err));
  if (store == NULL) {
    fprintf(stderr, "cannot go on without a store\n");
    return 1;
  }

  /* ---- A: the default preset with a small budget; B: every chunk (full attention) ---- */
  kvtier_session_options ao = kvtier_session_options_default();
  CHECK(ao.preset == NULL && ao.budget_tokens > 0 && ao.positions == KVTIER_POSITIONS_ABSOLUTE,
        "session defaults: budget %d", ao.budget_tokens);
  ao.budget_tokens = 4 * CHUNK;
  ao.keep_queries = 8;
  kvtier_session_options bo = kvtier_session_options_default();
  bo.preset = "infllm"; /* top-k: with a budget past the context it takes every chunk */
  /* Past the context, not past the hot pool: the pool must hold both sessions' budgets. */
  bo.budget_tokens = T;
  kvtier_session *a = NULL, *b = NULL;
  OK(kvtier_session_open(store, &ao, &a, &err));
  OK(kvtier_session_open(store, &bo, &b, &err));
  if (a == NULL || b == NULL) return 1;
  CHECK(kvtier_session_sequence(a) != kvtier_session_sequence(b), "both sessions on sequence %llu",
        (unsigned long long)kvtier_session_sequence(a));

  static float out_a[LAYERS][Q_TOK], out_b[LAYERS][Q_TOK];
  kvtier_attend_stats st_a[LAYERS], st_b[LAYERS];
  memset(st_a, 0, sizeof(st_a));
  memset(st_b, 0, sizeof(st_b));
  drive(a, "A", out_a, st_a);
  drive(b, "B", out_b, st_b);

  kvtier_store_counters sc;
  OK(kvtier_store_get_counters(store, &sc, &err));
  printf(
      "store: %llu chunks sealed, %llu promotions, %llu hits, %llu misses, %llu cold writes, %llu cold "
      "reads\n",
      (unsigned long long)sc.chunks_sealed, (unsigned long long)sc.promotions, (unsigned long long)sc.hits,
      (unsigned long long)sc.misses, (unsigned long long)sc.cold_writes, (unsigned long long)sc.cold_reads);
  CHECK(sc.chunks_sealed > 0 && sc.chunks_sealed % (2 * LAYERS) == 0, "chunks_sealed %llu",
        (unsigned long long)sc.chunks_sealed);
  CHECK(sc.promotions > 0 && sc.misses > 0 && sc.bytes_moved > 0, "promotions %llu misses %llu",
        (unsigned long long)sc.promotions, (unsigned long long)sc.misses);
  if (data_dir) {
    OK(kvtier_store_wait_durable(store, &err));
    OK(kvtier_store_get_counters(store, &sc, &err));
    /* Waiting for durability lands every sealed chunk first: none is left landing. */
    CHECK(sc.chunks_landing == 0, "%llu chunks still landing after wait_durable",
          (unsigned long long)sc.chunks_landing);
    CHECK(sc.cold_writes > 0 && sc.cold_chunks > 0, "cold writes %llu", (unsigned long long)sc.cold_writes);
    CHECK(sc.warm_chunks < sc.chunks_sealed, "warm %llu of %llu chunks: nothing spilled",
          (unsigned long long)sc.warm_chunks, (unsigned long long)sc.chunks_sealed);
  }
  const unsigned long long chunks_per_layer = sc.chunks_sealed / (2 * LAYERS);

  kvtier_session_counters ca, cb;
  OK(kvtier_session_get_counters(a, &ca, &err));
  OK(kvtier_session_get_counters(b, &cb, &err));
  const unsigned long long steps = PREFILL / WINDOW + DECODE;
  printf(
      "A: %llu steps, %llu attends, %llu chunks attended (at most %llu per layer step); "
      "B: %llu chunks attended\n",
      (unsigned long long)ca.steps, (unsigned long long)ca.attends, (unsigned long long)ca.chunks_attended,
      (unsigned long long)ca.max_layer_chunks, (unsigned long long)cb.chunks_attended);
  CHECK(ca.steps == steps && ca.attends == steps * LAYERS, "A: steps %llu attends %llu",
        (unsigned long long)ca.steps, (unsigned long long)ca.attends);
  CHECK(ca.tokens_appended == (unsigned long long)T * LAYERS, "A: tokens %llu",
        (unsigned long long)ca.tokens_appended);
  /* The entropy allocator hands what a shallow layer leaves to deeper ones: 4 chunks per layer on average. */
  CHECK(ca.chunks_attended > 0 && ca.chunks_attended <= steps * LAYERS * 4 && ca.max_layer_chunks > 0 &&
            ca.max_layer_chunks <= LAYERS * 4,
        "A: retrieval brought %llu chunks, at most %llu per layer step (budget 4 chunks per layer)",
        (unsigned long long)ca.chunks_attended, (unsigned long long)ca.max_layer_chunks);
  CHECK(ca.attention_ms > 0.0 && ca.search_ms >= 0.0, "A: attention %.3f ms", ca.attention_ms);
  CHECK(cb.max_layer_chunks == chunks_per_layer, "B: at most %llu chunks per layer step, %llu sealed",
        (unsigned long long)cb.max_layer_chunks, chunks_per_layer);

  /* B's last step attended every chunk: it is full attention over every key. */
  double max_err_b = 0.0, max_err_a = 0.0;
  for (int l = 0; l < LAYERS; ++l) {
    double ref[Q_TOK];
    full_attention(l, T - 1, ref);
    CHECK(st_b[l].chunks == chunks_per_layer, "B layer %d: %llu chunks in its last step, %llu sealed", l,
          (unsigned long long)st_b[l].chunks, chunks_per_layer);
    for (int i = 0; i < Q_TOK; ++i) {
      const double eb = fabs(out_b[l][i] - ref[i]), ea = fabs(out_a[l][i] - ref[i]);
      if (eb > max_err_b) max_err_b = eb;
      if (ea > max_err_a || ea != ea) max_err_a = ea;
    }
  }
  CHECK(st_a[0].chunks + st_a[1].chunks > 0 && st_a[0].chunks + st_a[1].chunks <= LAYERS * 4,
        "A: %llu + %llu chunks in its last step", (unsigned long long)st_a[0].chunks,
        (unsigned long long)st_a[1].chunks);
  printf("last decode step vs full attention: budget over every chunk %.2e, budget of 4 chunks %.2e\n",
         max_err_b, max_err_a);
  CHECK(max_err_b < 1e-4, "full-budget session differs from full attention by %g", max_err_b);
  CHECK(max_err_a == max_err_a && max_err_a < 2.0, "small-budget session output off the scale: %g",
        max_err_a);

  /* ---- compression ---- */
  printf("compression:\n");
  EXPECT_ERROR(kvtier_session_compress(a, "nosuchpolicy", SINK + LOCAL + 4 * CHUNK, 0, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_compress(a, "h2o:bogus_key=1", SINK + LOCAL + 4 * CHUNK, 0, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_compress(a, NULL, SINK + LOCAL + 4 * CHUNK, 0, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_compress(a, "h2o", 8, 0, NULL, &err),
               KVTIER_INVALID_ARGUMENT); /* below sinks+local */
  EXPECT_ERROR(kvtier_session_compress(b, "h2o", SINK + LOCAL + 4 * CHUNK, 0, NULL, &err),
               KVTIER_FAILED_PRECONDITION); /* B keeps no queries */
  EXPECT_ERROR(kvtier_session_compress(NULL, "h2o", SINK + LOCAL + 4 * CHUNK, 0, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  kvtier_compress_report rep;
  memset(&rep, 0, sizeof(rep));
  OK(kvtier_session_compress(a, "h2o", SINK + LOCAL + 4 * CHUNK, 0, &rep, &err));
  printf("  h2o to %d tokens: policy %s, %llu chunks dropped, %llu tokens kept per layer\n",
         SINK + LOCAL + 4 * CHUNK, rep.policy, (unsigned long long)rep.dropped_chunks,
         (unsigned long long)rep.kept_tokens);
  CHECK(rep.policy[0] != '\0' && rep.dropped_chunks > 0, "report: policy '%s', dropped %llu", rep.policy,
        (unsigned long long)rep.dropped_chunks);
  CHECK(rep.kept_tokens <= (unsigned long long)(SINK + LOCAL + 4 * CHUNK + CHUNK) && rep.kept_tokens > 0,
        "kept %llu tokens per layer", (unsigned long long)rep.kept_tokens);
  OK(kvtier_session_get_counters(a, &ca, &err));
  OK(kvtier_store_get_counters(store, &sc, &err));
  CHECK(ca.compressions == 1 && ca.dropped_chunks == rep.dropped_chunks &&
            sc.dropped_chunks == rep.dropped_chunks,
        "compressions %llu, session dropped %llu, store dropped %llu", (unsigned long long)ca.compressions,
        (unsigned long long)ca.dropped_chunks, (unsigned long long)sc.dropped_chunks);
  { /* a decode step on the compressed sequence */
    static float k1[KV_TOK], v1[KV_TOK], q1[Q_TOK], o1[Q_TOK];
    const int64_t pos = T;
    for (int i = 0; i < KV_TOK; ++i) k1[i] = uniform(), v1[i] = uniform();
    for (int i = 0; i < Q_TOK; ++i) q1[i] = uniform();
    OK(kvtier_session_begin_step(a, KVTIER_STEP_DECODE, &err));
    for (int l = 0; l < LAYERS; ++l) {
      OK(kvtier_session_append(a, l, k1, v1, 1, KVTIER_F32, &err));
      OK(kvtier_session_attend(a, l, q1, &pos, 1, o1, NULL, &err));
    }
  }

  /* ---- a session that screens a slice: its decode steps after the first say so ---- */
  {
    kvtier_session_options so = ao;
    so.screen_period = 4;
    kvtier_session* sl = NULL;
    OK(kvtier_session_open(store, &so, &sl, &err));
    if (sl == NULL) return 1;
    static float out_s[LAYERS][Q_TOK];
    kvtier_attend_stats st_s[LAYERS];
    memset(st_s, 0, sizeof(st_s));
    drive(sl, "sliced", out_s, st_s);
    kvtier_session_counters cs;
    OK(kvtier_session_get_counters(sl, &cs, &err));
    printf("sliced session: %llu of %llu attends screened a slice, %llu reused\n",
           (unsigned long long)cs.selections_sliced, (unsigned long long)cs.attends,
           (unsigned long long)cs.selections_reused);
    CHECK(cs.selections_sliced > 0 && cs.selections_sliced < cs.attends && cs.selections_reused == 0,
          "sliced %llu of %llu, reused %llu", (unsigned long long)cs.selections_sliced,
          (unsigned long long)cs.attends, (unsigned long long)cs.selections_reused);
    CHECK(st_s[0].sliced == 1 && st_s[0].reused == 0, "the last decode step: sliced %d reused %d",
          st_s[0].sliced, st_s[0].reused);
    /* the bytes the step read come through: a slice screened and rescored, K/V attended */
    CHECK(st_s[0].first_stage_bytes > 0 && st_s[0].rescoring_bytes > 0 && st_s[0].attention_bytes > 0 &&
              cs.first_stage_bytes >= st_s[0].first_stage_bytes &&
              cs.attention_bytes >= st_s[0].attention_bytes,
          "bytes: step %llu/%llu/%llu, session %llu/%llu", (unsigned long long)st_s[0].first_stage_bytes,
          (unsigned long long)st_s[0].rescoring_bytes, (unsigned long long)st_s[0].attention_bytes,
          (unsigned long long)cs.first_stage_bytes, (unsigned long long)cs.attention_bytes);
    CHECK(ca.selections_sliced == 0 && ca.selections_reused == 0 && st_a[0].sliced == 0,
          "A (defaults) sliced %llu reused %llu", (unsigned long long)ca.selections_sliced,
          (unsigned long long)ca.selections_reused);
    kvtier_session_destroy(sl);
  }

  /* ---- bad input: a third session, so that A and B stay as they were ---- */
  printf("bad input:\n");
  kvtier_session* c = (kvtier_session*)&err;
  kvtier_session_options co = kvtier_session_options_default();
  co.preset = "nosuchpreset";
  EXPECT_ERROR(kvtier_session_open(store, &co, &c, &err), KVTIER_INVALID_ARGUMENT);
  CHECK(c == NULL, "session_open failed but left *out set");
  co = kvtier_session_options_default();
  co.budget_tokens = -1;
  EXPECT_ERROR(kvtier_session_open(store, &co, &c, &err), KVTIER_INVALID_ARGUMENT);
  co = kvtier_session_options_default();
  EXPECT_ERROR(kvtier_session_options_set(&co, "budget_tokens", "-1", &err), KVTIER_INVALID_ARGUMENT);
  CHECK(co.budget_tokens == 2048, "a refused kvtier_session_options_set changed budget_tokens to %d",
        co.budget_tokens);
  EXPECT_ERROR(kvtier_session_options_set(&co, "no_such_option", "1", &err), KVTIER_INVALID_ARGUMENT);
  co = kvtier_session_options_default();
  co.positions = (kvtier_positions)5;
  EXPECT_ERROR(kvtier_session_open(store, &co, &c, &err), KVTIER_INVALID_ARGUMENT);
  co = kvtier_session_options_default();
  co.rope_theta = -1.0;
  EXPECT_ERROR(kvtier_session_open(store, &co, &c, &err), KVTIER_INVALID_ARGUMENT);
  co = kvtier_session_options_default();
  CHECK(co.screen_period == 1, "default screen_period is not 1");
  co.screen_period = 0;
  EXPECT_ERROR(kvtier_session_open(store, &co, &c, &err), KVTIER_INVALID_ARGUMENT);
  co = kvtier_session_options_default();
  EXPECT_ERROR(kvtier_session_open(NULL, &co, &c, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_open(store, NULL, &c, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_open(store, &co, NULL, &err), KVTIER_INVALID_ARGUMENT);
  OK(kvtier_session_open(store, &co, &c, &err));
  if (c == NULL) return 1;

  static float q2[2 * Q_TOK], o2[2 * Q_TOK];
  int64_t pos2[2] = {0, 1};
  for (int i = 0; i < 2 * Q_TOK; ++i) q2[i] = uniform();
  /* positions are the layer's last appended tokens: a layer with none, then positions past,
   * before and at its last token (a fourth session, gone before C's checks) */
  {
    kvtier_session* d = NULL;
    kvtier_session_options dopt = kvtier_session_options_default();
    dopt.budget_tokens = 4 * CHUNK; /* beside A, B and C in the pool */
    OK(kvtier_session_open(store, &dopt, &d, &err));
    if (d == NULL) return 1;
    o2[0] = 7.0f;
    OK(kvtier_session_begin_step(d, KVTIER_STEP_PREFILL, &err));
    EXPECT_ERROR(kvtier_session_attend(d, 0, q2, pos2, 2, o2, NULL, &err), KVTIER_FAILED_PRECONDITION);
    CHECK(strstr(err.message, "layer 0 holds no tokens") != NULL, "message \"%s\"", err.message);
    CHECK(o2[0] == 7.0f, "a refused attend wrote out");
    OK(kvtier_session_append(d, 0, K[0][0], V[0][0], 2, KVTIER_F32, &err));
    OK(kvtier_session_begin_step(d, KVTIER_STEP_DECODE, &err));
    const int64_t past = INT64_MAX;
    EXPECT_ERROR(kvtier_session_attend(d, 0, q2, &past, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
    CHECK(strstr(err.message, "layer 0 holds positions 0..1") && strstr(err.message, "9223372036854775807"),
          "message \"%s\"", err.message);
    EXPECT_ERROR(kvtier_session_attend(d, 0, q2, pos2, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
    CHECK(strstr(err.message, "1..1") && strstr(err.message, "got 0..0"), "message \"%s\"", err.message);
    CHECK(o2[0] == 7.0f, "a refused attend wrote out");
    OK(kvtier_session_attend(d, 0, q2, pos2 + 1, 1, o2, NULL, &err));
    kvtier_session_destroy(d);
  }
  /* NULL handles and buffers */
  EXPECT_ERROR(kvtier_session_append(NULL, 0, K[0][0], V[0][0], 1, KVTIER_F32, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append(c, 0, NULL, V[0][0], 1, KVTIER_F32, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append(c, 0, K[0][0], NULL, 1, KVTIER_F32, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_begin_step(NULL, KVTIER_STEP_DECODE, &err), KVTIER_INVALID_ARGUMENT);
  /* the device-pointer calls: NULLs refused as by their host twins; on this store's cpu hot tier
   * KVTIER_FAILED_PRECONDITION naming the "cuda" tier they need, nothing appended or written */
  EXPECT_ERROR(kvtier_session_append_device(NULL, 0, K[0][0], V[0][0], 1, KVTIER_F32, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append_device(c, 0, NULL, V[0][0], 1, KVTIER_F32, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append_device(c, 0, K[0][0], NULL, 1, KVTIER_F32, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend_device(NULL, 0, q2, pos2, 1, o2, NULL, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend_device(c, 0, NULL, pos2, 1, o2, NULL, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend_device(c, 0, q2, NULL, 1, o2, NULL, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend_device(c, 0, q2, pos2, 1, NULL, NULL, NULL, &err),
               KVTIER_INVALID_ARGUMENT);
  {
    kvtier_session_counters before, after;
    OK(kvtier_session_get_counters(c, &before, &err));
    EXPECT_ERROR(kvtier_session_append_device(c, 0, K[0][0], V[0][0], 1, KVTIER_F32, NULL, &err),
                 KVTIER_FAILED_PRECONDITION);
    CHECK(strstr(err.message, "\"cuda\"") != NULL, "message \"%s\"", err.message);
    o2[0] = 7.0f;
    EXPECT_ERROR(kvtier_session_attend_device(c, 0, q2, pos2, 1, o2, NULL, NULL, &err),
                 KVTIER_FAILED_PRECONDITION);
    CHECK(strstr(err.message, "\"cuda\"") != NULL, "message \"%s\"", err.message);
    CHECK(o2[0] == 7.0f, "a refused attend_device wrote out");
    OK(kvtier_session_get_counters(c, &after, &err));
    CHECK(after.tokens_appended == before.tokens_appended && after.attends == before.attends,
          "a refused device call appended or attended: tokens %llu -> %llu, attends %llu -> %llu",
          (unsigned long long)before.tokens_appended, (unsigned long long)after.tokens_appended,
          (unsigned long long)before.attends, (unsigned long long)after.attends);
  }
  EXPECT_ERROR(kvtier_session_attend(NULL, 0, q2, pos2, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_get_counters(NULL, &ca, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_get_counters(c, NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_close(NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_drop(NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_store_get_counters(NULL, &sc, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_store_get_counters(store, NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_store_wait_durable(NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_store_close(NULL, &err), KVTIER_INVALID_ARGUMENT);
  /* shapes, layers and dtypes */
  EXPECT_ERROR(kvtier_session_append(c, LAYERS, K[0][0], V[0][0], 1, KVTIER_F32, &err),
               KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append(c, -1, K[0][0], V[0][0], 1, KVTIER_F32, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append(c, 0, K[0][0], V[0][0], 0, KVTIER_F32, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append(c, 0, K[0][0], V[0][0], -3, KVTIER_F32, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append(c, 0, K[0][0], V[0][0], 1, KVTIER_F16, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_append(c, 0, K[0][0], V[0][0], 1, (kvtier_dtype)42, &err),
               KVTIER_INVALID_ARGUMENT);
  /* non-finite K/V: refused naming layer, tensor, token and head; nothing appended (counted below) */
  {
    static float bad[2 * KV_TOK];
    const float poison[3] = {NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 3; ++i) {
      memcpy(bad, K[1][0], sizeof(bad));
      bad[KV_TOK + D + 5] = poison[i]; /* token 1, kv head 1, element 5 */
      EXPECT_ERROR(kvtier_session_append(c, 1, bad, V[1][0], 2, KVTIER_F32, &err), KVTIER_INVALID_ARGUMENT);
      CHECK(strstr(err.message, "layer 1") && strstr(err.message, "k[1][1][5]") &&
                strstr(err.message, "not finite"),
            "message \"%s\"", err.message);
      EXPECT_ERROR(kvtier_session_append(c, 1, K[1][0], bad, 2, KVTIER_F32, &err), KVTIER_INVALID_ARGUMENT);
      CHECK(strstr(err.message, "v[1][1][5]") != NULL, "message \"%s\"", err.message);
    }
  }
  for (int l = 0; l < LAYERS; ++l) OK(kvtier_session_append(c, l, K[l][0], V[l][0], 2, KVTIER_F32, &err));
  EXPECT_ERROR(kvtier_session_attend(c, 0, q2, pos2, 1, o2, NULL, &err),
               KVTIER_FAILED_PRECONDITION); /* no step */
  EXPECT_ERROR(kvtier_session_begin_step(c, (kvtier_step_kind)7, &err), KVTIER_INVALID_ARGUMENT);
  OK(kvtier_session_begin_step(c, KVTIER_STEP_DECODE, &err));
  EXPECT_ERROR(kvtier_session_attend(c, 0, q2, pos2, 2, o2, NULL, &err),
               KVTIER_INVALID_ARGUMENT); /* decode, m=2 */
  EXPECT_ERROR(kvtier_session_attend(c, 0, NULL, pos2, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend(c, 0, q2, NULL, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend(c, 0, q2, pos2, 1, NULL, NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend(c, LAYERS, q2, pos2, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend(c, -1, q2, pos2, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_ERROR(kvtier_session_attend(c, 0, q2, pos2, 0, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
  {
    const int64_t negative = -3;
    EXPECT_ERROR(kvtier_session_attend(c, 0, q2, &negative, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
    CHECK(strstr(err.message, "positions[0] = -3") != NULL, "message \"%s\"", err.message);
    static float qnan[Q_TOK];
    memcpy(qnan, q2, sizeof(qnan));
    qnan[Q_TOK - 1] = NAN;
    EXPECT_ERROR(kvtier_session_attend(c, 0, qnan, pos2, 1, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
    CHECK(strstr(err.message, "not finite") != NULL, "message \"%s\"", err.message);
  }
  EXPECT_ERROR(kvtier_session_attend(c, 1, q2, pos2 + 1, 1, o2, NULL, &err),
               KVTIER_FAILED_PRECONDITION); /* order */
  OK(kvtier_session_begin_step(c, KVTIER_STEP_PREFILL, &err));
  {
    int64_t down[2] = {1, 0};
    EXPECT_ERROR(kvtier_session_attend(c, 0, q2, down, 2, o2, NULL, &err), KVTIER_INVALID_ARGUMENT);
  }
  OK(kvtier_session_attend(c, 0, q2, pos2, 2, o2, NULL, &err)); /* the same call, well formed, succeeds */
  /* err may be NULL: the code alone */
  CHECK(kvtier_session_attend(c, 9, q2, pos2, 2, o2, NULL, NULL) == KVTIER_INVALID_ARGUMENT, "NULL err");
  CHECK(kvtier_session_attend(c, 1, q2, pos2, 2, o2, NULL, NULL) == KVTIER_OK, "NULL err on success");
  /* the store refuses to close under open sessions */
  EXPECT_ERROR(kvtier_store_close(store, &err), KVTIER_FAILED_PRECONDITION);
  OK(kvtier_store_get_counters(store, &sc, &err)); /* still open */
  /* a dropped sequence */
  OK(kvtier_session_drop(c, &err));
  EXPECT_ERROR(kvtier_session_append(c, 0, K[0][0], V[0][0], 1, KVTIER_F32, &err),
               KVTIER_FAILED_PRECONDITION);
  EXPECT_ERROR(kvtier_session_begin_step(c, KVTIER_STEP_DECODE, &err), KVTIER_FAILED_PRECONDITION);
  EXPECT_ERROR(kvtier_session_attend(c, 0, q2, pos2, 1, o2, NULL, &err), KVTIER_FAILED_PRECONDITION);
  EXPECT_ERROR(kvtier_session_compress(c, "h2o", 1000, 0, NULL, &err), KVTIER_FAILED_PRECONDITION);
  EXPECT_ERROR(kvtier_session_close(c, &err), KVTIER_FAILED_PRECONDITION);
  EXPECT_ERROR(kvtier_session_drop(c, &err), KVTIER_FAILED_PRECONDITION); /* a second drop */
  CHECK(strstr(err.message, "dropped") != NULL, "message \"%s\"", err.message);
  OK(kvtier_session_get_counters(c, &ca, &err));
  CHECK(ca.tokens_appended == 2 * LAYERS && ca.attends == 2, "C: %llu tokens, %llu attends",
        (unsigned long long)ca.tokens_appended, (unsigned long long)ca.attends);
  /* a closed sequence is read-only */
  OK(kvtier_session_close(b, &err));
  EXPECT_ERROR(kvtier_session_append(b, 0, K[0][0], V[0][0], 1, KVTIER_F32, &err),
               KVTIER_FAILED_PRECONDITION);

  kvtier_session_destroy(c);
  kvtier_session_destroy(b);
  EXPECT_ERROR(kvtier_store_close(store, &err), KVTIER_FAILED_PRECONDITION); /* a is still open */
  kvtier_session_destroy(a);
  kvtier_session_destroy(NULL);
  OK(kvtier_store_close(store, &err));

  if (failures) {
    fprintf(stderr, "%d of %d checks failed\n", failures, checks);
    return 1;
  }
  printf("all %d checks passed\n", checks);
  return 0;
}
