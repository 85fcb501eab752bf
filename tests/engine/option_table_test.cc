// The option list (engine/option_table.h) against everything that follows from it: the
// structs' defaults and fields, each Validate's ranges, the C API's fields, defaults and
// setters, the dtype spellings, docs/options.md's tables and the CLI's --help. Each test
// fails when a name, a default, a range or a meaning drifts from the rows. Also the C API's
// counters struct against StoreCounters, field by field.
#include "engine/option_table.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine/c_api_internal.h"
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

// ---- one default per option ------------------------------------------------------------

TEST(OptionTable, OneRetrievalDefault) {
  // RetrieverOptions{}, SessionOptions{}.retrieval, RecommendedRetrieval() and the "kvtier"
  // preset are one configuration, alloc and index included.
  const RetrieverOptions plain;
  const SessionOptions session;
  Result<RetrievalPreset> preset = MakeRetrievalPreset("kvtier");
  ASSERT_TRUE(preset.ok());
  for (const auto& d : RetrieverOptionTable()) {
    const std::string want = FormatOptionValue(d.get(plain));
    EXPECT_EQ(FormatOptionValue(d.get(session.retrieval)), want) << d.name;
    EXPECT_EQ(FormatOptionValue(d.get(RecommendedRetrieval())), want) << d.name;
    EXPECT_EQ(FormatOptionValue(d.get(preset->retrieval)), want) << d.name;
  }
  EXPECT_EQ(plain.alloc, "entropy:rank=logit");
  EXPECT_EQ(plain.index, "Exact:heads=max");
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
      if (d.type == OptionType::kDouble) {
        EXPECT_LT(d.dlo, d.dhi) << d.name;
      }
      if (d.type == OptionType::kChoice) {
        EXPECT_NE(std::string(d.choices), "") << d.name;
      }
      // The struct's default is inside its own row.
      EXPECT_TRUE(CheckOptionValue(d, OptionDefault(d)).ok())
          << d.name << ": " << CheckOptionValue(d, OptionDefault(d)).message();
    }
  };
  check(StoreOptionTable());
  check(RetrieverOptionTable());
  check(SessionOptionTable());
}

// ---- Validate checks every row's range --------------------------------------------------

// The largest value field type T holds, as int64_t.
template <typename T>
int64_t FieldMax() {
  return std::numeric_limits<T>::max() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
             ? std::numeric_limits<int64_t>::max()
             : static_cast<int64_t>(std::numeric_limits<T>::max());
}

// The row's value written without SetOption's check, as a caller filling the struct would.
template <typename Options>
Options With(const OptionDesc<Options>& d, Options o, const OptionValue& v) {
  EXPECT_TRUE(d.set(&o, v).ok()) << d.name;
  return o;
}

// For every int, size and number row: a value just outside each bound is refused by
// `validate` with InvalidArgument naming the option; the bounds themselves pass the row's
// check, and whatever Validate then says (a relation between options) names no range of it.
template <typename Options, typename Validate>
void ExpectValidateChecksRanges(const std::vector<OptionDesc<Options>>& table, const Options& base,
                                int64_t (*field_max)(const OptionDesc<Options>&), Validate validate) {
  int refused = 0;
  for (const auto& d : table) {
    const std::string named = std::string("option '") + d.name + "': ";
    std::vector<OptionValue> outside, bounds;
    if (d.type == OptionType::kInt || d.type == OptionType::kBytes) {
      const int64_t max = field_max(d);
      const int64_t min = d.type == OptionType::kBytes ? 0 : -max - 1;  // the field's own limits
      if (d.lo > min) outside.push_back(OptionValue{d.lo - 1});
      if (d.hi < max) outside.push_back(OptionValue{d.hi + 1});
      bounds = {OptionValue{d.lo}, OptionValue{d.hi}};
    } else if (d.type == OptionType::kDouble) {
      if (std::isfinite(d.dlo)) {
        outside.push_back(OptionValue{d.dlo_open ? d.dlo : std::nextafter(d.dlo, -1e300)});
        if (!d.dlo_open) bounds.push_back(OptionValue{d.dlo});
      }
      if (std::isfinite(d.dhi)) {
        outside.push_back(OptionValue{std::nextafter(d.dhi, 1e300)});
        bounds.push_back(OptionValue{d.dhi});
      }
      outside.push_back(OptionValue{std::nan("")});
    } else if (d.type == OptionType::kChoice) {
      outside.push_back(OptionValue{std::string("no-such-choice")});
    }
    for (const OptionValue& v : outside) {
      Options o = base;
      if (d.type == OptionType::kChoice) {
        // A choice field holds only its enum's values; SetOption refuses the text instead.
        Status st = SetOption(d, &o, v);
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << d.name;
        EXPECT_EQ(st.message().rfind(named, 0), 0u) << st.message();
        continue;
      }
      Status st = validate(With(d, o, v));
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << d.name << " = " << FormatOptionValue(v);
      EXPECT_NE(st.message().find(named), std::string::npos)
          << d.name << " = " << FormatOptionValue(v) << ": " << st.message();
      ++refused;
    }
    for (const OptionValue& v : bounds) {
      const Options o = With(d, base, v);
      EXPECT_TRUE(CheckOptionRanges(table, o).ok()) << d.name << " = " << FormatOptionValue(v);
      Status st = validate(o);
      EXPECT_EQ(st.message().find(named), std::string::npos)
          << d.name << " = " << FormatOptionValue(v) << " is in range, but: " << st.message();
    }
  }
  EXPECT_GT(refused, 1);
}

