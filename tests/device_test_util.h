// Helpers shared by the device tests (those built into the emulated-GPU run, Makefile's
// GPU_EMU_TESTS): whether a CUDA device exists, and device and pinned memory that frees itself
// with the test. They call the CUDA runtime directly, as tests may (scripts/lint.sh allocs leaves
// tests/ out); a failed allocation or copy fails the test that made it. Empty in a build without
// CUDA (KVTIER_HAVE_CUDA unset).
#pragma once

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kernels/cuda/kernels.h"

namespace kvtier::device_test {

/// Whether the CUDA runtime sees a device (a real one, or HIP-CPU's in the emulated build).
inline bool HaveDevice() { return kernels::cuda::DeviceCount() > 0; }

/// `bytes` of device memory (uninitialised), freed with the object. A failed cudaMalloc fails
/// the test.
struct DeviceArray {
  void* ptr = nullptr;
  explicit DeviceArray(size_t bytes) { EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess); }
  ~DeviceArray() {
    if (ptr) cudaFree(ptr);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

/// A test's device arrays and mapped pinned host buffers, all freed with the arena. Every call
/// returns null (and fails the test) when its allocation fails. An array of 0 elements still
/// gets one element, so its pointer is a valid, non-null device address.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* p : device_) cudaFree(p);
    for (void* p : pinned_) cudaFreeHost(p);
  }

  /// n elements of T in device memory, all bytes zero.
  template <class T>
  T* Zeros(size_t n) {
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << bytes << " bytes failed";
      return nullptr;
    }
    device_.push_back(p);
    EXPECT_EQ(cudaMemset(p, 0, bytes), cudaSuccess);
    return static_cast<T*>(p);
  }

  /// A device copy of host[0, n) (zeros when n is 0).
  template <class T>
  T* Put(const T* host, size_t n) {
    T* p = Zeros<T>(n);
    if (p != nullptr && n > 0) {
      EXPECT_EQ(cudaMemcpy(p, host, n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
    return p;
  }

  /// A device copy of v.
  template <class T>
  T* Put(const std::vector<T>& v) {
    return Put(v.data(), v.size());
  }

  /// `bytes` of pinned host memory, mapped (cudaHostAllocMapped): a kernel reads it through UVA.
  void* Pinned(size_t bytes) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped) != cudaSuccess) {
      ADD_FAILURE() << "cudaHostAlloc of " << bytes << " bytes failed";
      return nullptr;
    }
    pinned_.push_back(p);
    return p;
  }

 private:
  std::vector<void*> device_, pinned_;
};

/// A host copy of device[0, n) (cudaMemcpy: the host waits for the copy); a failed copy fails
/// the test.
template <class T>
std::vector<T> Get(const T* device, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

}  // namespace kvtier::device_test

#endif  // KVTIER_HAVE_CUDA
