#include "runtime/ipc_mailbox.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "base/text.h"

namespace ficco {

// ---------------------------------------------------------------------------------------------
// The segment's layout. Zero bytes are the valid initial state of every field, so the segment
// needs no initialisation beyond ftruncate's zero fill, and processes may open it in any order.
// ---------------------------------------------------------------------------------------------
namespace {

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the mailbox needs lock-free (address-free) atomics to share them between processes");

struct PostData {
  int64_t op_id;
  int64_t signature_len;
  int64_t signature[kIpcMaxSignature];
  int64_t buffer_export;
  int64_t buffer_offset;
  int32_t num_events;
  int32_t unused;
  int32_t event_ids[kIpcMaxPostEvents];
  uint64_t raw_buffer;
  uint64_t raw_events[kIpcMaxPostEvents];
};

struct alignas(64) RankBox {
  std::atomic<uint64_t> posted;     // the number of this rank's last post (0: none yet)
  std::atomic<uint64_t> abandoned;  // the post number at which this rank gave up (0: never)
  PostData data[2];                 // post n lives in data[n % 2]
};

enum EntryState : uint32_t { kFree = 0, kClaiming = 1, kReady = 2 };

}  // namespace

struct HostMailbox::GroupEntry {
  std::atomic<uint32_t> state;
  int32_t size;
  int32_t members[kIpcMaxRanks];
  RankBox ranks[kIpcMaxRanks];
};

struct HostMailbox::DeviceEntry {
  std::atomic<uint32_t> state;
  int32_t member;
  std::atomic<int32_t> num_exports;  // ids below this are published
  std::atomic<int32_t> num_events;
  uint64_t export_bytes[kIpcMaxExports];
  IpcHandleBytes exports[kIpcMaxExports];
  IpcHandleBytes events[kIpcMaxEvents];
};

struct HostMailbox::Layout {
  GroupEntry groups[kIpcMaxGroups];
  DeviceEntry devices[kIpcMaxDevices];
};

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point DeadlineAfter(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Peers of a healthy program arrive within microseconds: yield for the first 200 us, then
// sleep in 20 us steps so that a long wait (a peer still compiling) does not burn a core.
void Backoff(Clock::time_point started) {
  if (Clock::now() - started < std::chrono::microseconds(200)) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

std::string Members(const std::vector<int>& members) { return JoinNumbers(members); }

// The first words of every mailbox error: which op, phase, group and rank.
std::string Where(const MailboxArrival& who, const std::string& mailbox) {
  return "op " + std::to_string(who.ctx->op_id) + " (" + who.ctx->target + ") phase " + who.phase_name +
         ", group of devices [" + Members(*who.members) + "] across processes (host mailbox " + mailbox +
         "), rank " + std::to_string(who.rank);
}

}  // namespace

std::string MailboxName(int64_t job) {
  return "/ficco_jax_" + Hex(static_cast<uint64_t>(job));
}

// ---------------------------------------------------------------------------------------------
// Opening and closing
// ---------------------------------------------------------------------------------------------
ffi::Error HostMailbox::Open(const CallContext& ctx, int64_t job, std::unique_ptr<HostMailbox>* out) {
  const std::string name = MailboxName(job);
  const size_t bytes = sizeof(Layout);
  auto fail = [&](const char* call) {
    return MakeError(ctx, std::string(call) + "(" + name + ") failed: " + std::strerror(errno) +
                              "; the host mailbox of processes on one host lives in /dev/shm (containers "
                              "need a shared /dev/shm and IPC namespace, e.g. docker --ipc=host)");
  };
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0) return fail("shm_open");
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return fail("fstat");
  }
  // Every opener grows it to the same size; growing zero-fills, and a size already reached is
  // left alone, so the order in which processes open it does not matter.
  if (static_cast<size_t>(st.st_size) < bytes && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return fail("ftruncate");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return fail("mmap");
  out->reset(new HostMailbox(name, job, static_cast<Layout*>(base), bytes));
  return ffi::Error::Success();
}

HostMailbox::~HostMailbox() { munmap(layout_, bytes_); }

void HostMailbox::Unlink() { shm_unlink(name_.c_str()); }

// ---------------------------------------------------------------------------------------------
// Groups and the exchange
// ---------------------------------------------------------------------------------------------
ffi::Error HostMailbox::FindGroup(const MailboxArrival& who, GroupEntry** found) {
  const std::vector<int>& members = *who.members;
  const int n = static_cast<int>(members.size());
  if (n < 1 || n > kIpcMaxRanks) {
    return MakeInvalid(*who.ctx, "a group across processes has " + std::to_string(n) + " members; the host "
                                     "mailbox holds 1 to " + std::to_string(kIpcMaxRanks));
  }
  auto same = [&](const GroupEntry& g) {
    if (g.size != n) return false;
    for (int i = 0; i < n; ++i) {
      if (g.members[i] != members[i]) return false;
    }
    return true;
  };
  const auto started = Clock::now();
  const auto deadline = DeadlineAfter(who.timeout_s);
  for (int i = 0; i < kIpcMaxGroups; ++i) {
    GroupEntry& g = layout_->groups[i];
    uint32_t state = g.state.load(std::memory_order_acquire);
    if (state == kFree) {
      uint32_t expected = kFree;
      if (g.state.compare_exchange_strong(expected, kClaiming, std::memory_order_acq_rel)) {
        g.size = n;
        for (int r = 0; r < n; ++r) g.members[r] = members[r];
        g.state.store(kReady, std::memory_order_release);
        *found = &g;
        return ffi::Error::Success();
      }
      state = expected;
    }
    while (state == kClaiming) {  // another process is writing this entry's members: microseconds
      if (Clock::now() > deadline) {
        return MakeError(*who.ctx, "host mailbox " + name_ + ": group entry " + std::to_string(i) +
                                       " stayed half-written (a process died while claiming it?)");
      }
      Backoff(started);
      state = g.state.load(std::memory_order_acquire);
    }
    if (same(g)) {
      *found = &g;
      return ffi::Error::Success();
    }
  }
  return MakeError(*who.ctx, "host mailbox " + name_ + " is full: more than " + std::to_string(kIpcMaxGroups) +
                                 " distinct groups span processes in this job");
}

namespace {

// A group in which some rank gave up is out of step for good: fail at once.
ffi::Error FailIfAbandoned(const MailboxArrival& who, const std::string& mailbox, const RankBox* ranks, int n) {
  for (int r = 0; r < n; ++r) {
    const uint64_t gave_up = ranks[r].abandoned.load(std::memory_order_acquire);
    if (gave_up != 0) {
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        "ficco_jax: rendezvous failed at once in " + Where(who, mailbox) + ": rank " + std::to_string(r) +
                            " already gave up at post " + std::to_string(gave_up) +
                            " (this rank arrived after the group gave up, or an earlier call failed); the "
                            "processes' calls are out of step, restart them");
    }
  }
  return ffi::Error::Success();
}

// Writes `mine` as post `number` of `box`, then publishes it.
void WritePost(RankBox& box, uint64_t number, const WirePost& mine) {
  PostData& data = box.data[number % 2];
  data.op_id = mine.op_id;
  data.signature_len = static_cast<int64_t>(mine.signature.size());
  std::copy(mine.signature.begin(), mine.signature.end(), data.signature);
  data.buffer_export = mine.buffer_export;
  data.buffer_offset = mine.buffer_offset;
  data.num_events = static_cast<int32_t>(mine.event_ids.size());
  std::copy(mine.event_ids.begin(), mine.event_ids.end(), data.event_ids);
  data.raw_buffer = mine.raw_buffer;
  std::copy(mine.raw_events.begin(), mine.raw_events.end(), data.raw_events);
  box.posted.store(number, std::memory_order_release);
}

// Waits for every rank's post `number`; on a peer that gave up, or at the deadline, marks `box`
// abandoned and fails.
ffi::Error AwaitPosts(const MailboxArrival& who, const std::string& mailbox, const RankBox* ranks, int n, RankBox& box,
                      uint64_t number) {
  const auto started = Clock::now();
  const auto deadline = DeadlineAfter(who.timeout_s);
  for (;;) {
    bool all = true;
    for (int r = 0; r < n; ++r) {
      if (ranks[r].posted.load(std::memory_order_acquire) >= number) continue;
      all = false;
      const uint64_t gave_up = ranks[r].abandoned.load(std::memory_order_acquire);
      if (gave_up != 0) {
        box.abandoned.store(number, std::memory_order_release);
        return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                          "ficco_jax: rendezvous failed in " + Where(who, mailbox) + ": rank " + std::to_string(r) +
                              " gave up waiting (post " + std::to_string(gave_up) +
                              "); a peer failed or never launched this op");
      }
    }
    if (all) return ffi::Error::Success();
    if (Clock::now() > deadline) {
      std::vector<int> missing;
      for (int r = 0; r < n; ++r) {
        if (ranks[r].posted.load(std::memory_order_acquire) < number) missing.push_back(r);
      }
      box.abandoned.store(number, std::memory_order_release);
      const std::string msg =
          "ficco_jax: rendezvous timed out after " + ShortNumber(who.timeout_s) + " s in " + Where(who, mailbox) +
          ": missing ranks [" + JoinNumbers(missing) + "] (post " + std::to_string(number) +
          "); a peer process failed, exited or never launched this op; set FICCO_RENDEZVOUS_TIMEOUT_S to "
          "wait longer";
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg);
    }
    Backoff(started);
  }
}

