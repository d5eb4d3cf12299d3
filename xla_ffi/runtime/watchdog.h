// The watchdog of the copy-engine calls: no wait of ours, on a device or in a handler, can last
// forever unreported.
//
// (Symmetric calls, runtime/symmetric.h, are watched per site instead, from words their devices
// post: a call replayed from a CUDA graph has no handler to register it. WatchedSite, below.)
//
// Every call is watched from the moment its handler starts until its device work is done:
//
//   handler  : CallWatch(..) [started] ... meetings (peer events noted) ... Finish: [finished]
//   watchdog : polls `started` and `finished`; once `finished` is done, the call's events go back
//              to the pool (in-process groups; once the group's ranks have all announced "release":
//              call_session.cc, JoinAndRelease) and the call is forgotten.
//
// A call whose `started` mark is done but whose `finished` mark is not (or whose handler has not
// returned: on CPU the waits are the handler's own) after its timeout (config.WATCHDOG_S, an
// attribute of every call) is stuck. The watchdog then writes to stderr what every unfinished call
// of the process waits for — op, where it was written, schedule, device, rank and group, and each
// peer event not yet complete, by rank, device and phase, or each channel word not yet reached, with
// the value it waits for and the value it holds — and ends the process with std::abort, as
// NCCL's watchdog ends a PyTorch process. Raising is no way out: the host thread that would see
// the error is the one blocked in XLA waiting for the result, and a device whose stream waits on
// an event that never completes cannot be used again in this process.
//
// An event is re-recorded only after the watchdog has seen its call finish, so what the report says
// of an event is about this call's record, never a later one. (Across processes the events go back
// at the release meeting instead, as they did before: each is exported once into a bounded table.)
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_WATCHDOG_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_WATCHDOG_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/errors.h"
#include "device/backend.h"
#include "runtime/op_config.h"

namespace ficco {

enum class Phase : int;

// Turns true once every rank of a group has announced itself at one rendezvous key
// (Rendezvous::Announce, runtime/registry.h).
using Announcement = std::shared_ptr<const std::atomic<bool>>;

// One event a call's streams wait on that a peer recorded.
struct PeerEvent {
  int rank;
  int device;
  Phase phase;
  int index;  // its place in the peer's post of that phase
  Event event;
};

// One word of a group channel (runtime/channel.h) that a call's streams wait on until it reaches
// `value`: set by rank `rank`'s device.
struct PeerWord {
  int rank;
  int device;
  const char* what;  // "ready" or "done"
  int64_t index;     // the part of the owner's data it guards ("ready")
  const uint32_t* word;
  uint32_t value;
};

// Who a watched call or site is, formatted only for a report (Describe): a call's path pays no
// string formatting.
struct WatchedOp {
  WatchedOp() = default;
  explicit WatchedOp(const OpConfig& config);
  const char* target = "";  // a string literal of the target table (ffi/ops.h)
  int64_t op_id = -1;
  int device = -1;
  int rank = 0;
  std::vector<int> group;
  int64_t chunks = 1;
  Order order = Order::kRing;
  GemmMode gemm = GemmMode::kPerChunk;
  int copy_streams = 1;
  bool push = false;
  bool symmetric = false;
  std::string site;  // where the op was written, "" where unknown
  double timeout_s = 0.0;

