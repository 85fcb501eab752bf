// The device seal's representatives: each (chunk, out head) of MassRepresentativesParams runs the
// CPU twin's own scalar flow (kernels/cpu/representatives.h, MassRepresentativesOne) in one
// thread, so the chosen tokens, the copied keys and their inverse norms are the host's bit for bit.
// A seal chooses a few chunks' representatives per step; one thread per pair is plenty.
#include <cuda_runtime.h>

#include "kernels/cpu/representatives.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvtier::kernels::cuda {
namespace {

constexpr int kPairsPerBlock = 32;

__global__ void MassRepresentativesKernel(const MassRepresentativesParams p) {
  const int pair = static_cast<int>(blockIdx.x) * kPairsPerBlock + static_cast<int>(threadIdx.x);
  if (pair >= p.chunks * p.shape.out_heads) return;
  MassRepresentativesOne(p, pair / p.shape.out_heads, pair % p.shape.out_heads);
}

}  // namespace

KernelError LaunchChooseMassRepresentatives(const MassRepresentativesParams& p, Stream stream) {
  if (const KernelError e = MassRepresentativesCheck(p); e != KernelError::kOk) return e;
  const int pairs = p.chunks * p.shape.out_heads;
  if (pairs == 0) return KernelError::kOk;
  LaunchKernel(&MassRepresentativesKernel, (pairs + kPairsPerBlock - 1) / kPairsPerBlock, kPairsPerBlock, 0,
               static_cast<cudaStream_t>(stream), p);
  return CheckLaunch();
}

}  // namespace kvtier::kernels::cuda
