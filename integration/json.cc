#include "integration/json.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

namespace kvtier {

using nlohmann::ordered_json;

struct JsonWriter::Impl {
  struct Level {
    ordered_json* node;  // stays valid while open: only the innermost open container grows
    bool key_pending = false;
    std::string key;
  };
  ordered_json root;
  std::vector<Level> stack;
  std::string out;
  bool pretty;
  int indent;
  bool ok = true;
  bool top_done = false;

  // Puts `v` where the next value goes: the slot it landed in, or null on misuse.
  ordered_json* Put(ordered_json v) {
    if (!ok) return nullptr;
    if (stack.empty()) {
      if (top_done) return Misuse();  // a second top-level value
      top_done = true;
      root = std::move(v);
      return &root;
    }
    Level& l = stack.back();
    if (l.node->is_object()) {
      if (!l.key_pending) return Misuse();  // a value without a key
      l.key_pending = false;
      ordered_json& slot = (*l.node)[l.key];
      slot = std::move(v);
      return &slot;
    }
    l.node->push_back(std::move(v));
    return &l.node->back();
  }
  ordered_json* Misuse() {
    ok = false;
    return nullptr;
  }
  void Open(ordered_json v) {
    if (ordered_json* slot = Put(std::move(v))) stack.push_back(Level{slot, false, {}});
  }
  // Closes the innermost container if it is an object (`object`) or an array.
  void Close(bool object) {
    if (!ok || stack.empty() || stack.back().node->is_object() != object || stack.back().key_pending) {
      Misuse();
      return;
    }
    stack.pop_back();
  }
};

JsonWriter::JsonWriter(bool pretty, int indent) : impl_(std::make_unique<Impl>()) {
  impl_->pretty = pretty;
  impl_->indent = indent < 0 ? 0 : indent;
}
JsonWriter::~JsonWriter() = default;
JsonWriter::JsonWriter(JsonWriter&&) noexcept = default;
JsonWriter& JsonWriter::operator=(JsonWriter&&) noexcept = default;

JsonWriter& JsonWriter::BeginObject() {
  impl_->Open(ordered_json::object());
  return *this;
}

JsonWriter& JsonWriter::BeginArray() {
  impl_->Open(ordered_json::array());
  return *this;
}

JsonWriter& JsonWriter::EndObject() {
  impl_->Close(/*object=*/true);
  return *this;
}

JsonWriter& JsonWriter::EndArray() {
  impl_->Close(/*object=*/false);
  return *this;
}

JsonWriter& JsonWriter::Key(std::string_view key) {
  Impl& m = *impl_;
  if (!m.ok || m.stack.empty() || !m.stack.back().node->is_object() || m.stack.back().key_pending) {
    m.Misuse();
    return *this;
  }
  m.stack.back().key_pending = true;
  m.stack.back().key.assign(key);
  return *this;
}

bool JsonWriter::ok() const { return impl_->ok; }

bool JsonWriter::complete() const { return impl_->ok && impl_->stack.empty() && impl_->top_done; }

const std::string& JsonWriter::str() const {
  // error_handler_t::replace: a string with invalid UTF-8 (a file name, say) is written with
  // U+FFFD in its place instead of throwing.
  impl_->out = impl_->top_done
                   ? impl_->root.dump(impl_->pretty ? impl_->indent : -1, ' ', /*ensure_ascii=*/false,
                                      ordered_json::error_handler_t::replace)
                   : std::string();
  return impl_->out;
}

std::string JsonWriter::Quote(std::string_view s) {
  return ordered_json(std::string(s))
      .dump(-1, ' ', /*ensure_ascii=*/false, ordered_json::error_handler_t::replace);
}

JsonWriter& JsonWriter::String(std::string_view value) {
  impl_->Put(ordered_json(std::string(value)));
  return *this;
}

JsonWriter& JsonWriter::Int(int64_t value) {
  impl_->Put(ordered_json(value));
  return *this;
}

JsonWriter& JsonWriter::Uint(uint64_t value) {
  impl_->Put(ordered_json(value));
  return *this;
}

JsonWriter& JsonWriter::Double(double value) {
  if (!std::isfinite(value)) {
    impl_->Put(nullptr);
  } else if (value == std::trunc(value) && std::fabs(value) < 0x1p53 &&
             !(value == 0 && std::signbit(value))) {
    // A whole number as an integer: "4096" as the reports always had it, not nlohmann's
    // "4096.0" (exact: below 2^53 every integer is a double).
    impl_->Put(ordered_json(static_cast<int64_t>(value)));
  } else {
    impl_->Put(ordered_json(value));  // nlohmann: the shortest text that reads back to `value`
  }
  return *this;
}

JsonWriter& JsonWriter::Bool(bool value) {
  impl_->Put(ordered_json(value));
  return *this;
}

JsonWriter& JsonWriter::Null() {
  impl_->Put(nullptr);
  return *this;
}

}  // namespace kvtier
