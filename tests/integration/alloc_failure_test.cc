// An allocation that fails at a public entry point whose allocations grow with the caller's
// input comes back as ResourceExhausted naming what was being allocated, never as a
// std::bad_alloc crossing the API. Each case runs in a child process whose address space is
// capped (RLIMIT_AS) a little above what it already uses.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "integration/kv_trace.h"
#include "integration/model/safetensors.h"
#include "offload/policy/scoring_policy.h"
#include "offload/tiered_store.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

// Caps the address space at what the process maps now plus `headroom` bytes.
void CapAddressSpace(size_t headroom) {
  unsigned long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%lu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  const rlim_t cap = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + headroom;
  const rlimit rl{cap, cap};
  if (pages == 0 || setrlimit(RLIMIT_AS, &rl) != 0) {
    std::fprintf(stderr, "could not cap the address space\n");
    std::_Exit(3);
  }
}

// Prints the status and exits 0 when it is ResourceExhausted (1 otherwise).
[[noreturn]] void ExitWith(const Status& st) {
  std::fprintf(stderr, "status: %s\n", st.ToString().c_str());
  std::fflush(stderr);
  std::_Exit(st.code() == StatusCode::kResourceExhausted ? 0 : 1);
}

// A sparse file of `bytes` bytes (no disk used).
std::string SparseFile(const std::string& dir, uint64_t bytes) {
  const std::string path = dir + "/huge.bin";
  const int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  close(fd);
  return path;
}

// ---- what each child process runs (it exits with ExitWith) ----

[[noreturn]] void LoadSafetensorsUnderCap(const std::string& path) {
  CapAddressSpace(256u << 20);
  ExitWith(model::LoadSafeTensors(path).status());
}

[[noreturn]] void ReadTraceUnderCap(const std::string& path) {
  CapAddressSpace(256u << 20);
  ExitWith(ReadKvTrace(path).status());
}

// 4M keys observed with 8 MiB to spare: every policy keeps state per observed key.
[[noreturn]] void ObserveUnderCap(const std::string& spec) {
  PolicyGeometry g;
  g.layers = 1;
  g.q_heads = 1;
  g.kv_heads = 1;
  g.head_dim = 1;
  g.sink_tokens = 4;
  g.local_tokens = 32;
  auto policy = MakeScoringPolicy(spec);
  if (!policy.ok()) ExitWith(policy.status());
  if (Status st = (*policy)->Begin(g); !st.ok()) ExitWith(st);
  const int64_t n = int64_t{4} << 20;
  std::vector<int64_t> keys(static_cast<size_t>(n));
  std::iota(keys.begin(), keys.end(), 0);
  const int64_t query = n - 1;
  std::vector<float> attention(static_cast<size_t>(n), 0.0f), k(static_cast<size_t>(n), 0.5f), v(k);
  attention[0] = 1.0f;
  AttentionObservation obs;
  obs.layer = 0;
  obs.n_queries = 1;
  obs.n_keys = n;
  obs.key_positions = keys.data();
  obs.query_positions = &query;
  obs.attention = attention.data();
  obs.keys = k.data();
  obs.values = v.data();
  CapAddressSpace(8u << 20);
  ExitWith((*policy)->Observe(obs));
}

// A sequence's sinks and local window are allocated per layer from the store's options.
[[noreturn]] void CreateSequenceUnderCap() {
  StoreOptions o;
  o.geometry = Geometry{1, 1, 1, 1, DType::kF32};
  o.n_sink = 0;
  o.chunk_size = 32;
  o.n_local = 32 << 20;  // 128 MiB per K and V ring, and as much for the ring's statistics
  o.repr_topk = 1;
  o.hot_bytes = 64 * o.chunk_bytes();
  o.warm_bytes = 64 * o.chunk_bytes();
  auto store = TieredStore::Open(o);
  if (!store.ok()) ExitWith(Internal(store.status().ToString()));
  CapAddressSpace(320u << 20);
  ExitWith((*store)->CreateSequence().status());
}

class AllocFailureDeathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVTIER_SKIP_UNDER_SANITIZER(
        "the child caps its address space a little above what it maps (RLIMIT_AS), "
        "which a sanitizer's shadow memory exceeds, and ASan aborts on a failed "
        "allocation instead of throwing std::bad_alloc");
    GTEST_FLAG_SET(death_test_style, "threadsafe");
  }
};

TEST_F(AllocFailureDeathTest, SafetensorsFileTooLargeToHold) {
  TempDir dir;
  const std::string path = SparseFile(dir.path(), uint64_t{8} << 30);
  EXPECT_EXIT(LoadSafetensorsUnderCap(path), ::testing::ExitedWithCode(0),
              "status: ResourceExhausted: .*huge.bin.*out of memory");
}

TEST_F(AllocFailureDeathTest, TraceFileTooLargeToHold) {
  TempDir dir;
  const std::string path = SparseFile(dir.path(), uint64_t{8} << 30);
  EXPECT_EXIT(ReadTraceUnderCap(path), ::testing::ExitedWithCode(0),
              "status: ResourceExhausted: trace file .*huge.bin.*out of memory");
}

TEST_F(AllocFailureDeathTest, PolicyObserveOfMoreKeysThanFit) {
  for (const PolicyInfo& info : ListScoringPolicies()) {
    SCOPED_TRACE(info.name);
    EXPECT_EXIT(ObserveUnderCap(info.name), ::testing::ExitedWithCode(0),
                "status: ResourceExhausted: .*Observe: state for 4194304 keys: out of memory");
  }
}

TEST_F(AllocFailureDeathTest, CreateSequenceLargerThanFits) {
  EXPECT_EXIT(CreateSequenceUnderCap(), ::testing::ExitedWithCode(0), "status: ResourceExhausted: ");
}

}  // namespace
}  // namespace kvtier