// Every rank's post `number`.
void ReadPosts(const RankBox* ranks, int n, uint64_t number, std::vector<WirePost>* posts) {
  posts->assign(n, WirePost{});
  for (int r = 0; r < n; ++r) {
    const PostData& peer = ranks[r].data[number % 2];
    WirePost& post = (*posts)[r];
    post.op_id = peer.op_id;
    post.signature.assign(peer.signature, peer.signature + std::min<int64_t>(peer.signature_len, kIpcMaxSignature));
    post.buffer_export = peer.buffer_export;
    post.buffer_offset = peer.buffer_offset;
    const int32_t num_events = std::min<int32_t>(peer.num_events, kIpcMaxPostEvents);
    post.event_ids.assign(peer.event_ids, peer.event_ids + num_events);
    post.raw_buffer = peer.raw_buffer;
    post.raw_events.assign(peer.raw_events, peer.raw_events + num_events);
  }
}

}  // namespace

ffi::Error HostMailbox::Exchange(const MailboxArrival& who, const WirePost& mine, std::vector<WirePost>* posts) {
  if (mine.signature.size() > kIpcMaxSignature || mine.event_ids.size() > kIpcMaxPostEvents ||
      mine.raw_events.size() != mine.event_ids.size()) {
    return MakeInvalid(*who.ctx, "a post across processes carries " + std::to_string(mine.signature.size()) +
                                     " signature words and " + std::to_string(mine.event_ids.size()) +
                                     " events; the host mailbox holds at most " + std::to_string(kIpcMaxSignature) +
                                     " and " + std::to_string(kIpcMaxPostEvents) + " (fewer chunks or a smaller group)");
  }
  GroupEntry* group = nullptr;
  FICCO_RETURN_IF_ERROR(FindGroup(who, &group));
  const int n = group->size;
  RankBox& box = group->ranks[who.rank];
  FICCO_RETURN_IF_ERROR(FailIfAbandoned(who, name_, group->ranks, n));
  const uint64_t number = box.posted.load(std::memory_order_relaxed) + 1;
  WritePost(box, number, mine);
  FICCO_RETURN_IF_ERROR(AwaitPosts(who, name_, group->ranks, n, box, number));
  ReadPosts(group->ranks, n, number, posts);
  return ffi::Error::Success();
}

