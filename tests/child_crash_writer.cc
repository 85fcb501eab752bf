// Child process of the SIGKILL test (tests/offload/crash_test.cc): appends
// deterministic KV to a store until it is killed, printing one line per chunk
// the cold tier acknowledged:  "ACK <seq> <layer> <index>".
// Usage: kvtier_child_crash_writer DATA_DIR SEED
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "integration/pattern.h"
#include "offload/tiered_store.h"
#include "tests/crash_layout.h"
#include "tests/tiered_store_test_peer.h"

int main(int argc, char** argv) {
  using namespace kvtier;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DATA_DIR SEED\n", argv[0]);
    return 2;
  }
  StoreOptions o = CrashTestOptions(argv[1]);
  const uint64_t seed = std::strtoull(argv[2], nullptr, 10);
  auto store = TieredStore::Open(o);
  if (!store.ok()) {
    std::fprintf(stderr, "open: %s\n", store.status().ToString().c_str());
    return 1;
  }
  TieredStoreTestPeer::SetAckListener(**store, [](const ChunkKey& k) {
    char line[96];
    const int n =
        std::snprintf(line, sizeof(line), "ACK %llu %u %llu\n", static_cast<unsigned long long>(k.seq),
                      k.layer, static_cast<unsigned long long>(k.index));
    // One write() per line: a line is either wholly in the pipe or absent.
    if (write(1, line, n) != n) std::abort();
  });
  std::vector<SequenceId> seqs;
  for (int i = 0; i < kCrashSequences; ++i) {
    auto s = (*store)->CreateSequence();
    if (!s.ok()) return 1;
    seqs.push_back(*s);
  }
  std::mt19937_64 rng(seed);
  const size_t tb = o.geometry.token_elems() * DTypeSize(o.geometry.dtype);
  std::vector<int64_t> len(seqs.size() * o.geometry.layers, 0);
  std::vector<uint8_t> k, v;
  for (;;) {  // until SIGKILL (or the safety cap)
    for (size_t i = 0; i < seqs.size(); ++i)
      for (int l = 0; l < o.geometry.layers; ++l) {
        int64_t& n_done = len[i * o.geometry.layers + l];
        if (n_done > 2000000) return 3;
        const int n = 1 + static_cast<int>(rng() % 61);
        k.resize(n * tb);
        v.resize(n * tb);
        FillPattern(kCrashSalt, seqs[i], l, 0, n_done, n, tb, k.data());
        FillPattern(kCrashSalt, seqs[i], l, 1, n_done, n, tb, v.data());
        Status st = (*store)->Append(seqs[i], l, k.data(), v.data(), n, o.geometry.dtype);
        if (!st.ok()) {
          std::fprintf(stderr, "append: %s\n", st.ToString().c_str());
          return 1;
        }
        n_done += n;
      }
  }
}
