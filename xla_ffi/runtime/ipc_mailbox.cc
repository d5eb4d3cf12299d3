#include "runtime/ipc_mailbox.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <memory>
#include <thread>

#include "base/text.h"
#include "runtime/registry.h"

namespace ficco {

// ---------------------------------------------------------------------------------------------
// The segment's layout. Zero bytes are the valid initial state of every field but the header, so
// the creator's ftruncate zero-fills it, writes the header last, and openers wait for the header.
// ---------------------------------------------------------------------------------------------
namespace {

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the mailbox needs lock-free (address-free) atomics to share them between processes");

struct PostData {
  int64_t op_id;
  int32_t phase;
  int32_t unused_tag;
  uint64_t call;
  int64_t run_id;
  int64_t signature_len;
  int64_t signature[kIpcMaxSignature];
  int64_t buffer_export;
  int64_t buffer_offset;
  int64_t buffer_bytes;
  int32_t num_events;
  int32_t unused;
  int32_t event_ids[kIpcMaxPostEvents];
  uint64_t raw_buffer;
  uint64_t raw_events[kIpcMaxPostEvents];
};

struct alignas(64) RankBox {
  std::atomic<uint64_t> posted;     // the number of this rank's last post (0: none yet)
  std::atomic<uint64_t> abandoned;  // the post number at which this rank gave up (0: never)
  std::atomic<uint64_t> calls;      // this rank's calls of the group so far (only it writes)
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

// Written by the creator once the rest is zero: an opener that finds another value waits for it
// (the creator is between ftruncate and this store) and then checks the layout's size.
constexpr uint64_t kMailboxMagic = 0x6669636f6d626f78;  // "ficombox"

struct HostMailbox::Layout {
  std::atomic<uint64_t> magic;
  uint64_t layout_bytes;
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

namespace {
// The registered segments of this process (RegisterMailbox): one per job, set once from Python
// before the job's first cross-process call. Kept beside the mailbox code rather than in the
// registry: it is the mailbox's naming, read only when a mailbox is opened.
struct Registered {
  std::string name;
  double first_timeout_s = 0.0;
};
std::mutex& RegisteredMu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
std::map<int64_t, Registered>& RegisteredNames() {
  static auto* names = new std::map<int64_t, Registered>();  // never destroyed: handlers may run at exit
  return *names;
}
bool IsToken(const std::string& token) {
  if (token.size() < 32 || token.size() > 64) return false;
  return std::all_of(token.begin(), token.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}
}  // namespace

std::string RegisterMailbox(int64_t job, const std::string& token, double first_timeout_s) {
  if (job == 0) return "host mailbox: job id 0 is not a job";
  if (!IsToken(token)) {
    return "host mailbox: token of " + std::to_string(token.size()) + " characters; expected 32 to 64 lowercase hex "
           "digits (os.urandom(16).hex())";
  }
  std::lock_guard<std::mutex> lock(RegisteredMu());
  Registered& entry = RegisteredNames()[job];
  const std::string name = "/ficco_jax_" + token;
  if (!entry.name.empty() && entry.name != name) {
    return "host mailbox: job " + std::to_string(job) + " already has the segment " + entry.name +
           " in this process; a second token " + token + " was registered for it";
  }
  entry.name = name;
  entry.first_timeout_s = std::max(0.0, first_timeout_s);
  return "";
}

std::string MailboxName(int64_t job) {
  std::lock_guard<std::mutex> lock(RegisteredMu());
  auto found = RegisteredNames().find(job);
  return found == RegisteredNames().end() ? std::string() : found->second.name;
}

// ---------------------------------------------------------------------------------------------
// Opening and closing
// ---------------------------------------------------------------------------------------------
namespace {
// How long an opener waits for the creator to size the segment and write its header: the creator
// does that right after creating it, in microseconds; a segment left half-made by a process that
// died there is an error after this.
constexpr double kCreatorWaitS = 10.0;

std::string ModeText(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "0%03o", static_cast<unsigned>(mode & 0777));
  return text;
}
}  // namespace

ffi::Error HostMailbox::Open(const CallContext& ctx, int64_t job, std::unique_ptr<HostMailbox>* out) {
  double first_timeout_s = 0.0;
  std::string name;
  {
    std::lock_guard<std::mutex> lock(RegisteredMu());
    auto found = RegisteredNames().find(job);
    if (found != RegisteredNames().end()) {
      name = found->second.name;
      first_timeout_s = found->second.first_timeout_s;
    }
  }
  if (name.empty()) {
    return MakeInvalid(ctx, "no host mailbox is registered for job " + std::to_string(job) + " in this process: "
                            "ficco_jax.runtime.ipc.job_id() registers it (its random name comes from the job's "
                            "key-value store) when a site spanning processes is lowered; a program compiled in "
                            "another job cannot run its cross-process sites here");
  }
  const size_t bytes = sizeof(Layout);
  auto fail = [&](const char* call) {
    return MakeError(ctx, std::string(call) + "(" + name + ") failed: " + std::strerror(errno) +
                              "; the host mailbox of processes on one host lives in /dev/shm (containers "
                              "need a shared /dev/shm and IPC namespace, e.g. docker --ipc=host)");
  };
  // The first process of the job on this host creates the segment, exclusively: a name that exists
  // already was made by a peer of this job (the name is random) or by someone else, and the checks
  // below tell which.
  bool creator = true;
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 && errno == EEXIST) {
    creator = false;
    fd = shm_open(name.c_str(), O_RDWR, 0);
  }
  if (fd < 0) return fail("shm_open");
  const auto close_with = [&](ffi::Error error) {
    close(fd);
    return error;
  };
  struct stat st;
  if (fstat(fd, &st) != 0) return close_with(fail("fstat"));
  if (st.st_uid != geteuid() || (st.st_mode & 0777) != 0600) {
    return close_with(MakeError(
        ctx, "host mailbox " + name + " is owned by uid " + std::to_string(st.st_uid) + " with mode " +
                 ModeText(st.st_mode) + "; expected uid " + std::to_string(geteuid()) + " (this process's user) "
                 "and mode 0600, as its creator makes it: someone else made this segment, so it is not "
                 "used; remove /dev/shm" + name + " and restart the job"));
  }
  if (creator) {
    if (fchmod(fd, 0600) != 0) return close_with(fail("fchmod"));  // whatever the umask took away
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const ffi::Error error = fail("ftruncate");
      shm_unlink(name.c_str());
      return close_with(error);
    }
  } else {
    // The creator sizes it right after creating it.
    const auto deadline = DeadlineAfter(kCreatorWaitS);
    const auto started = Clock::now();
    while (static_cast<size_t>(st.st_size) < bytes) {
      if (Clock::now() > deadline) {
        return close_with(MakeError(ctx, "host mailbox " + name + " has " + std::to_string(st.st_size) +
                                             " bytes after " + ShortNumber(kCreatorWaitS) + " s; expected " +
                                             std::to_string(bytes) + " (its creator died while making it?); "
                                             "restart the job"));
      }
      Backoff(started);
      if (fstat(fd, &st) != 0) return close_with(fail("fstat"));
    }
    if (static_cast<size_t>(st.st_size) != bytes) {
      return close_with(MakeError(ctx, "host mailbox " + name + " has " + std::to_string(st.st_size) +
                                           " bytes; this build's layout has " + std::to_string(bytes) +
                                           " (processes of one job must run the same ficco_jax build)"));
    }
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return fail("mmap");
  Layout* layout = static_cast<Layout*>(base);
  if (creator) {
    layout->layout_bytes = bytes;
    layout->magic.store(kMailboxMagic, std::memory_order_release);
  } else {
    const auto deadline = DeadlineAfter(kCreatorWaitS);
    const auto started = Clock::now();
    while (layout->magic.load(std::memory_order_acquire) != kMailboxMagic) {
      if (Clock::now() > deadline) {
        munmap(base, bytes);
        return MakeError(ctx, "host mailbox " + name + " has no valid header after " + ShortNumber(kCreatorWaitS) +
                                  " s (its creator died while making it, or it is not a ficco_jax mailbox); "
                                  "restart the job");
      }
      Backoff(started);
    }
    if (layout->layout_bytes != bytes) {
      munmap(base, bytes);
      return MakeError(ctx, "host mailbox " + name + " was made for a layout of " +
                                std::to_string(layout->layout_bytes) + " bytes; this build's has " +
                                std::to_string(bytes) + " (processes of one job must run the same ficco_jax build)");
    }
  }
  out->reset(new HostMailbox(name, job, layout, bytes, first_timeout_s));
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
  if (who.rank < 0 || who.rank >= n) {
    return MakeInvalid(*who.ctx, "rank " + std::to_string(who.rank) + " in a group of " + std::to_string(n) +
                                     " across processes; expected 0 to " + std::to_string(n - 1) + " (a bug)");
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
  data.phase = mine.phase;
  data.call = mine.call;
  data.run_id = mine.run_id;
  data.signature_len = static_cast<int64_t>(mine.signature.size());
  std::copy(mine.signature.begin(), mine.signature.end(), data.signature);
  data.buffer_export = mine.buffer_export;
  data.buffer_offset = mine.buffer_offset;
  data.buffer_bytes = mine.buffer_bytes;
  data.num_events = static_cast<int32_t>(mine.event_ids.size());
  std::copy(mine.event_ids.begin(), mine.event_ids.end(), data.event_ids);
  data.raw_buffer = mine.raw_buffer;
  std::copy(mine.raw_events.begin(), mine.raw_events.end(), data.raw_events);
  box.posted.store(number, std::memory_order_release);
}

// Waits for every rank's post `number` until `deadline`; on a peer that gave up, or at the
// deadline, marks `box` abandoned and fails.
ffi::Error AwaitPosts(const MailboxArrival& who, const std::string& mailbox, const RankBox* ranks, int n, RankBox& box,
                      uint64_t number, double timeout_s) {
  const auto started = Clock::now();
  const auto deadline = DeadlineAfter(timeout_s);
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
          "ficco_jax: rendezvous timed out after " + ShortNumber(timeout_s) + " s in " + Where(who, mailbox) +
          ": missing ranks [" + JoinNumbers(missing) + "] (post " + std::to_string(number) +
          "); a peer process failed, exited or never launched this op; set FICCO_RENDEZVOUS_TIMEOUT_S to "
          "wait longer";
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg);
    }
    Backoff(started);
  }
}

// Rank `r`'s post `number`, each field checked before it is used: a count beyond the layout or a
// negative offset or size is an error naming the field, never an index.
ffi::Error ReadPost(const MailboxArrival& who, const std::string& mailbox, const RankBox& box, int r, uint64_t number,
                    WirePost* post) {
  const PostData& peer = box.data[number % 2];
  const auto bad = [&](const std::string& field, int64_t value, const std::string& expected) {
    return MakeError(*who.ctx, "host mailbox " + mailbox + ": rank " + std::to_string(r) + " of group [" +
                                   Members(*who.members) + "] posted " + field + " = " + std::to_string(value) +
                                   "; expected " + expected + " (a corrupt post: restart the processes)");
  };
  const int64_t signature_len = peer.signature_len;
  const int32_t num_events = peer.num_events;
  const int64_t offset = peer.buffer_offset, bytes = peer.buffer_bytes;
  if (signature_len < 0 || signature_len > kIpcMaxSignature) {
    return bad("signature_len", signature_len, "0 to " + std::to_string(kIpcMaxSignature));
  }
  if (num_events < 0 || num_events > kIpcMaxPostEvents) {
    return bad("num_events", num_events, "0 to " + std::to_string(kIpcMaxPostEvents));
  }
  if (peer.buffer_export < -1 || peer.buffer_export >= kIpcMaxExports) {
    return bad("buffer_export", peer.buffer_export, "-1 to " + std::to_string(kIpcMaxExports - 1));
  }
  if (offset < 0) return bad("buffer_offset", offset, ">= 0");
  if (bytes < 0 || bytes > INT64_MAX - offset) return bad("buffer_bytes", bytes, "0 to " + std::to_string(INT64_MAX - offset));
  post->op_id = peer.op_id;
  post->phase = peer.phase;
  post->call = peer.call;
  post->run_id = peer.run_id;
  post->signature.assign(peer.signature, peer.signature + signature_len);
  post->buffer_export = peer.buffer_export;
  post->buffer_offset = offset;
  post->buffer_bytes = bytes;
  post->event_ids.assign(peer.event_ids, peer.event_ids + num_events);
  for (int32_t id : post->event_ids) {
    if (id < 0 || id >= kIpcMaxEvents) return bad("an event id", id, "0 to " + std::to_string(kIpcMaxEvents - 1));
  }
  post->raw_buffer = peer.raw_buffer;
  post->raw_events.assign(peer.raw_events, peer.raw_events + num_events);
  return ffi::Error::Success();
}

std::string PhaseText(int32_t phase) {
  return phase >= 0 && phase <= static_cast<int32_t>(Phase::kRoster) ? PhaseName(static_cast<Phase>(phase))
                                                                         : "phase " + std::to_string(phase);
}

// "phase 'done' of call 7 of the group, launch 123, op 12": a post's tag, for errors.
std::string TagText(const WirePost& post) {
  return "phase '" + PhaseText(post.phase) + "' of call " + std::to_string(post.call) + " of the group, launch " +
         std::to_string(post.run_id) + ", op " + std::to_string(post.op_id);
}

bool SameTag(const WirePost& a, const WirePost& b) {
  return a.op_id == b.op_id && a.phase == b.phase && a.call == b.call && a.run_id == b.run_id;
}

}  // namespace

