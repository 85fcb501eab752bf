#include "integration/model/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

namespace kvtier::model {
namespace {

// A JSON reader just big enough for a safetensors header: objects, strings
// (with escapes, \u included), arrays, non-negative integers. Anything else
// (floats, true/false/null) is an error: the format never holds them in the
// places we read, and refusing keeps the reader small.
// An object member is a struct declared after Json rather than std::pair<std::string, Json>:
// a pair of an incomplete type may not be named inside Json itself (libstdc++'s
// pair checks completeness, which clang enforces), while std::vector of an incomplete
// type is allowed since C++17.
struct JsonMember;
struct Json {
  enum Kind { kObject, kArray, kString, kInt } kind = kInt;
  std::vector<JsonMember> members;  // object, in file order
  std::vector<Json> items;          // array
  std::string str;
  uint64_t num = 0;
};
struct JsonMember {
  std::string name;
  Json value;
};

class JsonReader {
 public:
  explicit JsonReader(std::string_view text) : s_(text) {}

  Status Parse(Json* out) {
    KVTIER_RETURN_IF_ERROR(Value(out, 0));
    SkipSpace();
    if (i_ != s_.size()) return Error("trailing characters after the top-level value");
    return Status::Ok();
  }

 private:
  Status Error(const std::string& what) const {
    return InvalidArgument("bad JSON at byte " + std::to_string(i_) + " of the header: " + what);
  }
  void SkipSpace() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool Eat(char c) {
    SkipSpace();
    if (i_ < s_.size() && s_[i_] == c) { ++i_; return true; }
    return false;
  }

  Status Value(Json* out, int depth) {
    if (depth > 8) return Error("nested too deep");
    SkipSpace();
    if (i_ >= s_.size()) return Error("unexpected end");
    const char c = s_[i_];
    if (c == '{') return Object(out, depth);
    if (c == '[') return Array(out, depth);
    if (c == '"') { out->kind = Json::kString; return String(&out->str); }
    if (c >= '0' && c <= '9') return Int(out);
    return Error(std::string("unexpected character '") + c + "'");
  }

  Status Object(Json* out, int depth) {
    out->kind = Json::kObject;
    ++i_;
    if (Eat('}')) return Status::Ok();
    do {
      SkipSpace();
      if (i_ >= s_.size() || s_[i_] != '"') return Error("expected a member name");
      std::string key;
      KVTIER_RETURN_IF_ERROR(String(&key));
      if (!Eat(':')) return Error("expected ':' after \"" + key + "\"");
      Json v;
      KVTIER_RETURN_IF_ERROR(Value(&v, depth + 1));
      out->members.push_back(JsonMember{std::move(key), std::move(v)});
    } while (Eat(','));
    if (!Eat('}')) return Error("expected ',' or '}'");
    return Status::Ok();
  }

  Status Array(Json* out, int depth) {
    out->kind = Json::kArray;
    ++i_;
    if (Eat(']')) return Status::Ok();
    do {
      Json v;
      KVTIER_RETURN_IF_ERROR(Value(&v, depth + 1));
      out->items.push_back(std::move(v));
    } while (Eat(','));
    if (!Eat(']')) return Error("expected ',' or ']'");
    return Status::Ok();
  }

  Status Int(Json* out) {
    out->kind = Json::kInt;
    uint64_t v = 0;
    const size_t begin = i_;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      const uint64_t d = static_cast<uint64_t>(s_[i_] - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) return Error("integer overflows 64 bits");
      v = v * 10 + d;
      ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E'))
      return Error("only non-negative integers are accepted (number at byte " + std::to_string(begin) + ")");
    out->num = v;
    return Status::Ok();
  }

  static void PutUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  Status Hex4(uint32_t* cp) {
    if (i_ + 4 > s_.size()) return Error("truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= static_cast<uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f') v |= static_cast<uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= static_cast<uint32_t>(h - 'A' + 10);
      else return Error("bad hex digit in \\u escape");
    }
    *cp = v;
    return Status::Ok();
  }

