// Pager's copy-on-write (allocator/pager.h): page-outs in an epoch into fresh ranges,
// holds of ranges at rest for snapshots, restores, and epochs' begin, commit and abort.
#include <algorithm>

#include "allocator/pager.h"
#include "allocator/pager_internal.h"
#include "backing/errors.h"

namespace statepager {

// In an epoch a page-out never overwrites committed bytes: an extent whose range holds
// them is written to a fresh range of its store (copy-on-write). The fresh ranges are
// taken in address order, so that neighbours in memory tend to be neighbours in the store
// too, and their page-ins join into one copy (page_in_bytes).
void Pager::redirect_writes_locked(const std::vector<ExtentId>& ids) {
  std::vector<Extent*> moving;
  for (ExtentId id : ids) {
    Extent& e = extents_.at(id);
    if (e.committed && e.committed->state == Residency::kFile &&
        e.ranges.store == e.committed->ranges.store) {
      moving.push_back(&e);
    }
  }
  std::sort(moving.begin(), moving.end(),
            [](const Extent* a, const Extent* b) { return a->addr < b->addr; });
  std::vector<std::pair<Extent*, uint64_t>> fresh;
  try {
    for (Extent* e : moving) {
      Arena& space = stores_[store_index(e->ranges.store)]->space;
      fresh.emplace_back(e, space.allocate(e->file_bytes, kFileAlign));
    }
  } catch (...) {
    for (auto [e, range] : fresh) free_range_locked(range);
    throw;
  }
  for (auto [e, range] : fresh) e->ranges.store = range;
}

// No range: a placement without bytes at rest (no spans).
Placement Pager::placement_locked(const Extent& e, std::optional<uint64_t> range) const {
  Placement p;
  p.state = e.state;
  p.bytes = e.bytes;
  p.store_bytes = align_up(e.bytes, kFileAlign);
  if (!range) return p;
  p.range = *range;
  if (HostTier::is_host(*range)) {
    p.host = host_tier_->host(*range);
  } else {
    p.spans = file_->spans(p.range, p.store_bytes);
  }
  return p;
}

std::vector<Placement> Pager::hold(const std::vector<ExtentId>& ids) {
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  if (!held_.empty()) {
    throw UsageError("a checkpoint copy still holds ranges of this Pager's store: wait for it "
                     "to finish before taking another");
  }
  wait_tier_moves_locked(lock, ids);
  std::vector<Placement> out;
  for (ExtentId id : ids) {
    const Extent& e = extents_.at(id);
    if (!at_rest(e.state)) {
      throw UsageError("extent " + std::to_string(id) + " is resident or being paged: page it "
                       "out (and wait) before copying the store");
    }
    check_not_in_epoch_locked(e, id, "be copied");
    const bool host = e.state == Residency::kHost;
    out.push_back(placement_locked(e, host ? e.ranges.host : e.ranges.store));
  }
  for (const Placement& p : out) {
    if (p.state != Residency::kZero && p.store_bytes > 0) {
      held_[p.range] = p.range + p.store_bytes;
    }
  }
  return out;
}

std::shared_ptr<const HostTier> Pager::host_memory() const {
  std::unique_lock lock(mu_);
  return host_tier_;
}

void Pager::unhold(uint64_t range) {
  check_owner();
  std::unique_lock lock(mu_);
  if (held_.erase(range) == 0) return;
  auto freed = freed_held_.find(range);
  if (freed != freed_held_.end()) {
    const size_t punch_bytes = freed->second;
    freed_held_.erase(freed);
    free_range_locked(range, punch_bytes);
  }
  work_cv_.notify_one();  // a page-out may be waiting for this range
}

// True when the (unstarted) job is a page-out into a held range; counts it once.
bool Pager::waits_for_hold_locked(Job& job) {
  if (!job.out() || job.kind == JobKind::kDiscard || held_.empty()) return false;
  for (const Chunk& c : job.chunks) {
    auto next = held_.upper_bound(c.store_offset);  // ranges are disjoint: check two
    const bool before = next != held_.begin() && std::prev(next)->second > c.store_offset;
    const bool after = next != held_.end() && next->first < c.store_offset + c.file_bytes;
    if (before || after) {
      if (!job.counted_held) counters_.buckets_held++;
      job.counted_held = true;
      return true;
    }
  }
  return false;
}

bool Pager::only_held_jobs_locked() {
  for (const Ticket& job : queue_) {
    if (job->phase != JobPhase::kQueued || !waits_for_hold_locked(*job)) return false;
  }
  return true;
}

std::vector<Placement> Pager::begin_restore(const std::vector<ExtentId>& ids,
                                            const std::vector<bool>& zero) {
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  wait_tier_moves_locked(lock, ids);
  for (ExtentId id : ids) {
    const Extent& e = extents_.at(id);
    if (!at_rest(e.state)) {
      throw UsageError("extent " + std::to_string(id) + " is resident or being paged: page "
                       "it out or discard it (and wait) before restoring it");
    }
    if (held_.count(e.ranges.store) != 0 || (e.ranges.host && held_.count(*e.ranges.host) != 0)) {
      throw UsageError("a checkpoint copy still holds the store range of extent " +
                       std::to_string(id) + ": wait for the save to finish first");
    }
    check_not_in_epoch_locked(e, id, "be restored");
  }
  std::vector<std::optional<uint64_t>> fresh(ids.size());  // where the new bytes go
  try {
    for (size_t i = 0; i < ids.size(); i++) {
      if (zero[i]) continue;
      const Extent& e = extents_.at(ids[i]);
      // Free host room first: the store does not grow by a second copy of the state, and
      // the next step finds the bytes in the host tier (Note [Restores are all-or-nothing]).
      if (host_tier_) fresh[i] = host_tier_->allocate(e.file_bytes);
      if (fresh[i]) continue;
      // In the store it moves to, if it moves: the move is done once the bytes are there.
      const uint64_t now = e.ranges.next_store.value_or(e.ranges.store);
      fresh[i] = stores_[store_index(now)]->space.allocate(e.file_bytes, kFileAlign);
    }
  } catch (...) {
    for (std::optional<uint64_t> range : fresh) {
      if (range) free_range_locked(*range);
    }
    throw;
  }
  std::vector<Placement> places(ids.size());
  for (size_t i = 0; i < ids.size(); i++) {
    Extent& e = extents_.at(ids[i]);
    places[i] = placement_locked(e, fresh[i]);
    places[i].state = zero[i]                         ? Residency::kZero
                      : HostTier::is_host(places[i].range) ? Residency::kHost
                                                           : Residency::kFile;
    e.restore_from = e.state;
    e.state = Residency::kPagingIn;
  }
  return places;
}

void Pager::end_restore(const std::vector<ExtentId>& ids, const std::vector<Placement>& places,
                        bool ok) {
  check_owner();
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < ids.size(); i++) {
    Extent& e = extents_.at(ids[i]);
    const bool zero = places[i].state == Residency::kZero;
    if (!ok) {
      if (!zero) free_range_locked(places[i].range);
      e.state = e.restore_from;
    } else if (zero) {
      drop_host_locked(e);
      e.state = Residency::kZero;
      finish_move_locked(e);
    } else if (places[i].state == Residency::kHost) {  // its store range stays its own
      drop_host_locked(e);
      finish_move_locked(e);
      e.ranges.host = places[i].range;
      e.state = Residency::kHost;
    } else {
      drop_host_locked(e);
      for (uint64_t range : e.referenced()) free_range_locked(range);
      e.ranges.store = places[i].range;
      e.ranges.next_store.reset();
      e.state = Residency::kFile;
    }
  }
  done_cv_.notify_all();
}

