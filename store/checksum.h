// CRC-32C (Castagnoli): the checksum of every value kvtier writes to disk.
//
// Reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF, the
// same CRC as iSCSI, ext4 metadata and RocksDB's crc32c. Test vector:
// Crc32c("123456789", 9) == 0xE3069283.
//
// `seed` chains calls: Crc32c(b, nb, Crc32c(a, na)) == Crc32c(a ++ b).
//
// Crc32c() uses the CPU's CRC32C instruction when the build targets one
// (SSE4.2 on x86-64, the CRC extension on AArch64; -march=native turns it on),
// three streams interleaved for long inputs, and the portable slice-by-8 table
// method otherwise. Both give identical results; Crc32cSoftware() is always
// the table method.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

/// CRC-32C of n bytes at data, continuing from `seed` (0 to start).
uint32_t Crc32c(const void* data, size_t n, uint32_t seed = 0);

/// The portable slice-by-8 table implementation (same results as Crc32c).
uint32_t Crc32cSoftware(const void* data, size_t n, uint32_t seed = 0);

/// True when Crc32c() uses a hardware CRC32C instruction.
bool Crc32cIsHardware();

}  // namespace kvtier
