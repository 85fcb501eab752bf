// The device memory counter (offload/device_memory.h): counts by owner, the process total and
// its peak, the pinned host count, and the wrappers of offload/device_memory_cuda.h counting what
// the runtime gave and uncounting it on free, and the cuda hot tier counting its pool and regions
// (tests/retrieval/device_retrieval_test.cc checks the retrieval mirror's count). The DeviceMemory.* tests
// that need a device run on the emulated one (make test-gpu-emulated).
#include "offload/device_memory.h"

#include <gtest/gtest.h>

#include <cstdint>

#if KVTIER_HAVE_CUDA
#include "kernels/cuda/kernels.h"
#include "offload/cuda_hot_tier.h"
#include "offload/device_memory_cuda.h"
#include "tests/device_test_util.h"
#endif

namespace kvtier {
namespace {

constexpr DeviceMemoryOwner kAll[] = {
    DeviceMemoryOwner::kHotTier,         DeviceMemoryOwner::kAttention,
    DeviceMemoryOwner::kRetrievalMirror, DeviceMemoryOwner::kRetrievalWorkspace,
    DeviceMemoryOwner::kModelForward,    DeviceMemoryOwner::kEngineArrays};

TEST(DeviceMemoryCounter, CountsByOwnerWithTheTotalsPeakAndReset) {
  static_assert(sizeof(kAll) / sizeof(kAll[0]) == kDeviceMemoryOwners);
  for (DeviceMemoryOwner o : kAll) EXPECT_STRNE(DeviceMemoryOwnerName(o), "unknown");
  ResetDeviceMemoryPeaks();
  const DeviceMemoryUse at0 = ReadDeviceMemory();
  EXPECT_EQ(at0.peak_total, at0.current_total);
  CountDeviceAllocation(DeviceMemoryOwner::kAttention, 1000);
  CountDeviceAllocation(DeviceMemoryOwner::kRetrievalMirror, 500);
  CountDeviceFree(DeviceMemoryOwner::kAttention, 1000);
  CountDeviceAllocation(DeviceMemoryOwner::kRetrievalMirror, 200);
  const DeviceMemoryUse u = ReadDeviceMemory();
  EXPECT_EQ(u.current_of(DeviceMemoryOwner::kAttention), at0.current_of(DeviceMemoryOwner::kAttention));
  EXPECT_EQ(u.peak_of(DeviceMemoryOwner::kAttention), at0.current_of(DeviceMemoryOwner::kAttention) + 1000);
  EXPECT_EQ(u.current_of(DeviceMemoryOwner::kRetrievalMirror),
            at0.current_of(DeviceMemoryOwner::kRetrievalMirror) + 700);
  EXPECT_EQ(u.current_total, at0.current_total + 700);
  // The most held at once (1500), not the sum of the owners' peaks (1700).
  EXPECT_EQ(u.peak_total, at0.current_total + 1500);
  EXPECT_EQ(DeviceMemoryPeakBytes(), u.peak_total);
  // A free past what the owner holds takes it to 0, and the total by what it held.
  CountDeviceFree(DeviceMemoryOwner::kRetrievalMirror,
                  u.current_of(DeviceMemoryOwner::kRetrievalMirror) + 99);
  const DeviceMemoryUse v = ReadDeviceMemory();
  EXPECT_EQ(v.current_of(DeviceMemoryOwner::kRetrievalMirror), 0u);
  EXPECT_EQ(v.current_total, u.current_total - u.current_of(DeviceMemoryOwner::kRetrievalMirror));
  ResetDeviceMemoryPeaks();
  EXPECT_EQ(ReadDeviceMemory().peak_total, v.current_total);
  EXPECT_EQ(ReadDeviceMemory().peak_of(DeviceMemoryOwner::kAttention),
            v.current_of(DeviceMemoryOwner::kAttention));
  CountPinnedHostAllocation(4096);
  EXPECT_EQ(ReadDeviceMemory().pinned_host_current, v.pinned_host_current + 4096);
  EXPECT_GE(ReadDeviceMemory().pinned_host_peak, v.pinned_host_current + 4096);
  CountPinnedHostFree(4096);
  EXPECT_EQ(ReadDeviceMemory().pinned_host_current, v.pinned_host_current);
  EXPECT_EQ(ReadDeviceMemory().current_total, v.current_total);  // pinned memory is not device memory
}

#if KVTIER_HAVE_CUDA

using device_test::HaveDevice;

TEST(DeviceMemory, WrappersCountWhatTheyAllocateAndFree) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  ResetDeviceMemoryPeaks();
  const DeviceMemoryUse at0 = ReadDeviceMemory();
  uint8_t* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(device_memory::Malloc(&a, 3000, DeviceMemoryOwner::kModelForward), cudaSuccess);
  ASSERT_EQ(device_memory::Malloc(&b, 5000, DeviceMemoryOwner::kHotTier), cudaSuccess);
  ASSERT_NE(a, nullptr);
  const DeviceMemoryUse u = ReadDeviceMemory();
  EXPECT_EQ(u.current_of(DeviceMemoryOwner::kModelForward),
            at0.current_of(DeviceMemoryOwner::kModelForward) + 3000);
  EXPECT_EQ(u.current_of(DeviceMemoryOwner::kHotTier), at0.current_of(DeviceMemoryOwner::kHotTier) + 5000);
  EXPECT_EQ(u.current_total, at0.current_total + 8000);
  ASSERT_EQ(device_memory::Free(b), cudaSuccess);  // the size and owner come from the record
  EXPECT_EQ(ReadDeviceMemory().current_of(DeviceMemoryOwner::kHotTier),
            at0.current_of(DeviceMemoryOwner::kHotTier));
  ASSERT_EQ(device_memory::Free(a), cudaSuccess);
  ASSERT_EQ(device_memory::Free(nullptr), cudaSuccess);  // frees nothing, counts nothing
  const DeviceMemoryUse v = ReadDeviceMemory();
  EXPECT_EQ(v.current_total, at0.current_total);
  EXPECT_EQ(v.peak_total, at0.current_total + 8000);
  void* pinned = nullptr;
  ASSERT_EQ(device_memory::HostAlloc(&pinned, 1234, cudaHostAllocDefault), cudaSuccess);
  EXPECT_EQ(ReadDeviceMemory().pinned_host_current, at0.pinned_host_current + 1234);
  EXPECT_EQ(ReadDeviceMemory().current_total, at0.current_total);
  ASSERT_EQ(device_memory::FreeHost(pinned), cudaSuccess);
  EXPECT_EQ(ReadDeviceMemory().pinned_host_current, at0.pinned_host_current);
}

TEST(DeviceMemory, CudaHotTierCountsItsPoolAndRegionsAsTheHotTiers) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  const uint64_t before = ReadDeviceMemory().current_of(DeviceMemoryOwner::kHotTier);
  {
    auto made = CudaHotTier::Create(8 * 4096, 4096);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    EXPECT_EQ(ReadDeviceMemory().current_of(DeviceMemoryOwner::kHotTier), before + 8 * 4096);
    auto region = (*made)->AllocateRegion(1000);
    ASSERT_TRUE(region.ok());
    EXPECT_EQ(ReadDeviceMemory().current_of(DeviceMemoryOwner::kHotTier), before + 8 * 4096 + 1000);
    (*made)->FreeRegion(*region, 1000);
    EXPECT_EQ(ReadDeviceMemory().current_of(DeviceMemoryOwner::kHotTier), before + 8 * 4096);
  }
  EXPECT_EQ(ReadDeviceMemory().current_of(DeviceMemoryOwner::kHotTier), before);
}

#endif  // KVTIER_HAVE_CUDA

}  // namespace
}  // namespace kvtier
