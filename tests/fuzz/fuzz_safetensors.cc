// libFuzzer target: the safetensors reader (integration/model/safetensors.h) on any bytes.
// Every input must come back as a SafeTensors or a Status; a parsed file's tensors must
// convert to fp32 without reading outside the data section (ASan/UBSan watch).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "integration/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto st = kvtier::model::ParseSafeTensors("fuzz.safetensors", std::vector<uint8_t>(data, data + size));
  if (!st.ok()) return 0;
  for (const auto& [name, info] : st->tensors) {
    // Bounded: the data section is at most the input, so this is at most size / 2 floats.
    auto f = st->ToFloat32(name);
    if (f.ok() && static_cast<int64_t>(f->size()) != info.elements()) __builtin_trap();
  }
  return 0;
}