// ---- epochs ----------------------------------------------------------------------------

uint64_t Pager::begin_epoch(const std::vector<ExtentId>& ids) {
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  std::vector<ExtentId> members = ids;
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  wait_tier_moves_locked(lock, members);
  for (ExtentId id : members) {
    const Extent& e = extents_.at(id);
    if (e.segment) throw UsageError("a segment of PyTorch's allocator cannot be in an epoch");
    if (!at_rest(e.state)) {
      throw UsageError("extent " + std::to_string(id) + " is resident or being paged: page it "
                       "out (and wait) before an epoch begins");
    }
    check_not_in_epoch_locked(e, id, "join another one");
  }
  const uint64_t epoch = next_epoch_++;
  for (ExtentId id : members) {
    Extent& e = extents_.at(id);
    e.committed = Committed{epoch, e.state, e.ranges};
  }
  epochs_[epoch] = std::move(members);
  return epoch;
}

// The epoch's extents (those not released meanwhile), once none is being paged.
std::vector<Extent*> Pager::settled_epoch_locked(std::unique_lock<std::mutex>& lock,
                                                        uint64_t epoch) {
  check_open();
  auto it = epochs_.find(epoch);
  if (it == epochs_.end()) throw UsageError("no open epoch " + std::to_string(epoch));
  std::vector<Extent*> members;
  done_cv_.wait(lock, [&] {
    members.clear();
    for (ExtentId id : it->second) {
      Extent* e = extents_.find(id);
      if (e == nullptr || !e->committed || e->committed->epoch != epoch) continue;
      if (e->state == Residency::kPagingIn || e->state == Residency::kPagingOut) return false;
      members.push_back(e);
    }
    return true;
  });
  return members;
}

// Ends e's epoch. keep: what it holds now becomes committed; else it returns to what it
// committed. The ranges it no longer refers to are freed.
void Pager::end_epoch_locked(Extent& e, bool keep) {
  const std::vector<uint64_t> before = e.referenced();
  if (!keep) {
    if (e.state == Residency::kResident) pool_.unref(e.addr, e.bytes);
    e.state = e.committed->state;
    e.ranges = e.committed->ranges;
  }
  e.committed.reset();
  const std::vector<uint64_t> now = e.referenced();
  for (uint64_t range : before) {
    if (std::find(now.begin(), now.end(), range) == now.end()) free_range_locked(range);
  }
}

void Pager::commit_epoch(uint64_t epoch) {
  check_owner();
  std::unique_lock lock(mu_);
  for (Extent* e : settled_epoch_locked(lock, epoch)) end_epoch_locked(*e, true);
  epochs_.erase(epoch);
}

void Pager::abort_epoch(uint64_t epoch) {
  check_owner();
  std::unique_lock lock(mu_);
  std::vector<Extent*> members = settled_epoch_locked(lock, epoch);
  if (std::any_of(members.begin(), members.end(),
                  [](const Extent* e) { return e->state == Residency::kResident; })) {
    lock.unlock();
    device_->synchronize();  // kernels may still use what is about to be unmapped
    lock.lock();
    members = settled_epoch_locked(lock, epoch);
  }
  for (Extent* e : members) end_epoch_locked(*e, false);
  epochs_.erase(epoch);
}

}  // namespace statepager
