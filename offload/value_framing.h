// Value framing: how every lower tier frames what it stores (the cold tier's RocksDB values,
// the remote tier's Redis values), so that a value read back is checked the same way wherever
// it was kept. A value is a 28-byte header then the body:
//   magic u32 | format version u8 | kind u8 | 2 bytes zero | body length u64 | aux u64 |
//   CRC32C u32 (over the header's first 24 bytes, then the body)
// (little-endian). `aux` is the kind's own field (the cold tier: a blob's length or a
// sequence record's; the remote tier: a tag of the key the value was written under).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvtier/status.h"

namespace kvtier {
namespace value_framing {

inline constexpr size_t kValueHeaderBytes = 28;
inline constexpr uint32_t kMagic = 0x5443564Bu;
inline constexpr uint8_t kFormatVersion = 1;
/// The value header's kind byte.
enum class ValueKind : uint8_t { kSequence = 1, kMeta = 2, kPayload = 3, kBlob = 4 };

/// Checks a stored value as every read does (length, magic, version, kind, length field,
/// CRC) and points *body at its body (inside `value`); *aux gets the header's aux field
/// (may be null). Corruption naming `what` (e.g. "chunk seq=3/layer=1/chunk=17 payload")
/// and what failed otherwise, worded as the cold tier's ("cold tier: ..."; the remote tier
/// rewords it). Any bytes are safe to pass (a fuzz target does).
Status DecodeValue(std::string_view value, ValueKind kind, const std::string& what, std::string_view* body,
                   uint64_t* aux);
/// The stored value of `body`: header (with `aux`) then body.
std::string EncodeValue(ValueKind kind, std::string_view body, uint64_t aux);
/// Writes the kValueHeaderBytes of header of `body` (body_bytes long) into `dst`: for a caller
/// that builds the value in one buffer (the body may already sit right after `dst`).
void EncodeHeader(char* dst, ValueKind kind, const void* body, uint64_t body_bytes, uint64_t aux);

}  // namespace value_framing
}  // namespace kvtier
