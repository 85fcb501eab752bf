// fp32 -> f16 / bf16 as integer bit operations that compile for the host and the device: the
// element conversion of LaunchConvertToStore (kernels/cuda/forward.cu). They reproduce
// kvtier::FloatToF16 / FloatToBf16 (kernels/dtype.h) bit for bit, NaNs included (round to
// nearest even, f16 overflow to inf, exact subnormals). The CUDA intrinsics __float2half_rn /
// __float2bfloat16_rn round the same way but return a canonical NaN (0x7fff), so they would
// agree with the twin only "in meaning"; these agree in every bit, which the CPU test checks
// on the host build of this same code (tests/kernels/kernel_backends_test.cc,
// StoreConversionBitsEqualTheHostConversion). The f16 subnormal path works on the integer
// mantissa (dtype.cc uses float arithmetic there, exact on the host; on a device built with
// -ftz a subnormal fp32 input would flush, so the integer form does not depend on that flag).
//
// A plain header with no CUDA include: any C++ translation unit can include it.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace kvtier::kernels {

/// fp32 bits -> bf16 bits: FloatToBf16.
KVTIER_HOST_DEVICE inline uint16_t Bf16BitsFromF32Bits(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// fp32 bits -> f16 bits: FloatToF16.
KVTIER_HOST_DEVICE inline uint16_t F16BitsFromF32Bits(uint32_t u) {
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN -> quiet NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {  // below 2^-14: an f16 subnormal (unit 2^-24) or zero
    // |x| <= 2^-25 rounds to 0 (2^-25 itself is the tie 0.5 units, to even 0); fp32
    // subnormals are far below.
    if (abs <= 0x33000000u) return sign;
    // |x| = mant * 2^(e - 150), so |x| / 2^-24 = mant >> (126 - e) with the shifted-out
    // bits the remainder; e in [102, 112], shift in [14, 24].
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal range: rebias exponent 127 -> 15, round mantissa 23 -> 10 bits.
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);
  m -= (112u << 23);
  return static_cast<uint16_t>(sign | (m >> 13));
}

}  // namespace kvtier::kernels