template <typename Options>
int64_t StoreFieldMax(const OptionDesc<Options>& d) {
  const std::string f = d.field;
  if (f == "hot_bytes" || f == "warm_bytes" || f == "index_bytes") return FieldMax<uint64_t>();
  return FieldMax<int>();
}

TEST(OptionTable, ValidateChecksEveryRowsRange) {
  ASSERT_TRUE(StoreOptions{}.Validate().ok());
  ExpectValidateChecksRanges(StoreOptionTable(), StoreOptions{}, &StoreFieldMax<StoreOptions>,
                             [](const StoreOptions& o) { return o.Validate(); });
  ExpectValidateChecksRanges(RetrieverOptionTable(), RetrieverOptions{}, &StoreFieldMax<RetrieverOptions>,
                             [](const RetrieverOptions& o) { return o.Validate(); });
  ExpectValidateChecksRanges(SessionOptionTable(), SessionOptions{}, &StoreFieldMax<SessionOptions>,
                             [](const SessionOptions& o) { return o.Validate(); });
  // Cases the front ends used to disagree on: a budget of 0 (sinks and local window only) is
  // valid everywhere; chunk_size has one range, the row's.
  RetrieverOptions r;
  r.budget_tokens = 0;
  EXPECT_TRUE(r.Validate().ok());
  StoreOptions s;
  s.chunk_size = 1 << 17;
  s.n_local = 1 << 17;
  EXPECT_EQ(s.Validate().message(), "option 'chunk_size': 131072 is outside [1, 65536]");
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
  EXPECT_EQ(SetOption(*FindOption(SessionOptionTable(), "rope_theta"), &so, OptionValue{0.0}).message(),
            "option 'rope_theta': 0 is outside (0, inf]");
  ASSERT_TRUE(
      SetOption(*FindOption(SessionOptionTable(), "positions"), &so, OptionValue{std::string("infllm")})
          .ok());
  EXPECT_EQ(so.positions, PositionMode::kInfLLM);
  // Every row reads back what it wrote.
  for (const auto& d : t) {
    StoreOptions x;
    ASSERT_TRUE(SetOption(d, &x, OptionDefault(d)).ok()) << d.name;
    EXPECT_EQ(FormatOptionValue(d.get(x)), FormatOptionValue(OptionDefault(d))) << d.name;
  }
}

// ---- dtype spellings ---------------------------------------------------------------------

struct Spelling {
  const char* text;
  DType dtype;
};
const Spelling kSpellings[] = {
    {"f16", DType::kF16},  {"fp16", DType::kF16},  {"float16", DType::kF16},
    {"half", DType::kF16}, {"bf16", DType::kBF16}, {"bfloat16", DType::kBF16},
    {"f32", DType::kF32},  {"fp32", DType::kF32},  {"float32", DType::kF32},
};