ffi::Error HostMailbox::FailIfGaveUp(const MailboxArrival& who) {
  GroupEntry* group = nullptr;
  FICCO_RETURN_IF_ERROR(FindGroup(who, &group));
  return FailIfAbandoned(who, name_, group->ranks, group->size);
}

// ---------------------------------------------------------------------------------------------
// Device tables
// ---------------------------------------------------------------------------------------------
ffi::Error HostMailbox::FindDevice(const CallContext& ctx, int member, bool claim, DeviceEntry** found) {
  for (int i = 0; i < kIpcMaxDevices; ++i) {
    DeviceEntry& d = layout_->devices[i];
    uint32_t state = d.state.load(std::memory_order_acquire);
    if (state == kFree && claim) {
      uint32_t expected = kFree;
      if (d.state.compare_exchange_strong(expected, kClaiming, std::memory_order_acq_rel)) {
        d.member = member;
        d.state.store(kReady, std::memory_order_release);
        *found = &d;
        return ffi::Error::Success();
      }
      state = expected;
    }
    if (state == kFree) break;  // entries are claimed in order: nothing beyond a free one
    const auto started = Clock::now();
    while (state == kClaiming) {  // claimed a few instructions ago by another process
      if (Clock::now() - started > std::chrono::seconds(10)) {
        return MakeError(ctx, "host mailbox " + name_ + ": device entry " + std::to_string(i) +
                                  " stayed half-written (a process died while claiming it?)");
      }
      Backoff(started);
      state = d.state.load(std::memory_order_acquire);
    }
    if (d.member == member) {
      *found = &d;
      return ffi::Error::Success();
    }
  }
  return MakeError(ctx, "host mailbox " + name_ + ": device " + std::to_string(member) +
                            (claim ? " finds no free entry (more than " + std::to_string(kIpcMaxDevices) +
                                         " devices on this host?)"
                                   : " has published nothing (it posted an id it never exported: a bug)"));
}

