// RetrieverOptions' rows (store/option_desc.h): one per option, in the order docs/options.md
// lists them. RetrieverOptions::Validate checks each row's range; engine/option_table.h
// hands the rows to the front ends.
#pragma once

#include <vector>

#include "kvtier/options.h"
#include "store/option_desc.h"

namespace kvtier {

using RetrieverOptionDesc = OptionDesc<RetrieverOptions>;

const std::vector<RetrieverOptionDesc>& RetrieverOptionTable();

}  // namespace kvtier
