// Runs one schedule of one op on one device: ordering, dependencies, rendezvous and joins.
//
// The executor is backend-neutral: it speaks to a Backend that owns the streams. On CUDA the
// compute stream is XLA's stream and copies run on copy streams ordered by events; on CPU
// every call runs synchronously in the order issued, so the same issue order is the execution
// order and the CPU backend exercises the rendezvous, chunk indexing and ordering.
//
// Roles inside one call of device r (group of n, c chunks):
//   Owner:  records `ready` (its inputs, or its send partials, are valid) before the exchange;
//           must not return until every peer's pulls from it are done (the join).
//   Puller: after the exchange, copy streams wait on the owner's event, pull each chunk into
//           local memory and record one event per chunk for the compute stream.
// With transfer=push (config.push; groups inside one process) the roles turn round:
//   Receiver: records `entry` (its destination buffer is XLA's to write from here) and posts
//             the destination in the exchange (CallSession::Push).
//   Sender:   its copy streams wait on the target's entry and on its own data's events, write
//             each chunk into the target's buffer and record one event per chunk; a second
//             meeting (kPushed) hands those events to the receivers.
// The join: XLA's stream waits for this device's copy streams (now writing peers) and, through
// the kPushed events, for every peer's push into it, before the handler returns; so a push call
// meets three times (exchange, pushed, release) like a pull call (exchange, done, release). Why push: on 2 x H200 with both GPUs receiving
// at once, copy-engine ingress was 339 (push) vs 311 (pull) GB/s at 40 MiB blocks and 262 vs 162
// at 8 MiB (scripts/ingress_probe.py, PyTorch streams, session 6). Through this executor, at the
// same group size, pushes then timed level with pulls (36 op/schedule pairs, median 1.3 % slower;
// session 7), so they are opt-in; three senders per GPU (tp = 4) were not measured.
#ifndef FICCO_JAX_XLA_FFI_EXECUTOR_H_
#define FICCO_JAX_XLA_FFI_EXECUTOR_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "errors.h"
#include "gemm.h"
#include "reduce.h"
#include "registry.h"

namespace ficco {

// ------------------------------------------------------------------------------------------
// The schedule and group of one call, decoded from the FFI attributes (module.cc).
// ------------------------------------------------------------------------------------------
enum class Order : int { kRing = 0, kDirect = 1 };
enum class GemmMode : int { kPerChunk = 0, kGrouped = 1 };
enum class Fault : int { kNone = 0, kSkip = 1, kFail = 2 };

struct OpConfig {
  CallContext ctx;
  int64_t run_id = 0;
  // This device's group in rank order: device ordinals of this process, or, for a group across
  // processes (ipc_job != 0), global device ids; `group_local` has each member's ordinal in this
  // process, -1 for a device of another process.
  std::vector<int> group;
  std::vector<int> group_local;
  int64_t ipc_job = 0;  // != 0: the group spans processes of this host; the host mailbox's job id
  int64_t group_index = 0;
  int rank = 0;
  int64_t chunks = 1;
  Order order = Order::kRing;
  GemmMode gemm = GemmMode::kPerChunk;
  int copy_streams = 1;
  double timeout_s = 5.0;
  double spin_s = 0.0;  // rendezvous spin before sleeping (set by the CUDA bindings)
  Fault fault = Fault::kNone;
  int fault_rank = -1;
  bool skip_own_rows = false;  // ag_matmul / a2a_matmul whose gathered / received output nobody reads
  bool push = false;  // transfer=push: senders write into their peers' buffers (see the top of this file)

