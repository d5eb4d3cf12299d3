#include "runtime/registry.h"

#include <chrono>
#include <thread>

#include "base/text.h"

namespace ficco {

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kExchange: return "exchange";
    case Phase::kDone: return "done";
    case Phase::kRelease: return "release";
    case Phase::kPushed: return "pushed";
    case Phase::kSetup: return "channel setup";
    case Phase::kSymmetric: return "symmetric setup";
    case Phase::kRoster: return "roster";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Rendezvous
// ---------------------------------------------------------------------------------------------

ffi::Error Rendezvous::TimeoutError(const RendezvousKey& key, const Arrival& who, const Slot& slot,
                                    bool late) {
  std::vector<int> missing;
  for (size_t rank = 0; rank < slot.present.size(); ++rank) {
    if (!slot.present[rank]) missing.push_back(static_cast<int>(rank));
  }
  const std::string msg =
      "ficco_jax: rendezvous timed out after " + ShortNumber(who.timeout_s) + " s in op " +
      std::to_string(key.op_id) + " (" + who.ctx->target + ") phase " + PhaseName(key.phase) + ", group [" +
      JoinNumbers(*who.group_ordinals) + "], rank " + std::to_string(who.rank) + ": missing ranks [" +
      JoinNumbers(missing) + "]" + (late ? " (this rank arrived after the group gave up)" : "") +
      "; a peer failed or never launched this op; set FICCO_RENDEZVOUS_TIMEOUT_S to wait longer";
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg);
}

namespace {
// Two arrivals at one key whose groups differ in size: calls of different groups sharing an op id.
ffi::Error SizeMismatch(const CallContext& ctx, const RendezvousKey& key, int first, int mine, int rank) {
  return MakeInvalid(ctx, "rendezvous of op " + std::to_string(key.op_id) + " phase " + PhaseName(key.phase) +
                              ": the first rank to arrive belongs to a group of " + std::to_string(first) +
                              " devices, this one (rank " + std::to_string(rank) + ") to a group of " +
                              std::to_string(mine) + "; calls that meet under one key must come from one group "
                              "(two calls of different groups share an op id: a lowering reused across meshes?)");
}
}  // namespace

ffi::Error Rendezvous::Arrive(const RendezvousKey& key, const Arrival& who, Post post,
                              std::vector<Post>* posts) {
  const int n = static_cast<int>(who.group_ordinals->size());
  const TimeSection timed(meetings_);
  std::unique_lock<std::mutex> lock(mu_);
  std::unique_ptr<Slot>& entry = slots_[key];
  if (!entry) {
    entry = std::make_unique<Slot>();
    entry->posts.resize(n);
    entry->present.assign(n, false);
  }
  Slot& slot = *entry;
  // The slot was sized by its first arrival; a rank of a group of another size at the same key (two
  // calls sharing an op id) would index past it.
  if (static_cast<int>(slot.posts.size()) != n || who.rank < 0 || who.rank >= n) {
    return SizeMismatch(*who.ctx, key, static_cast<int>(slot.posts.size()), n, who.rank);
  }
  if (slot.abandoned) return TimeoutError(key, who, slot, /*late=*/true);
  if (slot.present[who.rank]) {
    return MakeError(*who.ctx, "rendezvous: rank " + std::to_string(who.rank) +
                                   " arrived twice in phase " + PhaseName(key.phase));
  }
  slot.posts[who.rank] = std::move(post);
  slot.present[who.rank] = true;
  if (++slot.arrived == n) slot.cv.notify_all();
  if (slot.arrived < n && who.spin_s > 0.0) {
    // The slot cannot be erased while we have not departed, so it stays valid unlocked.
    lock.unlock();
    const auto spin_until = std::chrono::steady_clock::now() +
                            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(who.spin_s));
    while (slot.arrived.load(std::memory_order_acquire) < n && std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    }
    lock.lock();
  }

  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(who.timeout_s));
  bool complete = slot.cv.wait_until(lock, deadline, [&] { return slot.arrived == n || slot.abandoned; });
  if (!complete || slot.abandoned) {
    // Abandoned slots stay in the map (they are tiny and keyed by a unique run id) so that a
    // rank arriving late fails at once instead of waiting for peers that already left.
    slot.abandoned = true;
    slot.cv.notify_all();
    return TimeoutError(key, who, slot, /*late=*/false);
  }
  *posts = slot.posts;
  if (++slot.departed == n) slots_.erase(key);  // the last one out removes the slot
  return ffi::Error::Success();
}

