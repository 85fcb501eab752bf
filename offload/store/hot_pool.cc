// HotPool: the hot slot pool's bookkeeping (see offload/store/hot_pool.h).

#include "offload/store/hot_pool.h"

#include <algorithm>
#include <string>

namespace kvtier {

using store_internal::Chunk;

int32_t HotPool::AcquireSlotLocked(Clock::time_point now, StoreCounters* counters) {
  int32_t slot = tier_->AcquireSlot();
  if (slot >= 0) return slot;
  uint64_t victim = 0;
  auto can_leave = [&](uint64_t id) {
    const Chunk* c = chunks_->at(id);
    return !c->hot_loading && !Pinned(c, now);
  };
  if (!policy_->PickVictim(can_leave, &victim)) return -1;
  Chunk* c = chunks_->at(victim);
  if (c->hot_pins > 0) {  // an expired lease: the pin no longer protects it
    counters->lease_expired += c->hot_pins;
    c->hot_pins = 0;
  }
  // The hot slot is a cache: warm or a lower tier still holds the chunk.
  slot = c->hot_slot;
  c->hot_slot = -1;
  c->tiers &= ~kTierHot;
  policy_->OnRemove(victim);
  counters->demotions++;
  return slot;
}

void HotPool::ForgetLocked(Chunk* c) {
  if (c->hot_slot < 0) return;
  tier_->ReleaseSlot(c->hot_slot);
  policy_->OnRemove(c->id);
  c->hot_slot = -1;
  c->tiers &= ~kTierHot;
}

void HotPool::EvictUnpinnedLocked(Clock::time_point now) {
  uint64_t victim = 0;
  while (policy_->PickVictim(
      [&](uint64_t id) {
        const Chunk* c = chunks_->at(id);
        return !c->hot_loading && !Pinned(c, now);
      },
      &victim)) {
    Chunk* c = chunks_->at(victim);
    tier_->ReleaseSlot(c->hot_slot);
    c->hot_slot = -1;
    c->tiers &= ~kTierHot;
    c->hot_pins = 0;
    policy_->OnRemove(victim);
  }
}

HotPool::Room HotPool::RoomLocked(SequenceId seq, int64_t need, const std::vector<uint64_t>& requested,
                                  Clock::time_point now, bool full) const {
  Room room;
  room.available = tier_->slot_capacity() - tier_->slots_used();
  if (room.available >= need && !full) return room;
  // Every hot chunk is in the policy: walk it (stopping once enough are evictable). A chunk
  // the fetch asks for is not room: it is a hit, and evicting it would only move it.
  uint64_t unused = 0;
  policy_->PickVictim(
      [&](uint64_t id) {
        const Chunk* c = chunks_->at(id);
        if (c->hot_loading || Pinned(c, now)) {
          (c->key.seq == seq ? room.held_self : room.held_other)++;
        } else if (!std::binary_search(requested.begin(), requested.end(), id)) {
          room.available++;
        }
        return !full && room.available >= need;  // true stops the walk
      },
      &unused);
  return room;
}

int64_t HotPool::ReservedForLocked(SequenceId seq) const {
  int64_t r = 0;
  for (const auto& [id, res] : reservations_)
    if (res.seq == seq) r = std::max<int64_t>(r, res.slots);
  return r;
}

int64_t HotPool::ReservedTotalLocked() const {
  std::unordered_map<SequenceId, int64_t> by_seq;
  for (const auto& [id, res] : reservations_) {
    int64_t& r = by_seq[res.seq];
    r = std::max<int64_t>(r, res.slots);
  }
  int64_t total = 0;
  for (const auto& [seq, r] : by_seq) total += r;
  return total;
}

size_t HotPool::FitWithinClaimsLocked(SequenceId seq, size_t n, Clock::time_point now) const {
  const int64_t reserved = ReservedForLocked(seq);
  if (static_cast<int64_t>(n) <= reserved) return n;
  // Each sequence's claim: the larger of its reservation and the slots it holds. Every pin
  // and load but ReadTokens' (held only while it copies) belongs to a live holder, so this
  // reads the pinned chunks alone, not the whole pool.
  std::unordered_map<SequenceId, int64_t> held;
  std::unordered_set<uint64_t> seen;
  for (const Holder* f : holders_)
    for (uint64_t id : f->chunk_ids) {
      if (!seen.insert(id).second) continue;
      auto it = chunks_->find(id);
      if (it == chunks_->end()) continue;  // dropped meanwhile
      const Chunk* c = it->second;
      if (c->hot_slot >= 0 && (c->hot_loading || Pinned(c, now))) held[c->key.seq]++;
    }
  std::unordered_map<SequenceId, int64_t> claim = held;
  for (const auto& [id, res] : reservations_) {
    int64_t& r = claim[res.seq];
    r = std::max<int64_t>(r, res.slots);
  }
  int64_t others = 0;
  for (const auto& [s, c] : claim)
    if (s != seq) others += c;
  const int64_t left = tier_->slot_capacity() - others - held[seq];
  return static_cast<size_t>(std::clamp<int64_t>(std::max(reserved, left), 0, static_cast<int64_t>(n)));
}

int64_t HotPool::HeldByThreadLocked(std::thread::id thread, Clock::time_point now) const {
  std::unordered_set<uint64_t> ids;
  for (const Holder* f : holders_)
    if (f->thread == thread) ids.insert(f->chunk_ids.begin(), f->chunk_ids.end());
  int64_t held = 0;
  for (uint64_t id : ids) {
    auto it = chunks_->find(id);
    if (it == chunks_->end()) continue;  // dropped meanwhile
    const Chunk* c = it->second;
    if (c->hot_slot >= 0 && (c->hot_loading || Pinned(c, now))) held++;
  }
  return held;
}

Result<uint64_t> HotPool::ReserveLocked(SequenceId seq, int32_t slots, uint64_t* reserved_after) {
  const int64_t pool = tier_->slot_capacity();
  const int64_t reserved = ReservedTotalLocked();
  const int64_t mine = ReservedForLocked(seq);
  // Sessions of one sequence count once, at their largest reservation.
  const int64_t after = reserved - mine + std::max<int64_t>(mine, slots);
  if (after > pool)
    return ResourceExhausted(
        "hot tier: " + std::to_string(pool) + " slots, " + std::to_string(reserved) +
        " reserved by the open sessions (" + std::to_string(reservations_.size()) + "), this one asks " +
        std::to_string(slots) +
        " (its budget in chunks): the pool cannot hold the budgets of the sessions open at once; "
        "close or drop a session, lower budget_tokens or raise hot_bytes");
  const uint64_t id = next_reservation_++;
  reservations_.emplace(id, Reservation{seq, slots});
  *reserved_after = static_cast<uint64_t>(after);
  return id;
}

bool HotPool::ReleaseLocked(uint64_t reservation, uint64_t* reserved_after) {
  if (reservations_.erase(reservation) == 0) return false;
  *reserved_after = static_cast<uint64_t>(ReservedTotalLocked());
  return true;
}

uint64_t HotPool::StartWaitLocked() {
  const uint64_t ticket = next_ticket_++;
  waiters_.insert(ticket);
  return ticket;
}

}  // namespace kvtier
