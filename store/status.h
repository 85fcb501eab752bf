// Status and Result<T> are public vocabulary: include/kvtier/status.h.
#pragma once

#include "kvtier/status.h"