TEST(OptionTable, DTypeTakesTheUsualSpellings) {
  const StoreOptionDesc& d = *FindOption(StoreOptionTable(), "dtype");
  EXPECT_EQ(std::string(d.choices), DTypeSpellings());
  for (const Spelling& s : kSpellings) {
    StoreOptions o;
    o.geometry.dtype = s.dtype == DType::kF32 ? DType::kBF16 : DType::kF32;
    ASSERT_TRUE(SetOption(d, &o, OptionValue{std::string(s.text)}).ok()) << s.text;
    EXPECT_EQ(o.geometry.dtype, s.dtype) << s.text;
    EXPECT_NE(std::string(DTypeSpellings()).find(s.text), std::string::npos) << s.text;
  }
  StoreOptions o;
  EXPECT_EQ(SetOption(d, &o, OptionValue{std::string("fp8")}).message(),
            "option 'dtype': expected f16|fp16|float16|half|bf16|bfloat16|f32|fp32|float32 (got 'fp8')");
}

// ---- the C API ------------------------------------------------------------------------

std::string CStoreGet(const kvtier_store_options& o, const char* name) {
  char buf[512];
  kvtier_error err;
  EXPECT_EQ(kvtier_store_options_get(&o, name, buf, sizeof buf, &err), KVTIER_OK)
      << name << ": " << err.message;
  return buf;
}

std::string CSessionGet(const kvtier_session_options& o, const char* name) {
  char buf[512];
  kvtier_error err;
  EXPECT_EQ(kvtier_session_options_get(&o, name, buf, sizeof buf, &err), KVTIER_OK)
      << name << ": " << err.message;
  return buf;
}

// A value of the row other than its default, inside its range.
template <typename Options>
std::string OtherValue(const OptionDesc<Options>& d) {
  const OptionValue def = OptionDefault(d);
  switch (d.type) {
    case OptionType::kInt:
    case OptionType::kBytes:
      return std::to_string(std::get<int64_t>(def) == d.lo ? d.lo + 1 : d.lo);
    case OptionType::kBool:
      return std::get<bool>(def) ? "false" : "true";
    case OptionType::kDouble:
      return FormatOptionValue(std::isfinite(d.dhi) ? (std::get<double>(def) == d.dhi ? d.dlo : d.dhi)
                                                    : std::get<double>(def) + 1.5);
    case OptionType::kString:
      return "x" + std::get<std::string>(def);
    case OptionType::kChoice: {
      const std::string all = d.choices;
      for (size_t pos = 0; pos <= all.size();) {
        const size_t bar = std::min(all.find('|', pos), all.size());
        const std::string c = all.substr(pos, bar - pos);
        OptionValue v = c;
        Options o;
        if (d.set(&o, v).ok() && FormatOptionValue(d.get(o)) != FormatOptionValue(def)) return c;
        pos = bar + 1;
      }
      return "";
    }
  }
  return "";
}

