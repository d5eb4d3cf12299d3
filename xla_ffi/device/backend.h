// The backend of one device: streams, events, copies, matmuls and reductions. The executor
// (exec/) speaks only to this interface; device/backends.h makes the CPU and the CUDA one.
//
// On CUDA the compute stream is XLA's stream and copies run on copy streams ordered by events; on
// CPU every call runs synchronously in the order issued, so the same issue order is the execution
// order and the CPU backend exercises the rendezvous, chunk indexing and ordering.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_BACKEND_H_
#define FICCO_JAX_XLA_FFI_DEVICE_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/errors.h"
#include "device/gemm.h"
#include "device/reduce.h"

namespace ficco {

// An opaque event handle: a cudaEvent_t on CUDA, a host flag on CPU (device/backends.h).
using Event = void*;

// Where one device's events come from and go back to, as the watchdog (runtime/watchdog.h) sees
// them: it asks whether an event's work is done and returns a finished call's events. Lives as
// long as the process; thread-safe.
class EventPool {
 public:
  virtual ~EventPool() = default;
  // Whether the work before the event's record is done (true also for an event whose work failed:
  // there is nothing left to wait for).
  virtual bool Done(Event event) = 0;
  virtual void Release(const std::vector<Event>& events) = 0;
  // How many events the pool has made so far (it makes one whenever none is free): stays bounded
  // while calls give their events back.
  virtual int64_t Made() = 0;
  // How many of those are in the pool now, free to reuse; the others belong to calls in flight, to
  // finished calls the watchdog has not swept yet, or, for good, to failed calls.
  virtual int64_t Free() = 0;
};

// Copy streams of one device: 0 .. kMaxCopyStreams-1 carry a schedule's transfers; one more,
// kStagingStream, carries the staging copies of groups across processes (runtime/ipc.h). It is
// always the same stream, so that the wait which protects the staging buffer (CallSession,
// runtime/call_session.cc) orders every later staging copy of this device.
constexpr int kMaxCopyStreams = 8;
constexpr int kStagingStream = kMaxCopyStreams;
constexpr int kCopyStreamSlots = kMaxCopyStreams + 1;

// A byte offset into a device buffer.
inline const char* Offset(const void* base, int64_t bytes) { return static_cast<const char*>(base) + bytes; }
inline char* Offset(void* base, int64_t bytes) { return static_cast<char*>(base) + bytes; }

// The launch check of a symmetric call's counters (runtime/symmetric.h, "Launches"): the sender's
// PostCounter first copies its rank's launch number, *launch, into `tag` (a word of the receiver's
// site); the receiver's wait, once its word matched, compares that tag with its own *launch. Where
// they differ the two calls belong to different launches: on CUDA the receiver writes
// {slot + 1, its launch, the tag} into `parted` (three host words the watchdog reads, which reports
// at once) and its stream waits for good; on CPU the wait returns an error whose message is
// kLaunchParted. No tag: no check.
struct LaunchCheck {
  uint32_t* tag = nullptr;
  const uint32_t* launch = nullptr;
  uint32_t* parted = nullptr;  // the receiver's only
  int slot = 0;                // the receiver's slot the tag belongs to
};

// One wait of a stream on a symmetric site: until *word == *counter + offset (the counter is the
// wait list's), then its launch check.
struct CounterWait {
  const uint32_t* word = nullptr;
  int32_t offset = 0;
  LaunchCheck check;
};
// The waits a stream makes before its next work, in one kernel on CUDA (a kernel costs its launch:
// device/counters.h). Empty: none.
struct CounterWaits {
  const uint32_t* counter = nullptr;
  std::vector<CounterWait> words;
};

class Backend {
 public:
  static constexpr int kCompute = -1;  // XLA's stream; copy streams are 0 .. copy_streams-1
  // The copy stream of the staging copies (groups across processes, see CallSession::Exchange);
  // Prepare(kCopyStreamSlots, ...) creates it.
  static constexpr int kStaging = kStagingStream;
  virtual ~Backend() = default;
  // Creates persistent resources on first use (copy streams, peer access, cuBLASLt). `peer_stores`:
  // the call's kernels store into the memory of the group's other devices (a symmetric site's
  // counters), which needs peer access where copies do not: an error names a pair without it.
  virtual ffi::Error Prepare(int copy_streams, const std::vector<int>& group, bool peer_stores) = 0;
  // Takes an event from the pool and records it on `stream`.
  virtual ffi::Error Record(int stream, Event* event) = 0;
  // An event recorded on the compute stream that the caller owns (not one of the call's events):
  // the watchdog's marks of a call's start and end, returned to Pool() by the watchdog.
  virtual ffi::Error RecordMark(Event* event) = 0;
  // An event that never completes, for the tests' stall fault (testing/faults.h): a device that
  // never reaches the call, which only the watchdog ends.
  virtual ffi::Error RecordNever(Event* event) = 0;
  // `stream` waits for `event` (possibly recorded on another device).
  virtual ffi::Error Wait(int stream, Event event) = 0;
  // `pieces` runs of `bytes` each, run i from src + i * pitch into dst + i * pitch (one chunk of every
  // group of an expert block: exec/executor.h), as one submission: on CUDA one 2D copy, or one
  // contiguous copy where the runs touch (pitch = bytes).
  virtual ffi::Error CopyPieces(int stream, void* dst, const void* src, size_t bytes, int64_t pieces,
                                int64_t pitch) = 0;
  ffi::Error Copy(int stream, void* dst, const void* src, size_t bytes) {
    return CopyPieces(stream, dst, src, bytes, 1, static_cast<int64_t>(bytes));
  }
  // Words: 32-bit counters in host memory that every device of the process reads and writes (the
  // group channels of runtime/channel.h). `count` of them, zeroed; never freed.
  virtual ffi::Error AllocateWords(int64_t count, uint32_t** words) = 0;
  // `bytes` of this device's memory, zeroed, that every device of the process can read and write;
  // never freed.
  virtual ffi::Error AllocateRegion(int64_t bytes, void** region) = 0;
  // `stream` writes `value` into `word` once its earlier work is done, after a fence that makes that
  // work's writes visible to every device first.
  virtual ffi::Error SetWord(int stream, uint32_t* word, uint32_t value) = 0;
  // `stream`'s later work waits until `word` reaches `value` (cyclically: (int32_t)(word - value) >= 0).
  // On CUDA the device waits, for as long as it takes (the watchdog reports one that never ends); on
  // CPU the calling thread waits at most the call's timeout, then returns an error whose message is
  // kWordTimedOut (the executor says whose word it was).
  virtual ffi::Error WaitWord(int stream, const uint32_t* word, uint32_t value) = 0;
  // Counters of the calls that order themselves on the devices (transfer=symmetric,
  // runtime/symmetric.h): 32-bit words in memory every device of the group reaches (device memory,
  // peer-mapped or opened through CUDA IPC; host memory on CPU), read and written by small kernels
  // on `stream`, so that a call replayed from a CUDA graph compares what the devices counted, never a
  // value the host wrote into the graph when it was captured.
  // ++*counter, then *mirror = *counter where `mirror` is given (host memory the watchdog reads) —
  // unless `stopped` (host memory, or null) is nonzero: then `stream` stops there, counting nothing
  // (on CUDA its device waits until the watchdog reports it; on CPU an error whose message is
  // kCallStopped returns). Then the waits of `then` (their counter is `counter`), as WaitCounters.
  virtual ffi::Error CountCall(int stream, uint32_t* counter, uint32_t* mirror, const uint32_t* stopped,
                               const std::vector<CounterWait>& then) = 0;
  // `stream`'s later work waits until every word of `waits` equals *waits.counter + its offset, then
  // makes their launch checks (LaunchCheck). On CUDA the device waits, for as long as it takes (the
  // watchdog reports one that never ends); on CPU the calling thread waits at most the call's timeout,
  // then returns an error whose message is kWordTimedOut. The caller, which knows whose words they
  // are, finds on the host which wait failed (the words are host memory there).
  virtual ffi::Error WaitCounters(int stream, const CounterWaits& waits) = 0;
  // Once `stream`'s earlier work is done and visible to every device: *check.tag = *check.launch
  // where a tag is given, then *word = *counter, for each word.
  virtual ffi::Error PostCounter(int stream, const std::vector<uint32_t*>& words, const uint32_t* counter,
                                 const LaunchCheck& check) = 0;
  // Whether XLA's stream is being captured into a CUDA graph (XLA's command buffers): the call's work
  // is recorded, not run, and may be replayed later without its handler.
  virtual bool Capturing() = 0;
  virtual ffi::Error Gemm(const GemmProblem& problem) = 0;       // on the compute stream
  // On the compute stream, after the waits of `after` (as WaitCounters), made on CUDA by the sum's own
  // kernel where its grid is small (device/reduce.h): a symmetric call's receiver sums what landed with
  // no kernel of its own for the waits.
  virtual ffi::Error Reduce(const ReduceProblem& problem, const CounterWaits& after) = 0;
  // This call's events may be re-recorded once its device work is done. Called only after the
  // "release" step (JoinAndRelease() in runtime/call_session.cc says why that makes a re-record
  // safe). Interprocess events go back to their pool at once (every one a peer waits on is exported
  // once, into a bounded table: ipc_mailbox.h); the others are handed to the watchdog with
  // TakeReusable(), which returns them once the call's work is done and every rank of the group has
  // announced "release", so that no event a stuck call waits for is re-recorded before the watchdog
  // has read it.
  virtual void ReleaseEvents() = 0;
  // The events ReleaseEvents() left for the watchdog (none if it was not called: a failed call's
  // events stay out of the pool, since a peer may still wait on them).
  virtual std::vector<Event> TakeReusable() = 0;
  // The pool this device's events come from.
  virtual EventPool& Pool() = 0;
};

// WaitWord's error message when a CPU backend gave up waiting.
inline constexpr const char* kWordTimedOut = "word wait timed out";
// CountCall's error message on a CPU backend when the call was stopped.
inline constexpr const char* kCallStopped = "call stopped: its site failed";
// A counter wait's error message on a CPU backend when the peer's call belongs to another launch.
inline constexpr const char* kLaunchParted = "a peer's call of another launch";

// Whether `word` has reached `value`, as WaitWord compares: cyclically, so that counting past 2^32
// keeps working.
inline bool WordReached(uint32_t word, uint32_t value) { return static_cast<int32_t>(word - value) >= 0; }
// A word as the host reads it while devices write it.
inline uint32_t ReadWord(const uint32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_BACKEND_H_
