// The one process-wide object of ficco_jax: per-device state, the host rendezvous, the group
// channels, the symmetric sites, the watchdog, and the one hook through which tests inject faults
// (SetBackendWrapper: testing/faults.h sets it; nothing does in production).
//
// Per-device state (the occurrence counter and, in the CUDA build, the device's CudaDevice:
// copy streams, event pools, cuBLASLt, peer access, staging buffers) is created on first use, kept
// for the life of the process and indexed by device ordinal. The rendezvous lets the devices of one group meet
// on the host inside one call to exchange pointers and events; a group's channel lets its small calls
// skip that meeting. Nothing else in ficco_jax is global.
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_REGISTRY_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_REGISTRY_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "base/errors.h"
#include "base/timed.h"
#include "device/backend.h"
#include "device/backends.h"
#include "device/cuda_device.h"
#include "runtime/channel.h"
#include "runtime/ipc_mailbox.h"
#include "runtime/placement.h"
#include "runtime/symmetric.h"
#include "runtime/watchdog.h"

namespace ficco {

// What one rank posts in a rendezvous phase.
struct Post {
  int ordinal = -1;
  std::vector<int64_t> signature;  // shapes, dtype and schedule; must agree across the group
  const void* buffer = nullptr;    // the buffer peers read from (x, or the send workspace)
  std::vector<Event> events;       // the events peers wait on before reading `buffer`
  // A call on its group's channel (runtime/channel.h) meets nobody: its peers' posts are made from
  // the channel. In place of events they carry the owner's words that this rank waits for (ready[i]
  // guards what events[i] would, which stay null) until they reach `value`, and the word this rank
  // sets to `value` once it has pulled everything it reads from that owner (`done`).
  std::vector<const uint32_t*> ready;
  uint32_t* done = nullptr;
  uint32_t value = 0;
  uint32_t* words = nullptr;  // a channel's setup meeting: rank 0's words for the new generation
};

// kPushed: transfer=push only (runtime/call_session.h, CallSession::Push). kSetup: the meeting that
// makes a group channel's generation (runtime/channel.h). kSymmetric: the one meeting of a symmetric
// site (runtime/symmetric.h). kRoster: the members of a group learn each other's devices at their
// first call under a device assignment (runtime/placement.h).
enum class Phase : int { kExchange = 0, kDone = 1, kRelease = 2, kPushed = 3, kSetup = 4, kSymmetric = 5, kRoster = 6 };
const char* PhaseName(Phase phase);

struct RendezvousKey {
  int64_t run_id;
  int64_t op_id;
  int64_t occurrence;  // how many times this device already ran (run_id, op_id)
  Phase phase;
  int64_t group_index;

  bool operator<(const RendezvousKey& o) const {
    return std::tie(run_id, op_id, occurrence, phase, group_index) <
           std::tie(o.run_id, o.op_id, o.occurrence, o.phase, o.group_index);
  }
};

// Who is arriving, for the error messages.
struct Arrival {
  const CallContext* ctx;
  const std::vector<int>* group_ordinals;  // the group's ordinals in rank order
  int rank;
  double timeout_s;
  // Seconds to spin (yielding) before sleeping on the condition variable. A GPU handler's
  // peers arrive within microseconds; a futex sleep and wake-up costs tens of microseconds per
  // phase, which is what a small op pays twice per call. CPU handlers use 0.
  double spin_s = 0.0;
};

class Rendezvous {
 public:
  // Blocks until every rank of the group has arrived at `key`, then returns all posts (indexed
  // by rank) in `posts`. Fails with an error naming the missing ranks after `timeout_s`, or at
  // once if the slot was already abandoned by a rank that timed out.
  ffi::Error Arrive(const RendezvousKey& key, const Arrival& who, Post post, std::vector<Post>* posts);
  // Notes that `who` reached `key` and returns at once: `*all` turns true once every rank of the
  // group has. Nothing is exchanged and nobody waits, so nothing times out; a key some rank never
  // reaches (it failed before) stays false and keeps a few bytes for the life of the process.
  ffi::Error Announce(const RendezvousKey& key, const Arrival& who, Announcement* all);
  // How many times a rank waited for its group here (Arrive), and the host time it spent there, the
  // waiting for peers included: tests count a call's meetings, benchmarks time them.
  const TimedCount& meetings() const { return meetings_; }

 private:
  struct Slot {
    std::vector<Post> posts;
    std::vector<bool> present;
    std::atomic<int> arrived{0};  // written under mu_, read without it while spinning
    int departed = 0;
    bool abandoned = false;
    std::condition_variable cv;
  };
  static ffi::Error TimeoutError(const RendezvousKey& key, const Arrival& who, const Slot& slot,
                                 bool late);

