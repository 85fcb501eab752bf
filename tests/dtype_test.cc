#include <gtest/gtest.h>
#include "kernels/dtype.h"
TEST(Dtype, Placeholder) { EXPECT_EQ(kvtier::FloatToF16(1.0f), 0x3c00); }