ffi::Error HostMailbox::PublishExport(const CallContext& ctx, int member, const IpcHandleBytes& handle,
                                      uint64_t bytes, int32_t* id) {
  std::lock_guard<std::mutex> lock(publish_mu_);
  DeviceEntry* d = nullptr;
  FICCO_RETURN_IF_ERROR(FindDevice(ctx, member, /*claim=*/true, &d));
  const int32_t next = d->num_exports.load(std::memory_order_relaxed);
  if (next >= kIpcMaxExports) {
    return MakeError(ctx, "device " + std::to_string(member) + " exported " + std::to_string(next) +
                              " staging buffers to its peers, the most the host mailbox holds (staging buffers "
                              "grow twofold and are replaced after a failed call: this many means calls kept "
                              "failing; restart the processes)");
  }
  d->exports[next] = handle;
  d->export_bytes[next] = bytes;
  d->num_exports.store(next + 1, std::memory_order_release);
  *id = next;
  return ffi::Error::Success();
}

ffi::Error HostMailbox::ReadExport(const CallContext& ctx, int member, int32_t id, IpcHandleBytes* handle,
                                   uint64_t* bytes) {
  DeviceEntry* d = nullptr;
  FICCO_RETURN_IF_ERROR(FindDevice(ctx, member, /*claim=*/false, &d));
  if (id < 0 || id >= d->num_exports.load(std::memory_order_acquire)) {
    return MakeError(ctx, "device " + std::to_string(member) + " posted staging buffer id " + std::to_string(id) +
                              " that it has not published");
  }
  *handle = d->exports[id];
  *bytes = d->export_bytes[id];
  return ffi::Error::Success();
}

ffi::Error HostMailbox::PublishEvent(const CallContext& ctx, int member, const IpcHandleBytes& handle, int32_t* id) {
  std::lock_guard<std::mutex> lock(publish_mu_);
  DeviceEntry* d = nullptr;
  FICCO_RETURN_IF_ERROR(FindDevice(ctx, member, /*claim=*/true, &d));
  const int32_t next = d->num_events.load(std::memory_order_relaxed);
  if (next >= kIpcMaxEvents) {
    return MakeError(ctx, "device " + std::to_string(member) + " exported " + std::to_string(next) +
                              " IPC events, the most the host mailbox holds (events are pooled; this many "
                              "means calls failed and leaked theirs)");
  }
  d->events[next] = handle;
  d->num_events.store(next + 1, std::memory_order_release);
  *id = next;
  return ffi::Error::Success();
}

ffi::Error HostMailbox::ReadEvent(const CallContext& ctx, int member, int32_t id, IpcHandleBytes* handle) {
  DeviceEntry* d = nullptr;
  FICCO_RETURN_IF_ERROR(FindDevice(ctx, member, /*claim=*/false, &d));
  if (id < 0 || id >= d->num_events.load(std::memory_order_acquire)) {
    return MakeError(ctx, "device " + std::to_string(member) + " posted event id " + std::to_string(id) +
                              " that it has not published");
  }
  *handle = d->events[id];
  return ffi::Error::Success();
}

}  // namespace ficco
