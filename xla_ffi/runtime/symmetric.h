// transfer=symmetric: copy-engine calls that meet nobody per call, so that XLA may capture them in
// its command buffers (CUDA graphs) and replay them without their handlers.
//
// A call that meets (call_session.h) exchanges this execution's buffer pointers and events with its
// peers, because XLA may hand a site other buffers at every execution and a peer's event can be
// waited for only once the waiter knows it was recorded. A symmetric site removes both reasons. Per
// call site (op id) and group, each rank owns one zeroed allocation of its device's memory, made and
// exchanged once, at the site's first call, in one meeting of the group (pointers in one process,
// CUDA IPC handles across processes):
//
//   [epoch][landed: slots x chunks][free: slots][tag: slots] | slot 0 | ... | slot n-2
//   (32-bit words, then the slots from the next multiple of 256 bytes)
//
// Slot s of rank r receives one block from rank SourceOfSlot(s) = r-1-s, which sends it as its send
// slot s (to TargetOfSlot(s) = p+1+s = r). `epoch` counts the rank's calls of the site: each call's
// first kernel adds one, and every comparison of the call reads it on the device:
//
//   sender p, XLA's stream: epoch_p += 1, wait free_p[s] == epoch_p - 1 (every s) | ... (one kernel)
//   sender p, copy stream : copy its block -> slot s of r | landed_r[s][j] = epoch_p
//   receiver r            : wait landed_r[s][j] == epoch_r | read slot s ...............| free_p[s] = epoch_r
//
// free_p[s] == epoch - 1 says that r finished reading p's data of the previous call, so p may
// overwrite the slot; landed_r[s][j] == epoch says that chunk j of this call is in it. The ranks of a
// group run the same calls of a site in the same order, so their epochs agree call by call. Each
// word has one writer and is compared for equality with a value the devices computed, so no wait
// passes early, a graph replays with the values of its own execution, and data left by a call that
// never completed is never taken for a later call's. The waits and posts are one-thread kernels
// (device/counters.h), as few as the order allows: the count waits for the slots, a stream's waits
// share one kernel, and a small reduce-scatter sum makes its waits itself; the host only enqueues them.
//
// Data lands in the slots, not in XLA's buffers, whose addresses the peers would have to learn at
// every call. Where the landing buffer is the op's scratch (matmul_rs's and reduce_scatter's receive
// slots, ag_matmul's gathered rows that nobody reads) the consumers read the slots in place; where it
// is a result (all_gather, all_to_all, the gathered rows that are returned, matmul_a2a's blocks) one
// copy per slot moves the block into it.
//
// No wait is left unwatched: each call posts its epoch into host memory as it starts and again as
// it ends (`started`, `finished`), and the watchdog reports a site whose call started and has not
// finished within config.WATCHDOG_S (runtime/watchdog.h), whether the handler ran or a command
// buffer replayed the call. A call that fails after counting itself stops its site in this process:
// the ranks' epochs may have parted, so later calls of the site here fail at once, naming the first
// error, and a replayed one stops at its first kernel (`stopped`), reported by the watchdog, before it
// can pair with its peers.
//
// Launches. The epochs count calls, not launches: a device that ends a launch before a site its peers
// run (another op failed there, on its host or its device) is a call behind for good, and its next
// launch's call would pair with its peers' call of the launch it left, each taking the other's data
// for its own. So every rank also numbers the launches of each op on its device, in one device word
// (`launch`, per op id, device and group) that XLA's stream sets before the launch's work: on CUDA the
// handlers' initialize stage, which XLA runs for every thunk of every launch before any executes
// (and outside command buffers), counts the launch and sets the word; on CPU, where XLA has no such
// stage, each call writes the launch's run id into it. The ranks of a group count the same launches,
// so their numbers agree launch by launch. A sender copies its number into the receiver's `tag` of
// its slot before it posts `landed`; the receiver, once `landed` matched, compares the tag with its
// own number, and a difference stops its stream for good (on CPU: an error) and is reported at once
// by the watchdog, naming both launches: never a pairing of two launches' data. Not caught: a rank
// whose launch failed in XLA's initialize stage itself, before this op's initialize ran there: it
// counts one launch fewer, so its next launch pairs with its peers' call of the launch it never ran,
// as without the check. Allocations are never freed (work in flight, or a captured graph, may still
// use them).
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_SYMMETRIC_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_SYMMETRIC_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "base/errors.h"
#include "device/backend.h"
#include "runtime/op_config.h"

namespace ficco {

// One site's allocations, as this process sees them: every rank's base (its own, or mapped here).
class SymmetricSite {
 public:
  SymmetricSite(int n, int64_t chunks, int64_t slot_bytes, std::vector<char*> bases);

