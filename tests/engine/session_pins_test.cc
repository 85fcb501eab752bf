// Sessions sharing one store's hot slot pool: many sessions on many
// threads at a pool just above their summed budgets never fail mid-run for want of a slot
// another session is about to unpin.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/session_internal.h"
#include "kvtier/kvtier.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

constexpr int kLayers = 4, kQHeads = 8, kKvHeads = 2, kDim = 64;

// The issue's store: f32 4,8,2,64, sinks 16, local 128, chunks of 32, RocksDB tier;
// `slots` hot slots (the issue's 2 MiB is 64).
StoreOptions PinStore(const std::string& dir, int slots) {
  StoreOptions so;
  so.geometry = Geometry{kLayers, kQHeads, kKvHeads, kDim, DType::kF32};
  so.n_sink = 16;
  so.n_local = 128;
  so.chunk_size = 32;
  so.hot_bytes = static_cast<uint64_t>(slots) * so.chunk_bytes();
  so.data_dir = dir;
  return so;
}

SessionOptions Budget(int budget_tokens) {
  SessionOptions o;
  o.retrieval.budget_tokens = budget_tokens;
  return o;
}

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Decodes `tokens` tokens (from position 0) through every layer of a fresh session.
Status Decode(TieredStore* store, uint32_t seed, int budget_tokens, int tokens) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Session> s, Session::Open(store, Budget(budget_tokens)));
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> k(kKvHeads * kDim), v(k.size()), q(kQHeads * kDim), out(q.size());
  for (int64_t pos = 0; pos < tokens; ++pos) {
    KVTIER_RETURN_IF_ERROR(s->BeginStep(StepKind::kDecode));
    for (int l = 0; l < kLayers; ++l) {
      for (float& x : k) x = n(rng);
      for (float& x : v) x = n(rng);
      for (float& x : q) x = n(rng);
      KVTIER_RETURN_IF_ERROR(s->Append(l, k.data(), v.data(), 1, DType::kF32));
      Status st = s->Attend(l, q.data(), &pos, 1, out.data());
      if (!st.ok())
        return Status(st.code(), "session seed " + std::to_string(seed) + ", position " +
                                     std::to_string(pos) + ", layer " + std::to_string(l) + ": " +
                                     st.message());
    }
  }
  return s->Drop();
}

// The issue's program: 8 sessions of 512 budget tokens (16 chunks), two after another on
// each of 4 threads, over a pool of `slots`.
std::vector<Status> RunIssueProgram(TieredStore* store, int tokens) {
  constexpr int kThreads = 4, kPerThread = 2;
  std::vector<Status> status(kThreads * kPerThread);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i)
        status[t * kPerThread + i] = Decode(store, 1000u + t * kPerThread + i, 512, tokens);
    });
  for (auto& th : threads) th.join();
  return status;
}

TEST(SessionPins, ConcurrentSessionsAtAPoolJustAboveTheirBudgetsNeverFail) {
  // 4 sessions at a time x 16 chunks = 64 slots of budget; the pool has 4 more. The entropy
  // cut-off may give one layer more than 16 chunks, so Attends overlap on more slots than
  // the pool has: a fetch must wait for the others' unpins, never fail.
  TempDir dir;
  auto store = TieredStore::Open(PinStore(dir.path(), 68));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const std::vector<Status> status = RunIssueProgram(store->get(), 1000);
  for (size_t i = 0; i < status.size(); ++i)
    EXPECT_TRUE(status[i].ok()) << "session " << i << ": " << status[i].ToString();
  const StoreCounters c = (*store)->counters();
  EXPECT_EQ(c.pin_wait_timeouts, 0u);
  EXPECT_EQ(c.hot_reserved, 0u) << "every session gave its reservation back";
  std::printf("pin waits %llu, %.1f ms in all\n", static_cast<unsigned long long>(c.pin_waits),
              c.pin_wait_us / 1000.0);
}

