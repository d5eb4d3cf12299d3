// The building blocks of one call that every executor (exec/) shares: its rendezvous and, across
// processes, its staging (CallSession), the chunk copy loops of both directions, and the join that
// ends it.
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_CALL_SESSION_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_CALL_SESSION_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "base/errors.h"
#include "device/backend.h"
#include "runtime/channel.h"
#include "runtime/ipc.h"
#include "runtime/op_config.h"
#include "runtime/registry.h"
#include "runtime/symmetric.h"

namespace ficco {

// A byte offset into a peer's destination buffer, posted writable by CallSession::Push (posts
// carry every buffer as const void*).
inline char* Destination(const Post& post, int64_t bytes) {
  return static_cast<char*>(const_cast<void*>(post.buffer)) + bytes;
}

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

// What a stream waits for before it touches data another stream or device wrote: an event; on a
// channel, a word reaching a value (Post::ready); on a symmetric site, a word equal to this call's
// epoch (runtime/symmetric.h), both compared on the device.
struct Ready {
  Ready(Event event = nullptr) : event(event) {}  // NOLINT: an event is a Ready
  Ready(const uint32_t* word, uint32_t value) : word(word), value(value) {}
  Ready(const uint32_t* word, const uint32_t* epoch, LaunchCheck check) : word(word), epoch(epoch), check(check) {}
  // The same wait: waiting for it twice on one stream changes nothing.
  bool Same(const Ready& other) const {
    return word != nullptr ? word == other.word : event != nullptr && event == other.event;
  }
  Event event = nullptr;
  const uint32_t* word = nullptr;
  uint32_t value = 0;
  const uint32_t* epoch = nullptr;
  LaunchCheck check;  // a symmetric site's: the launch the data came from (device/backend.h)
};
// What landed of each receive slot s, chunk j: landed[s][j] (the same Ready for every chunk of a
// slot marked once: LandedEvents::kPerSlot).
using Landed = std::vector<std::vector<Ready>>;
// What event (or word) i of `post` stands for.
inline Ready ReadyOf(const Post& post, int64_t i) {
  return post.ready.empty() ? Ready(post.events[i]) : Ready(post.ready[i], post.value);
}

// The rendezvous of one call: the key is (run id, op id, occurrence, phase, group), where the
// occurrence separates repeated executions of one call site inside one launch (lax.scan,
// fori_loop, rematerialised copies), because every device runs them in the same order.
//
// Or its group's channel (runtime/channel.h), which an in-process pull call uses instead where it
// computes the data its peers read in place (StageInPlace: matmul_rs's and matmul_a2a's partials) and
// that data fits config.channel_bytes. Decided in StageInPlace, the same on every rank (it depends on
// the op alone); the call then meets nobody, except where the channel needs a new generation.
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
  // Exchange then posts it without copying. In-process, where the call runs on its group's channel:
  // this rank's channel region, which XLA's stream writes once the readers pulled the previous
  // call's data from it, in `pieces` parts, each published (Publish) once written. nullptr
  // otherwise (write XLA's buffer as before).
  ffi::Error StageInPlace(Backend& backend, int64_t bytes, int64_t pieces, void** region);
  // On a channel, once XLA's stream has enqueued the writes of part `piece` of StageInPlace's region
  // (of `pieces`): sets, on XLA's stream, the ready word of the rank that reads it (part p belongs to
  // send slot p * (n-1) / pieces, read by TargetOfSlot of that slot). A no-op off the channel.
  ffi::Error Publish(Backend& backend, int64_t piece, int64_t pieces);
  // Whether this call runs on its group's channel.
  bool on_channel() const { return gen_ != nullptr; }
  // On a channel, after the pulls were enqueued: says that this rank's done words of this call are
  // enqueued (the owners' next calls wait for that on the host: runtime/channel.h).
  void EndChannelCall();
  // Posts (buffer, events) and returns every rank's post once all have arrived. A peer whose
  // shapes or schedule differ from ours is an error, not a wrong answer. Across processes peers may
  // read `bytes` of `buffer` (checked against the mapping they open).
  ffi::Error Meet(Phase phase, const void* buffer, std::vector<Event> events, std::vector<Post>* posts,
                  int64_t bytes = 0);
  // In-process groups: notes that this rank reached `phase` without waiting for its peers
  // (Rendezvous::Announce); `*all` turns true once every rank has.
  ffi::Error Announce(Phase phase, Announcement* all);
  // transfer=push, from the exchange to the landed events. Posts this device's `destination` (where
  // its peers write) and `entry` (their copies into it wait for it), then calls `push` with every
  // rank's post to enqueue this device's pushes, recording pushed[s][j] once chunk j is written
  // into the peer of send slot s (TargetOfSlot). A second meeting (kPushed) hands those events
  // round; `landed[s][j]` is the event of chunk j that the peer of receive slot s (SourceOfSlot)
  // pushed here — that peer's send slot s, as p + 1 + s = r.
  // Failure safety: peers write into this device's buffers, which XLA frees once the handler
  // returns an error. So every rank that passed the exchange meets at kPushed on every path (a
  // rank whose own pushes failed says so in its post, and posts, for every chunk it has no event of,
  // its copy stream's tail recorded after the failure), the kPushed meeting waits as long as the
  // watchdog would for a stuck device (returning without a peer's events would let its writes land
  // in reused memory; past that the process ends with a report), and on any
  // failure, ours or a peer's, XLA's stream waits for every push into this device and for this
  // device's copy streams before the error returns. With `consumed` false (nothing on this device
  // reads the landed data: all_gather, all_to_all, matmul_a2a) XLA's stream waits for them on
  // success too; consumers wait per chunk (and AwaitLanded on a later error).
  using PushFn = std::function<ffi::Error(const std::vector<Post>&, Landed*)>;
  ffi::Error Push(Backend& backend, void* destination, Event entry, const PushFn& push, bool consumed,
                  Landed* landed);
  // transfer=symmetric: this call's site (runtime/symmetric.h) for blocks of `slot_bytes`, made in
  // one meeting of the group at the site's first call on this device; an error where an earlier
  // call of the site failed in this process.
  ffi::Error SymmetricSiteOf(Backend& backend, int64_t slot_bytes, std::shared_ptr<SymmetricSite>* site);
  // Across processes, within JoinAndRelease (a no-op otherwise): once the peers' pulls_done events
  // are known, the staging stream waits for them (see call_session.cc for why).
  ffi::Error ProtectStaging(Backend& backend, const std::vector<Post>& done_posts);

