#include "store/coding.h"

#include <limits>

namespace kvtier {
namespace {
constexpr bool kLittleEndianHost = std::endian::native == std::endian::little;
}  // namespace

void PutFloat32Array(std::string* dst, const float* v, size_t n) {
  if constexpr (kLittleEndianHost) {
    dst->append(reinterpret_cast<const char*>(v), n * sizeof(float));
  } else {
    const size_t at = dst->size();
    dst->resize(at + n * 4);
    for (size_t i = 0; i < n; ++i) EncodeFixed32(dst->data() + at + 4 * i, std::bit_cast<uint32_t>(v[i]));
  }
}

void PutInt32Array(std::string* dst, const int32_t* v, size_t n) {
  if constexpr (kLittleEndianHost) {
    dst->append(reinterpret_cast<const char*>(v), n * sizeof(int32_t));
  } else {
    const size_t at = dst->size();
    dst->resize(at + n * 4);
    for (size_t i = 0; i < n; ++i) EncodeFixed32(dst->data() + at + 4 * i, static_cast<uint32_t>(v[i]));
  }
}

Status RecordReader::Need(size_t n, const char* field) const {
  if (remaining() >= n) return Status::Ok();
  return Corruption(what_ + ": " + field + " needs " + std::to_string(n) + " bytes, " +
                    std::to_string(remaining()) + " left (the record is short)");
}

Status RecordReader::ReadFixed8(uint8_t* v, const char* field) {
  KVTIER_RETURN_IF_ERROR(Need(1, field));
  *v = static_cast<uint8_t>(*Take(1));
  return Status::Ok();
}

Status RecordReader::ReadFixed16(uint16_t* v, const char* field) {
  KVTIER_RETURN_IF_ERROR(Need(2, field));
  *v = DecodeFixed16(Take(2));
  return Status::Ok();
}

Status RecordReader::ReadFixed32(uint32_t* v, const char* field) {
  KVTIER_RETURN_IF_ERROR(Need(4, field));
  *v = DecodeFixed32(Take(4));
  return Status::Ok();
}

Status RecordReader::ReadFixed64(uint64_t* v, const char* field) {
  KVTIER_RETURN_IF_ERROR(Need(8, field));
  *v = DecodeFixed64(Take(8));
  return Status::Ok();
}

Status RecordReader::ReadInt32(int32_t* v, const char* field) {
  uint32_t u = 0;
  KVTIER_RETURN_IF_ERROR(ReadFixed32(&u, field));
  *v = static_cast<int32_t>(u);
  return Status::Ok();
}

Status RecordReader::ReadInt64(int64_t* v, const char* field) {
  uint64_t u = 0;
  KVTIER_RETURN_IF_ERROR(ReadFixed64(&u, field));
  *v = static_cast<int64_t>(u);
  return Status::Ok();
}

Status RecordReader::ReadFloat32(float* v, const char* field) {
  uint32_t u = 0;
  KVTIER_RETURN_IF_ERROR(ReadFixed32(&u, field));
  *v = std::bit_cast<float>(u);
  return Status::Ok();
}

Status RecordReader::ReadBytes(void* dst, size_t n, const char* field) {
  KVTIER_RETURN_IF_ERROR(Need(n, field));
  if (n > 0) std::memcpy(dst, Take(n), n);
  return Status::Ok();
}

Status RecordReader::ReadView(size_t n, std::string_view* out, const char* field) {
  KVTIER_RETURN_IF_ERROR(Need(n, field));
  *out = std::string_view(Take(n), n);
  return Status::Ok();
}

Status RecordReader::ReadLengthPrefixed(std::string* out, const char* field) {
  // Check the length and the bytes together, so a failure leaves the cursor where it was.
  KVTIER_RETURN_IF_ERROR(Need(4, field));
  const uint32_t n = DecodeFixed32(data_.data() + pos_);
  if (remaining() - 4 < n)
    return Corruption(what_ + ": " + field + " says " + std::to_string(n) + " bytes, " +
                      std::to_string(remaining() - 4) + " left (the record is short)");
  Take(4);
  out->assign(Take(n), n);
  return Status::Ok();
}

Status RecordReader::ReadFloat32Array(float* dst, size_t n, const char* field) {
  if (n > std::numeric_limits<size_t>::max() / 4)
    return Corruption(what_ + ": " + field + " of " + std::to_string(n) + " elements cannot fit any record");
  KVTIER_RETURN_IF_ERROR(Need(n * 4, field));
  const char* p = Take(n * 4);
  if constexpr (kLittleEndianHost) {
    if (n > 0) std::memcpy(dst, p, n * 4);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(DecodeFixed32(p + 4 * i));
  }
  return Status::Ok();
}

Status RecordReader::ReadInt32Array(int32_t* dst, size_t n, const char* field) {
  if (n > std::numeric_limits<size_t>::max() / 4)
    return Corruption(what_ + ": " + field + " of " + std::to_string(n) + " elements cannot fit any record");
  KVTIER_RETURN_IF_ERROR(Need(n * 4, field));
  const char* p = Take(n * 4);
  if constexpr (kLittleEndianHost) {
    if (n > 0) std::memcpy(dst, p, n * 4);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = static_cast<int32_t>(DecodeFixed32(p + 4 * i));
  }
  return Status::Ok();
}

Status RecordReader::ExpectEnd() const {
  if (done()) return Status::Ok();
  return Corruption(what_ + ": " + std::to_string(remaining()) + " bytes past the end of the record");
}

}  // namespace kvtier