ffi::Error HostMailbox::NextCall(const MailboxArrival& who, uint64_t* call) {
  GroupEntry* group = nullptr;
  FICCO_RETURN_IF_ERROR(FindGroup(who, &group));
  // Only this rank writes its box's count.
  RankBox& box = group->ranks[who.rank];
  *call = box.calls.load(std::memory_order_relaxed) + 1;
  box.calls.store(*call, std::memory_order_relaxed);
  return ffi::Error::Success();
}

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
  // A rank's first post meets peers that may still be compiling: it waits at least the first-meeting
  // timeout. Later posts meet peers running the same program, a call apart at most.
  const double timeout_s = number == 1 ? std::max(who.timeout_s, first_timeout_s_) : who.timeout_s;
  FICCO_RETURN_IF_ERROR(AwaitPosts(who, name_, group->ranks, n, box, number, timeout_s));
  posts->assign(n, WirePost{});
  for (int r = 0; r < n; ++r) {
    ffi::Error read = ReadPost(who, name_, group->ranks[r], r, number, &(*posts)[r]);
    if (read.failure()) {
      box.abandoned.store(number, std::memory_order_release);
      return read;
    }
  }
  for (int r = 0; r < n; ++r) {
    const WirePost& theirs = (*posts)[r];
    if (SameTag(theirs, mine)) continue;
    // Posts of two meetings paired by number: taking theirs would mix two calls or launches. The
    // group is out of step for good, so give up and let the peers fail at once.
    box.abandoned.store(number, std::memory_order_release);
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "ficco_jax: rendezvous failed in " + Where(who, name_) + ": rank " + std::to_string(r) +
                          " posted " + TagText(theirs) + " where this rank posted " + TagText(mine) + " (post " +
                          std::to_string(number) + "): the processes' calls are out of step (a process failed a "
                          "call before meeting its peers and went on, or the processes run different programs); "
                          "nothing of it was used; restart the processes");
  }
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
  if (id < 0 || id >= std::min(d->num_exports.load(std::memory_order_acquire), kIpcMaxExports)) {
    return MakeError(ctx, "device " + std::to_string(member) + " posted staging buffer id " + std::to_string(id) +
                              " that it has not published");
  }
  *handle = d->exports[id];
  *bytes = d->export_bytes[id];
  if (*bytes == 0 || *bytes > (uint64_t{1} << 48)) {
    return MakeError(ctx, "device " + std::to_string(member) + " published staging buffer " + std::to_string(id) +
                              " of " + std::to_string(*bytes) + " bytes; expected 1 to 2^48 (a corrupt entry: "
                              "restart the processes)");
  }
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
  if (id < 0 || id >= std::min(d->num_events.load(std::memory_order_acquire), kIpcMaxEvents)) {
    return MakeError(ctx, "device " + std::to_string(member) + " posted event id " + std::to_string(id) +
                              " that it has not published");
  }
  *handle = d->events[id];
  return ffi::Error::Success();
}

