// Pager's host tier (allocator/pager.h, PagerOptions::host_budget): where each
// extent of a page-out goes, which HOST extents spill to make room, and read-ahead from
// the store into free host room.
#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>

#include "allocator/pager.h"
#include "allocator/pager_internal.h"
#include "backing/errors.h"

namespace statepager {

// Where each extent of a page-out goes: into a fresh host range while the host tier has
// room (a page-out never writes a host range in use, so committed host bytes stay as they
// are); short of room, after spills of the least recently used HOST extents (deferred,
// after[i] kResident until place_deferred_locked() decides); else to its store range.
// Returns those going to the store now.
std::vector<ExtentId> Pager::place_outs_locked(Job& job) {
  std::vector<ExtentId> to_store;
  size_t short_bytes = 0;
  for (ExtentId id : job.extents) {
    Extent& e = extents_.at(id);
    std::optional<uint64_t> range;
    if (host_tier_) range = host_tier_->allocate(e.file_bytes);
    if (!range && host_tier_ && e.file_bytes <= host_tier_->host_budget()) {
      job.after.push_back(Residency::kResident);
      job.deferred.push_back(id);
      short_bytes += e.file_bytes;
      continue;
    }
    if (!range) {
      job.after.push_back(Residency::kFile);
      to_store.push_back(id);
      continue;
    }
    e.ranges.host = *range;
    // Past its bytes a range holds zeros, as a store range does (checkpoints copy them).
    std::memset(host_tier_->host(*range) + e.bytes, 0, e.file_bytes - e.bytes);
    job.after.push_back(Residency::kHost);
    job.host_copies.push_back(HostCopy{e.addr, host_tier_->host(*range), e.bytes});
    job.host_bytes += e.bytes;
  }
  if (!job.deferred.empty()) choose_spills_locked(job, short_bytes);
  if (job.spills.empty()) {  // no room to make: the store takes them now
    for (size_t i = 0; i < job.extents.size(); i++) {
      if (job.after[i] != Residency::kResident) continue;
      job.after[i] = Residency::kFile;
      to_store.push_back(job.extents[i]);
    }
    job.deferred.clear();
  }
  return to_store;
}

// HOST extents whose host range no save holds, until their ranges add up to short_bytes
// (see the class comment for the order): the job writes them back before placing its
// deferred extents. They are 'paging_out' (TierMove::kSpill) meanwhile.
void Pager::choose_spills_locked(Job& job, size_t short_bytes) {
  std::optional<uint64_t> needed;  // when the job's own extents are needed next, if known
  for (ExtentId id : job.deferred) {
    const std::optional<uint64_t> next_use = extents_.at(id).next_use;
    if (next_use) needed = std::min(needed.value_or(*next_use), *next_use);
  }
  // Ordered by (hinted, hinted: farthest next use first, else least recently used).
  constexpr uint64_t kLast = std::numeric_limits<uint64_t>::max();
  std::vector<std::tuple<bool, uint64_t, ExtentId>> order;
  for (const auto& [id, e] : extents_) {
    if (e->state != Residency::kHost || held_.count(*e->ranges.host) != 0) continue;
    if (!e->next_use) {
      order.emplace_back(false, e->last_use, id);
    } else if (!needed || *e->next_use > *needed) {
      order.emplace_back(true, kLast - *e->next_use, id);
    }
  }
  std::sort(order.begin(), order.end());
  size_t freed = 0;
  for (auto [known, rank, id] : order) {
    if (freed >= short_bytes) break;
    job.spills.push_back(id);
    freed += extents_.at(id).file_bytes;
  }
  redirect_writes_locked(job.spills);  // committed store bytes are never overwritten
  for (ExtentId id : job.spills) {
    extents_.at(id).state = Residency::kPagingOut;
    extents_.at(id).tier_move = TierMove::kSpill;
  }
}

// Phase two of a page-out short of host room, once its spills are written: they let
// their host ranges go and the deferred extents take what room there is; the rest goes
// to the store. start_job() starts the work added (JobPhase::kPlaced).
void Pager::place_deferred_locked(Job& job) {
  job.phase = JobPhase::kPlaced;  // also if this throws: the spills have landed
  for (ExtentId id : job.spills) {
    Extent& e = extents_.at(id);
    counters_.spills++;
    counters_.spilled_bytes += e.bytes;
    spilled_locked(e);
  }
  std::vector<ExtentId> to_store;
  for (size_t i = 0; i < job.extents.size(); i++) {
    if (job.after[i] != Residency::kResident) continue;  // placed at submit
    Extent& e = extents_.at(job.extents[i]);
    const std::optional<uint64_t> range = host_tier_->allocate(e.file_bytes);
    if (!range) {
      job.after[i] = Residency::kFile;
      to_store.push_back(job.extents[i]);
      continue;
    }
    e.ranges.host = *range;
    std::memset(host_tier_->host(*range) + e.bytes, 0, e.file_bytes - e.bytes);
    job.after[i] = Residency::kHost;
    job.host_copies.push_back(HostCopy{e.addr, host_tier_->host(*range), e.bytes});
    job.host_bytes += e.bytes;
  }
  redirect_writes_locked(to_store);
  std::vector<StoreTier::Move> moves;
  for (ExtentId id : to_store) {
    const Extent& e = extents_.at(id);
    moves.push_back(StoreTier::Move{e.addr, e.bytes, e.ranges.store, e.file_bytes});
  }
  store_tier_->plan(job, std::move(moves));
  if (waits_for_hold_locked(job)) job.phase = JobPhase::kHeldBack;
}

// A spill landed: the extent's bytes are in its store range, its host range goes. In an
// epoch whose committed bytes were that host range, the store range holds them now.
void Pager::spilled_locked(Extent& e) {
  if (e.committed && e.ranges.host == e.committed->ranges.host) {
    e.committed->state = Residency::kFile;
    e.committed->ranges.store = e.ranges.store;
    e.committed->ranges.host.reset();
  }
  drop_host_locked(e);
  e.state = Residency::kFile;
  e.tier_move.reset();
}

// Waits until none of `ids` is being spilled or read ahead.
void Pager::wait_tier_moves_locked(std::unique_lock<std::mutex>& lock,
                                   const std::vector<ExtentId>& ids) {
  done_cv_.wait(lock, [&] {
    for (ExtentId id : ids) {
      const Extent* e = extents_.find(id);
      if (e != nullptr && e->tier_move) return false;
    }
    return true;
  });
}

Ticket Pager::read_ahead(const std::vector<ExtentId>& bucket) {
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  auto job = std::make_shared<Job>(JobKind::kReadAhead);
  const std::vector<ExtentId> ids = sorted_unique(bucket);
  wait_tier_moves_locked(lock, ids);
  for (ExtentId id : ids) {
    Extent& e = extents_.at(id);
    if (!host_tier_ || e.state != Residency::kFile) continue;
    const std::optional<uint64_t> range = host_tier_->allocate(e.file_bytes);
    if (!range) break;  // no room: the rest stays FILE
    e.ranges.host = *range;
    e.state = Residency::kPagingIn;
    e.tier_move = TierMove::kReadAhead;
    e.last_use = ++use_clock_;
    job->extents.push_back(id);
    job->before.push_back(Residency::kFile);
  }
  plan_locked(*job);
  if (job->extents.empty()) {
    job->set_done();
    return job;
  }
  queue_.push_back(job);
  work_cv_.notify_one();
  return job;
}

}  // namespace statepager
