// libFuzzer target: the KV trace reader (integration/kv_trace.h) on any bytes.
// The first byte picks a mode: odd -> the rest is taken as is (the checks up to the CRC);
// even -> the rest gets a correct file_bytes field and CRC, so the fuzzer reaches the
// header and array decoding behind the checksum. A decoded trace must validate and
// encode back to the same bytes (but for the reserved field, which the reader ignores).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "integration/kv_trace.h"
#include "store/checksum.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 1) == 0 && bytes.size() >= 24) {
    std::memcpy(bytes.data(), "KVTTRACE", 8);
    const uint64_t total = bytes.size() + 4;
    std::memcpy(bytes.data() + 16, &total, 8);
    const uint32_t crc = kvtier::Crc32c(bytes.data(), bytes.size());
    bytes.append(reinterpret_cast<const char*>(&crc), 4);
  }
  auto t = kvtier::DecodeKvTrace(bytes, "fuzz");
  if (!t.ok()) return 0;
  if (!t->Validate().ok()) __builtin_trap();
  // The reader ignores the reserved field (bytes 12..16) and the writer writes 0 there.
  std::memset(bytes.data() + 12, 0, 4);
  const uint32_t crc = kvtier::Crc32c(bytes.data(), bytes.size() - 4);
  std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
  auto again = kvtier::EncodeKvTrace(*t);
  if (!again.ok() || *again != bytes) __builtin_trap();
  return 0;
}
