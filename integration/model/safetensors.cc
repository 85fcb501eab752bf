#include "integration/model/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "store/file_bytes.h"

namespace kvtier::model {
namespace {

using nlohmann::ordered_json;

// How deep the header may nest: the format needs 3 levels (the top object, a tensor's
// object, its shape array); the bound keeps a hostile header from nesting without end.
constexpr int kMaxHeaderDepth = 8;

// What the parse callback refuses, which nlohmann's own grammar allows: a repeated key in
// an object (nlohmann keeps the last one silently, and a duplicated tensor name must be an
// error) and nesting deeper than kMaxHeaderDepth. Thrown out of the parse to stop it there.
struct HeaderRefused {
  std::string what;
};

// nlohmann's message without its id: "[json.exception.parse_error.101] parse error at line 1,
// column 9: syntax error while parsing ..." -> "parse error at line 1, column 9: ...".
std::string Reason(const ordered_json::exception& e) {
  std::string what = e.what();
  if (const size_t at = what.find("] "); what.rfind("[json.exception", 0) == 0 && at != std::string::npos)
    what.erase(0, at + 2);
  return what;
}

// Parses the header JSON with nlohmann (ordered_json: members in file order, so the first
// bad tensor reported is the first in the file). InvalidArgument naming what is wrong.
Status ParseHeaderJson(std::string_view text, ordered_json* out) {
  struct Open {
    std::set<std::string> keys;  // those seen so far (objects)
    std::string last_key;        // the member being parsed (objects)
  };
  std::vector<Open> open;  // the containers being parsed, outermost first
  auto check = [&](int /*depth*/, ordered_json::parse_event_t event, ordered_json& parsed) {
    using E = ordered_json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      if (open.size() >= kMaxHeaderDepth)
        throw HeaderRefused{"bad JSON: nested deeper than " + std::to_string(kMaxHeaderDepth) + " levels"};
      open.emplace_back();
    } else if (event == E::object_end || event == E::array_end) {
      open.pop_back();
    } else if (event == E::key) {
      std::string key = parsed.get<std::string>();
      if (!open.back().keys.insert(key).second) {
        if (open.size() == 1) throw HeaderRefused{"duplicate entry '" + key + "' in the header"};
        if (open.size() == 2 && open[0].last_key == "__metadata__")
          throw HeaderRefused{"duplicate __metadata__ key '" + key + "'"};
        throw HeaderRefused{"duplicate key '" + key + "' under '" + open[0].last_key + "' in the header"};
      }
      open.back().last_key = std::move(key);
    }
    return true;
  };
  try {
    *out = ordered_json::parse(text.begin(), text.end(), check);
  } catch (const HeaderRefused& r) {
    return InvalidArgument(r.what);
  } catch (const ordered_json::parse_error& e) {
    return InvalidArgument("bad JSON at byte " + std::to_string(e.byte) + " of the header: " + Reason(e));
  } catch (const ordered_json::exception& e) {  // e.g. out_of_range.406: a number like 1e999
    return InvalidArgument("bad JSON in the header: " + Reason(e));
  }
  return Status::Ok();
}

bool ParseSafeDType(const std::string& s, DType* out) {
  if (s == "F32") {
    *out = DType::kF32;
    return true;
  }
  if (s == "F16") {
    *out = DType::kF16;
    return true;
  }
  if (s == "BF16") {
    *out = DType::kBF16;
    return true;
  }
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
  if (t->offset % DTypeSize(t->dtype) !=
      0) {  // the format does not promise alignment; ToFloat reads whole elements
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
          return bad("file too short (" + std::to_string(bytes.size()) +
                     " bytes) to hold the 8-byte header length");
        uint64_t header_len = 0;
        for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[static_cast<size_t>(i)];
        if (header_len > bytes.size() - 8)
          return bad("header length " + std::to_string(header_len) + " goes past the end of the file (" +
                     std::to_string(bytes.size()) + " bytes)");
        const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, header_len);
        ordered_json root;
        {
          Status st = ParseHeaderJson(text, &root);
          if (!st.ok()) return bad(st.message());
        }
        if (!root.is_object()) return bad("header is not a JSON object");

        SafeTensors out;
        out.path = path;
        const size_t data_begin = 8 + header_len;
        const uint64_t data_len = bytes.size() - data_begin;
        std::vector<std::pair<uint64_t, std::string>> spans;  // (begin, name), to find overlaps
        // Names are unique here: ParseHeaderJson refuses a repeated key in any object.
        for (const auto& [name, value] : root.items()) {
          if (name == "__metadata__") {
            if (!value.is_object()) return bad("__metadata__ is not an object");
            for (const auto& [k, v] : value.items()) {
              if (!v.is_string()) return bad("__metadata__ value of '" + k + "' is not a string");
              out.metadata.emplace(k, v.get<std::string>());
            }
            continue;
          }
          const std::string what = "tensor '" + name + "'";
          if (!value.is_object()) return bad(what + " is not an object");
          const auto dtype = value.find("dtype"), shape = value.find("shape"),
                     offsets = value.find("data_offsets");
          if (dtype == value.end() || !dtype->is_string())
            return bad(what + ": missing or non-string \"dtype\"");
          if (shape == value.end() || !shape->is_array())
            return bad(what + ": missing or non-array \"shape\"");
          if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2)
            return bad(what + ": \"data_offsets\" must be an array of two integers");
          const std::string dtype_name = dtype->get<std::string>();
          TensorInfo t;
          if (!ParseSafeDType(dtype_name, &t.dtype))
            return bad(what + ": unknown or unsupported dtype '" + dtype_name +
                       "' (supported: F32, F16, BF16)");
          // Sizes and offsets are non-negative integers: nlohmann's number_unsigned (a negative
          // integer is number_integer, a fraction or exponent number_float).
          uint64_t elems = 1;
          for (const ordered_json& d : *shape) {
            if (!d.is_number_unsigned())
              return bad(what + ": shape holds a value that is not a non-negative integer");
            const uint64_t n = d.get<uint64_t>();
            if (n > (1ull << 40) || (n != 0 && elems > (1ull << 40) / n))
              return bad(what + ": shape is too large");
            elems *= n;
            t.shape.push_back(static_cast<int64_t>(n));
          }
          for (const ordered_json& o : *offsets)
            if (!o.is_number_unsigned())
              return bad(what + ": data_offsets holds a value that is not a non-negative integer");
          const uint64_t begin = (*offsets)[0].get<uint64_t>(), end = (*offsets)[1].get<uint64_t>();
          if (begin > end)
            return bad(what + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                       "] are reversed");
          if (end > data_len)
            return bad(what + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                       "] go past the data section (" + std::to_string(data_len) + " bytes)");
          const uint64_t expect = elems * DTypeSize(t.dtype);
          if (end - begin != expect)
            return bad(what + ": shape " + t.ShapeString() + " x " + dtype_name + " needs " +
                       std::to_string(expect) + " bytes but data_offsets [" + std::to_string(begin) + ", " +
                       std::to_string(end) + "] span " + std::to_string(end - begin));
          t.offset = static_cast<size_t>(begin);
          t.size = static_cast<size_t>(expect);
          spans.emplace_back(begin, name);
          out.tensors.emplace(name, std::move(t));
        }
        std::sort(spans.begin(), spans.end());
        for (size_t i = 1; i < spans.size(); ++i) {
          const TensorInfo& prev = out.tensors.at(spans[i - 1].second);
          if (prev.size > 0 && prev.offset + prev.size > spans[i].first)
            return bad("tensors '" + spans[i - 1].second + "' and '" + spans[i].second +
                       "' overlap in the data section");
        }
        // Keep only the data section; offsets are relative to it already.
        bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(data_begin));
        out.data = std::move(bytes);
        return out;
      });
}

Result<SafeTensors> LoadSafeTensors(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytesU8(path, "model file"));
  return ParseSafeTensors(path, std::move(bytes));
}

}  // namespace kvtier::model