TEST(CApiMirror, StoreCountersCopyEveryCField) {
  // Each field of kvtier_store_counters and the StoreCounters field it mirrors (same name).
  struct Mirrored {
    const char* name;
    uint64_t StoreCounters::*cpp;
    uint64_t kvtier_store_counters::*c;
  };
  const std::vector<Mirrored> mirrored = {
      {"hot_chunks", &StoreCounters::hot_chunks, &kvtier_store_counters::hot_chunks},
      {"hot_bytes", &StoreCounters::hot_bytes, &kvtier_store_counters::hot_bytes},
      {"warm_chunks", &StoreCounters::warm_chunks, &kvtier_store_counters::warm_chunks},
      {"warm_bytes", &StoreCounters::warm_bytes, &kvtier_store_counters::warm_bytes},
      {"cold_chunks", &StoreCounters::cold_chunks, &kvtier_store_counters::cold_chunks},
      {"cold_bytes", &StoreCounters::cold_bytes, &kvtier_store_counters::cold_bytes},
      {"promotions", &StoreCounters::promotions, &kvtier_store_counters::promotions},
      {"demotions", &StoreCounters::demotions, &kvtier_store_counters::demotions},
      {"hits", &StoreCounters::hits, &kvtier_store_counters::hits},
      {"misses", &StoreCounters::misses, &kvtier_store_counters::misses},
      {"bytes_moved", &StoreCounters::bytes_moved, &kvtier_store_counters::bytes_moved},
      {"cold_writes", &StoreCounters::cold_writes, &kvtier_store_counters::cold_writes},
      {"cold_reads", &StoreCounters::cold_reads, &kvtier_store_counters::cold_reads},
      {"lease_expired", &StoreCounters::lease_expired, &kvtier_store_counters::lease_expired},
      {"chunks_sealed", &StoreCounters::chunks_sealed, &kvtier_store_counters::chunks_sealed},
      {"dropped_chunks", &StoreCounters::dropped_chunks, &kvtier_store_counters::dropped_chunks},
      {"chunks_landing", &StoreCounters::chunks_landing, &kvtier_store_counters::chunks_landing},
  };
  // A field added to the C struct changes the count until the list above names it.
  EXPECT_EQ(CountFields<kvtier_store_counters>(), mirrored.size())
      << "kvtier_store_counters has a field the list above does not name";
  // Distinct values, so a field copied from the wrong counter, or not at all, shows.
  StoreCounters c;
  uint64_t next = 1000;
  for (const Mirrored& m : mirrored) c.*m.cpp = ++next;
  kvtier_store_counters out;
  std::memset(&out, 0, sizeof out);
  StoreCountersToC(c, &out);
  for (const Mirrored& m : mirrored) EXPECT_EQ(out.*m.c, c.*m.cpp) << m.name;
}

