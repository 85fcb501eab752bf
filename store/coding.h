// Record coding: the one place kvtier turns integers and floats into bytes for
// anything it writes to disk (the tiered store's records, the cold tier's value
// header and keys, the trace file).
//
// Why a module of its own: copying host-order bytes with memcpy gives
// "little-endian" only on a little-endian host. Every encoder here spells the
// byte order out, so a file
// written on one host reads back the same on any other, and a short or
// damaged record is reported the same way everywhere: RecordReader returns
// Corruption naming the record and the field instead of reading past the end.
//
//  * Fixed-width little-endian: u8/u16/u32/u64, i32/i64 (two's complement),
//    f32 (its IEEE-754 bit pattern).
//  * Fixed-width big-endian u32/u64, for keys whose bytewise order must be
//    their numeric order (RocksDB compares keys bytewise).
//  * Length-prefixed bytes: u32 little-endian length, then the bytes.
//  * Arrays of f32 / i32: the elements in order, each little-endian. On a
//    little-endian host this is one memcpy (the trace file holds megabytes of
//    them); elsewhere each element is swapped.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "store/status.h"

namespace kvtier {

// ---- fixed width, into a buffer the caller owns ------------------------------------

inline void EncodeFixed16(char* dst, uint16_t v) {
  dst[0] = static_cast<char>(v & 0xff);
  dst[1] = static_cast<char>(v >> 8);
}
inline void EncodeFixed32(char* dst, uint32_t v) {
  for (int i = 0; i < 4; ++i) dst[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
inline void EncodeFixed64(char* dst, uint64_t v) {
  for (int i = 0; i < 8; ++i) dst[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
inline uint16_t DecodeFixed16(const char* p) {
  return static_cast<uint16_t>(static_cast<uint8_t>(p[0]) |
                               (static_cast<uint16_t>(static_cast<uint8_t>(p[1])) << 8));
}
inline uint32_t DecodeFixed32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
inline uint64_t DecodeFixed64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

/// Big-endian: for keys, so that bytewise order is numeric order.
inline void EncodeBigEndian32(char* dst, uint32_t v) {
  for (int i = 3; i >= 0; --i) {
    dst[i] = static_cast<char>(v & 0xff);
    v >>= 8;
  }
}
inline void EncodeBigEndian64(char* dst, uint64_t v) {
  for (int i = 7; i >= 0; --i) {
    dst[i] = static_cast<char>(v & 0xff);
    v >>= 8;
  }
}
inline uint32_t DecodeBigEndian32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
inline uint64_t DecodeBigEndian64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// ---- appending to a string -------------------------------------------------------------

inline void PutFixed8(std::string* dst, uint8_t v) { dst->push_back(static_cast<char>(v)); }
inline void PutFixed16(std::string* dst, uint16_t v) {
  char b[2];
  EncodeFixed16(b, v);
  dst->append(b, 2);
}
inline void PutFixed32(std::string* dst, uint32_t v) {
  char b[4];
  EncodeFixed32(b, v);
  dst->append(b, 4);
}
inline void PutFixed64(std::string* dst, uint64_t v) {
  char b[8];
  EncodeFixed64(b, v);
  dst->append(b, 8);
}
inline void PutInt32(std::string* dst, int32_t v) { PutFixed32(dst, static_cast<uint32_t>(v)); }
inline void PutInt64(std::string* dst, int64_t v) { PutFixed64(dst, static_cast<uint64_t>(v)); }
/// The float's IEEE-754 bit pattern, little-endian (NaN payloads survive).
inline void PutFloat32(std::string* dst, float v) { PutFixed32(dst, std::bit_cast<uint32_t>(v)); }
/// Raw bytes, no length: the reader must know n.
inline void PutBytes(std::string* dst, const void* p, size_t n) {
  dst->append(static_cast<const char*>(p), n);
}
/// u32 length, then the bytes. Callers keep inputs below 4 GiB (every record
/// kvtier writes is far smaller; EncodeKvTrace's strings are checked).
inline void PutLengthPrefixed(std::string* dst, std::string_view s) {
  PutFixed32(dst, static_cast<uint32_t>(s.size()));
  dst->append(s.data(), s.size());
}
/// n floats, each little-endian.
void PutFloat32Array(std::string* dst, const float* v, size_t n);
/// n int32s, each little-endian.
void PutInt32Array(std::string* dst, const int32_t* v, size_t n);

// ---- reading -------------------------------------------------------------------------

/// A bounded cursor over one record. Every read checks the bytes left first; a
/// short input is Corruption("<what>: <field> needs N bytes, M left"), and the
/// cursor does not move. `what` names the record in messages (e.g. "cold tier:
/// chunk seq=3/layer=1/chunk=17 meta"); the view must outlive the reader.
class RecordReader {
 public:
  RecordReader(std::string_view data, std::string what) : data_(data), what_(std::move(what)) {}

  Status ReadFixed8(uint8_t* v, const char* field);
  Status ReadFixed16(uint16_t* v, const char* field);
  Status ReadFixed32(uint32_t* v, const char* field);
  Status ReadFixed64(uint64_t* v, const char* field);
  Status ReadInt32(int32_t* v, const char* field);
  Status ReadInt64(int64_t* v, const char* field);
  Status ReadFloat32(float* v, const char* field);
  /// Copies n raw bytes to dst.
  Status ReadBytes(void* dst, size_t n, const char* field);
  /// A view of the next n bytes (valid while the input is).
  Status ReadView(size_t n, std::string_view* out, const char* field);
  /// u32 length, then that many bytes.
  Status ReadLengthPrefixed(std::string* out, const char* field);
  Status ReadFloat32Array(float* dst, size_t n, const char* field);
  Status ReadInt32Array(int32_t* dst, size_t n, const char* field);
  /// Corruption when bytes are left over (a record longer than its format says).
  Status ExpectEnd() const;

  size_t remaining() const { return data_.size() - pos_; }
  size_t position() const { return pos_; }
  bool done() const { return pos_ == data_.size(); }
  const std::string& what() const { return what_; }

 private:
  Status Need(size_t n, const char* field) const;
  const char* Take(size_t n) {
    const char* p = data_.data() + pos_;
    pos_ += n;
    return p;
  }
  std::string_view data_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace kvtier
