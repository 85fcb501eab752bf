// StoreCounters are public (include/kvtier/counters.h): the parts of the store
// (offload/store/, offload/lower_tier.h) add to them without the store's header.
#pragma once

#include "kvtier/counters.h"