// A batching engine on one thread: `sessions` sessions of 128 budget tokens (4 chunks each)
// over a pool of their reservations plus `spare` slots; each step, per layer, every session
// appends its token and gathers its spans, all are attended, then all are released. Returns
// the first failed call (naming session, step and layer) or OK; `wall_ms` is the decode's
// time, `clipped` the chunks cut from grants.
Status BatchedDecodeOnOneThread(int sessions, int spare, int pin_wait_ms, int steps, double* wall_ms,
                                uint64_t* clipped, StoreCounters* counters) {
  StoreOptions so = PinStore("", sessions * 4 + spare);
  so.pin_wait_ms = pin_wait_ms;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<TieredStore> store, TieredStore::Open(so));
  std::vector<std::unique_ptr<Session>> ss;
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  constexpr int kPrompt = 16 + 128 + 24 * 32;  // sinks, local window, 24 chunks
  std::vector<float> k(static_cast<size_t>(kPrompt) * kKvHeads * kDim), v(k.size());
  for (int i = 0; i < sessions; ++i) {
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Session> s, Session::Open(store.get(), Budget(128)));
    if (s->reserved_slots() != 4) return Internal("reserved " + std::to_string(s->reserved_slots()));
    for (int l = 0; l < kLayers; ++l) {
      for (float& x : k) x = n(rng);
      for (float& x : v) x = n(rng);
      KVTIER_RETURN_IF_ERROR(s->Append(l, k.data(), v.data(), kPrompt, DType::kF32));
    }
    ss.push_back(std::move(s));
  }
  std::vector<float> k1(kKvHeads * kDim), v1(k1.size()), q(kQHeads * kDim);
  std::vector<LayerParts> held(static_cast<size_t>(sessions));
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    const int64_t pos = kPrompt + step;
    for (auto& s : ss) KVTIER_RETURN_IF_ERROR(s->BeginStep(StepKind::kDecode));
    for (int l = 0; l < kLayers; ++l) {
      for (int i = 0; i < sessions; ++i) {
        for (float& x : k1) x = n(rng);
        for (float& x : v1) x = n(rng);
        for (float& x : q) x = n(rng);
        KVTIER_RETURN_IF_ERROR(ss[i]->Append(l, k1.data(), v1.data(), 1, DType::kF32));
        auto lp = ImplOf(*ss[i]).Gather(l, q.data(), &pos, 1);
        if (!lp.ok())
          return Status(lp.status().code(), "session " + std::to_string(i) + ", step " +
                                                std::to_string(step) + ", layer " + std::to_string(l) + ": " +
                                                lp.status().message());
        held[static_cast<size_t>(i)] = std::move(*lp);
      }
      for (LayerParts& lp : held) lp.Release();  // attended: every session's spans at once
    }
  }
  *wall_ms = MsSince(t0);
  *clipped = 0;
  for (auto& s : ss) *clipped += s->counters().chunks_clipped;
  *counters = store->counters();
  return Status::Ok();
}

TEST(SessionPins, OneThreadBatchingManySessionsNeverWaitsForItsOwnPins) {
  // The entropy cut-off grants a layer more than the budget's share (here 5 or more chunks of
  // a 4-chunk reservation); the thread holds every earlier session's pins while it gathers
  // the next. No gather may wait: every pin in the pool is this thread's.
  constexpr int kSteps = 40, kWaitMs = 2000;
  struct Case {
    int sessions, spare;
  };
  for (const Case& c : {Case{16, 0}, Case{8, 0}, Case{16, 4}}) {
    SCOPED_TRACE(std::to_string(c.sessions) + " sessions, " + std::to_string(c.spare) + " spare slots");
    double wall_ms = 0;
    uint64_t clipped = 0;
    StoreCounters sc;
    const Status st = BatchedDecodeOnOneThread(c.sessions, c.spare, kWaitMs, kSteps, &wall_ms, &clipped, &sc);
    ASSERT_TRUE(st.ok()) << st.ToString();
    std::printf("%d sessions, %d spare: %d steps in %.0f ms, %llu chunks cut from grants, %llu pin waits\n",
                c.sessions, c.spare, kSteps, wall_ms, static_cast<unsigned long long>(clipped),
                static_cast<unsigned long long>(sc.pin_waits));
    EXPECT_EQ(sc.pin_waits, 0u);
    EXPECT_EQ(sc.pin_wait_timeouts, 0u);
    // A wait is counted (pin_waits above); the clock only backs that up against an uncounted
    // one, with room for a sanitizer build on a loaded machine (about 0.3 s in a Release build,
    // up to 4 s under ThreadSanitizer at load 8): ten waits of pin_wait_ms would still exceed it.
    EXPECT_LT(wall_ms, 10 * kWaitMs) << "far below steps x pin_wait_ms = " << kSteps * kWaitMs << " ms";
    if (c.spare == 0) {
      EXPECT_GT(clipped, 0u) << "no grant passed the reservation: the case tests nothing";
    }
  }
}

