// Emulation build only: the CUDA toolkit's <cuda_fp16.h> on HIP-CPU (see hip_cpu_compat.h).
#pragma once
#include "kernels/cuda/emulation/hip_cpu_compat.h"
