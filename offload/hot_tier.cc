#include "offload/hot_tier.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#if KVTIER_HAVE_CUDA
#include "kernels/cuda/kernels.h"
#include "offload/cuda_hot_tier.h"
#endif

namespace kvtier {

Result<std::unique_ptr<HostHotTier>> HostHotTier::Create(size_t slot_pool_bytes, size_t slot_bytes) {
  auto tier = std::unique_ptr<HostHotTier>(new HostHotTier());
  KVTIER_ASSIGN_OR_RETURN(tier->pool_, SlotPool::Create("hot_bytes", slot_pool_bytes, slot_bytes, false));
  return tier;
}

const char* MemorySpaceName(MemorySpace space) {
  switch (space) {
    case MemorySpace::kHost: return "host";
    case MemorySpace::kDevice: return "device";
  }
  return "unknown";
}

Status HotTier::UploadBatch(const UploadOp* ops, size_t n) {
  for (size_t i = 0; i < n; ++i) KVTIER_RETURN_IF_ERROR(Upload(ops[i].dst, ops[i].src, ops[i].bytes));
  return Status::Ok();
}

Status HotTier::CopyWithin(uint8_t*, const void*, size_t) {
  return Unavailable(std::string("hot tier (") + device() +
                     "): this tier does not copy within its own memory space; hand Append host K/V "
                     "(MemorySpace::kHost)");
}

Result<TransferTicket> HotTier::DownloadBatchAsync(const DownloadOp* ops, size_t n) {
  for (size_t i = 0; i < n; ++i) KVTIER_RETURN_IF_ERROR(Download(ops[i].dst, ops[i].src, ops[i].bytes));
  return kCompletedTransfer;
}

Status HotTier::WaitTransfer(TransferTicket ticket) {
  if (ticket != kCompletedTransfer)
    return InvalidArgument("hot tier: unknown transfer ticket " + std::to_string(ticket) + " (never issued or already waited)");
  return Status::Ok();
}

Result<bool> HotTier::TransferDone(TransferTicket ticket) {
  // Not through WaitTransfer: a polled ticket must stay waitable in a tier that overrides it.
  if (ticket != kCompletedTransfer)
    return InvalidArgument("hot tier: unknown transfer ticket " + std::to_string(ticket) + " (never issued or already waited)");
  return true;
}

Result<uint8_t*> HostHotTier::AllocateRegion(size_t bytes) {
  if (bytes == 0) return InvalidArgument("hot region size must be > 0");
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return ResourceExhausted("hot tier: could not allocate " + std::to_string(bytes) + " bytes");
  return static_cast<uint8_t*>(p);
}

void HostHotTier::FreeRegion(uint8_t* region, size_t) { std::free(region); }

Status HostHotTier::Upload(uint8_t* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostHotTier::Download(void* dst, const uint8_t* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostHotTier::CopyWithin(uint8_t* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

}  // namespace kvtier

// ---- the registry --------------------------------------------------------------------

namespace kvtier {
namespace {

constexpr const char* kHostName = "host";
constexpr const char* kCudaName = "cuda";

struct Registry {
  std::mutex mu;
  std::map<std::string, HotTierFactory> factories;  // registered ones; "host" is built in
};
Registry& GetRegistry() {
  static Registry* r = new Registry();  // never destroyed: stores may be closed during static destruction
  return *r;
}

std::string KnownNames() {
  std::string s;
  for (const std::string& n : HotTierNames()) s += (s.empty() ? "" : "|") + n;
  return s;
}

// The factory for a parsed spec, or the status explaining why there is none.
Result<HotTierFactory> FindFactory(const FactorySpec& spec) {
  if (spec.name == kHostName) {
    if (!spec.params.empty())
      return InvalidArgument("hot tier \"host\" takes no parameters (got \"" + spec.params[0].first + "\")");
    return HotTierFactory([](const FactorySpec&, size_t pool_bytes, size_t slot_bytes)
                              -> Result<std::unique_ptr<HotTier>> {
      KVTIER_ASSIGN_OR_RETURN(auto tier, HostHotTier::Create(pool_bytes, slot_bytes));
      return std::unique_ptr<HotTier>(std::move(tier));
    });
  }
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> l(r.mu);
    auto it = r.factories.find(spec.name);
    if (it != r.factories.end()) return it->second;
  }
  if (spec.name == kCudaName) {
#if KVTIER_HAVE_CUDA
    if (!spec.params.empty())
      return InvalidArgument("hot tier \"cuda\" takes no parameters (got \"" + spec.params[0].first + "\")");
    // Asked here, not only in the factory, so that StoreOptions::Validate names the missing
    // device before anything is opened.
    if (kernels::cuda::DeviceCount() == 0)
      return Unavailable(std::string("hot tier \"cuda\": no CUDA device: ") + kernels::cuda::LastCudaErrorString());
    return HotTierFactory([](const FactorySpec&, size_t pool_bytes, size_t slot_bytes)
                              -> Result<std::unique_ptr<HotTier>> {
      KVTIER_ASSIGN_OR_RETURN(auto tier, CudaHotTier::Create(pool_bytes, slot_bytes));
      return std::unique_ptr<HotTier>(std::move(tier));
    });
#else
    return Unavailable("hot tier \"cuda\": this build has no CUDA (configure with KVTIER_CUDA=on where nvcc "
                       "exists); use \"host\"");
#endif
  }
  return InvalidArgument("unknown hot tier \"" + spec.name + "\" (known: " + KnownNames() + ")");
}

}  // namespace

Status RegisterHotTier(const std::string& name, HotTierFactory factory) {
  if (name.empty()) return InvalidArgument("RegisterHotTier: name must not be empty");
  if (!factory) return InvalidArgument("RegisterHotTier: factory for \"" + name + "\" is empty");
  if (name == kHostName) return AlreadyExists("hot tier \"host\" is built in");
#if KVTIER_HAVE_CUDA
  if (name == kCudaName) return AlreadyExists("hot tier \"cuda\" is built in (this build has CUDA)");
#endif
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> l(r.mu);
  if (!r.factories.emplace(name, std::move(factory)).second)
    return AlreadyExists("hot tier \"" + name + "\" is already registered");
  return Status::Ok();
}

std::vector<std::string> HotTierNames() {
  std::vector<std::string> names{kHostName};
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> l(r.mu);
  for (const auto& [name, f] : r.factories) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

Status CheckHotTierSpec(const std::string& spec) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec parsed, ParseFactorySpec(spec, "hot tier"));
  return FindFactory(parsed).status();
}

Result<std::unique_ptr<HotTier>> MakeHotTier(const std::string& spec, size_t slot_pool_bytes, size_t slot_bytes) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec parsed, ParseFactorySpec(spec, "hot tier"));
  KVTIER_ASSIGN_OR_RETURN(HotTierFactory factory, FindFactory(parsed));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<HotTier> tier, factory(parsed, slot_pool_bytes, slot_bytes));
  if (tier == nullptr) return Internal("hot tier \"" + parsed.name + "\": its factory returned no tier");
  return tier;
}

}  // namespace kvtier