TEST(SessionPins, OpenIsRefusedWhenThePoolCannotHoldTheBudgets) {
  // 40 slots hold two budgets of 16 chunks, not three.
  auto store = TieredStore::Open(PinStore("", 40));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore* st = store->get();
  auto a = Session::Open(st, Budget(512));
  auto b = Session::Open(st, Budget(512));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->reserved_slots(), 16);
  EXPECT_EQ(st->counters().hot_reserved, 32u);
  const size_t sequences = st->ListSequences().size();
  auto c = Session::Open(st, Budget(512));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kResourceExhausted) << c.status().ToString();
  for (const char* part : {"40 slots", "32 reserved", "asks 16", "budget_tokens 512"})
    EXPECT_NE(c.status().message().find(part), std::string::npos) << part << " in: " << c.status().ToString();
  EXPECT_EQ(st->ListSequences().size(), sequences) << "a refused Open leaves no sequence behind";
  // A smaller budget still fits; another session on a's sequence counts once, at its largest.
  auto small = Session::Open(st, Budget(256));
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  auto beside_a = Session::Attach(st, (*a)->sequence(), Budget(512));
  ASSERT_TRUE(beside_a.ok()) << beside_a.status().ToString();
  EXPECT_EQ(st->counters().hot_reserved, 40u);
  small->reset();
  // Drop, Close and destruction each give the reservation back.
  ASSERT_TRUE((*b)->Drop().ok());
  EXPECT_EQ((*b)->reserved_slots(), 0);
  auto c2 = Session::Open(st, Budget(512));
  ASSERT_TRUE(c2.ok()) << c2.status().ToString();
  EXPECT_FALSE(Session::Open(st, Budget(512)).ok());
  ASSERT_TRUE((*c2)->Close().ok());
  auto c3 = Session::Open(st, Budget(512));
  ASSERT_TRUE(c3.ok()) << c3.status().ToString();
  EXPECT_FALSE(Session::Open(st, Budget(512)).ok());
  c3->reset();
  EXPECT_TRUE(Session::Open(st, Budget(512)).ok());
  // retrieve = false reserves nothing; a budget above the pool is refused, naming both
  // numbers; the whole pool's budget leaves no room for anything else with a budget.
  a->reset();
  beside_a->reset();
  SessionOptions full;
  full.retrieve = false;
  auto f = Session::Open(st, full);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->reserved_slots(), 0);
  EXPECT_EQ(st->counters().hot_reserved, 0u);
  auto over = Session::Open(st, Budget(4096));
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(
      over.status().message().find("budget_tokens 4096 needs 128 chunks of 32 tokens, and the hot slot pool "
                                   "holds 40"),
      std::string::npos)
      << over.status().ToString();
  EXPECT_EQ(st->counters().hot_reserved, 0u);
  auto big = Session::Open(st, Budget(40 * 32));
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_EQ((*big)->reserved_slots(), 40);
  auto refused = Session::Open(st, Budget(32));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("40 reserved"), std::string::npos) << refused.status().ToString();
}

// A store of tiny chunks with `slots` hot slots and three sequences of `chunks` sealed chunks
// each in layer 0 (c for the tests that need a third).
struct TwoSequences {
  std::unique_ptr<TieredStore> store;
  SequenceId a = 0, b = 0, c = 0;
};
TwoSequences MakeTwoSequences(int slots, int chunks, int pin_wait_ms) {
  StoreOptions so;
  so.geometry = Geometry{1, 2, 1, 16, DType::kF32};
  so.n_sink = 0;
  so.n_local = 8;
  so.chunk_size = 8;
  so.repr_topk = 2;
  so.hot_bytes = static_cast<uint64_t>(slots) * so.chunk_bytes();
  so.pin_wait_ms = pin_wait_ms;
  TwoSequences t;
  auto store = TieredStore::Open(so);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  t.store = std::move(*store);
  const int n = so.n_local + chunks * so.chunk_size;
  std::vector<float> kv(static_cast<size_t>(n) * 16, 0.5f);
  for (SequenceId* seq : {&t.a, &t.b, &t.c}) {
    *seq = *t.store->CreateSequence();
    EXPECT_TRUE(t.store->Append(*seq, 0, kv.data(), kv.data(), n, DType::kF32).ok());
  }
  return t;
}