TEST(OptionTable, CApiCoversEveryOption) {
  // One C field per row (plus the session's preset): a row without a C field fails here.
  EXPECT_EQ(CountFields<kvtier_store_options>(), StoreOptionTable().size());
  EXPECT_EQ(CountFields<kvtier_session_options>(),
            1 + RetrieverOptionTable().size() + SessionOptionTable().size());

  // The C defaults are the table's, read back by name.
  const kvtier_store_options c = kvtier_store_options_default();
  for (const auto& d : StoreOptionTable())
    EXPECT_EQ(CStoreGet(c, d.name), FormatOptionValue(OptionDefault(d)))
        << "kvtier_store_options_default()." << d.name;
  const kvtier_session_options s = kvtier_session_options_default();
  EXPECT_EQ(s.preset, nullptr);
  for (const auto& d : RetrieverOptionTable())
    EXPECT_EQ(CSessionGet(s, d.name), FormatOptionValue(d.get(SessionOptions{}.retrieval))) << d.name;
  for (const auto& d : SessionOptionTable())
    EXPECT_EQ(CSessionGet(s, d.name), FormatOptionValue(OptionDefault(d))) << d.name;

  // Every row's setter writes a C field that reads back (a row the C fields miss would
  // read back its default), and refuses a value outside the row naming the option.
  for (const auto& d : StoreOptionTable()) {
    kvtier_store_options o = kvtier_store_options_default();
    const std::string v = OtherValue(d);
    kvtier_error err;
    ASSERT_EQ(kvtier_store_options_set(&o, d.name, v.c_str(), &err), KVTIER_OK)
        << d.name << "=" << v << ": " << err.message;
    EXPECT_EQ(CStoreGet(o, d.name), v) << d.name;
    if ((d.type == OptionType::kInt || d.type == OptionType::kBytes) && d.lo > 0) {
      const kvtier_store_options before = o;
      EXPECT_EQ(kvtier_store_options_set(&o, d.name, std::to_string(d.lo - 1).c_str(), &err),
                KVTIER_INVALID_ARGUMENT);
      EXPECT_EQ(std::string(err.message).find(std::string("option '") + d.name + "': "), 0u) << err.message;
      EXPECT_EQ(std::memcmp(&before, &o, sizeof o), 0) << d.name << ": a refused value changed the options";
    }
  }
  for (const auto* table : {&RetrieverOptionTable()}) {
    for (const auto& d : *table) {
      kvtier_session_options o = kvtier_session_options_default();
      const std::string v = OtherValue(d);
      kvtier_error err;
      ASSERT_EQ(kvtier_session_options_set(&o, d.name, v.c_str(), &err), KVTIER_OK)
          << d.name << ": " << err.message;
      EXPECT_EQ(CSessionGet(o, d.name), v) << d.name;
    }
  }
  for (const auto& d : SessionOptionTable()) {
    kvtier_session_options o = kvtier_session_options_default();
    const std::string v = OtherValue(d);
    kvtier_error err;
    ASSERT_EQ(kvtier_session_options_set(&o, d.name, v.c_str(), &err), KVTIER_OK)
        << d.name << ": " << err.message;
    EXPECT_EQ(CSessionGet(o, d.name), v) << d.name;
  }

  // Names and spellings.
  kvtier_store_options o = kvtier_store_options_default();
  kvtier_error err;
  EXPECT_EQ(kvtier_store_options_set(&o, "no_such_option", "1", &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err.message).find("unknown store option 'no_such_option' (known: layers, "),
            std::string::npos)
      << err.message;
  for (const Spelling& sp : kSpellings) {
    ASSERT_EQ(kvtier_store_options_set(&o, "dtype", sp.text, &err), KVTIER_OK) << sp.text;
    EXPECT_EQ(static_cast<int>(o.dtype), static_cast<int>(sp.dtype)) << sp.text;
  }
  EXPECT_EQ(kvtier_store_options_set(&o, "dtype", "fp8", &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err.message).find("f16|fp16|float16|half|bf16|bfloat16|f32|fp32|float32"),
            std::string::npos);
  ASSERT_EQ(kvtier_store_options_set(&o, "device", "cuda", &err), KVTIER_OK);
  EXPECT_EQ(o.device, KVTIER_DEVICE_CUDA);
  ASSERT_EQ(kvtier_store_options_set(&o, "hot_bytes", "8M", &err), KVTIER_OK);
  EXPECT_EQ(o.hot_bytes, uint64_t{8} << 20);
  EXPECT_EQ(kvtier_store_options_set(&o, "n_sink", "many", &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_STREQ(err.message, "option 'n_sink': 'many' is not an integer");
}

TEST(OptionTable, CApiOpensASessionWithBudgetZero) {
  // budget_tokens 0 (sinks and local window only, as infinitebench's StreamingLLM row uses)
  // is in the row's range, for the C API as for every front end.
  kvtier_store_options so = kvtier_store_options_default();
  kvtier_error err;
  for (auto [name, value] : std::vector<std::pair<const char*, const char*>>{
           {"layers", "2"}, {"q_heads", "4"}, {"kv_heads", "2"}, {"head_dim", "16"}, {"dtype", "fp32"}})
    ASSERT_EQ(kvtier_store_options_set(&so, name, value, &err), KVTIER_OK) << err.message;
  kvtier_store* store = nullptr;
  ASSERT_EQ(kvtier_store_open(&so, &store, &err), KVTIER_OK) << err.message;
  kvtier_session_options o = kvtier_session_options_default();
  ASSERT_EQ(kvtier_session_options_set(&o, "budget_tokens", "0", &err), KVTIER_OK) << err.message;
  kvtier_session* s = nullptr;
  ASSERT_EQ(kvtier_session_open(store, &o, &s, &err), KVTIER_OK) << err.message;
  kvtier_session_destroy(s);
  o.budget_tokens = -1;
  EXPECT_EQ(kvtier_session_open(store, &o, &s, &err), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err.message).find("option 'budget_tokens': -1 is outside [0, "), std::string::npos)
      << err.message;
  ASSERT_EQ(kvtier_store_close(store, &err), KVTIER_OK) << err.message;
}

// ---- docs/options.md -----------------------------------------------------------------------

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The markdown table right after the first line `heading` (the lines from the first one
// starting with '|' to the first one that does not), or "" without one; *begin and *end
// locate it in `text`.
std::string TableAfter(const std::string& text, const std::string& heading, size_t* begin, size_t* end) {
  size_t at = text.find("\n" + heading + "\n");
  if (at == std::string::npos) return "";
  at = text.find("\n|", at);
  if (at == std::string::npos) return "";
  *begin = at + 1;
  size_t e = *begin;
  while (e < text.size() && text[e] == '|') {
    const size_t nl = text.find('\n', e);
    e = nl == std::string::npos ? text.size() : nl + 1;
  }
  *end = e;
  return text.substr(*begin, e - *begin);
}

TEST(OptionTable, OptionsDocIsGeneratedFromTheTable) {
  const std::string path = std::string(KVTIER_SOURCE_DIR) + "/docs/options.md";
  std::string doc = ReadFile(path);
  // KVTIER_WRITE_OPTIONS_DOC=1 writes the generated tables into docs/options.md.
  const bool write = std::getenv("KVTIER_WRITE_OPTIONS_DOC") != nullptr;
  for (const auto& [heading, want] : std::vector<std::pair<std::string, std::string>>{
           {"## Store options", StoreOptionsMarkdown()}, {"## Session options", SessionOptionsMarkdown()}}) {
    size_t b = 0, e = 0;
    const std::string have = TableAfter(doc, heading, &b, &e);
    ASSERT_NE(have, "") << "docs/options.md has no table under '" << heading << "'";
    if (write) {
      doc.replace(b, e - b, want);
      continue;
    }
    EXPECT_EQ(have, want)
        << "docs/options.md's table under '" << heading
        << "' differs from the option table: run KVTIER_WRITE_OPTIONS_DOC=1 build/kvtier_tests "
           "--gtest_filter=OptionTable.OptionsDocIsGeneratedFromTheTable";
  }
  if (write) std::ofstream(path) << doc;
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

TEST(OptionTable, CliHelpShowsTheTablesDefaults) {
  // kvtier run's flags start from the structs' defaults: --help shows each row's default.
  const std::string help = ReadCommand(std::string(KVTIER_BINARY_DIR) + "/kvtier run --help 2>&1");
  int checked = 0;
  auto expect = [&](const auto& d) {
    // Not switches, sizes (shown as 64M) or empty strings (the command describes its own).
    if (!*d.flag || d.type == OptionType::kBool || d.type == OptionType::kBytes ||
        FormatOptionValue(OptionDefault(d)).empty())
      return;
    const size_t at = help.find(std::string("  --") + d.flag + " ");
    ASSERT_NE(at, std::string::npos) << "kvtier run --help lacks --" << d.flag;
    const std::string line = help.substr(at, help.find('\n', at) - at);
    const std::string want = "(default " + FormatOptionValue(OptionDefault(d)) + ")";
    EXPECT_NE(line.find(want), std::string::npos) << "'" << line << "' does not show " << want;
    ++checked;
  };
  for (const auto& d : StoreOptionTable()) expect(d);
  for (const auto& d : RetrieverOptionTable()) expect(d);
  EXPECT_GT(checked, 8);
}

TEST(OptionTable, CliDTypeTakesTheUsualSpellings) {
  const std::string kvtier = std::string(KVTIER_BINARY_DIR) + "/kvtier";
  for (const Spelling& s : kSpellings) {
    const std::string cmd = kvtier + " run --dtype " + s.text + " --help >/dev/null 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  const std::string out = ReadCommand(kvtier + " run --dtype fp8 --context 1024 2>&1");
  EXPECT_NE(out.find("--dtype: unknown dtype 'fp8' (f16|fp16|float16|half|bf16|bfloat16|f32|fp32|float32)"),
            std::string::npos)
      << out;
}

TEST(OptionTable, ReportsHoldEveryStoreOption) {
  // kvtier stress's JSON report writes its store's options from the rows
  // (integration/options_json.h), as kvtier run's does.
  const std::string json = testing::TempDir() + "option_table_stress.json";
  const std::string cmd = std::string(KVTIER_BINARY_DIR) +
                          "/kvtier stress --sequences 1 --tokens 256 --json " + json + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::string report = ReadFile(json);
  const size_t config = report.find("\"config\"");
  ASSERT_NE(config, std::string::npos) << report;
  for (const auto& d : StoreOptionTable())
    EXPECT_NE(report.find(std::string("\"") + d.name + "\"", config), std::string::npos)
        << "the report's config lacks " << d.name;
  std::remove(json.c_str());
}

}  // namespace
}  // namespace kvtier
