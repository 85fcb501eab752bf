#include "kernels/cpu/entropy_grant.h"

namespace kvtier::kernels {

KernelError EntropyGrantCheck(const EntropyGrantParams& p) {
  if (p.cap < 0 || p.fixed_k < 0 || p.layer < 0) return KernelError::kBadShape;
  if (p.n == nullptr || p.take == nullptr) return KernelError::kNullPointer;
  if (p.fixed_k == 0 && (p.state == nullptr || p.theta == nullptr)) return KernelError::kNullPointer;
  return KernelError::kOk;
}

KernelError EntropyGrantStep(const EntropyGrantParams& p) {
  if (const KernelError e = EntropyGrantCheck(p); e != KernelError::kOk) return e;
  EntropyGrantRun(p);
  return KernelError::kOk;
}

}  // namespace kvtier::kernels