  // The bytes of one rank's allocation, words included.
  static int64_t Bytes(int n, int64_t chunks, int64_t slot_bytes) {
    return WordsBytes(n, chunks) + int64_t{n - 1} * slot_bytes;
  }
  int n() const { return n_; }
  int64_t chunks() const { return chunks_; }
  int64_t slot_bytes() const { return slot_bytes_; }

  // Rank `rank`'s words and slots as rank `viewer`'s device addresses them (-1: as the first rank of
  // this process to install the site did). Across processes each local rank opened its peers'
  // allocations through its own device (ipc_cuda.cc), so the addresses differ by viewer.
  uint32_t* Epoch(int rank, int viewer = -1) const { return Words(rank, viewer); }
  uint32_t* Landed(int rank, int slot, int64_t chunk, int viewer = -1) const {
    return Words(rank, viewer) + 1 + slot * chunks_ + chunk;
  }
  uint32_t* Free(int rank, int slot, int viewer = -1) const {
    return Words(rank, viewer) + 1 + int64_t{n_ - 1} * chunks_ + slot;
  }
  uint32_t* Tag(int rank, int slot, int viewer = -1) const { return Free(rank, n_ - 1, viewer) + slot; }
  char* Slot(int rank, int slot, int viewer = -1) const {
    return Bases(viewer)[rank] + WordsBytes(n_, chunks_) + slot * slot_bytes_;
  }
  // `viewer`'s addresses of every rank's allocation, from its own setup meeting; set once, before
  // `viewer` uses the site.
  void SetView(int viewer, std::vector<char*> bases);

  // The words of the ranks of this process (null for the others). Host words: the devices post
  // `epoch` into `started` and `finished` as a call starts and ends (the watchdog reads them); the host
  // sets `stopped` once the site failed, which stops a call that a command buffer replays at its first
  // kernel (Backend::CountCall), before it can pair with its peers' calls; a receiver whose peer's data
  // came from another launch writes `parted` (three words: LaunchCheck). `launch`: the device word with
  // the number of the rank's current launch of this op ("Launches" above).
  struct Watch {
    uint32_t* started = nullptr;
    uint32_t* finished = nullptr;
    uint32_t* stopped = nullptr;
    uint32_t* parted = nullptr;
    uint32_t* launch = nullptr;
  };
  void SetWatch(int rank, Watch watch);
  Watch WatchOf(int rank);

  // A call of the site failed on `rank` with `why` (after its epoch was counted, or in a way that
  // leaves the site unusable): the site stops in this process. "" while none has.
  void Fail(int rank, const std::string& why);
  std::string Failed();

 private:
  static int64_t WordsBytes(int n, int64_t chunks) {
    const int64_t words = 1 + int64_t{n - 1} * (chunks + 2);
    return (words * 4 + 255) / 256 * 256;
  }
  uint32_t* Words(int rank, int viewer) const { return reinterpret_cast<uint32_t*>(Bases(viewer)[rank]); }
  const std::vector<char*>& Bases(int viewer) const {
    return viewer >= 0 && viewer < n_ && !views_[viewer].empty() ? views_[viewer] : bases_;
  }

  const int n_;
  const int64_t chunks_, slot_bytes_;
  const std::vector<char*> bases_;
  // Per viewer rank (empty: bases_). Each element is written once, by its viewer's thread, before its
  // first use; the vector itself never changes size.
  std::vector<std::vector<char*>> views_;
  std::mutex mu_;
  std::vector<Watch> watches_;
  std::string failed_;
};

// The process's symmetric sites, by (op id, group members in rank order, chunks, block bytes): one
// call site traced once runs other shapes where it is batched again (vmap of a jitted function keeps
// its op ids), each a site of its own.
class SymmetricSites {
 public:
  using Key = std::tuple<int64_t, std::vector<int>, int64_t, int64_t>;
  std::shared_ptr<SymmetricSite> Find(const Key& key);
  // The site made from a setup meeting's bases (one per rank, in rank order, as rank `viewer`'s
  // device addresses them); the first rank of the process to get here makes it, the others get the
  // same one with their own view added (SymmetricSite::SetView).
  std::shared_ptr<SymmetricSite> Install(const Key& key, std::vector<char*> bases, int viewer);
  // Fails every site of a group across processes (ipc.close() unmaps what they reach of their peers).
  void FailCrossProcess(const std::string& why);
  // A site of a group across processes (its members are global device ids).
  void MarkCrossProcess(const Key& key);

