// The decode steps of `kvtier run` on a "cuda" hot tier, driven the way an inference engine
// drives kvtier: each layer's K, V and query written into device arrays on the engine's own CUDA
// stream and handed over at once (Session::AppendDevice / AttendDevice, no host wait between
// the engine's copy and kvtier's call), every layer's output left on the device and read back
// once per step, as an engine reads its logits. The host waits kvtier makes are then the ones its
// device contract leaves (SessionCounters::host_syncs, `kvtier run --json`
// device.host_syncs_per_token); the driver's own read-back is the engine's wait, not kvtier's.
//
// Builds without CUDA: Create answers Unavailable.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvtier/session.h"
#include "store/status.h"

namespace kvtier {

class DeviceDriver {
 public:
  /// Device arrays for one token's K and V and one query per layer at `g` (counted as
  /// DeviceMemoryOwner::kEngineArrays), pinned staging for them, and the engine's stream.
  static Result<std::unique_ptr<DeviceDriver>> Create(const Geometry& g);
  ~DeviceDriver();
  DeviceDriver(const DeviceDriver&) = delete;
  DeviceDriver& operator=(const DeviceDriver&) = delete;

  /// One token's K and V of `layer` (the store's dtype, [kv_heads, head_dim] each) copied up on
  /// the engine's stream, then Session::AppendDevice.
  Status Append(Session* session, int layer, const void* k, const void* v, DType dtype);
  /// One decode query of `layer` ([q_heads, head_dim] fp32) copied up on the engine's stream,
  /// then Session::AttendDevice into the layer's device output.
  Status Attend(Session* session, int layer, const float* q, const int64_t* position, AttendStats* stats);
  /// Every layer's output since the last call, read back on the engine's stream with one wait
  /// (the engine's, outside every kvtier call). out[l] gets [q_heads, head_dim] floats.
  Status ReadOutputs(std::vector<std::vector<float>>* out);

 private:
  struct Buffers;
  explicit DeviceDriver(const Geometry& g);
  Geometry g_;
  std::unique_ptr<Buffers> b_;
};

}  // namespace kvtier
