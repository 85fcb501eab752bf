#include "store/checksum.h"

#include <bit>
#include <cstring>

#if defined(__SSE4_2__) && (defined(__x86_64__) || defined(_M_X64))
#include <nmmintrin.h>
#define KVTIER_CRC32C_HW_X86 1
#elif defined(__ARM_FEATURE_CRC32) && defined(__aarch64__)
#include <arm_acle.h>
#define KVTIER_CRC32C_HW_ARM 1
#endif

namespace kvtier {
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;

struct Crc32cTables {
  uint32_t t[8][256];
};

// t[0] is the classic byte-at-a-time table; t[k][b] is the CRC of byte b
// followed by k zero bytes, so eight table lookups advance the CRC 8 bytes.
constexpr Crc32cTables MakeTables() {
  Crc32cTables tb{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kCastagnoliReflected & (0u - (c & 1u)));
    tb.t[0][i] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t i = 0; i < 256; ++i) tb.t[k][i] = (tb.t[k - 1][i] >> 8) ^ tb.t[0][tb.t[k - 1][i] & 0xffu];
  return tb;
}

constexpr Crc32cTables kTables = MakeTables();
static_assert(kTables.t[0][1] == 0xF26B8303u, "CRC-32C table");

inline uint32_t ByteStep(uint32_t crc, uint8_t b) { return kTables.t[0][(crc ^ b) & 0xffu] ^ (crc >> 8); }

// Raw (un-inverted) slice-by-8 update.
uint32_t SoftwareUpdate(uint32_t crc, const uint8_t* p, size_t n) {
  if constexpr (std::endian::native == std::endian::little) {
    // Align to 8 bytes so the word loads are aligned (cheaper on some cores).
    while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
      crc = ByteStep(crc, *p++);
      --n;
    }
    const auto& t = kTables.t;
    while (n >= 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      w ^= crc;
      crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
            t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
      p += 8;
      n -= 8;
    }
  }
  while (n > 0) {
    crc = ByteStep(crc, *p++);
    --n;
  }
  return crc;
}

#if defined(KVTIER_CRC32C_HW_X86) || defined(KVTIER_CRC32C_HW_ARM)

#if defined(KVTIER_CRC32C_HW_X86)
inline uint32_t HwWord(uint32_t crc, uint64_t w) { return static_cast<uint32_t>(_mm_crc32_u64(crc, w)); }
inline uint32_t HwByte(uint32_t crc, uint8_t b) { return _mm_crc32_u8(crc, b); }
#else
inline uint32_t HwWord(uint32_t crc, uint64_t w) { return __crc32cd(crc, w); }
inline uint32_t HwByte(uint32_t crc, uint8_t b) { return __crc32cb(crc, b); }
#endif

inline uint64_t Load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// The CRC instruction has a latency of ~3 cycles and a throughput of one per
// cycle, so one dependency chain runs at a third of the possible speed. Large
// inputs are cut into three adjacent streams of `len` bytes that run in
// parallel; their CRCs are joined with crc(A || B) = Shift_|B|(crc(A)) ^ crc(B)
// (raw, un-inverted CRCs; the map is linear). Shift_len, "append len zero
// bytes", is applied with four byte-indexed tables.
constexpr size_t kLongBlock = 8192;
constexpr size_t kShortBlock = 256;

struct ShiftTable {
  uint32_t t[4][256];
  uint32_t operator()(uint32_t crc) const {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
};

ShiftTable MakeShiftTable(size_t zeros) {
  // Image of each of the 32 basis states after `zeros` zero bytes.
  uint32_t basis[32];
  for (int bit = 0; bit < 32; ++bit) {
    uint32_t c = 1u << bit;
    for (size_t i = 0; i < zeros; ++i) c = kTables.t[0][c & 0xffu] ^ (c >> 8);
    basis[bit] = c;
  }
  ShiftTable st{};
  for (int k = 0; k < 4; ++k)
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t v = 0;
      for (int i = 0; i < 8; ++i)
        if (b & (1u << i)) v ^= basis[8 * k + i];
      st.t[k][b] = v;
    }
  return st;
}

const ShiftTable& LongShift() {
  static const ShiftTable t = MakeShiftTable(kLongBlock);
  return t;
}
const ShiftTable& ShortShift() {
  static const ShiftTable t = MakeShiftTable(kShortBlock);
  return t;
}

// Three interleaved streams of `block` bytes each, while 3 * block remain.
inline uint32_t HwTriple(uint32_t crc0, const uint8_t*& p, size_t& n, size_t block, const ShiftTable& shift) {
  while (n >= 3 * block) {
    uint32_t crc1 = 0, crc2 = 0;
    const uint8_t* end = p + block;
    do {
      crc0 = HwWord(crc0, Load64(p));
      crc1 = HwWord(crc1, Load64(p + block));
      crc2 = HwWord(crc2, Load64(p + 2 * block));
      p += 8;
    } while (p < end);
    crc0 = shift(crc0) ^ crc1;
    crc0 = shift(crc0) ^ crc2;
    p += 2 * block;
    n -= 3 * block;
  }
  return crc0;
}

uint32_t HardwareUpdate(uint32_t crc, const uint8_t* p, size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    crc = HwByte(crc, *p++);
    --n;
  }
  if (n >= 3 * kShortBlock) {
    crc = HwTriple(crc, p, n, kLongBlock, LongShift());
    crc = HwTriple(crc, p, n, kShortBlock, ShortShift());
  }
  while (n >= 8) {
    crc = HwWord(crc, Load64(p));
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    crc = HwByte(crc, *p++);
    --n;
  }
  return crc;
}
#endif

}  // namespace

uint32_t Crc32cSoftware(const void* data, size_t n, uint32_t seed) {
  return ~SoftwareUpdate(~seed, static_cast<const uint8_t*>(data), n);
}

uint32_t Crc32c(const void* data, size_t n, uint32_t seed) {
#if defined(KVTIER_CRC32C_HW_X86) || defined(KVTIER_CRC32C_HW_ARM)
  return ~HardwareUpdate(~seed, static_cast<const uint8_t*>(data), n);
#else
  return ~SoftwareUpdate(~seed, static_cast<const uint8_t*>(data), n);
#endif
}

bool Crc32cIsHardware() {
#if defined(KVTIER_CRC32C_HW_X86) || defined(KVTIER_CRC32C_HW_ARM)
  return true;
#else
  return false;
#endif
}

}  // namespace kvtier
