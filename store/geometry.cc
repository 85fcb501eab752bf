#include "store/geometry.h"

#include <cstdio>
#include <sstream>

#include "kernels/cpu/attention.h"

namespace kvtier {

Status Geometry::Validate() const {
  if (layers <= 0) return InvalidArgument("geometry.layers must be > 0 (got " + std::to_string(layers) + ")");
  if (q_heads <= 0)
    return InvalidArgument("geometry.q_heads must be > 0 (got " + std::to_string(q_heads) + ")");
  if (kv_heads <= 0)
    return InvalidArgument("geometry.kv_heads must be > 0 (got " + std::to_string(kv_heads) + ")");
  if (!kernels::HeadDimSupported(head_dim))
    return InvalidArgument("geometry.head_dim must be in [1, " + std::to_string(kernels::kMaxHeadDim) +
                           "], what the attention kernel supports (got " + std::to_string(head_dim) + ")");
  if (q_heads % kv_heads != 0)
    return InvalidArgument("geometry.q_heads (" + std::to_string(q_heads) +
                           ") must be a multiple of geometry.kv_heads (" + std::to_string(kv_heads) + ")");
  if (layers > 4096 || q_heads > 4096) return InvalidArgument("geometry is implausibly large: " + ToString());
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16)
    return InvalidArgument("geometry.dtype is not one of f32, f16, bf16");
  return Status::Ok();
}

std::string Geometry::ToString() const {
  std::ostringstream os;
  os << layers << "," << q_heads << "," << kv_heads << "," << head_dim << ":" << DTypeName(dtype);
  return os.str();
}

Status Geometry::ParseShape(const std::string& text) {
  Geometry g = *this;
  char tail = 0;
  if (std::sscanf(text.c_str(), "%d,%d,%d,%d%c", &g.layers, &g.q_heads, &g.kv_heads, &g.head_dim, &tail) != 4)
    return InvalidArgument("geometry must be 'L,Hq,Hkv,D' with four integers (got '" + text + "')");
  KVTIER_RETURN_IF_ERROR(g.Validate());
  *this = g;
  return Status::Ok();
}

bool operator==(const Geometry& a, const Geometry& b) {
  return a.layers == b.layers && a.q_heads == b.q_heads && a.kv_heads == b.kv_heads &&
         a.head_dim == b.head_dim && a.dtype == b.dtype;
}

}  // namespace kvtier
