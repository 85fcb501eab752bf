// JsonWriter: a small streaming-style builder for reports, over nlohmann::ordered_json.
//
//   JsonWriter w(/*pretty=*/true);
//   w.BeginObject();
//   w.Key("quality"); w.BeginObject();
//   w.Key("needle_hit_rate"); w.Double(0.93);
//   w.EndObject();
//   w.EndObject();
//   std::string s = w.str();
//
// The calls build an nlohmann::ordered_json document (members keep the order they were
// written in) that str() serialises: pretty (indented, one member or item per line) or
// compact. Strings are escaped by nlohmann (" \ and control characters; UTF-8 passes
// through, an invalid byte sequence becomes U+FFFD). int64 and uint64 are written exactly; a
// double is the shortest text that reads back to the same double, a whole number below 2^53
// without a fraction ("1", not "1.0"); NaN and infinities, which JSON lacks, are null. Misuse
// (a value where a key is due, a key outside an object, an unbalanced End*) is not written:
// ok() turns false and stays false. No reader. A repeated key replaces the earlier value.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace kvtier {

class JsonWriter {
 public:
  /// pretty: newlines and `indent` spaces per level; otherwise no whitespace.
  explicit JsonWriter(bool pretty = false, int indent = 2);
  ~JsonWriter();
  JsonWriter(JsonWriter&&) noexcept;
  JsonWriter& operator=(JsonWriter&&) noexcept;

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

  /// The document as text: what was written so far, containers still open shown closed
  /// ("" before the first value).
  const std::string& str() const;
  /// False once the writer was misused.
  bool ok() const;
  /// True when exactly one top-level value is written and every container is closed.
  bool complete() const;

  /// JSON string literal of `s`, quotes included.
  static std::string Quote(std::string_view s);

 private:
  struct Impl;  // the document and the open containers (json.cc: nlohmann stays out of headers)
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier
