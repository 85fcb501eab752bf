// libFuzzer target: CompilerKV's table file reader (ParseCompilerKvTables) on any bytes.
// The first byte picks a mode: odd -> as is; even -> the rest gets a correct
// "crc32c <hex>" line, so the fuzzer reaches the header and table lines behind it. Tables
// that parse must validate and build a policy.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "offload/policy/compilerkv.h"
#include "store/checksum.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string content(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 1) == 0) {
    if (!content.empty() && content.back() != '\n') content += '\n';
    char crc[32];
    std::snprintf(crc, sizeof crc, "crc32c %08x\n", kvtier::Crc32c(content.data(), content.size()));
    content += crc;
  }
  auto t = kvtier::ParseCompilerKvTables(content, "fuzz.tables");
  if (!t.ok()) return 0;
  if (!t->Validate().ok()) __builtin_trap();
  return 0;
}
