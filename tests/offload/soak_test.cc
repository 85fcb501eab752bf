// SIGKILL soak: one data directory through N kill/reopen cycles. Each cycle a child
// (tests/child_soak_writer.cc) reopens the store, appends, drops chunks, closes and
// drops sequences, and is killed with SIGKILL at a random point; then the store is
// reopened here and checked against what the child was told:
//  * every chunk acknowledged to the child (its ack listener) and not dropped since is
//    in TieredStore::AcknowledgedChunks() -- the library's own account of what is
//    durable -- and every chunk in that account reads back bit for bit;
//  * a chunk DropChunks returned for stays gone, a dropped sequence stays gone;
//  * a sequence CloseSequence returned for is closed and whole, sinks and local window too.
// The suite runs a few cycles (KVTIER_SOAK_CYCLES, default 20); `make soak` runs hundreds.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "integration/pattern.h"
#include "offload/tiered_store.h"
#include "tests/crash_layout.h"
#include "tests/kill_child.h"
#include "tests/test_util.h"

extern char** environ;

namespace kvtier {
namespace {

// Starts the child and returns every complete line it printed until it had printed
// `kill_after` ACK lines (or a few more: the kill races with the child, as it should),
// when it is SIGKILLed. *status gets its wait status.
std::vector<std::string> RunCycle(const std::string& dir, uint64_t seed, size_t kill_after, int* status) {
  bool killed = false;
  return RunChildUntilAcks("kvtier_child_soak_writer", dir, seed, kill_after, status, &killed);
}

int SoakCycles() {
  const char* s = std::getenv("KVTIER_SOAK_CYCLES");
  return s != nullptr ? std::max(1, std::atoi(s)) : 20;
}

TEST(Soak, SigkillReopenCyclesKeepEveryAcknowledgedChunk) {
  TempDir dir;
  const StoreOptions o = CrashTestOptions(dir.path());
  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  const size_t half = static_cast<size_t>(o.chunk_size) * tb;
  // What the child was promised, across cycles.
  std::set<ChunkKey> expected;       // acknowledged, not dropped since
  std::set<ChunkKey> dropped;        // DropChunks returned OK
  std::set<ChunkKey> maybe_dropped;  // killed inside DropChunks: either way is right
  std::set<SequenceId> dropped_seqs, closed_seqs;
  std::map<ChunkKey, std::string> history;  // what the lines said about each chunk, for failure messages
  std::mt19937_64 rng(20261124);
  const int cycles = SoakCycles();
  uint64_t verified = 0;
  for (int cycle = 0; cycle < cycles; ++cycle) {
    SCOPED_TRACE("cycle " + std::to_string(cycle));
    int status = 0;
    const std::vector<std::string> lines = RunCycle(dir.path(), 7000 + cycle, 20 + rng() % 200, &status);
    ASSERT_TRUE(!lines.empty() && lines.front() == "OPEN") << "the child could not reopen the store";
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "child exited early, status " << status;
    for (const std::string& line : lines) {
      std::istringstream in(line);
      std::string tag;
      ChunkKey key;
      in >> tag;
      if (tag == "ACK" || tag == "DROPPING" || tag == "DROP") {
        in >> key.seq >> key.layer >> key.index;
        history[key] += " " + tag + "@" + std::to_string(cycle);
      }
      if (tag == "ACK") {
        // DropChunks waits for a cold write in flight, whose ack can come after DROPPING.
        if (!maybe_dropped.count(key)) expected.insert(key);
      } else if (tag == "DROPPING") {
        expected.erase(key);
        maybe_dropped.insert(key);
      } else if (tag == "DROP") {
        maybe_dropped.erase(key);
        dropped.insert(key);
      } else if (tag == "DROPPINGSEQ" || tag == "DROPSEQ") {
        SequenceId s = 0;
        in >> s;
        for (auto it = expected.begin(); it != expected.end();)
          it = it->seq == s ? expected.erase(it) : std::next(it);
        if (tag == "DROPSEQ") dropped_seqs.insert(s);
      } else if (tag == "CLOSED") {
        SequenceId s = 0;
        in >> s;
        closed_seqs.insert(s);
      }
    }

    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << "reopen after SIGKILL: " << store.status().ToString();
    TieredStore* st = store->get();
    std::set<ChunkKey> acked;
    for (const ChunkRange& r : st->lower_tiers().AcknowledgedChunks())
      for (uint64_t i = r.first; i <= r.last; ++i) acked.insert(ChunkKey{r.seq, r.layer, i});
    for (const ChunkKey& k : expected)
      ASSERT_TRUE(acked.count(k)) << "acknowledged chunk " << k.ToString()
                                  << " is not in AcknowledgedChunks(); its lines:" << history[k];
    std::vector<uint8_t> gk(half), gv(half), ek(half), ev(half);
    for (const ChunkKey& k : acked) {
      const int64_t first = o.n_sink + static_cast<int64_t>(k.index) * o.chunk_size;
      Status s =
          st->ReadTokens(k.seq, static_cast<int>(k.layer), first, first + o.chunk_size, gk.data(), gv.data());
      ASSERT_TRUE(s.ok()) << "acknowledged chunk " << k.ToString() << ": " << s.ToString();
      FillPattern(kCrashSalt, k.seq, k.layer, 0, first, o.chunk_size, tb, ek.data());
      FillPattern(kCrashSalt, k.seq, k.layer, 1, first, o.chunk_size, tb, ev.data());
      ASSERT_EQ(gk, ek) << "K of " << k.ToString();
      ASSERT_EQ(gv, ev) << "V of " << k.ToString();
      ++verified;
    }
    for (const ChunkKey& k : dropped) {
      if (dropped_seqs.count(k.seq)) continue;
      EXPECT_FALSE(acked.count(k)) << "dropped chunk " << k.ToString() << " is acknowledged again";
      const int64_t first = o.n_sink + static_cast<int64_t>(k.index) * o.chunk_size;
      EXPECT_FALSE(
          st->ReadTokens(k.seq, static_cast<int>(k.layer), first, first + o.chunk_size, gk.data(), gv.data())
              .ok())
          << "dropped chunk " << k.ToString() << " came back";
    }
    const std::vector<SequenceId> listed = st->ListSequences();
    for (SequenceId s : dropped_seqs)
      EXPECT_FALSE(std::count(listed.begin(), listed.end(), s)) << "dropped sequence " << s << " came back";
    for (SequenceId s : closed_seqs) {
      if (dropped_seqs.count(s)) continue;
      for (int l = 0; l < o.geometry.layers; ++l) {
        auto n = st->SequenceLength(s, l);
        ASSERT_TRUE(n.ok()) << "closed sequence " << s << ": " << n.status().ToString();
        // Whole: sinks, every chunk still there, the local window, read a chunk's span at a
        // time. Dropped chunks are holes.
        int64_t p = 0;
        while (p < *n) {
          const int64_t c = ChunkOfPosition(p, o.n_sink, o.chunk_size, kAnyChunkCount);
          const int64_t end = c < 0 ? std::min<int64_t>(*n, o.n_sink)
                                    : std::min<int64_t>(*n, ChunkFirstToken(c + 1, o.n_sink, o.chunk_size));
          const ChunkKey ck{s, static_cast<uint32_t>(l), static_cast<uint64_t>(c)};
          if (c >= 0 && (dropped.count(ck) || maybe_dropped.count(ck))) {
            p = end;
            continue;
          }
          const size_t bytes = static_cast<size_t>(end - p) * tb;
          std::vector<uint8_t> k(bytes), v(bytes), ek1(bytes), ev1(bytes);
          Status rs = st->ReadTokens(s, l, p, end, k.data(), v.data());
          ASSERT_TRUE(rs.ok()) << "closed sequence " << s << " layer " << l << " tokens " << p << ".." << end
                               << ": " << rs.ToString();
          FillPattern(kCrashSalt, s, l, 0, p, end - p, tb, ek1.data());
          FillPattern(kCrashSalt, s, l, 1, p, end - p, tb, ev1.data());
          ASSERT_EQ(k, ek1) << "closed sequence " << s << " layer " << l << " tokens " << p << ".." << end;
          ASSERT_EQ(v, ev1) << "closed sequence " << s << " layer " << l << " tokens " << p << ".." << end;
          p = end;
        }
      }
    }
  }
  std::printf(
      "soak: %d cycles, %llu acknowledged chunk reads verified, %zu chunks and %zu sequences dropped, %zu "
      "closed\n",
      cycles, static_cast<unsigned long long>(verified), dropped.size(), dropped_seqs.size(),
      closed_seqs.size());
}

}  // namespace
}  // namespace kvtier