  Status String(std::string* out) {
    ++i_;  // opening quote
    while (true) {
      if (i_ >= s_.size()) return Error("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return Status::Ok();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') { out->push_back(c); continue; }
      if (i_ >= s_.size()) return Error("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          KVTIER_RETURN_IF_ERROR(Hex4(&cp));
          if (cp >= 0xD800 && cp < 0xDC00) {  // a surrogate pair encodes one code point above U+FFFF
            uint32_t lo = 0;
            if (i_ + 2 > s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u') return Error("unpaired surrogate");
            i_ += 2;
            KVTIER_RETURN_IF_ERROR(Hex4(&lo));
            if (lo < 0xDC00 || lo >= 0xE000) return Error("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            return Error("unpaired surrogate");
          }
          PutUtf8(cp, out);
          break;
        }
        default: return Error(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  std::string_view s_;
  size_t i_ = 0;
};

bool ParseSafeDType(const std::string& s, DType* out) {
  if (s == "F32") { *out = DType::kF32; return true; }
  if (s == "F16") { *out = DType::kF16; return true; }
  if (s == "BF16") { *out = DType::kBF16; return true; }
  return false;
}

}  // namespace

int64_t TensorInfo::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string TensorInfo::ShapeString() const { return ShapeToString(shape); }

Result<const TensorInfo*> SafeTensors::Find(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) return NotFound(path + ": tensor '" + name + "' is missing");
  return &it->second;
}

Result<std::vector<float>> SafeTensors::ToFloat32(const std::string& name) const {
  KVTIER_ASSIGN_OR_RETURN(const TensorInfo* t, Find(name));
  std::vector<float> out(static_cast<size_t>(t->elements()));
  const uint8_t* src = data.data() + t->offset;
  std::vector<uint8_t> aligned;
  if (t->offset % DTypeSize(t->dtype) != 0) {  // the format does not promise alignment; ToFloat reads whole elements
    aligned.assign(src, src + t->size);
    src = aligned.data();
  }
  ::kvtier::ToFloat(t->dtype, src, out.data(), out.size());
  return out;
}

Result<SafeTensors> ParseSafeTensors(const std::string& path, std::vector<uint8_t> bytes) {
  // What the header describes is bounded by the file; failing to allocate it is ResourceExhausted.
  return ReturnOnBadAlloc(
      [&] { return path + ": the header and tensor table (" + std::to_string(bytes.size()) + "-byte file)"; },
      [&]() -> Result<SafeTensors> {
  auto bad = [&](const std::string& what) { return InvalidArgument(path + ": " + what); };
  if (bytes.size() < 8)
    return bad("file too short (" + std::to_string(bytes.size()) + " bytes) to hold the 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[static_cast<size_t>(i)];
  if (header_len > bytes.size() - 8)
    return bad("header length " + std::to_string(header_len) + " goes past the end of the file (" +
               std::to_string(bytes.size()) + " bytes)");
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, header_len);
  Json root;
  {
    Status st = JsonReader(text).Parse(&root);
    if (!st.ok()) return bad(st.message());
  }
  if (root.kind != Json::kObject) return bad("header is not a JSON object");

  SafeTensors out;
  out.path = path;
  const size_t data_begin = 8 + header_len;
  const uint64_t data_len = bytes.size() - data_begin;
  std::set<std::string> seen;
  std::vector<std::pair<uint64_t, std::string>> spans;  // (begin, name), to find overlaps
  for (auto& [name, value] : root.members) {
    if (!seen.insert(name).second) return bad("duplicate entry '" + name + "' in the header");
    if (name == "__metadata__") {
      if (value.kind != Json::kObject) return bad("__metadata__ is not an object");
      for (auto& [k, v] : value.members) {
        if (v.kind != Json::kString) return bad("__metadata__ value of '" + k + "' is not a string");
        if (!out.metadata.emplace(k, v.str).second) return bad("duplicate __metadata__ key '" + k + "'");
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (value.kind != Json::kObject) return bad(what + " is not an object");
    const Json *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
    for (auto& [k, v] : value.members) {
      if (k == "dtype") dtype = &v;
      else if (k == "shape") shape = &v;
      else if (k == "data_offsets") offsets = &v;
    }
    if (dtype == nullptr || dtype->kind != Json::kString) return bad(what + ": missing or non-string \"dtype\"");
    if (shape == nullptr || shape->kind != Json::kArray) return bad(what + ": missing or non-array \"shape\"");
    if (offsets == nullptr || offsets->kind != Json::kArray || offsets->items.size() != 2)
      return bad(what + ": \"data_offsets\" must be an array of two integers");
    TensorInfo t;
    if (!ParseSafeDType(dtype->str, &t.dtype))
      return bad(what + ": unknown or unsupported dtype '" + dtype->str + "' (supported: F32, F16, BF16)");
    uint64_t elems = 1;
    for (const Json& d : shape->items) {
      if (d.kind != Json::kInt) return bad(what + ": shape holds a non-integer");
      if (d.num > (1ull << 40) || (d.num != 0 && elems > (1ull << 40) / d.num))
        return bad(what + ": shape is too large");
      elems *= d.num;
      t.shape.push_back(static_cast<int64_t>(d.num));
    }
    for (const Json& o : offsets->items)
      if (o.kind != Json::kInt) return bad(what + ": data_offsets holds a non-integer");
    const uint64_t begin = offsets->items[0].num, end = offsets->items[1].num;
    if (begin > end)
      return bad(what + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] are reversed");
    if (end > data_len)
      return bad(what + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                 "] go past the data section (" + std::to_string(data_len) + " bytes)");
    const uint64_t expect = elems * DTypeSize(t.dtype);
    if (end - begin != expect)
      return bad(what + ": shape " + t.ShapeString() + " x " + dtype->str + " needs " + std::to_string(expect) +
                 " bytes but data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] span " +
                 std::to_string(end - begin));
    t.offset = static_cast<size_t>(begin);
    t.size = static_cast<size_t>(expect);
    spans.emplace_back(begin, name);
    out.tensors.emplace(name, std::move(t));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    const TensorInfo& prev = out.tensors.at(spans[i - 1].second);
    if (prev.size > 0 && prev.offset + prev.size > spans[i].first)
      return bad("tensors '" + spans[i - 1].second + "' and '" + spans[i].second + "' overlap in the data section");
  }
  // Keep only the data section; offsets are relative to it already.
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(data_begin));
  out.data = std::move(bytes);
  return out;
  });
}

Result<SafeTensors> LoadSafeTensors(const std::string& path) {
  return ReturnOnBadAlloc([&] { return path + ": the file's bytes"; }, [&]() -> Result<SafeTensors> {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return NotFound(path + ": cannot open the file");
  const std::streamoff size = in.tellg();
  if (size < 0) return IOError(path + ": cannot determine the file size");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size))
    return IOError(path + ": read failed");
  return ParseSafeTensors(path, std::move(bytes));
  });
}

}  // namespace kvtier::model
