// Geometry::Validate and the attention kernel agree on which head_dim values exist: every
// geometry the store accepts is one the kernel runs, and the other way round.
#include "store/geometry.h"

#include <gtest/gtest.h>

#include <vector>

#include "kernels/cpu/attention.h"

namespace kvtier {
namespace {

// The kernel's verdict on a head_dim: one query over one key, every other parameter valid.
bool KernelAccepts(int head_dim) {
  const int d = head_dim > 0 ? head_dim : 1;
  std::vector<float> q(static_cast<size_t>(d), 0.5f), k(static_cast<size_t>(d), 0.25f), v(k), out(q.size());
  const int64_t pos = 0;
  kernels::KvSpan span;
  span.k = k.data();
  span.v = v.data();
  span.n_tokens = 1;
  kernels::AttentionParams p;
  p.q_heads = 1;
  p.kv_heads = 1;
  p.head_dim = head_dim;
  p.dtype = DType::kF32;
  p.n_queries = 1;
  p.q = q.data();
  p.q_positions = &pos;
  p.parts = &span;
  p.n_parts = 1;
  p.out = out.data();
  return kernels::Attention(p) == kernels::KernelError::kOk;
}

bool GeometryAccepts(int head_dim) {
  Geometry g{1, 1, 1, head_dim, DType::kF32};
  return g.Validate().ok();
}

TEST(Geometry, HeadDimAgreesWithTheKernelAtTheBoundaries) {
  const int max = kernels::kMaxHeadDim;
  // Before they shared kernels::HeadDimSupported, Geometry took head_dim up to 4096 and the
  // kernel only up to kMaxHeadDim: a store could hold KV no attention could read.
  for (int d : {-1, 0, 1, 2, 63, 64, 127, 128, max - 1, max, max + 1, 2048, 4096, 4097}) {
    EXPECT_EQ(GeometryAccepts(d), KernelAccepts(d)) << "head_dim " << d;
    EXPECT_EQ(GeometryAccepts(d), kernels::HeadDimSupported(d)) << "head_dim " << d;
  }
  EXPECT_TRUE(GeometryAccepts(max));
  EXPECT_FALSE(GeometryAccepts(max + 1));
  EXPECT_FALSE(GeometryAccepts(0));
  Geometry g{1, 1, 1, max + 1, DType::kF16};
  const Status st = g.Validate();
  EXPECT_NE(st.message().find("head_dim"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find(std::to_string(max)), std::string::npos) << st.ToString();
  // ParseShape goes through Validate.
  Geometry parsed;
  EXPECT_FALSE(parsed.ParseShape("1,1,1," + std::to_string(max + 1)).ok());
  EXPECT_TRUE(parsed.ParseShape("1,1,1," + std::to_string(max)).ok());
}

}  // namespace
}  // namespace kvtier
