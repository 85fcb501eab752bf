// Demotion policies: which resident chunk leaves a tier when the tier is full.
//
// A tier tells its policy when a chunk enters, is used, or leaves; when space
// is needed it asks for the best victim among the chunks the tier says may
// leave (not pinned, lower tier acknowledged or able to acknowledge). Policies
// are built from factory strings: "lru", or any scoring policy's string
// ("h2o", "gkv:form=max"), which demotes the chunk with the lowest score first;
// the caller feeds chunk scores (block aggregation of the scoring policy's
// token scores) through TieredStore::SetChunkScores.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/status.h"

namespace kvtier {

class DemotionPolicy {
 public:
  virtual ~DemotionPolicy() = default;
  virtual void OnInsert(uint64_t id) = 0;
  virtual void OnAccess(uint64_t id) = 0;
  virtual void OnRemove(uint64_t id) = 0;
  /// The best victim for which `can_leave(id)` is true, or false if none.
  /// Ties break deterministically (insertion order).
  virtual bool PickVictim(const std::function<bool(uint64_t)>& can_leave, uint64_t* victim) = 0;
  /// A new score for a chunk (higher = keep). Recency-based policies ignore it.
  virtual void OnScore(uint64_t id, float score) {
    (void)id;
    (void)score;
  }
  virtual size_t size() const = 0;
  /// Factory string that rebuilds this policy.
  virtual std::string ToString() const = 0;
};

/// Least recently used: the chunk touched longest ago leaves first.
///
/// The store calls it for every chunk a fetch touches, under its lock, so it keeps the order
/// in flat arrays rather than node-based containers: a doubly linked list over a node array
/// (indices, not pointers) and an open-addressing table from chunk id to node. A tier's
/// chunks then fit in a few hundred KiB that stay in cache, and each call touches a handful of
/// adjacent entries instead of scattered heap nodes. The order and every victim are the same
/// as a std::list kept most-recent-first (tests/offload/demotion_policy_test.cc compares them).
class LruPolicy final : public DemotionPolicy {
 public:
  LruPolicy();
  void OnInsert(uint64_t id) override;
  void OnAccess(uint64_t id) override;
  void OnRemove(uint64_t id) override;
  bool PickVictim(const std::function<bool(uint64_t)>& can_leave, uint64_t* victim) override;
  size_t size() const override { return size_; }
  std::string ToString() const override { return "lru"; }

 private:
  static constexpr uint32_t kNone = 0xffffffffu;
  struct Node {
    uint64_t id = 0;
    uint32_t prev = 0, next = 0;  // node 0 is the sentinel: next = most recent, prev = least
  };
  uint32_t Find(uint64_t id) const;  // node of id, or kNone
  size_t Bucket(uint64_t id) const;  // home bucket of id in table_
  void Unlink(uint32_t n);
  void LinkFront(uint32_t n);
  void Grow();                 // doubles table_, re-inserting every node
  void EraseBucket(size_t b);  // backward-shift deletion (linear probing)

  std::vector<Node> nodes_;  // [0] sentinel, then chunks; freed nodes in free_
  std::vector<uint32_t> free_;
  std::vector<uint32_t> table_;  // node index per bucket, kNone = empty; size a power of two
  int shift_ = 0;                // 64 - log2(table_.size())
  size_t size_ = 0;
};

/// Score-driven demotion: the chunk with the lowest score leaves first; chunks never
/// scored count as score 0; ties go to the chunk inserted first (deterministic).
class ScoredDemotionPolicy final : public DemotionPolicy {
 public:
  explicit ScoredDemotionPolicy(std::string spec) : spec_(std::move(spec)) {}
  void OnInsert(uint64_t id) override;
  void OnAccess(uint64_t id) override {}
  void OnRemove(uint64_t id) override;
  void OnScore(uint64_t id, float score) override;
  bool PickVictim(const std::function<bool(uint64_t)>& can_leave, uint64_t* victim) override;
  size_t size() const override { return where_.size(); }
  std::string ToString() const override { return spec_; }

 private:
  using Key = std::pair<float, uint64_t>;  // (score, insertion sequence number)
  std::string spec_;
  uint64_t next_seq_ = 0;
  std::map<Key, uint64_t> order_;            // ascending: the first victim first
  std::unordered_map<uint64_t, Key> where_;  // id -> its key in order_
};

/// Builds a policy from its factory string: "lru", or a scoring policy's string (checked
/// by MakeScoringPolicy) for score-driven demotion; anything else is InvalidArgument.
Result<std::unique_ptr<DemotionPolicy>> MakeDemotionPolicy(const std::string& spec);

}  // namespace kvtier