std::vector<uint64_t> Range(uint64_t begin, uint64_t end) {
  std::vector<uint64_t> v;
  for (uint64_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

TEST(SessionPins, AFetchWaitsForAnotherSequencesUnpin) {
  TwoSequences t = MakeTwoSequences(8, 10, 10000);
  auto all = t.store->FetchChunks(t.a, 0, Range(0, 8));  // every slot pinned by a
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_TRUE(all->Wait().ok());
  Result<FetchHandle> waited = FailedPrecondition("not run");
  std::thread other([&] { waited = t.store->FetchChunks(t.b, 0, Range(0, 4)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  all->Release();
  other.join();
  ASSERT_TRUE(waited.ok()) << waited.status().ToString();
  EXPECT_TRUE(waited->Wait().ok());
  const StoreCounters c = t.store->counters();
  EXPECT_EQ(c.pin_waits, 1u);
  EXPECT_GT(c.pin_wait_us, 0u);
  EXPECT_EQ(c.pin_wait_timeouts, 0u);
}

TEST(SessionPins, AFetchWaitIsBoundedAndNamed) {
  TwoSequences t = MakeTwoSequences(8, 10, 100);
  // Another thread's pins (this thread's own would be refused at once, not waited for).
  Result<FetchHandle> all = FailedPrecondition("not run");
  std::thread holder([&] { all = t.store->FetchChunks(t.a, 0, Range(0, 8)); });
  holder.join();
  ASSERT_TRUE(all.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto refused = t.store->FetchChunks(t.b, 0, Range(0, 2));
  EXPECT_GE(MsSince(t0), 90.0);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  for (const char* part :
       {"needs 2 more hot slots", "pool's 8", "8 are pinned or loading for other sequences", "waited 100 ms"})
    EXPECT_NE(refused.status().message().find(part), std::string::npos)
        << part << " in: " << refused.status().ToString();
  const StoreCounters c = t.store->counters();
  EXPECT_EQ(c.pin_waits, 1u);
  EXPECT_EQ(c.pin_wait_timeouts, 1u);
  EXPECT_GE(c.pin_wait_us, 90000u);
}

TEST(SessionPins, NoWaitForPinsTheCallingThreadHolds) {
  // This thread holds every slot through a's and b's handles; c holds none, so waiting would
  // be allowed by the sequence rule, but only this thread could free the slots.
  TwoSequences t = MakeTwoSequences(8, 10, 10000);
  TieredStore* st = t.store.get();
  auto six = st->FetchChunks(t.a, 0, Range(0, 6));
  auto two = st->FetchChunks(t.b, 0, Range(0, 2));
  ASSERT_TRUE(six.ok() && two.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto refused = st->FetchChunks(t.c, 0, Range(0, 2));
  EXPECT_LT(MsSince(t0), 1000.0) << "well under pin_wait_ms (10000)";
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  for (const char* part :
       {"needs 2 more hot slots", "the calling thread holds 8 of them", "would wait for itself", "release"})
    EXPECT_NE(refused.status().message().find(part), std::string::npos)
        << part << " in: " << refused.status().ToString();
  EXPECT_EQ(st->counters().pin_waits, 0u);
  // With b's 2 pins taken by another thread instead (pins count for the thread that
  // fetched them), c may wait for those 2, and fails at once asking for 3.
  two->Release();
  Result<FetchHandle> other = FailedPrecondition("not run");
  std::thread holder([&] { other = st->FetchChunks(t.b, 0, Range(0, 2)); });
  holder.join();
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  t0 = std::chrono::steady_clock::now();
  auto three = st->FetchChunks(t.c, 0, Range(0, 3));
  EXPECT_LT(MsSince(t0), 1000.0);
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.status().message().find("the calling thread holds 6 of them"), std::string::npos)
      << three.status().ToString();
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    other->Release();
  });
  auto waited = st->FetchChunks(t.c, 0, Range(0, 2));  // the other thread's 2 will come free
  releaser.join();
  ASSERT_TRUE(waited.ok()) << waited.status().ToString();
  EXPECT_EQ(st->counters().pin_waits, 1u);
  EXPECT_EQ(st->counters().pin_wait_timeouts, 0u);
}

TEST(SessionPins, NoWaitForPinsASequenceHoldsItselfOrBeyondItsReservation) {
  TwoSequences t = MakeTwoSequences(8, 10, 10000);
  TieredStore* st = t.store.get();
  // a holds 6 slots and has no reservation, b holds the other 2: a's next fetch fails at
  // once (waiting for b alone would be fine, but a cannot know b is not waiting for a).
  auto six = st->FetchChunks(t.a, 0, Range(0, 6));
  auto two = st->FetchChunks(t.b, 0, Range(0, 2));
  ASSERT_TRUE(six.ok() && two.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto self = st->FetchChunks(t.a, 0, Range(6, 8));
  EXPECT_LT(MsSince(t0), 5000.0);
  ASSERT_FALSE(self.ok());
  EXPECT_EQ(self.status().code(), StatusCode::kResourceExhausted);
  for (const char* part : {"waiting could deadlock", "6 for this one",
                           "2 are pinned or loading for other sequences", "reservation 0"})
    EXPECT_NE(self.status().message().find(part), std::string::npos)
        << part << " in: " << self.status().ToString();
  six->Release();
  two->Release();
  // Each sequence reserves half the pool, holds it, and asks for more on its own thread:
  // neither may wait for the other (that would deadlock until pin_wait_ms).
  auto ra = st->ReserveHotSlots(t.a, 4);
  auto rb = st->ReserveHotSlots(t.b, 4);
  ASSERT_TRUE(ra.ok() && rb.ok());
  auto over = st->ReserveHotSlots(t.b, 5);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().ToString();
  auto half_a = st->FetchChunks(t.a, 0, Range(0, 4));
  auto half_b = st->FetchChunks(t.b, 0, Range(0, 4));
  ASSERT_TRUE(half_a.ok() && half_b.ok());
  Result<FetchHandle> more_a = FailedPrecondition("not run"), more_b = FailedPrecondition("not run");
  t0 = std::chrono::steady_clock::now();
  std::thread ta([&] { more_a = st->FetchChunks(t.a, 0, Range(4, 6)); });
  std::thread tb([&] { more_b = st->FetchChunks(t.b, 0, Range(4, 6)); });
  ta.join();
  tb.join();
  EXPECT_LT(MsSince(t0), 5000.0) << "the two fetches waited for each other";
  for (const Result<FetchHandle>* r : {&more_a, &more_b}) {
    ASSERT_FALSE(r->ok());
    EXPECT_EQ(r->status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(r->status().message().find("waiting could deadlock"), std::string::npos)
        << r->status().ToString();
    EXPECT_NE(r->status().message().find("reservation 4"), std::string::npos) << r->status().ToString();
  }
  EXPECT_EQ(st->counters().pin_waits, 0u);
  // Within its reservation a sequence that holds pins may wait: a (6 reserved) holds 2 and
  // asks 2 while b (2 reserved) holds 6, more than its share, taken while there was room.
  half_a->Release();
  half_b->Release();
  st->ReleaseHotSlots(*ra);
  st->ReleaseHotSlots(*rb);
  ra = st->ReserveHotSlots(t.a, 6);
  rb = st->ReserveHotSlots(t.b, 2);
  ASSERT_TRUE(ra.ok() && rb.ok());
  auto two_a = st->FetchChunks(t.a, 0, Range(0, 2));
  auto six_b = st->FetchChunks(t.b, 0, Range(0, 6));
  ASSERT_TRUE(two_a.ok() && six_b.ok()) << six_b.status().ToString();
  Result<FetchHandle> within = FailedPrecondition("not run");
  std::thread tw([&] { within = st->FetchChunks(t.a, 0, Range(2, 4)); });  // 2 + 2 <= 6: waits
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  six_b->Release();
  tw.join();
  ASSERT_TRUE(within.ok()) << within.status().ToString();
  EXPECT_EQ(st->counters().pin_waits, 1u);
  st->ReleaseHotSlots(*ra);
  st->ReleaseHotSlots(*rb);
  st->ReleaseHotSlots(*ra);  // twice: ignored
  EXPECT_EQ(st->counters().hot_reserved, 0u);
}

}  // namespace
}  // namespace kvtier
