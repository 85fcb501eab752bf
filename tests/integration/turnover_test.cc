#include "integration/turnover.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

TEST(SelectionTurnover, CountsTheChunksThePreviousStepDidNotRetrieve) {
  SelectionTurnover t;
  EXPECT_FALSE(t.measured());
  EXPECT_EQ(t.rate(), 0.0);
  t.Add({1, 4, 7, 9}, {1, 2, 7, 10});  // 2 and 10 are new
  EXPECT_EQ(t.fresh, 2u);
  EXPECT_EQ(t.retrieved, 4u);
  t.Add({}, {3, 5});  // after a step that retrieved nothing every chunk is new
  EXPECT_EQ(t.fresh, 4u);
  t.Add({3, 5}, {});  // nothing retrieved: nothing measured
  EXPECT_EQ(t.retrieved, 6u);
  t.Add({0, 1, 2}, {0, 1, 2});
  EXPECT_EQ(t.fresh, 4u);
  EXPECT_EQ(t.retrieved, 9u);
  EXPECT_TRUE(t.measured());
  EXPECT_DOUBLE_EQ(t.rate(), 4.0 / 9.0);
  SelectionTurnover u;
  u.Add({8}, {9});
  t.Add(u);
  EXPECT_EQ(t.fresh, 5u);
  EXPECT_EQ(t.retrieved, 10u);
}

}  // namespace
}  // namespace kvtier
