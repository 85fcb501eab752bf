#include "integration/stress_job.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "engine/session_internal.h"
#include "integration/json.h"
#include "integration/options_json.h"
#include "integration/pattern.h"
#include "integration/sysinfo.h"
#include "integration/tier_report.h"
#include "kvtier/session.h"
#include "offload/tiered_store.h"

namespace kvtier {
namespace {

constexpr uint64_t kStressSalt = 0x5354524553530001ull;

struct Shared {
  std::atomic<uint64_t> appends{0}, fetches{0}, fetched_chunks{0}, verified{0}, bytes{0}, errors{0};
  std::mutex mu;
  std::string first_error;
  void Fail(const std::string& what) {
    errors++;
    std::lock_guard<std::mutex> l(mu);
    if (first_error.empty()) first_error = what;
  }
};

// Reads every token of every layer of `seq` and compares with the pattern.
uint64_t VerifySequence(TieredStore* store, SequenceId seq, uint64_t pattern_id, int64_t tokens, Shared* sh) {
  const StoreOptions& o = store->options();
  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  const int64_t block = 1024;
  std::vector<uint8_t> k(block * tb), v(block * tb), ek(block * tb), ev(block * tb);
  uint64_t verified = 0;
  for (int l = 0; l < o.geometry.layers; ++l) {
    for (int64_t b = 0; b < tokens; b += block) {
      const int64_t n = std::min(block, tokens - b);
      Status st = store->ReadTokens(seq, l, b, b + n, k.data(), v.data());
      if (!st.ok()) {
        sh->Fail("read seq " + std::to_string(seq) + ": " + st.ToString());
        continue;
      }
      FillPattern(kStressSalt, pattern_id, l, 0, b, n, tb, ek.data());
      FillPattern(kStressSalt, pattern_id, l, 1, b, n, tb, ev.data());
      if (std::memcmp(k.data(), ek.data(), n * tb) != 0 || std::memcmp(v.data(), ev.data(), n * tb) != 0)
        sh->Fail("seq " + std::to_string(seq) + " layer " + std::to_string(l) + " tokens [" +
                 std::to_string(b) + ", " + std::to_string(b + n) + ") differ from what was appended");
      else
        verified += n;
    }
  }
  return verified;
}

}  // namespace

Status StressOptions::Validate() const {
  KVTIER_RETURN_IF_ERROR(store.Validate());
  if (store.data_dir.empty())
    return InvalidArgument("stress needs a data_dir (the cold tier is part of the test)");
  if (sequences <= 0) return InvalidArgument("sequences must be > 0 (got " + std::to_string(sequences) + ")");
  if (threads <= 0) return InvalidArgument("threads must be > 0 (got " + std::to_string(threads) + ")");
  if (tokens <= 0) return InvalidArgument("tokens must be > 0 (got " + std::to_string(tokens) + ")");
  if (max_block <= 0) return InvalidArgument("max_block must be > 0 (got " + std::to_string(max_block) + ")");
  if (fetch_probability < 0 || fetch_probability > 1)
    return InvalidArgument("fetch_probability must be in [0, 1]");
  if (fetch_chunks <= 0) return InvalidArgument("fetch_chunks must be > 0");
  if (static_cast<uint64_t>(fetch_chunks) * store.chunk_bytes() * threads > store.hot_bytes)
    return InvalidArgument("hot_bytes must hold fetch_chunks x threads chunks (" +
                           std::to_string(static_cast<uint64_t>(fetch_chunks) * threads) + ")");
  return Status::Ok();
}

Result<StressReport> RunStress(const StressOptions& opt) {
  KVTIER_RETURN_IF_ERROR(opt.Validate());
  const double t0 = NowSeconds();
  StressReport rep;
  Shared sh;
  std::vector<std::pair<SequenceId, uint64_t>> made;  // (sequence, pattern id)
  {
    KVTIER_ASSIGN_OR_RETURN(auto store, TieredStore::Open(opt.store));
    const StoreOptions& o = store->options();
    const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
    std::vector<SequenceId> ids;
    for (int i = 0; i < opt.sequences; ++i) {
      KVTIER_ASSIGN_OR_RETURN(SequenceId id, store->CreateSequence());
      ids.push_back(id);
      made.emplace_back(id, static_cast<uint64_t>(i) + opt.seed * 1000);
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < opt.threads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(opt.seed * 7919 + t);
        std::vector<uint8_t> k, v, got, hot_k, hot_v;
        for (size_t si = t; si < ids.size(); si += opt.threads) {
          const SequenceId seq = ids[si];
          const uint64_t pid = made[si].second;
          // Each sequence through the engine API: a session whose chunk selector picks random
          // chunks, so Gather fetches and pins them as Attend would.
          SessionOptions so;
          so.retrieve = false;
          auto session = Session::Attach(store.get(), seq, so);
          if (!session.ok()) {
            sh.Fail("session: " + session.status().ToString());
            return;
          }
          std::vector<uint64_t> pick;
          ImplOf(**session).SetChunkSelector(
              [&](int, const float*, const int64_t*, int,
                  const std::vector<ChunkInfo>& chunks) -> Result<std::vector<uint64_t>> {
                pick.clear();
                for (int c = 0; c < opt.fetch_chunks && !chunks.empty(); ++c)
                  pick.push_back(chunks[rng() % chunks.size()].key.index);
                return pick;
              });
          const std::vector<float> q(static_cast<size_t>(o.geometry.q_heads) * o.geometry.head_dim, 0.0f);
          std::vector<int64_t> len(o.geometry.layers, 0);
          bool done = false;
          while (!done) {
            done = true;
            for (int l = 0; l < o.geometry.layers; ++l) {
              if (len[l] >= opt.tokens) continue;
              done = false;
              const int n = static_cast<int>(
                  std::min<int64_t>(opt.tokens - len[l],
                                    1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(opt.max_block))));
              k.resize(n * tb);
              v.resize(n * tb);
              FillPattern(kStressSalt, pid, l, 0, len[l], n, tb, k.data());
              FillPattern(kStressSalt, pid, l, 1, len[l], n, tb, v.data());
              Status st = (*session)->Append(l, k.data(), v.data(), n, o.geometry.dtype);
              if (!st.ok()) {
                sh.Fail("append: " + st.ToString());
                return;
              }
              len[l] += n;
              sh.appends++;
              sh.bytes += 2 * n * tb;
              if (std::uniform_real_distribution<double>(0, 1)(rng) >= opt.fetch_probability) continue;
              if (o.warm_policy != "lru" || o.hot_policy != "lru") {
                // A score-driven policy: random chunk scores, so victims are picked
                // against pins and in-flight transfers in every order.
                auto chunks = store->ListChunks(seq, l);
                if (!chunks.ok()) {
                  sh.Fail("list chunks: " + chunks.status().ToString());
                  return;
                }
                std::vector<std::pair<uint64_t, float>> scores;
                for (const ChunkInfo& c : *chunks)
                  scores.emplace_back(c.key.index, std::uniform_real_distribution<float>(0, 1)(rng));
                st = store->SetChunkScores(seq, l, scores);
                if (!st.ok()) {
                  sh.Fail("set chunk scores: " + st.ToString());
                  return;
                }
              }
              st = (*session)->BeginStep(StepKind::kDecode);
              if (!st.ok()) {
                sh.Fail("begin step: " + st.ToString());
                return;
              }
              const int64_t at = len[l] - 1;
              auto parts = ImplOf(**session).Gather(l, q.data(), &at, 1);
              if (!parts.ok()) {
                sh.Fail("fetch: " + parts.status().ToString());
                continue;
              }
              if (parts->n_chunks == 0) continue;
              sh.fetches++;
              // Check each promoted chunk bit for bit against the pattern.
              for (size_t c = 0; c < parts->n_chunks; ++c) {
                const auto& span = parts->parts[1 + c];
                const size_t bytes = static_cast<size_t>(span.n_tokens) * tb;
                got.resize(bytes);
                hot_k.resize(bytes);
                hot_v.resize(bytes);
                // Through the hot tier: with --device cuda the spans are device pointers.
                st = store->hot_tier()->Download(hot_k.data(), static_cast<const uint8_t*>(span.k), bytes);
                if (st.ok())
                  st = store->hot_tier()->Download(hot_v.data(), static_cast<const uint8_t*>(span.v), bytes);
                if (!st.ok()) {
                  sh.Fail("read back a fetched chunk: " + st.ToString());
                  continue;
                }
                FillPattern(kStressSalt, pid, l, 0, span.first_position, span.n_tokens, tb, got.data());
                bool same = std::memcmp(got.data(), hot_k.data(), bytes) == 0;
                FillPattern(kStressSalt, pid, l, 1, span.first_position, span.n_tokens, tb, got.data());
                same = same && std::memcmp(got.data(), hot_v.data(), bytes) == 0;
                if (!same)
                  sh.Fail("fetched chunk " + std::to_string(parts->chunks[c]) + " of seq " +
                          std::to_string(seq) + " differs");
                sh.fetched_chunks++;
              }
            }
          }
          Status st = (*session)->Close();
          if (!st.ok()) sh.Fail("close: " + st.ToString());
        }
      });
    }
    for (auto& th : threads) th.join();
    for (auto& [seq, pid] : made)
      rep.verified_tokens += VerifySequence(store.get(), seq, pid, opt.tokens, &sh);
    KVTIER_RETURN_IF_ERROR(store->WaitForDurable());
    rep.counters = store->counters();
    if (!opt.reopen && opt.drop_at_end) {
      for (auto& [seq, pid] : made) KVTIER_RETURN_IF_ERROR(store->DropSequence(seq));
      KVTIER_RETURN_IF_ERROR(store->WaitForDurable());
      rep.sequences_dropped = true;
    }
  }
  if (opt.reopen) {
    // Reopen from the RocksDB directory alone: everything must come back.
    KVTIER_ASSIGN_OR_RETURN(auto store, TieredStore::Open(opt.store));
    for (auto& [seq, pid] : made)
      rep.verified_after_reopen += VerifySequence(store.get(), seq, pid, opt.tokens, &sh);
    if (opt.drop_at_end) {
      for (auto& [seq, pid] : made) KVTIER_RETURN_IF_ERROR(store->DropSequence(seq));
      KVTIER_RETURN_IF_ERROR(store->WaitForDurable());
      rep.sequences_dropped = true;
    }
  }
  rep.appends = sh.appends;
  rep.fetches = sh.fetches;
  rep.fetched_chunks = sh.fetched_chunks;
  rep.bytes_appended = sh.bytes;
  rep.errors = sh.errors;
  rep.first_error = sh.first_error;
  rep.seconds = NowSeconds() - t0;
  return rep;
}

