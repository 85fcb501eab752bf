#include "integration/json.h"

#include <charconv>
#include <cmath>

namespace kvtier {

JsonWriter::JsonWriter(bool pretty, int indent) : pretty_(pretty), indent_(indent < 0 ? 0 : indent) {}

void JsonWriter::Newline(size_t depth) {
  if (!pretty_) return;
  out_ += '\n';
  out_.append(depth * static_cast<size_t>(indent_), ' ');
}

bool JsonWriter::BeforeValue() {
  if (!ok_) return false;
  if (stack_.empty()) {
    if (top_done_) { ok_ = false; return false; }  // a second top-level value
    top_done_ = true;
    return true;
  }
  Level& l = stack_.back();
  if (l.object) {
    if (!l.key_pending) { ok_ = false; return false; }  // value without a key
    l.key_pending = false;
    return true;
  }
  if (!l.empty) out_ += ',';
  l.empty = false;
  Newline(stack_.size());
  return true;
}

JsonWriter& JsonWriter::BeginObject() {
  if (!BeforeValue()) return *this;
  out_ += '{';
  stack_.push_back(Level{true});
  return *this;
}

JsonWriter& JsonWriter::BeginArray() {
  if (!BeforeValue()) return *this;
  out_ += '[';
  stack_.push_back(Level{false});
  return *this;
}

JsonWriter& JsonWriter::EndObject() {
  if (!ok_ || stack_.empty() || !stack_.back().object || stack_.back().key_pending) { ok_ = false; return *this; }
  const bool empty = stack_.back().empty;
  stack_.pop_back();
  if (!empty) Newline(stack_.size());
  out_ += '}';
  return *this;
}

JsonWriter& JsonWriter::EndArray() {
  if (!ok_ || stack_.empty() || stack_.back().object) { ok_ = false; return *this; }
  const bool empty = stack_.back().empty;
  stack_.pop_back();
  if (!empty) Newline(stack_.size());
  out_ += ']';
  return *this;
}

JsonWriter& JsonWriter::Key(std::string_view key) {
  if (!ok_ || stack_.empty() || !stack_.back().object || stack_.back().key_pending) { ok_ = false; return *this; }
  Level& l = stack_.back();
  if (!l.empty) out_ += ',';
  l.empty = false;
  l.key_pending = true;
  Newline(stack_.size());
  out_ += Quote(key);
  out_ += pretty_ ? ": " : ":";
  return *this;
}

std::string JsonWriter::Quote(std::string_view s) {
  static const char kHex[] = "0123456789abcdef";
  std::string o;
  o.reserve(s.size() + 2);
  o += '"';
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\b': o += "\\b"; break;
      case '\f': o += "\\f"; break;
      case '\n': o += "\\n"; break;
      case '\r': o += "\\r"; break;
      case '\t': o += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          o += "\\u00";
          o += kHex[c >> 4];
          o += kHex[c & 15];
        } else {
          o += ch;
        }
    }
  }
  o += '"';
  return o;
}

JsonWriter& JsonWriter::String(std::string_view value) {
  if (BeforeValue()) out_ += Quote(value);
  return *this;
}

JsonWriter& JsonWriter::Int(int64_t value) {
  if (BeforeValue()) out_ += std::to_string(value);
  return *this;
}

JsonWriter& JsonWriter::Uint(uint64_t value) {
  if (BeforeValue()) out_ += std::to_string(value);
  return *this;
}

JsonWriter& JsonWriter::Double(double value) {
  if (!BeforeValue()) return *this;
  if (!std::isfinite(value)) {
    out_ += "null";
    return *this;
  }
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, value);  // shortest round-trip form
  out_.append(buf, res.ptr);
  return *this;
}

JsonWriter& JsonWriter::Bool(bool value) {
  if (BeforeValue()) out_ += value ? "true" : "false";
  return *this;
}

JsonWriter& JsonWriter::Null() {
  if (BeforeValue()) out_ += "null";
  return *this;
}

}  // namespace kvtier