  int n() const { return static_cast<int>(group.size()); }
  bool cross_process() const { return ipc_job != 0; }
  // The members whose ordinals this process knows (its own devices): where to enable peer access.
  std::vector<int> LocalOrdinals() const;
  // Peer read in slot s (s = 0 .. n-2): ring distance s + 1 behind this rank, so rank r pulls
  // from r-1 first, then r-2, ... Every rank's slot 0 peer is its ring neighbour, and the
  // matmul_rs partial a peer computes first (its slot 0, for rank peer+1) is the one pulled first.
  int SourceOfSlot(int slot) const { return (rank - 1 - slot + 2 * n()) % n(); }
  // Peer whose rows a rank computes into send slot s (matmul_rs): distance s + 1 ahead.
  int TargetOfSlot(int slot) const { return (rank + 1 + slot) % n(); }
  // The copy stream carrying slot s: ring moves one transfer at a time on one stream.
  int StreamOfSlot(int slot) const { return order == Order::kRing ? 0 : slot % copy_streams; }
};

// ------------------------------------------------------------------------------------------
// The backend: streams, events, copies, matmuls and reductions of one device.
// ------------------------------------------------------------------------------------------
class Backend {
 public:
  static constexpr int kCompute = -1;  // XLA's stream; copy streams are 0 .. copy_streams-1
  // The copy stream of the staging copies (groups across processes, see CallSession::Exchange);
  // Prepare(kCopyStreamSlots, ...) creates it.
  static constexpr int kStaging = kStagingStream;
  virtual ~Backend() = default;
  // Creates persistent resources on first use (copy streams, peer access, cuBLASLt).
  virtual ffi::Error Prepare(int copy_streams, const std::vector<int>& group) = 0;
  // Takes an event from the pool and records it on `stream`.
  virtual ffi::Error Record(int stream, Event* event) = 0;
  // `stream` waits for `event` (possibly recorded on another device).
  virtual ffi::Error Wait(int stream, Event event) = 0;
  virtual ffi::Error Copy(int stream, void* dst, const void* src, size_t bytes) = 0;
  virtual ffi::Error Gemm(const GemmProblem& problem) = 0;       // on the compute stream
  virtual ffi::Error Reduce(const ReduceProblem& problem) = 0;   // on the compute stream
  // Returns this call's events to the pool. Called only after the "release" rendezvous, see
  // JoinAndRelease() in call_session.cc for why that makes re-recording them safe.
  virtual void ReleaseEvents() = 0;
};

// ------------------------------------------------------------------------------------------
// The ops. Pointers are device buffers of this device; shapes are per device, row-major.
// ------------------------------------------------------------------------------------------
struct AllGatherArgs {        // ag_matmul and all_gather
  const void* x;              // [m, row_bytes]
  void* gathered;             // [n*m, row_bytes]
  int64_t m;
  int64_t row_bytes;
  // ag_matmul only (w == nullptr for all_gather): out[n*m, cols] = gathered @ w[inner, cols]
  const void* w = nullptr;
  void* out = nullptr;
  int64_t inner = 0, cols = 0;
  Dtype dtype = Dtype::kF32;
};

struct ReduceScatterArgs {    // matmul_rs and reduce_scatter
  const void* y;              // [n*m, inner] (matmul_rs) or [n*m, row_elems] (reduce_scatter)
  void* out;                  // [m, row_elems]
  void* send;                 // matmul_rs: [n-1, m, row_elems]; reduce_scatter: nullptr
  void* recv;                 // [n-1, m, row_elems]
  int64_t m;
  int64_t row_elems;          // K of matmul_rs (w's cols), or the row size of reduce_scatter
  const void* w = nullptr;    // matmul_rs only: [inner, row_elems]
  int64_t inner = 0;
  Dtype dtype = Dtype::kF32;
};

ffi::Error RunAllGather(Backend& backend, const OpConfig& config, const AllGatherArgs& args);
ffi::Error RunReduceScatter(Backend& backend, const OpConfig& config, const ReduceScatterArgs& args);

// A byte offset into a device buffer.
inline const char* Offset(const void* base, int64_t bytes) { return static_cast<const char*>(base) + bytes; }
inline char* Offset(void* base, int64_t bytes) { return static_cast<char*>(base) + bytes; }
// A byte offset into a peer's destination buffer, posted writable by CallSession::Push (posts
// carry every buffer as const void*).
inline char* Destination(const Post& post, int64_t bytes) {
  return static_cast<char*>(const_cast<void*>(post.buffer)) + bytes;
}

// ------------------------------------------------------------------------------------------
// Building blocks shared by the executors of every op (call_session.cc).
// ------------------------------------------------------------------------------------------
// What an owner exposes to its peers in the exchange phase: they read inside
// [buffer, buffer + bytes) after waiting on `events`. The events are recorded in index order on
// one stream, each after the data it guards was written; split into `pieces` equal parts, the
// data of event i lies in part i * pieces / E (E = events.size(); pieces divides E). Examples:
// all_gather exposes x, 1 piece, {ready}; matmul_rs its send partials, one piece per (slot, chunk)
// event; matmul_a2a its send slots, one piece per slot (a slot's chunks are strided rows).
struct Exposure {
  const void* buffer = nullptr;
  int64_t bytes = 0;
  int64_t pieces = 1;
  std::vector<Event> events;
};

// The rendezvous of one call: the key is (run id, op id, occurrence, phase, group), where the
// occurrence separates repeated executions of one call site inside one launch (lax.scan,
// fori_loop, rematerialised copies), because every device runs them in the same order.
class CallSession {
 public:
  // `signature`: shapes, dtype and schedule; every rank of the group must post the same one.
  CallSession(const OpConfig& config, std::vector<int64_t> signature);
  ~CallSession();
  CallSession(const CallSession&) = delete;
  CallSession& operator=(const CallSession&) = delete;