std::string StressReport::ToJson(const StressOptions& o) const {
  JsonWriter w(true);
  w.BeginObject();
  w.Key("ok").Bool(errors == 0);
  w.Key("errors").Uint(errors).Key("first_error").String(first_error);
  w.Key("appends").Uint(appends).Key("fetches").Uint(fetches).Key("fetched_chunks").Uint(fetched_chunks);
  w.Key("bytes_appended").Uint(bytes_appended);
  w.Key("verified_tokens").Uint(verified_tokens).Key("verified_tokens_after_reopen");
  if (o.reopen)
    w.Uint(verified_after_reopen);
  else
    w.Null();  // not reopened: not measured
  w.Key("sequences_dropped").Bool(sequences_dropped);
  w.Key("seconds").Double(seconds);
  w.Key("io").BeginObject();
  w.Key("bytes_moved").Uint(counters.bytes_moved).Key("promotions").Uint(counters.promotions);
  w.Key("demotions")
      .Uint(counters.demotions)
      .Key("hits")
      .Uint(counters.hits)
      .Key("misses")
      .Uint(counters.misses);
  w.Key("cold_reads").Uint(counters.cold_reads).Key("cold_writes").Uint(counters.cold_writes);
  w.Key("lease_expired").Uint(counters.lease_expired);
  w.Key("pin_waits").Uint(counters.pin_waits).Key("pin_wait_us").Uint(counters.pin_wait_us);
  w.Key("tiers");
  WriteTierTrafficJson(&w, counters);
  w.EndObject();
  w.Key("config").BeginObject();
  w.Key("geometry")
      .String(o.store.geometry.ToString())
      .Key("sequences")
      .Int(o.sequences)
      .Key("threads")
      .Int(o.threads);
  w.Key("tokens").Int(o.tokens);
  w.Key("seed").Uint(o.seed).Key("fetch_probability").Double(o.fetch_probability);
  WriteStoreOptionsJson(&w, o.store);
  w.EndObject();
  w.EndObject();
  return w.str();
}

