// SafeTensors: a reader of the safetensors weight format (the header parsed by nlohmann-json).
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON, then the
// raw little-endian tensor data. The JSON maps each tensor name to
// {"dtype": "F32"|"F16"|"BF16", "shape": [d0, d1, ...], "data_offsets": [begin, end]}
// (offsets into the data section) and may hold "__metadata__", an object of
// string values. Every malformed input is a Status naming the file and what is
// wrong; nothing throws. The whole file is read into memory: the models kvtier
// runs on CPU are small.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "store/status.h"

namespace kvtier::model {

struct TensorInfo {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t offset = 0;  ///< byte offset into SafeTensors::data
  size_t size = 0;    ///< bytes: product(shape) * DTypeSize(dtype)

  int64_t elements() const;
  /// "[256, 64]"
  std::string ShapeString() const;
};

struct SafeTensors {
  std::string path;  ///< what errors name
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;  ///< __metadata__
  std::vector<uint8_t> data;                    ///< the data section

  /// NotFound naming the file and the tensor when absent.
  Result<const TensorInfo*> Find(const std::string& name) const;
  /// The tensor converted to fp32, row-major as stored.
  Result<std::vector<float>> ToFloat32(const std::string& name) const;
};

/// Parses a safetensors image held in memory; `path` only names it in errors.
Result<SafeTensors> ParseSafeTensors(const std::string& path, std::vector<uint8_t> bytes);
/// Reads and parses a safetensors file. Both hold the whole file in memory: one that cannot be
/// allocated is ResourceExhausted naming the file.
Result<SafeTensors> LoadSafeTensors(const std::string& path);

/// "[2, 3]" for error messages.
std::string ShapeToString(const std::vector<int64_t>& shape);

}  // namespace kvtier::model
