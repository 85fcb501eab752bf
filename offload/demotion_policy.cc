#include "offload/demotion_policy.h"

#include <cmath>

#include "offload/policy/scoring_policy.h"

namespace kvtier {

LruPolicy::LruPolicy() : nodes_(1), table_(16, kNone), shift_(64 - 4) { nodes_[0].prev = nodes_[0].next = 0; }

size_t LruPolicy::Bucket(uint64_t id) const {
  return static_cast<size_t>((id * 0x9E3779B97F4A7C15ull) >> shift_);  // Fibonacci hashing
}

uint32_t LruPolicy::Find(uint64_t id) const {
  const size_t mask = table_.size() - 1;
  for (size_t b = Bucket(id);; b = (b + 1) & mask) {
    const uint32_t n = table_[b];
    if (n == kNone) return kNone;
    if (nodes_[n].id == id) return n;
  }
}

void LruPolicy::Unlink(uint32_t n) {
  Node& x = nodes_[n];
  nodes_[x.prev].next = x.next;
  nodes_[x.next].prev = x.prev;
}

void LruPolicy::LinkFront(uint32_t n) {
  Node& x = nodes_[n];
  x.prev = 0;
  x.next = nodes_[0].next;
  nodes_[x.next].prev = n;
  nodes_[0].next = n;
}

void LruPolicy::Grow() {
  std::vector<uint32_t> old(table_.size() * 2, kNone);
  old.swap(table_);
  --shift_;
  const size_t mask = table_.size() - 1;
  for (uint32_t n : old) {
    if (n == kNone) continue;
    size_t b = Bucket(nodes_[n].id);
    while (table_[b] != kNone) b = (b + 1) & mask;
    table_[b] = n;
  }
}

void LruPolicy::EraseBucket(size_t b) {
  // Backward-shift deletion: later entries of the probe run move into the hole when their
  // home bucket does not lie (cyclically) between the hole and their place.
  const size_t mask = table_.size() - 1;
  size_t hole = b;
  for (size_t j = (b + 1) & mask;; j = (j + 1) & mask) {
    const uint32_t n = table_[j];
    if (n == kNone) break;
    const size_t home = Bucket(nodes_[n].id);
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    table_[hole] = n;
    hole = j;
  }
  table_[hole] = kNone;
}

void LruPolicy::OnInsert(uint64_t id) {
  if (const uint32_t n = Find(id); n != kNone) {
    Unlink(n);
    LinkFront(n);
    return;
  }
  if (2 * (size_ + 1) > table_.size()) Grow();  // load factor <= 1/2
  uint32_t n;
  if (!free_.empty()) {
    n = free_.back();
    free_.pop_back();
  } else {
    n = static_cast<uint32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  nodes_[n].id = id;
  LinkFront(n);
  const size_t mask = table_.size() - 1;
  size_t b = Bucket(id);
  while (table_[b] != kNone) b = (b + 1) & mask;
  table_[b] = n;
  ++size_;
}

void LruPolicy::OnAccess(uint64_t id) {
  const uint32_t n = Find(id);
  if (n == kNone || nodes_[0].next == n) return;
  Unlink(n);
  LinkFront(n);
}

void LruPolicy::OnRemove(uint64_t id) {
  const size_t mask = table_.size() - 1;
  size_t b = Bucket(id);
  for (;; b = (b + 1) & mask) {
    const uint32_t n = table_[b];
    if (n == kNone) return;
    if (nodes_[n].id == id) break;
  }
  const uint32_t n = table_[b];
  EraseBucket(b);
  Unlink(n);
  free_.push_back(n);
  --size_;
}

bool LruPolicy::PickVictim(const std::function<bool(uint64_t)>& can_leave, uint64_t* victim) {
  for (uint32_t n = nodes_[0].prev; n != 0; n = nodes_[n].prev) {
    if (can_leave(nodes_[n].id)) {
      *victim = nodes_[n].id;
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