  // The launches of op `op_id` on device `ordinal` in group `group` (members in rank order), as one
  // device word ("Launches" above), made zeroed at first use: every site of the op and group on the
  // device reads it (a site batched again is another site of one op). Keyed by the group too: one
  // trace lowered for two meshes runs the same op id in groups that launch apart.
  using LaunchKey = std::tuple<int64_t, int, std::vector<int>>;
  ffi::Error LaunchWord(Backend& backend, const LaunchKey& key, uint32_t** word);
  // The initialize stage of a launch (CUDA): counts it, and sets the word to its number on XLA's
  // stream, behind the previous launch's work. Counts nothing while the stream is captured (no
  // value may be frozen into a graph).
  ffi::Error CountLaunch(Backend& backend, const LaunchKey& key);

 private:
  struct Launches {
    uint32_t* word = nullptr;
    uint32_t count = 0;
  };
  ffi::Error LaunchesOf(Backend& backend, const LaunchKey& key, Launches** launches);

  std::mutex mu_;
  std::map<Key, std::shared_ptr<SymmetricSite>> sites_;
  std::vector<Key> cross_process_;
  std::mutex launches_mu_;
  std::map<LaunchKey, Launches> launches_;
};

// What follows a report of two launches' calls meeting ("Launches" above): why, and what to do.
std::string LaunchPartedAdvice();

// One wait of a symmetric call for a word that rank `peer` posts (its `what` counter: "landed",
// "free"), as error messages name it.
struct PeerWait {
  CounterWait wait;
  int peer = 0;
  const char* what = "";
};
// The waits of one kernel (Backend::WaitCounters), their counter `epoch`.
CounterWaits CountersOf(const uint32_t* epoch, const std::vector<PeerWait>& waits);
// `status`, of waits on `epoch` that failed: on a CPU backend (kWordTimedOut, kLaunchParted) the error
// that names the first wait found unmet on the host (the words are host memory there) and whose word
// it was; any other error as it is.
ffi::Error PeerWaitsError(const OpConfig& config, const uint32_t* epoch, const std::vector<PeerWait>& waits,
                          ffi::Error status);

// One call of rank `config.rank` on its site: the waits and posts of the table above, for the
// executor's pipelines (exec/). `marks` is how finely the landed data is marked (per chunk, or once
// per slot after its last chunk: call_session.h, LandedEvents), the same on every rank.
class SymmetricCall {
 public:
  SymmetricCall(const OpConfig& config, std::shared_ptr<SymmetricSite> site, bool per_chunk);

  const SymmetricSite& site() const { return *site_; }
  // The call failed after Begin: its site stops in this process (SymmetricSite::Fail).
  void Fail(const std::string& why) const { site_->Fail(config_.rank, why); }
  // Compute stream, first: this call's epoch, posted as started; then, in the same kernel, until
  // the target of every send slot has read the previous call's block from it (its `free` word), so
  // that the sends need no wait of their own: what follows `Begin` on XLA's stream may write them.
  // `*counted`: whether the call may have been counted, failed or not (false only where the site had
  // stopped before): a counted call that fails must end through its site's failure (FailSymmetric).
  ffi::Error Begin(Backend& backend, bool* counted) const;
  // Where send slot `slot`'s block goes: the target's slot of the same index.
  char* Destination(int slot) const { return site_->Slot(config_.TargetOfSlot(slot), slot, config_.rank); }
  // Sender, on `stream` after the copies of chunks [first, end) of send slot `slot`: they landed,
  // tagged with this rank's launch.
  ffi::Error PostLanded(Backend& backend, int stream, int slot, int64_t first, int64_t end) const;
  // Receiver: the wait for chunk `chunk` of receive slot `slot` (its word equal to the epoch), and
  // the check of the launch it came from.
  PeerWait LandedWait(int slot, int64_t chunk) const {
    const uint32_t* word = site_->Landed(config_.rank, slot, per_chunk_ ? chunk : site_->chunks() - 1, config_.rank);
    return {{word, 0, {site_->Tag(config_.rank, slot, config_.rank), watch_.launch, watch_.parted, slot}},
            config_.SourceOfSlot(slot), "landed"};
  }
  const uint32_t* Epoch() const { return site_->Epoch(config_.rank, config_.rank); }
  // Where receive slot `slot` landed, in this device's memory.
  char* Landing(int slot) const { return site_->Slot(config_.rank, slot, config_.rank); }
  // Compute stream, last (after the join, so that nothing of this call reads its slots any more):
  // every sender may overwrite its slot, and this call's epoch is posted as finished; one kernel.
  ffi::Error End(Backend& backend) const;

 private:
  const OpConfig& config_;
  const std::shared_ptr<SymmetricSite> site_;
  const SymmetricSite::Watch watch_;
  const bool per_chunk_;
};

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_SYMMETRIC_H_
