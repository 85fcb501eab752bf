// Storage dtypes and their conversions to and from fp32.
//
// KV is stored as fp16, bf16 or fp32; all arithmetic accumulates in fp32.
// Conversions round to nearest even, keep infinities and NaNs (a NaN stays a
// NaN, quiet), and handle subnormals exactly. This header is part of kernels/,
// which depends on nothing else in kvtier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvtier {

// Spelled out identically in include/kvtier/types.h (the engine API's vocabulary, which
// kernels/ does not include); the shared guard keeps one of the two per translation unit.
#ifndef KVTIER_DTYPE_DEFINED_
#define KVTIER_DTYPE_DEFINED_
enum class DType : uint8_t {
  kF32 = 0,   ///< IEEE-754 binary32
  kF16 = 1,   ///< IEEE-754 binary16
  kBF16 = 2,  ///< bfloat16: the upper 16 bits of a binary32
};

/// Bytes per element.
constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
#endif  // KVTIER_DTYPE_DEFINED_
/// "f32", "f16", "bf16".
const char* DTypeName(DType t);
/// Parses "f32|fp32|float32", "f16|fp16|float16|half", "bf16|bfloat16".
bool ParseDType(const char* name, DType* out);
/// Every spelling ParseDType accepts, '|'-separated: "f16|fp16|float16|half|bf16|bfloat16|f32|fp32|float32".
const char* DTypeSpellings();

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// fp32 -> bf16, round to nearest even; NaN stays NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

/// fp32 -> fp16, round to nearest even, overflow to inf, exact subnormals.
uint16_t FloatToF16(float f);

namespace detail {
/// 65536-entry fp16 -> fp32 table, built once (256 KiB): a load beats bit
/// fiddling in the attention inner loops.
extern const float* const kF16Table;
}  // namespace detail
inline float F16ToFloat(uint16_t h) { return detail::kF16Table[h]; }

/// Converts n elements of `src` (dtype `t`) to fp32.
void ToFloat(DType t, const void* src, float* dst, size_t n);
/// Converts n fp32 elements to dtype `t`.
void FromFloat(DType t, const float* src, void* dst, size_t n);

}  // namespace kvtier
