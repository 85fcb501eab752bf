// kernels::Rope keeps the angles of small positions in a per-thread table (kernels/cpu/rope.cc)
// and computes the others each time. Both must give the same bits: a rotation may not depend
// on what the table happened to hold. The accuracy of the rotation itself is
// KernelBackends.RopeMatchesRotationReference's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/rope.h"

namespace kvtier::kernels {
namespace {

std::vector<float> Rotated(const std::vector<float>& x0, int heads, int head_dim,
                           const std::vector<int64_t>& pos, const std::vector<double>& inv_freq) {
  std::vector<float> x = x0;
  Rope(x.data(), static_cast<int>(pos.size()), heads, head_dim, pos.data(), inv_freq.data());
  return x;
}

::testing::AssertionResult SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

// Positions p in the table against p 2^20 with every frequency divided by 2^20: the same
// angles in double (scaling by a power of two is exact), but past any table, so computed.
TEST(KernelRope, TableAndComputedAnglesGiveTheSameBits) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int head_dim : {16, 64, 128}) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim));
    const int heads = 3;
    std::vector<int64_t> pos, far;
    for (int i = 0; i < 200; ++i) pos.push_back(1 + static_cast<int64_t>(rng() % 2048));
    for (const int64_t p : pos) far.push_back(p << 20);
    const std::vector<double> inv = RopeInvFreq(head_dim, 1e6);
    std::vector<double> inv_far = inv;
    for (double& f : inv_far) f = std::ldexp(f, -20);
    std::vector<float> x(pos.size() * heads * head_dim);
    for (float& v : x) v = normal(rng);
    const std::vector<float> table = Rotated(x, heads, head_dim, pos, inv);
    EXPECT_TRUE(SameBits(table, Rotated(x, heads, head_dim, far, inv_far)));
    // Once more from the table as the last call left it, and after another frequency set
    // replaced it.
    EXPECT_TRUE(SameBits(table, Rotated(x, heads, head_dim, pos, inv)));
    (void)Rotated(x, heads, head_dim, pos, RopeInvFreq(head_dim, 1e4));
    EXPECT_TRUE(SameBits(table, Rotated(x, heads, head_dim, pos, inv)));
  }
}

// A thread that starts with an empty table, filled one position at a time, gives the bits
// of one that filled it in one call.
TEST(KernelRope, AnotherThreadsTableGivesTheSameBits) {
  const int heads = 2, head_dim = 16;
  std::vector<int64_t> pos;
  for (int64_t p = 900; p >= 0; p -= 7) pos.push_back(p);
  std::vector<float> x(pos.size() * heads * head_dim);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x) v = normal(rng);
  const std::vector<double> inv = RopeInvFreq(head_dim, 1e6);
  const std::vector<float> here = Rotated(x, heads, head_dim, pos, inv);
  std::vector<float> there = x;
  std::thread t([&] {
    const size_t row = static_cast<size_t>(heads) * head_dim;
    for (size_t i = pos.size(); i-- > 0;)
      Rope(there.data() + i * row, 1, heads, head_dim, &pos[i], inv.data());
  });
  t.join();
  EXPECT_TRUE(SameBits(here, there));
}

}  // namespace
}  // namespace kvtier::kernels
