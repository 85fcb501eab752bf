// StoreOptions' rows (store/option_desc.h): one per option, in the order docs/options.md
// lists them. StoreOptions::Validate checks each row's range; engine/option_table.h
// hands the rows to the front ends.
#pragma once

#include <vector>

#include "kvtier/options.h"
#include "store/option_desc.h"

namespace kvtier {

using StoreOptionDesc = OptionDesc<StoreOptions>;

const std::vector<StoreOptionDesc>& StoreOptionTable();
/// StoreOptions' fields that are no option a user sets by name, each with why.
const std::vector<NotAnOption>& StoreOptionsNotOptions();

}  // namespace kvtier
