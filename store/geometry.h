// Geometry, the shape of a model's KV cache, is public vocabulary (include/kvtier/types.h);
// this header adds the kernels' dtype conversions that the code using it reads K/V with.
#pragma once

#include "kernels/dtype.h"
#include "kvtier/types.h"
#include "store/status.h"