 private:
  // This call's key and arrival in the in-process rendezvous (Meet and Announce): one key per phase.
  RendezvousKey KeyOf(Phase phase) const;
  Arrival Who(double timeout_s = 0.0) const;
  // Meet's work, for a post (and its signature) of any phase: in-process at `key`, or across processes.
  // `timeout_s` > 0 replaces config.timeout_s (the pushed meeting's, CallSession::Push).
  ffi::Error MeetAt(const RendezvousKey& key, Phase phase, Post post, std::vector<Post>* posts, int64_t bytes = 0,
                    double timeout_s = 0.0);
  // The channel (runtime/channel.h): whether this call can use it, and if so its
  // generation (SetUpChannel), its number, the signature check, and the owner's waits until every
  // reader pulled its data of the previous call.
  ffi::Error EnterChannel(Backend& backend, int64_t bytes, int64_t pieces);
  ffi::Error SetUpChannel(Backend& backend, Channel& channel, int64_t number, int64_t bytes,
                          std::shared_ptr<ChannelGeneration>* generation);
  // Every owner's post, made from the channel: its region, the ready words of `exposure`'s events.
  ffi::Error ChannelPosts(const Exposure& exposure, std::vector<Post>* posts);
  // Exchange's and StageInPlace's shared start: copy-stream limit, staging stream, staging region.
  ffi::Error AcquireStaging(Backend& backend, int64_t bytes, void** region);

  const OpConfig& config_;
  std::vector<int64_t> signature_;
  int64_t occurrence_ = 0;
  // Across processes: this device's ordinal of this call in its group (every post's tag carries it,
  // ipc_mailbox.h), taken at the call's first meeting; and the call's hold on the IPC mappings, which
  // ipc.close() waits for (runtime/ipc.h).
  uint64_t ipc_call_ = 0;
  std::optional<IpcCallScope> ipc_scope_;
  // The staging buffer holds this call's data and peers may pull from it, but the staging stream
  // does not yet wait for their pulls: if the call fails now, the region is retired (~CallSession).
  bool staging_exposed_ = false;
  const void* staged_from_ = nullptr;  // the exposure Stage copied, its staging region and events
  void* staged_region_ = nullptr;
  std::vector<Event> staged_events_;
  const void* in_place_ = nullptr;  // StageInPlace's region
  std::shared_ptr<ChannelGeneration> gen_;  // the channel's generation this call runs on; null: meetings
  uint32_t call_ = 0;                       // this call's number on it
};

// Copy streams a call uses: one for ring, else min(copy_streams, n - 1).
int CopyStreamsUsed(const OpConfig& config);
// The first steps of every op: `rows` (of the chunked dimension, named by `what`) must divide by
// config.chunks, then the device's copy streams and peers.
ffi::Error BeginCall(Backend& backend, const OpConfig& config, int64_t rows, const char* what);
// The join and the release of the call's events that end every call (see call_session.cc); a
// symmetric call's end is posted for the watchdog (runtime/symmetric.h).
ffi::Error JoinAndRelease(Backend& backend, const OpConfig& config, CallSession& session,
                          const SymmetricCall* symmetric = nullptr);