std::string StressReport::ToTable(const StressOptions& o) const {
  char buf[2048];
  std::snprintf(
      buf, sizeof(buf),
      "kvtier stress — %d sequences x %lld tokens x %d layers on %d threads, warm %llu B, hot %llu B\n"
      "  operations: %llu appends, %llu fetches (%llu chunks checked on promotion)\n"
      "  bytes appended: %.1f MiB; moved between tiers: %.1f MiB\n"
      "  tiers: %llu promotions, %llu demotions, %llu hits, %llu misses, %llu cold writes, %llu cold reads\n"
      "  verified bit for bit: %llu tokens, after reopen: %llu tokens\n"
      "  errors: %llu%s%s\n"
      "  %.2f s\n",
      o.sequences, static_cast<long long>(o.tokens), o.store.geometry.layers, o.threads,
      static_cast<unsigned long long>(o.store.warm_bytes), static_cast<unsigned long long>(o.store.hot_bytes),
      static_cast<unsigned long long>(appends), static_cast<unsigned long long>(fetches),
      static_cast<unsigned long long>(fetched_chunks), bytes_appended / 1048576.0,
      counters.bytes_moved / 1048576.0, static_cast<unsigned long long>(counters.promotions),
      static_cast<unsigned long long>(counters.demotions), static_cast<unsigned long long>(counters.hits),
      static_cast<unsigned long long>(counters.misses), static_cast<unsigned long long>(counters.cold_writes),
      static_cast<unsigned long long>(counters.cold_reads), static_cast<unsigned long long>(verified_tokens),
      static_cast<unsigned long long>(verified_after_reopen), static_cast<unsigned long long>(errors),
      first_error.empty() ? "" : " — first: ", first_error.c_str(), seconds);
  return buf + TierTrafficText(counters, !o.store.remote.empty(), "  ");
}

}  // namespace kvtier
