// The vocabulary of the engine API: the storage dtype, the shape of a model's KV cache
// (Geometry), where K/V live (MemorySpace) and how a sequence is named (SequenceId).
// Internal code includes this header too; kernels/ does not (it depends on nothing of
// ours), so DType is spelled out both here and in kernels/dtype.h under one include guard
// macro, and tests/install_consumer_test.sh fails when the two spellings differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvtier/status.h"

namespace kvtier {

#ifndef KVTIER_DTYPE_DEFINED_
#define KVTIER_DTYPE_DEFINED_
enum class DType : uint8_t {
  kF32 = 0,   ///< IEEE-754 binary32
  kF16 = 1,   ///< IEEE-754 binary16
  kBF16 = 2,  ///< bfloat16: the upper 16 bits of a binary32
};

/// Bytes per element.
constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
#endif  // KVTIER_DTYPE_DEFINED_
/// "f32", "f16", "bf16".
const char* DTypeName(DType t);
/// Parses "f32|fp32|float32", "f16|fp16|float16|half", "bf16|bfloat16".
bool ParseDType(const char* name, DType* out);
/// Every spelling ParseDType accepts, '|'-separated: "f16|fp16|float16|half|bf16|bfloat16|f32|fp32|float32".
const char* DTypeSpellings();

/// A sequence of the store: the tokens one request appended, per layer.
using SequenceId = uint64_t;

/// Where a hot tier keeps its memory.
enum class Device { kCpu, kCuda };
/// "cpu" or "cuda"; "unknown" for a value outside the enum (named in errors).
const char* DeviceName(Device device);
/// "cpu" | "cuda"; InvalidArgument naming the text otherwise.
Result<Device> ParseDevice(const std::string& name);

/// Where the K/V handed to Append live. kDevice: the hot tier's own memory space (device
/// pointers on Device::kCuda; on kCpu that is host memory, so kDevice == kHost there).
enum class MemorySpace { kHost, kDevice };
/// "host" or "device"; "unknown" for a value outside the enum (named in errors).
const char* MemorySpaceName(MemorySpace space);

struct Geometry {
  int layers = 32;            ///< transformer layers (default 32)
  int q_heads = 32;           ///< query heads (default 32)
  int kv_heads = 8;           ///< key/value heads; q_heads % kv_heads == 0 (GQA)
  int head_dim = 128;         ///< channels per head (default 128)
  DType dtype = DType::kF16;  ///< storage dtype of K and V (default fp16)

  /// Query heads sharing one kv head.
  int group_size() const { return q_heads / kv_heads; }
  /// Elements of K (or V) for one token of one layer: kv_heads * head_dim.
  size_t token_elems() const { return static_cast<size_t>(kv_heads) * head_dim; }
  /// Bytes of K plus V for one token of one layer.
  size_t token_kv_bytes() const { return 2 * token_elems() * DTypeSize(dtype); }

  Status Validate() const;
  /// "L,Hq,Hkv,D:dtype", e.g. "32,32,8,128:f16".
  std::string ToString() const;
  /// Parses "L,Hq,Hkv,D" (dtype unchanged) into *this; validates.
  Status ParseShape(const std::string& text);
};

bool operator==(const Geometry& a, const Geometry& b);

}  // namespace kvtier
