// Value framing shared by the lower tiers: see offload/value_framing.h.
#include "offload/value_framing.h"

#include <cinttypes>
#include <cstdio>

#include "store/checksum.h"
#include "store/coding.h"

namespace kvtier {
namespace value_framing {
namespace {

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIx32, v);
  return buf;
}

const char* KindName(uint8_t k) {
  switch (k) {
    case 1:
      return "sequence record";
    case 2:
      return "chunk meta";
    case 3:
      return "chunk payload";
    case 4:
      return "blob";
  }
  return "unknown";
}

}  // namespace

void EncodeHeader(char* dst, ValueKind kind, const void* body, uint64_t body_bytes, uint64_t aux) {
  EncodeFixed32(dst, kMagic);
  dst[4] = static_cast<char>(kFormatVersion);
  dst[5] = static_cast<char>(kind);
  dst[6] = 0;
  dst[7] = 0;
  EncodeFixed64(dst + 8, body_bytes);
  EncodeFixed64(dst + 16, aux);
  EncodeFixed32(dst + 24, Crc32c(body, body_bytes, Crc32c(dst, 24)));
}

// `what` names the key, e.g. "chunk seq=3/layer=1/chunk=17 payload".
Status DecodeValue(std::string_view v, ValueKind want, const std::string& what, std::string_view* body,
                   uint64_t* aux) {
  constexpr size_t H = kValueHeaderBytes;
  if (v.size() < H)
    return Corruption("cold tier: " + what + " value too short (" + std::to_string(v.size()) +
                      " bytes, the header alone is " + std::to_string(H) + ")");
  const char* p = v.data();
  uint32_t magic = DecodeFixed32(p);
  if (magic != kMagic)
    return Corruption("cold tier: " + what + " bad magic " + Hex32(magic) + " (expected " + Hex32(kMagic) +
                      ")");
  uint8_t version = static_cast<uint8_t>(p[4]);
  if (version != kFormatVersion)
    return Corruption("cold tier: " + what + " has format version " + std::to_string(version) +
                      ", this build reads " + std::to_string(kFormatVersion));
  uint8_t kind = static_cast<uint8_t>(p[5]);
  if (kind != static_cast<uint8_t>(want))
    return Corruption("cold tier: " + what + " holds a " + KindName(kind) + " value (kind " +
                      std::to_string(kind) + "), expected a " + KindName(static_cast<uint8_t>(want)));
  uint64_t len = DecodeFixed64(p + 8);
  if (len != v.size() - H)
    return Corruption("cold tier: " + what + " length mismatch (header says " + std::to_string(len) +
                      " bytes, value holds " + std::to_string(v.size() - H) + ")");
  uint32_t stored = DecodeFixed32(p + 24);
  uint32_t crc = Crc32c(p, 24);
  crc = Crc32c(p + H, len, crc);
  if (crc != stored)
    return Corruption("cold tier: " + what + " checksum mismatch (stored " + Hex32(stored) + ", computed " +
                      Hex32(crc) + ")");
  if (aux != nullptr) *aux = DecodeFixed64(p + 16);
  *body = std::string_view(p + H, len);
  return Status::Ok();
}

std::string EncodeValue(ValueKind kind, std::string_view body, uint64_t aux) {
  std::string v(kValueHeaderBytes, '\0');
  EncodeHeader(v.data(), kind, body.data(), body.size(), aux);
  v.append(body.data(), body.size());
  return v;
}

}  // namespace value_framing
}  // namespace kvtier