// How finely the chunk loops below mark what landed: an event per chunk, for a consumer that takes
// each chunk as it lands (per-chunk matmuls, a reduce-scatter's per-chunk sums), or one per slot,
// recorded after its last chunk and stored for every chunk of it, for a consumer that takes a slot
// whole (gemm=grouped) or none at all (the collectives, which only the join waits for). A slot's
// chunks run in order on one copy stream, so its last chunk's event covers them all; each event
// recorded costs a call into the driver, and its wait another (c8/grouped on 2 GPUs: 16 of them).
enum class LandedEvents { kPerChunk, kPerSlot };
// How the data that moves is made ready: chunk by chunk (per-chunk matmuls write each send chunk in
// turn, and its copy should start as soon as it is written), or a slot at once (x itself, y of a
// reduce_scatter, one matmul per block). With kPerSlot marks as well, a slot moves in one copy.
enum class ReadyMarks { kPerChunk, kPerSlot };
// The senders' loop of every transfer=push op (the `push` of CallSession::Push): send slot s goes to
// TargetOfSlot(s) on StreamOfSlot(s) after that target's entry event; chunk j after
// `source_ready(s, j)` (each distinct event waited once per stream; the CPU backend's null events
// are waited every time), chunks [j, j + count) enqueued by `copy_chunks(stream, target, post, s, j,
// count)` (count = 1, or every chunk of the slot: `readiness`), then pushed[s][j] recorded (`marks`).
using ChunkReady = std::function<Ready(int slot, int64_t chunk)>;
using ChunkCopy =
    std::function<ffi::Error(int stream, int target, const Post& post, int slot, int64_t chunk, int64_t count)>;
ffi::Error PushChunks(Backend& backend, const OpConfig& config, const std::vector<Post>& targets,
                      const ChunkReady& source_ready, ReadyMarks readiness, const ChunkCopy& copy_chunks,
                      LandedEvents marks, Landed* pushed);
// The same loop for transfer=symmetric (runtime/symmetric.h): no posts, and no events: each copy
// stream has waited for `entry` (EnterCopyStreams: this call's epoch is counted, every target has
// read the previous call's block from its slot, the data it sends is valid), and posts `landed` to the
// target after each mark; a failure is joined by the copy streams' last work (AwaitLanded).
ffi::Error PushSymmetric(Backend& backend, const OpConfig& config, const SymmetricCall& symmetric, Event entry,
                         const ChunkReady& source_ready, ReadyMarks readiness, const ChunkCopy& copy_chunks,
                         LandedEvents marks);
// A symmetric call's first wait on each of its copy streams: for `entry`, recorded on XLA's stream.
// While XLA captures the call, a stream joins the capture only by waiting for captured work, and XLA's
// stream may wait for an event of a stream that has joined it, never of one that has not (CUDA refuses
// it: cudaErrorStreamCaptureIsolation); the join at the call's end records on every copy stream.
ffi::Error EnterCopyStreams(Backend& backend, const OpConfig& config, Event entry);
// The receiver's waits of a symmetric call: landed[s][j], each chunk's word equal to the epoch.
Landed SymmetricLanded(const OpConfig& config, const SymmetricCall& symmetric);
// The receivers' loop of every transfer=pull op, its mirror: receive slot s comes from
// SourceOfSlot(s) on StreamOfSlot(s), after `entry` (this call's start on XLA's stream, which opens
// this device's buffers to the copies: call_session.cc says why); chunk j after `source_ready(s, j)`
// (an event or word of that owner, each distinct one waited once per stream), its copies enqueued by
// `copy_chunks(stream, owner, post, s, j, count)`, then landed[s][j] recorded (`marks`). On a channel
// the slot's stream then sets the owner's done word (Post::done).
ffi::Error PullChunks(Backend& backend, const OpConfig& config, const std::vector<Post>& owners, Event entry,
                      const ChunkReady& source_ready, ReadyMarks readiness, const ChunkCopy& copy_chunks,
                      LandedEvents marks, Landed* landed);
// On an error after transfers were enqueued: XLA's stream waits for every landed chunk (pulled by
// this device's copy streams or pushed by its peers) and for this device's copy streams, so the
// buffers XLA frees with the error are no longer written or read. Returns `error`.
ffi::Error AwaitLanded(Backend& backend, const OpConfig& config, const Landed& landed, ffi::Error error);
// `stream` waits for `ready` unless `*waited` (what it waited for last, in this loop) is the same: a
// block computed by one matmul (gemm=grouped) posts one event for all of its chunks. Within a call no
// event is re-recorded and no word changes back, so the second wait would change nothing — but
// across processes each wait on a peer's IPC event is not free: 4 x H200, one process per GPU,
// matmul_rs [2048,8192]@[8192,28672] dma/direct/c8/grouped left XLA's stream idle ~250 us per call
// after its matmuls, waiting for pulls that waited 24 times on 3 distinct IPC events (0.613 ms vs
// 0.388 in one process); waiting once per distinct event: 0.437 ms, the idle time ~64 us. A word is
// `peer`'s (`what` names it in the error of a CPU wait that gave up).
ffi::Error WaitOnce(Backend& backend, const OpConfig& config, int stream, const Ready& ready, Ready* waited,
                    int peer, const char* what);
inline ffi::Error WaitOnce(Backend& backend, int stream, Event event, Event* waited) {
  if (event != nullptr && event == *waited) return ffi::Error::Success();  // (the CPU backend's events are null)
  *waited = event;
  return backend.Wait(stream, event);
}

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_CALL_SESSION_H_
