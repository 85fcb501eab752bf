#include "integration/options_json.h"

#include <string>
#include <variant>

#include "engine/option_table.h"
#include "offload/remote_tier.h"

namespace kvtier {

void WriteStoreOptionsJson(JsonWriter* w, const StoreOptions& o) {
  for (const StoreOptionDesc& d : StoreOptionTable()) {
    const OptionValue v = d.get(o);
    w->Key(d.name);
    if (std::string_view(d.name) == "remote") {
      w->String(RedactRemoteSpec(std::get<std::string>(v)));
    } else if (const auto* i = std::get_if<int64_t>(&v)) {
      if (d.type == OptionType::kBytes)
        w->Uint(static_cast<uint64_t>(*i));
      else
        w->Int(*i);
    } else if (const auto* b = std::get_if<bool>(&v)) {
      w->Bool(*b);
    } else if (const auto* x = std::get_if<double>(&v)) {
      w->Double(*x);
    } else {
      w->String(std::get<std::string>(v));
    }
  }
}

}  // namespace kvtier
