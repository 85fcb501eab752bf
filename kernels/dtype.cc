#include "kernels/dtype.h"

#include <array>
#include <bit>
#include <cstring>
#include <string>

namespace kvtier {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "?";
}

namespace {

// Every spelling ParseDType accepts, the canonical one (DTypeName) first in each group.
struct DTypeSpelling {
  const char* text;
  DType dtype;
};
constexpr DTypeSpelling kDTypeSpellings[] = {
    {"f16", DType::kF16},  {"fp16", DType::kF16},  {"float16", DType::kF16},
    {"half", DType::kF16}, {"bf16", DType::kBF16}, {"bfloat16", DType::kBF16},
    {"f32", DType::kF32},  {"fp32", DType::kF32},  {"float32", DType::kF32},
};

}  // namespace

bool ParseDType(const char* name, DType* out) {
  if (name == nullptr || out == nullptr) return false;
  for (const DTypeSpelling& s : kDTypeSpellings) {
    if (std::strcmp(name, s.text) == 0) {
      *out = s.dtype;
      return true;
    }
  }
  return false;
}

const char* DTypeSpellings() {
  static const std::string all = [] {
    std::string out;
    for (const DTypeSpelling& s : kDTypeSpellings) out += (out.empty() ? "" : "|") + std::string(s.text);
    return out;
  }();
  return all.c_str();
}

uint16_t FloatToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN -> quiet NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {                        // below 2^-14: subnormal or zero
    // Value = abs_float; fp16 subnormal unit is 2^-24. Round to nearest even.
    const float a = BitsToFloat(abs);
    // a * 2^24 in float is exact for the integer part we need; use rint-like logic.
    const float scaled = a * 16777216.0f;  // 2^24
    uint32_t q = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  // Normal range: rebias exponent 127 -> 15, round mantissa 23 -> 10 bits.
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);
  m -= (112u << 23);
  return sign | static_cast<uint16_t>(m >> 13);
}

namespace {
// constexpr so that the table is constant-initialised (it lives in .rodata):
// a table built by a dynamic initialiser could be read as nullptr by another
// translation unit's static initialiser (initialisation order across TUs is
// unspecified).
constexpr float F16ToFloatSlow(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24, exact in fp32.
    const float v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) {
    // Inf, or NaN: keep the payload, set the quiet bit (a NaN stays a NaN, quiet).
    return std::bit_cast<float>(sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

constexpr std::array<float, 65536> BuildF16Table() {
  std::array<float, 65536> t{};
  for (uint32_t i = 0; i < 65536; ++i) t[i] = F16ToFloatSlow(static_cast<uint16_t>(i));
  return t;
}

constexpr std::array<float, 65536> kF16TableData = BuildF16Table();
}  // namespace

namespace detail {
constinit const float* const kF16Table = kF16TableData.data();
}  // namespace detail

void ToFloat(DType t, const void* src, float* dst, size_t n) {
  if (n == 0) return;  // memcpy with a null pointer is undefined even for 0 bytes
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      const float* table = detail::kF16Table;
      for (size_t i = 0; i < n; ++i) dst[i] = table[s[i]];
      return;
    }
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
  }
}

void FromFloat(DType t, const float* src, void* dst, size_t n) {
  if (n == 0) return;
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToF16(src[i]);
      return;
    }
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
  }
}

}  // namespace kvtier
