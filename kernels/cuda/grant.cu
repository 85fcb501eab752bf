// ActQKV Eq. 12 / Algorithm 1 on the device: one layer's grant from the Theta SegmentEntropy
// wrote, with the allocator's running state in device memory. See kernels/cuda/kernels.h; the CPU
// twin (kernels/cpu/entropy_grant.h) defines what it computes, and the kernel runs the twin's
// own inline flow (EntropyGrantRun), so grants and state agree bit for bit.
#include <cuda_runtime.h>

#include "kernels/cpu/entropy_grant.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvtier::kernels::cuda {
namespace {

// A scalar flow: one thread.
__global__ void EntropyGrantKernel(const EntropyGrantParams p) { EntropyGrantRun(p); }

__global__ void EntropyGrantBeginStepKernel(EntropyGrantState* state, int k) {
  EntropyGrantBeginStep(state, k);
}

}  // namespace

KernelError LaunchEntropyGrant(const EntropyGrantParams& p, Stream stream) {
  if (const KernelError e = EntropyGrantCheck(p); e != KernelError::kOk) return e;
  LaunchKernel(&EntropyGrantKernel, 1, 1, 0, static_cast<cudaStream_t>(stream), p);
  return CheckLaunch();
}

KernelError LaunchEntropyGrantBeginStep(EntropyGrantState* state, int k, Stream stream) {
  if (k < 1) return KernelError::kBadShape;
  if (state == nullptr) return KernelError::kNullPointer;
  LaunchKernel(&EntropyGrantBeginStepKernel, 1, 1, 0, static_cast<cudaStream_t>(stream), state, k);
  return CheckLaunch();
}

}  // namespace kvtier::kernels::cuda