std::vector<std::pair<std::string, int64_t>> MailboxLayoutForTests() {
  const auto at = [](const void* base, const void* field) {
    return static_cast<int64_t>(static_cast<const char*>(field) - static_cast<const char*>(base));
  };
  // Addresses only, in storage of the layout's size and alignment (nothing is read or written).
  static void* storage = ::operator new(sizeof(HostMailbox::Layout), std::align_val_t(alignof(HostMailbox::Layout)));
  const auto* layout = static_cast<const HostMailbox::Layout*>(storage);
  const auto& group = layout->groups[0];
  const RankBox& box = group.ranks[1];
  const PostData& post = box.data[1];
  return {{"rank_box", at(layout, &box)},
          {"rank_box_bytes", static_cast<int64_t>(sizeof(RankBox))},
          {"group_bytes", static_cast<int64_t>(sizeof(group))},
          {"posted", at(&box, &box.posted)},
          {"data1", at(&box, &post)},
          {"op_id", at(&post, &post.op_id)},
          {"phase", at(&post, &post.phase)},
          {"call", at(&post, &post.call)},
          {"run_id", at(&post, &post.run_id)},
          {"signature_len", at(&post, &post.signature_len)},
          {"buffer_export", at(&post, &post.buffer_export)},
          {"buffer_offset", at(&post, &post.buffer_offset)},
          {"buffer_bytes", at(&post, &post.buffer_bytes)},
          {"num_events", at(&post, &post.num_events)}};
}

}  // namespace ficco