  // "op 12 (ficco_ag_matmul), dma/direct/c2, on device 0: rank 0 of group [0, 1]"
  std::string Describe() const;
};

// What the watchdog knows of one call; the handler thread writes it through CallWatch, the watchdog
// thread reads it, both under `mu`.
struct WatchedCall : WatchedOp {
  std::mutex mu;
  EventPool* pool = nullptr;
  Event started = nullptr;
  Event finished = nullptr;  // recorded when the handler returns; stays null if that failed
  bool returned = false;
  std::vector<Event> reusable;  // the call's events, back to `pool` once `finished` is done
  Announcement released;        // and, where set, once every rank of the group announced "release"
  std::vector<PeerEvent> waits;
  std::vector<PeerWord> words;
  std::chrono::steady_clock::time_point registered, started_seen;
  bool seen_started = false;
};

class SymmetricSite;  // runtime/symmetric.h

// One rank's symmetric site (runtime/symmetric.h), watched for as long as the process lives: its
// device posts each call's number into `started` as the call begins and into `finished` after its
// join, whether the handler ran or a command buffer replayed the call. The handler thread writes it
// once; then only the watchdog's thread touches it.
struct WatchedSite : WatchedOp {
  using WatchedOp::WatchedOp;
  const uint32_t* started = nullptr;
  const uint32_t* finished = nullptr;
  const uint32_t* parted = nullptr;  // the rank's launch check (device/backend.h, LaunchCheck)
  std::shared_ptr<SymmetricSite> state;  // for the report: the other ranks' counters of this process
  // The unfinished call last seen (its started and finished numbers) and since when.
  bool pending = false;
  uint32_t seen_started = 0, seen_finished = 0;
  std::chrono::steady_clock::time_point since;
};

class Watchdog {
 public:
  // Registers a call (starts the watchdog's thread on first use).
  void Watch(std::shared_ptr<WatchedCall> call);
  // How many calls it watches: 0 once every call of the process has been swept, and then each
  // finished call's events are back in their pool, except those held for a group that never
  // announced its release (a peer failed).
  int64_t Watched();
  // Registers rank `config.rank`'s symmetric site, whose calls post into `started` and `finished`, and
  // whose receivers write `parted` where a peer's data came from another launch (reported at once).
  void WatchSite(const OpConfig& config, std::shared_ptr<SymmetricSite> state, const uint32_t* started,
                 const uint32_t* finished, const uint32_t* parted);

 private:
  void Loop();
  void StartLocked();
  // Forgets finished calls (their events back to the pool); returns the first stuck call, if any.
  std::shared_ptr<WatchedCall> Sweep();
  // The first site whose call has started and not finished for longer than its timeout, or whose
  // launch check failed, if any; `headline` says which.
  std::shared_ptr<WatchedSite> SweepSites(std::string* headline);
  // Writes `headline`, then what every unfinished call and site of the process waits for, and aborts.
  [[noreturn]] void ReportAndAbort(const std::string& headline);
  std::string ReportCalls();
  std::string ReportSites();

  // Finished calls' events that wait for their group's announcement; the watchdog's thread alone
  // touches them.
  struct Pending {
    EventPool* pool;
    std::vector<Event> events;
    Announcement released;
  };
  // Gives back the pending events whose announcement came. One that never comes (a peer failed
  // before "release") keeps its events out of the pool for good, as a failed call's are.
  void ReleasePending();

  std::mutex mu_;
  std::condition_variable cv_;
  std::list<std::shared_ptr<WatchedCall>> calls_;
  std::list<std::shared_ptr<WatchedSite>> sites_;
  std::list<Pending> pending_;
  std::unique_ptr<std::thread> thread_;
};

// The watch of one call, held by its handler: records `started` when made, notes the peer events
// of every meeting, and `finished` plus the reusable events in Finish. A call whose Finish never
// runs (its handler stuck) stays watched until the watchdog ends the process.
class CallWatch {
 public:
  CallWatch(Backend& backend, const OpConfig& config);
  ~CallWatch();
  CallWatch(const CallWatch&) = delete;
  CallWatch& operator=(const CallWatch&) = delete;
  // The events of `posts` of other ranks that this call's streams may wait on.
  template <typename Posts>
  void NotePeers(const OpConfig& config, Phase phase, const Posts& posts) {
    std::lock_guard<std::mutex> lock(call_->mu);
    for (int rank = 0; rank < config.n(); ++rank) {
      if (rank == config.rank) continue;
      const auto& events = posts[rank].events;
      for (int i = 0; i < static_cast<int>(events.size()); ++i) {
        if (events[i] != nullptr) call_->waits.push_back({rank, config.group[rank], phase, i, events[i]});
      }
    }
  }
  // A channel word of rank `rank` that this call's streams wait on until it reaches `value`.
  void NoteWord(const OpConfig& config, int rank, const char* what, int64_t index, const uint32_t* word,
                uint32_t value) {
    std::lock_guard<std::mutex> lock(call_->mu);
    call_->words.push_back({rank, config.group[rank], what, index, word, value});
  }
  // After the call's last enqueue (success or not): the `finished` mark and the events to reuse.
  void Finish(Backend& backend);
  // The events go back only once `all` is true as well (in-process groups: call_session.cc,
  // JoinAndRelease, says why).
  void ReleaseAfter(Announcement all);

 private:
  std::shared_ptr<WatchedCall> call_;
  bool finished_ = false;
};

// "dma/direct/c2/grouped/s2": the schedule as ficco_jax.Schedule prints it.
std::string ScheduleText(int64_t chunks, Order order, GemmMode gemm, int copy_streams, bool push,
                         bool symmetric = false);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_WATCHDOG_H_