  // The exchange phase. In-process: posts the exposed buffer itself (zero-copy). Across
  // processes: first copies it into this device's staging buffer (the only memory peers in other
  // processes can open, ipc.h), piece by piece (Stage), and posts that instead.
  ffi::Error Exchange(Backend& backend, const Exposure& exposure, std::vector<Post>* posts);
  // Exchange's staging copies alone, to enqueue them ahead of compute work (call_session.cc says why);
  // Exchange with the same exposure then only posts. A no-op in-process and for in-place data.
  ffi::Error Stage(Backend& backend, const Exposure& exposure);
  // Across processes, for data the call itself produces (matmul_rs's send partials): `*region` is
  // this device's staging buffer, `bytes` long, to be written in place on the compute stream, which
  // first waits for the staging stream (earlier calls' staging copies and their peers' pulls);
  // Exchange then posts it without copying. nullptr in-process (write XLA's buffer as before).
  ffi::Error StageInPlace(Backend& backend, int64_t bytes, void** region);
  // Posts (buffer, events) and returns every rank's post once all have arrived. A peer whose
  // shapes or schedule differ from ours is an error, not a wrong answer.
  ffi::Error Meet(Phase phase, const void* buffer, std::vector<Event> events, std::vector<Post>* posts);
  // transfer=push, from the exchange to the landed events. Posts this device's `destination` (where
  // its peers write) and `entry` (their copies into it wait for it), then calls `push` with every
  // rank's post to enqueue this device's pushes, recording pushed[s][j] once chunk j is written
  // into the peer of send slot s (TargetOfSlot). A second meeting (kPushed) hands those events
  // round; `landed[s][j]` is the event of chunk j that the peer of receive slot s (SourceOfSlot)
  // pushed here — that peer's send slot s, as p + 1 + s = r.
  // Failure safety: peers write into this device's buffers, which XLA frees once the handler
  // returns an error. So every rank that passed the exchange meets at kPushed on every path (a
  // rank whose own pushes failed, or the injected "fail" fault, says so in its post), and on any
  // failure, ours or a peer's, XLA's stream waits for every push into this device and for this
  // device's copy streams before the error returns. With `consumed` false (nothing on this device
  // reads the landed data: all_gather, all_to_all, matmul_a2a) XLA's stream waits for them on
  // success too; consumers wait per chunk (and AwaitLanded on a later error).
  using PushFn = std::function<ffi::Error(const std::vector<Post>&, std::vector<std::vector<Event>>*)>;
  ffi::Error Push(Backend& backend, void* destination, Event entry, const PushFn& push, bool consumed,
                  std::vector<std::vector<Event>>* landed);
  // Across processes, within JoinAndRelease (no-ops otherwise): XLA's stream waits for the
  // staging copies (they read XLA's buffers), and, once the peers' pulls_done events are known,
  // the staging stream waits for them (see call_session.cc for why).
  ffi::Error AwaitStagingCopies(Backend& backend);
  ffi::Error ProtectStaging(Backend& backend, const std::vector<Post>& done_posts);

 private:
  // Exchange's and StageInPlace's shared start: copy-stream limit, staging stream, staging region.
  ffi::Error AcquireStaging(Backend& backend, int64_t bytes, void** region);