  struct Announced {
    std::shared_ptr<std::atomic<bool>> all = std::make_shared<std::atomic<bool>>(false);
    std::vector<bool> present;
    int count = 0;
  };

  std::mutex mu_;
  std::map<RendezvousKey, std::unique_ptr<Slot>> slots_;
  std::map<RendezvousKey, Announced> announced_;
  TimedCount meetings_;
};


class DeviceState {
 public:
#ifdef FICCO_WITH_CUDA
  explicit DeviceState(int ordinal) : cuda_(ordinal) {}
#else
  explicit DeviceState(int) {}
#endif

  // How many times this device already ran `op_id` in launch `run_id`; counts this run. Each launch
  // counts apart (launches of two host threads may interleave on one device).
  int64_t NextOccurrence(int64_t run_id, int64_t op_id);
  // The same count for the roster meetings of `op_id` (runtime/placement.h), kept apart: a roster
  // meeting precedes the call's own meetings.
  int64_t NextRosterOccurrence(int64_t run_id, int64_t op_id);

#ifdef FICCO_WITH_CUDA
  // This device's streams, events, cuBLASLt state and staging buffers (device/cuda_device.h).
  CudaDevice& cuda() { return cuda_; }
#endif

 private:
  std::mutex mu_;
  // The counts of the launches this device ran most recently, by run id: two launches of two host
  // threads may interleave on a device, so a launch's counts are kept apart from the other's until
  // kLaunchesKept newer launches have run.
  struct LaunchCounts {
    std::map<int64_t, int64_t> occurrences;
    std::map<int64_t, int64_t> rosters;
  };
  static constexpr size_t kLaunchesKept = 64;
  std::map<int64_t, LaunchCounts> launches_;
  std::deque<int64_t> launch_order_;
  LaunchCounts& CountsOf(int64_t run_id);  // under mu_
#ifdef FICCO_WITH_CUDA
  CudaDevice cuda_;
#endif
};

class Registry {
 public:
  static Registry& Get();
  DeviceState& Device(int ordinal);
  std::vector<int> Ordinals();  // the devices that ran an op so far
  Rendezvous& rendezvous() { return rendezvous_; }
  Watchdog& watchdog() { return watchdog_; }
  // Every call's backend passes through here (ffi/handler.h). A test that arms a fault sets the
  // wrapper that injects it (testing/faults.h); nothing else ever does, so in a process without tests
  // this is one atomic load.
  using BackendWrapper = std::unique_ptr<Backend> (*)(std::unique_ptr<Backend>, const OpConfig&);
  void SetBackendWrapper(BackendWrapper wrapper) { backend_wrapper_.store(wrapper, std::memory_order_release); }
  std::unique_ptr<Backend> Wrap(std::unique_ptr<Backend> backend, const OpConfig& config) const {
    const BackendWrapper wrapper = backend_wrapper_.load(std::memory_order_acquire);
    return wrapper == nullptr ? std::move(backend) : wrapper(std::move(backend), config);
  }
  // The group channels of in-process groups (runtime/channel.h), and the host time their calls spent
  // waiting for a peer's host to enqueue its writes (a late peer included).
  Channels& channels() { return channels_; }
  // The symmetric sites of this process (runtime/symmetric.h).
  SymmetricSites& symmetric() { return symmetric_; }
  TimedCount& channel_waits() { return channel_waits_; }
  // The global device ids of this process's devices (runtime/placement.h).
  DeviceIds& device_ids() { return device_ids_; }
  // Every copy-engine handler of the process: how many ran and their host time from start to return.
  TimedCount& handlers() { return handlers_; }
  // The events of every CPU device (device/backends.h).
  EventPool& host_events() { return *host_events_; }

  // The host mailbox of job `job` (groups across processes, ipc_mailbox.h), opened on first use.
  // One job per process; after CloseMailbox() every cross-process call fails.
  ffi::Error Mailbox(const CallContext& ctx, int64_t job, HostMailbox** out);
  // Removes the mailbox's name from /dev/shm (at exit: the mapping stays valid until then).
  void UnlinkMailbox();
  // Unmaps it; later cross-process calls fail instead of meeting in a fresh, empty segment.
  void CloseMailbox();

 private:
  std::mutex mu_;
  std::map<int, std::unique_ptr<DeviceState>> devices_;
  Rendezvous rendezvous_;
  Watchdog watchdog_;
  std::atomic<BackendWrapper> backend_wrapper_{nullptr};
  Channels channels_;
  SymmetricSites symmetric_;
  TimedCount channel_waits_;
  DeviceIds device_ids_;
  TimedCount handlers_;
  std::unique_ptr<EventPool> host_events_ = MakeHostEventPool();
  std::unique_ptr<HostMailbox> mailbox_;
  bool mailbox_closed_ = false;
};

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_REGISTRY_H_