ffi::Error Rendezvous::Announce(const RendezvousKey& key, const Arrival& who, Announcement* all) {
  const int n = static_cast<int>(who.group_ordinals->size());
  std::lock_guard<std::mutex> lock(mu_);
  Announced& entry = announced_[key];
  if (entry.present.empty()) entry.present.assign(n, false);
  if (static_cast<int>(entry.present.size()) != n || who.rank < 0 || who.rank >= n) {
    return SizeMismatch(*who.ctx, key, static_cast<int>(entry.present.size()), n, who.rank);
  }
  if (entry.present[who.rank]) {
    return MakeError(*who.ctx, "rendezvous: rank " + std::to_string(who.rank) + " announced itself twice in phase " +
                                   PhaseName(key.phase));
  }
  entry.present[who.rank] = true;
  *all = entry.all;
  if (++entry.count == n) {
    entry.all->store(true, std::memory_order_release);
    announced_.erase(key);  // the holders keep the flag
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// DeviceState
// ---------------------------------------------------------------------------------------------

DeviceState::LaunchCounts& DeviceState::CountsOf(int64_t run_id) {
  auto found = launches_.find(run_id);
  if (found != launches_.end()) return found->second;
  launch_order_.push_back(run_id);
  if (launch_order_.size() > kLaunchesKept) {
    launches_.erase(launch_order_.front());
    launch_order_.pop_front();
  }
  return launches_[run_id];
}

int64_t DeviceState::NextOccurrence(int64_t run_id, int64_t op_id) {
  std::lock_guard<std::mutex> lock(mu_);
  return CountsOf(run_id).occurrences[op_id]++;
}

int64_t DeviceState::NextRosterOccurrence(int64_t run_id, int64_t op_id) {
  std::lock_guard<std::mutex> lock(mu_);
  return CountsOf(run_id).rosters[op_id]++;
}


// ---------------------------------------------------------------------------------------------
// Registry
// ---------------------------------------------------------------------------------------------

Registry& Registry::Get() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

DeviceState& Registry::Device(int ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<DeviceState>& state = devices_[ordinal];
  if (!state) state = std::make_unique<DeviceState>(ordinal);
  return *state;
}

std::vector<int> Registry::Ordinals() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> ordinals;
  for (const auto& entry : devices_) ordinals.push_back(entry.first);
  return ordinals;
}

ffi::Error Registry::Mailbox(const CallContext& ctx, int64_t job, HostMailbox** out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mailbox_closed_) {
    return MakeError(ctx, "the host mailbox of this process was closed (ficco_jax.runtime.ipc.close()); copy-engine "
                          "ops across processes cannot run after it");
  }
  if (!mailbox_) {
    FICCO_RETURN_IF_ERROR(HostMailbox::Open(ctx, job, &mailbox_));
  } else if (mailbox_->job() != job) {
    return MakeInvalid(ctx, "cross-process op of job " + std::to_string(job) + " but this process already "
                            "meets its peers in the mailbox of job " + std::to_string(mailbox_->job()) +
                            " (one jax.distributed job per process)");
  }
  *out = mailbox_.get();
  return ffi::Error::Success();
}

void Registry::UnlinkMailbox() {
  std::lock_guard<std::mutex> lock(mu_);
  if (mailbox_) mailbox_->Unlink();
}

void Registry::CloseMailbox() {
  std::lock_guard<std::mutex> lock(mu_);
  if (mailbox_) mailbox_->Unlink();
  mailbox_.reset();
  mailbox_closed_ = true;
}

}  // namespace ficco
