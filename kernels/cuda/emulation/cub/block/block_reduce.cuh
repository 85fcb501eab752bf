// Emulation build only: a CPU STAND-IN for cub::BlockReduce (kernels/cuda/emulation), not CUB.
// Same contract as CUB's (the aggregate is valid in thread 0; a __syncthreads() must separate
// two uses of one TempStorage), but it folds in thread order, not CUB's tree order, so a sum's
// last bits may differ from the real one on a GPU.
#pragma once
#include "kernels/cuda/emulation/hip_cpu_compat.h"

namespace cub {

template <typename T, int kBlockThreads>
class BlockReduce {
 public:
  struct TempStorage {
    T partial[kBlockThreads];
  };
  explicit BlockReduce(TempStorage& storage) : storage_(storage) {}

  template <typename Op>
  T Reduce(T value, Op op) {
    const int rank = kvtier_emu::ThreadRank();
    storage_.partial[rank] = value;
    kvtier_emu::SyncThreads();
    if (rank != 0) return value;  // only thread 0's result is defined, as in CUB
    T acc = storage_.partial[0];
    for (int i = 1; i < kBlockThreads; ++i) acc = op(acc, storage_.partial[i]);
    return acc;
  }
  T Sum(T value) {
    return Reduce(value, [](T a, T b) { return a + b; });
  }

 private:
  TempStorage& storage_;
};

}  // namespace cub
