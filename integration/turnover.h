// Selection turnover: of the chunks a layer's decode step retrieved, the share that the same
// layer's previous decode step did not retrieve. It says how much a step's choice depends on
// its own probe: shortcuts that score a step from an earlier step's scores (--reuse, --screen)
// can only be as good as the turnover of the layers that matter is low. `kvtier run` and
// `kvtier infinite` report it over all layers and by layer (docs/benchmarks.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "integration/json.h"

namespace kvtier {

struct SelectionTurnover {
  uint64_t fresh = 0;      ///< chunks retrieved that the previous step (same layer) did not
  uint64_t retrieved = 0;  ///< chunks retrieved by steps that had a previous step

  /// One layer's step after `previous` (both ascending, without duplicates). A step that
  /// retrieved nothing adds nothing.
  void Add(const std::vector<uint64_t>& previous, const std::vector<uint64_t>& current) {
    retrieved += current.size();
    size_t i = 0;
    for (uint64_t c : current) {
      while (i < previous.size() && previous[i] < c) ++i;
      if (i == previous.size() || previous[i] != c) ++fresh;
    }
  }
  void Add(const SelectionTurnover& o) {
    fresh += o.fresh;
    retrieved += o.retrieved;
  }
  bool measured() const { return retrieved > 0; }
  /// fresh / retrieved in [0, 1]; 0 when nothing was measured (check measured()).
  double rate() const {
    return retrieved ? static_cast<double>(fresh) / static_cast<double>(retrieved) : 0.0;
  }
};

/// Every layer's turnover summed.
SelectionTurnover TotalTurnover(const std::vector<SelectionTurnover>& by_layer);

/// "0.378 (by layer 0.00 0.73 0.47 0.36)", a layer with nothing measured as "-"; empty when
/// no layer measured anything.
std::string TurnoverText(const std::vector<SelectionTurnover>& by_layer);

/// "decode_turnover": the total's rate, and "decode_turnover_by_layer": each layer's; null
/// where nothing was measured.
void WriteTurnoverJson(JsonWriter* w, const std::vector<SelectionTurnover>& by_layer);

}  // namespace kvtier
