// JsonWriter: a tiny streaming JSON writer for reports.
//
//   JsonWriter w(/*pretty=*/true);
//   w.BeginObject();
//   w.Key("quality"); w.BeginObject();
//   w.Key("needle_hit_rate"); w.Double(0.93);
//   w.EndObject();
//   w.EndObject();
//   std::string s = w.str();
//
// Objects, arrays, strings (escaped: " \ and control characters; other bytes,
// UTF-8 included, pass through), int64, uint64, double (shortest text that
// reads back to the same double; NaN and infinities, which JSON lacks, are
// written as null), bool, null; nested to any depth; pretty (indented, one
// member per line) or compact. Misuse (a value where a key is due, a key
// outside an object, an unbalanced End*) is not written: ok() turns false and
// stays false. No reader.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier {

class JsonWriter {
 public:
  /// pretty: newlines and `indent` spaces per level; otherwise no whitespace.
  explicit JsonWriter(bool pretty = false, int indent = 2);

  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  /// The next member's name; only inside an object, before each value.
  JsonWriter& Key(std::string_view key);

  JsonWriter& String(std::string_view value);
  JsonWriter& Int(int64_t value);
  JsonWriter& Uint(uint64_t value);
  JsonWriter& Double(double value);  ///< NaN / inf -> null
  JsonWriter& Bool(bool value);
  JsonWriter& Null();

  /// The text so far.
  const std::string& str() const { return out_; }
  /// False once the writer was misused.
  bool ok() const { return ok_; }
  /// True when exactly one top-level value is written and every container is closed.
  bool complete() const { return ok_ && stack_.empty() && top_done_; }

  /// JSON string literal of `s`, quotes included.
  static std::string Quote(std::string_view s);

 private:
  struct Level {
    bool object;
    bool empty = true;
    bool key_pending = false;
  };
  bool BeforeValue();  // separators/indent; false on misuse
  void Newline(size_t depth);

  std::string out_;
  std::vector<Level> stack_;
  bool pretty_;
  int indent_;
  bool ok_ = true;
  bool top_done_ = false;
};

}  // namespace kvtier