  const OpConfig& config_;
  std::vector<int64_t> signature_;
  int64_t occurrence_ = 0;
  // The staging buffer holds this call's data and peers may pull from it, but the staging stream
  // does not yet wait for their pulls: if the call fails now, the region is retired (~CallSession).
  bool staging_exposed_ = false;
  Event staged_last_ = nullptr;  // the last staging copy of this call (none when staged in place)
  const void* staged_from_ = nullptr;  // the exposure Stage copied, its staging region and events
  void* staged_region_ = nullptr;
  std::vector<Event> staged_events_;
  const void* in_place_ = nullptr;  // StageInPlace's region
};

// Copy streams a call uses: one for ring, else min(copy_streams, n - 1).
int CopyStreamsUsed(const OpConfig& config);
// The injected fault of config.FAULT_INJECTION, if it is for this rank and moment.
ffi::Error CheckFault(const OpConfig& config, Fault when);
// The first steps of every op: the injected early fault ("skip"), then `rows` (of the chunked
// dimension, named by `what`) must divide by config.chunks, then the device's copy streams and peers.
ffi::Error BeginCall(Backend& backend, const OpConfig& config, int64_t rows, const char* what);
// The join and event release that end every call (see call_session.cc).
ffi::Error JoinAndRelease(Backend& backend, const OpConfig& config, CallSession& session);
// The senders' loop of every transfer=push op (the `push` of CallSession::Push): send slot s goes to
// TargetOfSlot(s) on StreamOfSlot(s) after that target's entry event; chunk j after
// `source_ready(s, j)` (each distinct event waited once per stream; the CPU backend's null events
// are waited every time), its copies enqueued by `copy_chunk(stream, target, post, s, j)`, then
// pushed[s][j] recorded.
using ChunkReady = std::function<Event(int slot, int64_t chunk)>;
using ChunkCopy = std::function<ffi::Error(int stream, int target, const Post& post, int slot, int64_t chunk)>;
ffi::Error PushChunks(Backend& backend, const OpConfig& config, const std::vector<Post>& targets,
                      const ChunkReady& source_ready, const ChunkCopy& copy_chunk,
                      std::vector<std::vector<Event>>* pushed);
// The receivers' loop of every transfer=pull op, its mirror: receive slot s comes from
// SourceOfSlot(s) on StreamOfSlot(s); chunk j after `source_ready(s, j)` (an event of that owner,
// each distinct one waited once per stream), its copies enqueued by
// `copy_chunk(stream, owner, post, s, j)`, then landed[s][j] recorded.
ffi::Error PullChunks(Backend& backend, const OpConfig& config, const std::vector<Post>& owners,
                      const ChunkReady& source_ready, const ChunkCopy& copy_chunk,
                      std::vector<std::vector<Event>>* landed);
// On an error after transfers were enqueued: XLA's stream waits for every landed chunk (pulled by
// this device's copy streams or pushed by its peers) and for this device's copy streams, so the
// buffers XLA frees with the error are no longer written or read. Returns `error`.
ffi::Error AwaitLanded(Backend& backend, const OpConfig& config, const std::vector<std::vector<Event>>& landed,
                       ffi::Error error);
// `stream` waits for `event` unless `*waited` (the event it waited for last, in this loop) is the
// same: a block computed by one matmul (gemm=grouped) posts one event for all of its chunks. Within
// a call no event is re-recorded, so the second wait would change nothing — but across processes
// each wait on a peer's IPC event is not free: 4 x H200, one process per GPU, matmul_rs
// [2048,8192]@[8192,28672] dma/direct/c8/grouped left XLA's stream idle ~250 us per call after its
// matmuls, waiting for pulls that waited 24 times on 3 distinct IPC events (0.613 ms vs 0.388 in
// one process); waiting once per distinct event: 0.437 ms, the idle time ~64 us (session 6).
inline ffi::Error WaitOnce(Backend& backend, int stream, Event event, Event* waited) {
  if (event != nullptr && event == *waited) return ffi::Error::Success();  // (the CPU backend's events are null)
  *waited = event;
  return backend.Wait(stream, event);
}

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_EXECUTOR_H_
