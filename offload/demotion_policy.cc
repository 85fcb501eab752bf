#include "offload/demotion_policy.h"

namespace kvtier {

void LruPolicy::OnInsert(uint64_t id) {
  auto it = where_.find(id);
  if (it != where_.end()) { order_.splice(order_.begin(), order_, it->second); return; }
  order_.push_front(id);
  where_[id] = order_.begin();
}

void LruPolicy::OnAccess(uint64_t id) {
  auto it = where_.find(id);
  if (it != where_.end()) order_.splice(order_.begin(), order_, it->second);
}

void LruPolicy::OnRemove(uint64_t id) {
  auto it = where_.find(id);
  if (it == where_.end()) return;
  order_.erase(it->second);
  where_.erase(it);
}

bool LruPolicy::PickVictim(const std::function<bool(uint64_t)>& can_leave, uint64_t* victim) {
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
    if (can_leave(*it)) { *victim = *it; return true; }
  }
  return false;
}

Result<std::unique_ptr<DemotionPolicy>> MakeDemotionPolicy(const std::string& spec) {
  if (spec == "lru") return std::unique_ptr<DemotionPolicy>(new LruPolicy());
  return InvalidArgument("unknown demotion policy '" + spec + "' (known: lru)");
}

}  // namespace kvtier
