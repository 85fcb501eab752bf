#include "offload/demotion_policy.h"

#include <cmath>

#include "offload/policy/scoring_policy.h"

namespace kvtier {

void LruPolicy::OnInsert(uint64_t id) {
  auto it = where_.find(id);
  if (it != where_.end()) {
    order_.splice(order_.begin(), order_, it->second);
    return;
  }
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
    if (can_leave(*it)) {
      *victim = *it;
      return true;
    }
  }
  return false;
}

void ScoredDemotionPolicy::OnInsert(uint64_t id) {
  if (where_.count(id)) return;
  const Key k{0.0f, next_seq_++};
  order_.emplace(k, id);
  where_.emplace(id, k);
}

void ScoredDemotionPolicy::OnRemove(uint64_t id) {
  auto it = where_.find(id);
  if (it == where_.end()) return;
  order_.erase(it->second);
  where_.erase(it);
}

void ScoredDemotionPolicy::OnScore(uint64_t id, float score) {
  auto it = where_.find(id);
  if (it == where_.end()) return;
  order_.erase(it->second);
  it->second.first = std::isfinite(score) ? score : 0.0f;
  order_.emplace(it->second, id);
}

bool ScoredDemotionPolicy::PickVictim(const std::function<bool(uint64_t)>& can_leave, uint64_t* victim) {
  for (const auto& [key, id] : order_)
    if (can_leave(id)) {
      *victim = id;
      return true;
    }
  return false;
}

Result<std::unique_ptr<DemotionPolicy>> MakeDemotionPolicy(const std::string& spec) {
  if (spec == "lru") return std::unique_ptr<DemotionPolicy>(new LruPolicy());
  auto scoring = MakeScoringPolicy(spec);
  if (!scoring.ok())
    return InvalidArgument("demotion policy '" + spec + "': not 'lru' and not a scoring policy (" +
                           scoring.status().message() + ")");
  return std::unique_ptr<DemotionPolicy>(new ScoredDemotionPolicy((*scoring)->ToString()));
}

}  // namespace kvtier
