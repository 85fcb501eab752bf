// KVTIER_HOST_DEVICE: marks an inline function that compiles for the host and the device, so
// that a CPU twin and its kernel run the same source (kernels/cpu/chunk_table.h,
// kernels/cpu/entropy_grant.h, kernels/cuda/store_convert.h). Under nvcc (__CUDACC__) it is
// __host__ __device__; in any other translation unit it is empty. A definition made before this
// header (e.g. on the command line) is kept. Plain C++ with no CUDA include and no include of
// ours: any translation unit, nvcc's included, can include it.
#pragma once

#ifndef KVTIER_HOST_DEVICE
#if defined(__CUDACC__)
#define KVTIER_HOST_DEVICE __host__ __device__
#else
#define KVTIER_HOST_DEVICE
#endif
#endif
