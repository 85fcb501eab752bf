// The option table (engine/option_table.h) against everything that restates it: the
// structs' defaults and fields, the C API's defaults, docs/options.md's tables and the
// CLI's --help. Each test fails when a name, a default or a meaning drifts from the table.
#include "engine/option_table.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "kvtier/kvtier_c.h"
#include "offload/cold_tier.h"

namespace kvtier {
namespace {

// Converts to any field type; only used unevaluated, to count an aggregate's fields.
struct AnyField {
  template <typename T>
  operator T() const;  // NOLINT: implicit by design
};

// The number of fields of aggregate T: the most initializers T{...} accepts. A field added
// to the struct changes it, so the tests below fail until the field has a row in the table
// or an entry in the table's list of fields that are no options.
template <typename T, typename... A>
constexpr size_t CountFields() {
  if constexpr (requires { T{A{}..., AnyField{}}; }) {
    return CountFields<T, A..., AnyField>();
  } else {
    return sizeof...(A);
  }
}

// CountFields sees every kind of member the option structs hold, so one more of any kind
// changes the count.
struct FieldKinds {
  Geometry geometry;
  int n = 1;
  uint64_t bytes = 2;
  bool flag = false;
  double x = 0.5;
  std::string text = "t";
  Compression compression = Compression::kLZ4;
  Device device = Device::kCpu;
  std::function<Status(int)> callback;
  std::shared_ptr<const Clock> clock;
  RetrieverOptions nested;
};
static_assert(CountFields<FieldKinds>() == 11);
static_assert(CountFields<Geometry>() == 5);

// The struct members the rows set: "geometry.layers" counts as "geometry".
template <typename Options>
std::set<std::string> TopFields(const std::vector<OptionDesc<Options>>& table) {
  std::set<std::string> out;
  for (const auto& d : table) {
    const std::string f = d.field;
    out.insert(f.substr(0, f.find('.')));
  }
  return out;
}

template <typename Options>
void ExpectDefaults(const std::vector<OptionDesc<Options>>& table, const Options& defaults) {
  for (const auto& d : table)
    EXPECT_EQ(FormatOptionValue(d.get(defaults)), d.default_text) << "option " << d.name;
}

TEST(OptionTable, DefaultsEqualTheStructs) {
  ExpectDefaults(StoreOptionTable(), StoreOptions{});
  ExpectDefaults(RetrieverOptionTable(), RetrieverOptions{});
  ExpectDefaults(SessionOptionTable(), SessionOptions{});
}

TEST(OptionTable, EveryFieldIsAnOptionOrListed) {
  std::set<std::string> store = TopFields(StoreOptionTable());
  for (const NotAnOption& n : StoreOptionsNotOptions()) EXPECT_TRUE(store.insert(n.field).second) << n.field;
  EXPECT_EQ(store.size(), CountFields<StoreOptions>())
      << "StoreOptions has a field that is neither a row of StoreOptionTable() nor in "
         "StoreOptionsNotOptions()";

  const std::set<std::string> retriever = TopFields(RetrieverOptionTable());
  EXPECT_EQ(retriever.size(), CountFields<RetrieverOptions>())
      << "RetrieverOptions has a field that is no row of RetrieverOptionTable()";

  std::set<std::string> session = TopFields(SessionOptionTable());
  for (const NotAnOption& n : SessionOptionsNotOptions())
    EXPECT_TRUE(session.insert(n.field).second) << n.field;
  EXPECT_EQ(session.size(), CountFields<SessionOptions>())
      << "SessionOptions has a field that is neither a row of SessionOptionTable() nor in "
         "SessionOptionsNotOptions()";
  // The geometry's own fields: one row each.
  EXPECT_EQ(CountFields<Geometry>(), 5u);
}

TEST(OptionTable, NamesAreUniqueAndRowsComplete) {
  std::set<std::string> names, flags;
  auto check = [&](const auto& table) {
    for (const auto& d : table) {
      EXPECT_TRUE(names.insert(d.name).second) << "duplicate option " << d.name;
      if (*d.flag) {
        EXPECT_TRUE(flags.insert(d.flag).second) << "duplicate flag " << d.flag;
      }
      EXPECT_NE(std::string(d.meaning), "") << d.name;
      EXPECT_EQ(std::string(d.meaning).find('\n'), std::string::npos) << d.name << ": one line";
      EXPECT_NE(d.get, nullptr) << d.name;
      EXPECT_NE(d.set, nullptr) << d.name;
      if (d.type == OptionType::kInt || d.type == OptionType::kBytes) {
        EXPECT_LT(d.lo, d.hi) << d.name;
      }
      if (d.type == OptionType::kChoice) {
        EXPECT_NE(std::string(d.choices), "") << d.name;
      }
    }
  };
  check(StoreOptionTable());
  check(RetrieverOptionTable());
  check(SessionOptionTable());
}

TEST(OptionTable, SetOptionChecksTypeRangeAndChoices) {
  StoreOptions o;
  const auto& t = StoreOptionTable();
  ASSERT_TRUE(SetOption(*FindOption(t, "n_sink"), &o, OptionValue{int64_t{7}}).ok());
  EXPECT_EQ(o.n_sink, 7);
  Status st = SetOption(*FindOption(t, "chunk_size"), &o, OptionValue{int64_t{0}});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "option 'chunk_size': 0 is outside [1, 65536]");
  st = SetOption(*FindOption(t, "write_through"), &o, OptionValue{int64_t{1}});
  EXPECT_EQ(st.message(), "option 'write_through': expected a bool");
  st = SetOption(*FindOption(t, "compression"), &o, OptionValue{std::string("gzip")});
  EXPECT_EQ(st.message(), "option 'compression': expected none|lz4|zstd (got 'gzip')");
  ASSERT_TRUE(SetOption(*FindOption(t, "compression"), &o, OptionValue{std::string("zstd")}).ok());
  EXPECT_EQ(o.compression, Compression::kZSTD);
  ASSERT_TRUE(SetOption(*FindOption(t, "hot_bytes"), &o, OptionValue{int64_t{1} << 30}).ok());
  EXPECT_EQ(o.hot_bytes, uint64_t{1} << 30);
  SessionOptions so;
  ASSERT_TRUE(
      SetOption(*FindOption(SessionOptionTable(), "rope_theta"), &so, OptionValue{int64_t{500000}}).ok());
  EXPECT_EQ(so.rope_theta, 500000.0);
  ASSERT_TRUE(
      SetOption(*FindOption(SessionOptionTable(), "positions"), &so, OptionValue{std::string("infllm")})
          .ok());
  EXPECT_EQ(so.positions, PositionMode::kInfLLM);
  // Every row reads back what it wrote.
  for (const auto& d : t) {
    StoreOptions x;
    ASSERT_TRUE(SetOption(d, &x, d.get(StoreOptions{})).ok()) << d.name;
    EXPECT_EQ(FormatOptionValue(d.get(x)), d.default_text) << d.name;
  }
}

// ---- the C API ------------------------------------------------------------------------

TEST(OptionTable, CDefaultsEqualTheTable) {
  const kvtier_store_options c = kvtier_store_options_default();
  // Every field of the C struct, as the table's name and the C default spelled as the table
  // spells values; a field added to the C struct fails the count below until it is here.
  const std::vector<std::pair<std::string, std::string>> store = {
      {"layers", std::to_string(c.layers)},
      {"q_heads", std::to_string(c.q_heads)},
      {"kv_heads", std::to_string(c.kv_heads)},
      {"head_dim", std::to_string(c.head_dim)},
      {"dtype", DTypeName(static_cast<DType>(c.dtype))},
      {"n_sink", std::to_string(c.n_sink)},
      {"n_local", std::to_string(c.n_local)},
      {"chunk_size", std::to_string(c.chunk_size)},
      {"repr_topk", std::to_string(c.repr_topk)},
      {"hot_bytes", std::to_string(c.hot_bytes)},
      {"warm_bytes", std::to_string(c.warm_bytes)},
      {"data_dir", c.data_dir == nullptr ? "" : c.data_dir},
      {"compression", CompressionName(static_cast<Compression>(c.compression))},
      {"remote", c.remote == nullptr ? "" : c.remote},
  };
  EXPECT_EQ(store.size(), CountFields<kvtier_store_options>());
  for (const auto& [name, value] : store) {
    const StoreOptionDesc* d = FindOption(StoreOptionTable(), name);
    ASSERT_NE(d, nullptr) << name;
    EXPECT_EQ(value, d->default_text) << "kvtier_store_options_default()." << name;
  }

  const kvtier_session_options s = kvtier_session_options_default();
  EXPECT_EQ(s.preset, nullptr);  // = "kvtier", SessionOptions' retrieval (RecommendedRetrieval)
  const std::vector<std::pair<std::string, std::string>> session = {
      {"positions", s.positions == KVTIER_POSITIONS_INFLLM ? "infllm" : "absolute"},
      {"rope_theta", FormatOptionValue(s.rope_theta)},
      {"keep_queries", std::to_string(s.keep_queries)},
  };
  // + preset, budget_tokens, reuse_cosine and screen_period.
  EXPECT_EQ(session.size() + 4, CountFields<kvtier_session_options>());
  for (const auto& [name, value] : session) {
    const SessionOptionDesc* d = FindOption(SessionOptionTable(), name);
    ASSERT_NE(d, nullptr) << name;
    EXPECT_EQ(value, d->default_text) << "kvtier_session_options_default()." << name;
  }
  EXPECT_EQ(std::to_string(s.budget_tokens),
            FindOption(RetrieverOptionTable(), "budget_tokens")->default_text);
  EXPECT_EQ(FormatOptionValue(s.reuse_cosine),
            FindOption(RetrieverOptionTable(), "reuse_cosine")->default_text);
  EXPECT_EQ(std::to_string(s.screen_period),
            FindOption(RetrieverOptionTable(), "screen_period")->default_text);
}

// ---- docs/options.md -----------------------------------------------------------------------

// A default as docs/options.md writes it: sizes in MiB, strings quoted.
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

std::string StripBackticks(std::string s) {
  std::string out;
  for (char c : s)
    if (c != '`') out += c;
  return out;
}

// The rows of the markdown table that follows `heading` in docs/options.md: cells trimmed.
std::vector<std::vector<std::string>> OptionsDocTable(const std::string& heading) {
  std::ifstream in(std::string(KVTIER_SOURCE_DIR) + "/docs/options.md");
  std::string line;
  bool in_section = false, in_table = false;
  std::vector<std::vector<std::string>> rows;
  while (std::getline(in, line)) {
    if (!in_section) {
      in_section = line == heading;
      continue;
    }
    if (line.rfind("|", 0) != 0) {
      if (in_table) break;
      continue;
    }
    in_table = true;
    if (line.rfind("|---", 0) == 0) continue;
    std::vector<std::string> cells;
    // Cells split at '|' ("\\|" is a '|' inside a cell, as GitHub's tables want it).
    std::string cell;
    for (size_t i = 1; i < line.size(); ++i) {
      const char ch = line[i];
      if (ch == '\\' && i + 1 < line.size() && line[i + 1] == '|') {  // "\|": a '|' in a cell
        cell += '|';
        ++i;
        continue;
      }
      if (ch == '|') {
        const size_t b = cell.find_first_not_of(' '), e = cell.find_last_not_of(' ');
        cells.push_back(b == std::string::npos ? "" : cell.substr(b, e - b + 1));
        cell.clear();
      } else {
        cell += ch;
      }
    }
    rows.push_back(cells);
  }
  return rows;
}

template <typename Options>
void ExpectReadmeRows(const std::vector<std::vector<std::string>>& rows, size_t* at,
                      const std::vector<OptionDesc<Options>>& table, const Options& defaults) {
  for (const auto& d : table) {
    const std::string want =
        std::string("| `") + d.name + "` | " + DocDefault(d.type, d.get(defaults)) + " | " + d.meaning + " |";
    ASSERT_LT(*at, rows.size()) << "docs/options.md lacks the row " << want;
    const auto& r = rows[(*at)++];
    ASSERT_EQ(r.size(), 3u) << want;
    EXPECT_EQ(r[0], std::string("`") + d.name + "`") << "want " << want;
    EXPECT_EQ(StripBackticks(r[1]), StripBackticks(DocDefault(d.type, d.get(defaults)))) << "want " << want;
    EXPECT_EQ(StripBackticks(r[2]), d.meaning) << "want " << want;
  }
}

TEST(OptionTable, OptionsDocTablesEqualTheTable) {
  const auto store_rows = OptionsDocTable("## Store options");
  ASSERT_FALSE(store_rows.empty()) << "docs/options.md has no table under '## Store options'";
  EXPECT_EQ(store_rows.front(), (std::vector<std::string>{"field", "default", "meaning"}));
  size_t at = 1;
  ExpectReadmeRows(store_rows, &at, StoreOptionTable(), StoreOptions{});
  EXPECT_EQ(at, store_rows.size()) << "docs/options.md's store options table has rows the table does not";

  const auto session_rows = OptionsDocTable("## Session options");
  ASSERT_FALSE(session_rows.empty()) << "docs/options.md has no table under '## Session options'";
  at = 1;
  const SessionOptions session_defaults;
  ExpectReadmeRows(session_rows, &at, RetrieverOptionTable(), session_defaults.retrieval);
  ExpectReadmeRows(session_rows, &at, SessionOptionTable(), session_defaults);
  EXPECT_EQ(at, session_rows.size()) << "docs/options.md's session options table has rows the table does not";
}

// ---- the CLI --------------------------------------------------------------------------

std::string ReadCommand(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

TEST(OptionTable, CliHelpShowsTheTablesMeanings) {
  const std::string kvtier = std::string(KVTIER_BINARY_DIR) + "/kvtier";
  for (const char* command : {"run", "stress", "infinite"}) {
    const std::string help = ReadCommand(kvtier + " " + command + " --help 2>&1");
    ASSERT_NE(help.find("flags:"), std::string::npos) << command << ": " << help;
    int checked = 0;
    auto expect = [&](const char* flag, const char* meaning) {
      const size_t at = help.find(std::string("  --") + flag + " ");
      ASSERT_NE(at, std::string::npos) << "kvtier " << command << " --help lacks --" << flag;
      const std::string line = help.substr(at, help.find('\n', at) - at);
      EXPECT_NE(line.find(meaning), std::string::npos)
          << "kvtier " << command << " --" << flag << ": '" << line << "' does not show '" << meaning << "'";
      ++checked;
    };
    for (const auto& d : StoreOptionTable()) {
      // kvtier infinite has no --dtype (the model's), --compression or --sync (a scratch store).
      const std::string f = d.flag;
      if (f.empty() ||
          (std::string(command) == "infinite" && (f == "dtype" || f == "compression" || f == "sync")))
        continue;
      expect(d.flag, d.meaning);
    }
    if (std::string(command) != "stress") {
      for (const auto& d : RetrieverOptionTable())
        if (*d.flag) expect(d.flag, d.meaning);
    }
    EXPECT_GT(checked, 5) << command;
  }
}

}  // namespace
}  // namespace kvtier
