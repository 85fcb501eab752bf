#include "engine/option_table.h"

namespace kvtier {
namespace {

using Se = SessionOptions;

// A default as docs/options.md writes it: sizes in MiB or GiB, strings quoted.
std::string DocDefault(OptionType type, const OptionValue& v) {
  if (type == OptionType::kBytes) {
    const int64_t b = std::get<int64_t>(v);
    if (b == 0) return "0";
    if (b % (int64_t{1} << 30) == 0) return std::to_string(b >> 30) + " GiB";
    if (b % (int64_t{1} << 20) == 0) return std::to_string(b >> 20) + " MiB";
    return std::to_string(b);
  }
  if (type == OptionType::kString) return "\"" + std::get<std::string>(v) + "\"";
  return FormatOptionValue(v);
}

// '|' inside a cell, as GitHub's tables want it.
std::string EscapeCell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

template <typename Options>
void AppendRows(const std::vector<OptionDesc<Options>>& table, const Options& defaults, std::string* out) {
  for (const auto& d : table) {
    std::string meaning = d.meaning;
    if (d.type == OptionType::kChoice) meaning += ": " + std::string(d.choices);
    *out += "| `" + std::string(d.name) + "` | " + EscapeCell(DocDefault(d.type, d.get(defaults))) + " | " +
            EscapeCell(meaning) + " |\n";
  }
}

const char kHeader[] = "| field | default | meaning |\n|---|---|---|\n";

}  // namespace

const std::vector<SessionOptionDesc>& SessionOptionTable() {
  static const std::vector<SessionOptionDesc> table = {
      {.name = "retrieve",
       .field = "retrieve",
       .type = OptionType::kBool,
       .meaning = "false: attend every live chunk (full attention through the store)",
       KVTIER_OPT_BOOL(Se, retrieve)},
      {.name = "positions",
       .field = "positions",
       .type = OptionType::kChoice,
       .meaning =
           "keys after RoPE (absolute: the engine applies it) or before it (infllm: the session rotates)",
       .choices = "absolute|infllm",
       .get = [](const Se& o) -> OptionValue { return std::string(PositionModeName(o.positions)); },
       .set = [](Se* o, const OptionValue& v) -> Status {
         KVTIER_ASSIGN_OR_RETURN(o->positions, ParsePositionMode(std::get<std::string>(v)));
         return Status::Ok();
       }},
      {.name = "rope_theta",
       .field = "rope_theta",
       .type = OptionType::kDouble,
       .meaning = "infllm positions: RoPE base (rotate-half, Hugging Face Llama)",
       .dlo = 0.0,
       .dlo_open = true,
       KVTIER_OPT_DOUBLE(Se, rope_theta)},
      {.name = "observe_prefill",
       .field = "observe_prefill",
       .type = OptionType::kBool,
       .meaning = "prefill Attend feeds representative-key statistics",
       KVTIER_OPT_BOOL(Se, observe_prefill)},
      {.name = "keep_queries",
       .field = "keep_queries",
       .meaning = "most recent queries kept per layer for Compress (0 = none)",
       .lo = 0,
       .hi = 1 << 20,
       KVTIER_OPT_INT(Se, keep_queries)},
      {.name = "defer_cold_chunks",
       .field = "defer_cold_chunks",
       .type = OptionType::kBool,
       .meaning =
           "cuda device lane: a chosen chunk with no warm copy is skipped for a step and brought back to "
           "warm (not to the hot tier) on a transfer worker, instead of its layer waiting for it on the host "
           "path",
       KVTIER_OPT_BOOL(Se, defer_cold_chunks)},
  };
  return table;
}

const std::vector<NotAnOption>& SessionOptionsNotOptions() {
  static const std::vector<NotAnOption> list = {
      {"retrieval", "a RetrieverOptions: its fields are RetrieverOptionTable's rows"},
  };
  return list;
}

std::string StoreOptionsMarkdown() {
  std::string out = kHeader;
  AppendRows(StoreOptionTable(), StoreOptions{}, &out);
  return out;
}

std::string SessionOptionsMarkdown() {
  std::string out = kHeader;
  const SessionOptions defaults;
  AppendRows(RetrieverOptionTable(), defaults.retrieval, &out);
  AppendRows(SessionOptionTable(), defaults, &out);
  return out;
}

}  // namespace kvtier
