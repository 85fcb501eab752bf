#include "integration/turnover.h"

#include <cstdio>

namespace kvtier {

SelectionTurnover TotalTurnover(const std::vector<SelectionTurnover>& by_layer) {
  SelectionTurnover total;
  for (const SelectionTurnover& l : by_layer) total.Add(l);
  return total;
}

std::string TurnoverText(const std::vector<SelectionTurnover>& by_layer) {
  const SelectionTurnover total = TotalTurnover(by_layer);
  if (!total.measured()) return "";
  char v[32];
  std::snprintf(v, sizeof(v), "%.3f", total.rate());
  std::string text = std::string(v) + " (by layer";
  for (const SelectionTurnover& l : by_layer) {
    if (l.measured())
      std::snprintf(v, sizeof(v), " %.2f", l.rate());
    else
      std::snprintf(v, sizeof(v), " -");
    text += v;
  }
  return text + ")";
}

void WriteTurnoverJson(JsonWriter* w, const std::vector<SelectionTurnover>& by_layer) {
  const SelectionTurnover total = TotalTurnover(by_layer);
  w->Key("decode_turnover");
  if (total.measured())
    w->Double(total.rate());
  else
    w->Null();
  w->Key("decode_turnover_by_layer").BeginArray();
  for (const SelectionTurnover& l : by_layer) l.measured() ? w->Double(l.rate()) : w->Null();
  w->EndArray();
}

}  // namespace kvtier
