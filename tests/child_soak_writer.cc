// Child process of the SIGKILL soak (tests/offload/soak_test.cc): one cycle of a long-lived
// store. Reopens the store in DATA_DIR (recovering whatever the last cycle left),
// then works on it until it is killed: appends to two new sequences, now and then
// drops a chunk, closes a sequence and starts another, and drops old sequences so
// the directory stays small over hundreds of cycles. One line per event on stdout,
// each a single write(2), so a line is either wholly in the pipe or absent:
//   OPEN                       the store opened (recovery passed its checks)
//   ACK <seq> <layer> <index>  the cold tier acknowledged a chunk
//   DROPPING <seq> <layer> <index> / DROP <seq> <layer> <index>   around DropChunks
//   CLOSED <seq>               CloseSequence returned OK
//   DROPPINGSEQ <seq> / DROPSEQ <seq>                            around DropSequence
// Token contents are FillPattern(kCrashSalt, seq, layer, K|V, position): the parent
// recomputes them. Usage: kvtier_child_soak_writer DATA_DIR SEED
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "integration/pattern.h"
#include "offload/tiered_store.h"
#include "tests/crash_layout.h"
#include "tests/tiered_store_test_peer.h"

namespace {

void Line(const char* fmt, ...) {
  char buf[160];
  va_list ap;
  va_start(ap, fmt);
  const int n = std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  if (n <= 0 || n >= static_cast<int>(sizeof(buf)) || write(1, buf, n) != n) std::abort();
}

int Die(const char* what, const kvtier::Status& st) {
  std::fprintf(stderr, "%s: %s\n", what, st.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvtier;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DATA_DIR SEED\n", argv[0]);
    return 2;
  }
  const StoreOptions o = CrashTestOptions(argv[1]);
  std::mt19937_64 rng(std::strtoull(argv[2], nullptr, 10));
  auto store = TieredStore::Open(o);
  if (!store.ok()) return Die("open", store.status());
  TieredStore* st = store->get();
  TieredStoreTestPeer::SetAckListener(*st, [](const ChunkKey& k) {
    Line("ACK %llu %u %llu\n", static_cast<unsigned long long>(k.seq), k.layer,
         static_cast<unsigned long long>(k.index));
  });
  Line("OPEN\n");
  // Sequences left by earlier cycles: keep the newest few, drop the rest.
  std::vector<SequenceId> old = st->ListSequences();
  constexpr size_t kKeepOld = 4;
  for (size_t i = 0; i + kKeepOld < old.size(); ++i) {
    Line("DROPPINGSEQ %llu\n", static_cast<unsigned long long>(old[i]));
    Status s = st->DropSequence(old[i]);
    if (!s.ok()) return Die("drop sequence", s);
    Line("DROPSEQ %llu\n", static_cast<unsigned long long>(old[i]));
  }

  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  struct Live {
    SequenceId id;
    std::vector<int64_t> len;
  };
  std::vector<Live> live;
  auto start = [&]() -> Status {
    KVTIER_ASSIGN_OR_RETURN(SequenceId id, st->CreateSequence());
    live.push_back(Live{id, std::vector<int64_t>(o.geometry.layers, 0)});
    return Status::Ok();
  };
  for (int i = 0; i < kCrashSequences; ++i)
    if (Status s = start(); !s.ok()) return Die("create", s);
  std::vector<uint8_t> k, v;
  for (uint64_t step = 0;; ++step) {  // until SIGKILL (or the safety cap)
    if (step > 10000000) return 3;
    Live& q = live[rng() % live.size()];
    const int l = static_cast<int>(rng() % o.geometry.layers);
    const int n = 1 + static_cast<int>(rng() % 61);
    k.resize(n * tb);
    v.resize(n * tb);
    FillPattern(kCrashSalt, q.id, l, 0, q.len[l], n, tb, k.data());
    FillPattern(kCrashSalt, q.id, l, 1, q.len[l], n, tb, v.data());
    Status s = st->Append(q.id, l, k.data(), v.data(), n, o.geometry.dtype);
    if (!s.ok()) return Die("append", s);
    q.len[l] += n;
    const uint64_t dice = rng() % 100;
    if (dice < 3) {
      // Compression's path: a chunk leaves every tier, and the manifest, for good.
      auto count = st->ChunkCount(q.id, l);
      if (!count.ok()) return Die("chunk count", count.status());
      if (*count == 0) continue;
      const uint64_t idx = rng() % *count;
      const unsigned long long sq = q.id, ix = idx;
      Line("DROPPING %llu %d %llu\n", sq, l, ix);
      s = st->DropChunks(q.id, l, {idx});
      if (!s.ok()) return Die("drop chunks", s);
      Line("DROP %llu %d %llu\n", sq, l, ix);
    } else if (dice == 3 && q.len[0] > 0) {
      const SequenceId id = q.id;
      s = st->CloseSequence(id);
      if (!s.ok()) return Die("close", s);
      Line("CLOSED %llu\n", static_cast<unsigned long long>(id));
      q = live.back();
      live.pop_back();
      if (s = start(); !s.ok()) return Die("create", s);
    }
  }
}
