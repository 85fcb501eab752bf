// StoreOptions::Validate, run by Store::Open before it builds anything: every option's
// range from its row (offload/store_option_table.h), then the checks that relate options to
// each other or to the machine (a data_dir that is a file, a device that is absent).

#include <filesystem>
#include <string>
#include <system_error>

#include "kvtier/options.h"
#include "offload/demotion_policy.h"
#include "offload/hot_tier.h"
#include "offload/remote_tier.h"
#include "offload/store_option_table.h"
#include "store/status.h"

namespace kvtier {

Status StoreOptions::Validate() const {
  // Each option's own range first (its row), then the geometry's and the options' relations.
  for (const StoreOptionDesc& d : StoreOptionTable())
    KVTIER_RETURN_IF_ERROR(CheckOptionValue(d, d.get(*this)));
  KVTIER_RETURN_IF_ERROR(geometry.Validate());
  if (n_local % chunk_size != 0)
    return InvalidArgument("n_local (" + std::to_string(n_local) + ") must be a multiple of chunk_size (" +
                           std::to_string(chunk_size) + ")");
  if (repr_topk > chunk_size)
    return InvalidArgument("repr_topk (" + std::to_string(repr_topk) + ") must be <= chunk_size (" +
                           std::to_string(chunk_size) + ")");
  if (hot_bytes < chunk_bytes())
    return InvalidArgument("hot_bytes (" + std::to_string(hot_bytes) + ") is smaller than one chunk (" +
                           std::to_string(chunk_bytes()) + " bytes)");
  if (index_bytes != 0 && index_bytes < (uint64_t{1} << 20))
    return InvalidArgument("index_bytes must be 0 (unbounded) or at least 1 MiB (got " +
                           std::to_string(index_bytes) + ")");
  if (warm_bytes < chunk_bytes())
    return InvalidArgument("warm_bytes (" + std::to_string(warm_bytes) + ") is smaller than one chunk (" +
                           std::to_string(chunk_bytes()) + " bytes)");
  if (!data_dir.empty()) {
    // Never the throwing overloads: an OS error other than "does not exist" (EACCES on a
    // parent, ENAMETOOLONG, ELOOP, ...) is IOError naming the path and the error.
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::status(data_dir, ec);
    if (ec && ec != std::errc::no_such_file_or_directory)
      return IOError("data_dir '" + data_dir + "': " + ec.message());
    if (std::filesystem::exists(st) && !std::filesystem::is_directory(st))
      return InvalidArgument("data_dir '" + data_dir + "' is a file, not a directory");
  }
  {
    auto p = MakeDemotionPolicy(hot_policy);
    if (!p.ok()) return InvalidArgument("hot_policy: " + p.status().message());
    auto w = MakeDemotionPolicy(warm_policy);
    if (!w.ok()) return InvalidArgument("warm_policy: " + w.status().message());
  }
  {
    // Keeps CheckDevice's code: Unavailable for cuda without a CUDA build or a device.
    Status h = CheckDevice(device);
    if (!h.ok()) return Status(h.code(), "device: " + h.message());
  }
  if (!remote.empty()) {
    auto r = ParseRemoteSpec(remote);
    if (!r.ok()) return InvalidArgument("remote: " + r.status().message());
  }
  if (!remote_namespace.empty()) {
    RemoteTierOptions ro;
    ro.endpoints.push_back(RedisEndpoint{"localhost", 6379});
    ro.ns = remote_namespace;
    Status st = ro.Validate();
    if (!st.ok()) return InvalidArgument("remote_namespace: " + st.message());
  }
  return Status::Ok();
}

}  // namespace kvtier
