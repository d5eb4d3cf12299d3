// The building blocks every op's executor shares (declared in call_session.h): the call's rendezvous
// and, across processes, its staging (CallSession), the copy loops, the join, and the first steps
// of a call. The pipelines themselves: exec/gather.cc and exec/scatter.cc.
#include "runtime/call_session.h"

#include "runtime/ipc.h"
#include "runtime/watchdog.h"
#include "base/text.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <thread>

namespace ficco {

namespace {
// The error of a wait for rank `peer` that gave up: "group [..], rank r: rank p (device d) <what>:
// missing ranks [p]<tail>", as a meeting's timeout names the late ranks, and why the group's channel
// was retired, if it was.
ffi::Error MissingPeerError(const OpConfig& config, int peer, const std::string& what, const char* tail = "") {
  int64_t run_id = 0;
  const std::string retired = Registry::Get().channels().Of(config.group).Retired(&run_id);
  return MakeError(config.ctx, "group [" + JoinNumbers(config.group) + "], rank " + std::to_string(config.rank) +
                                   ": rank " + std::to_string(peer) + " (device " + std::to_string(config.group[peer]) +
                                   ") " + what + ": missing ranks [" + std::to_string(peer) + "]" + tail +
                                   (retired.empty() ? "" : "; the channel was retired: " + retired));
}

// `stream` waits until `word`, set by rank `peer`, reaches `value`. A CPU backend that gave up
// (device/backend.h) returns an error naming the peer, the word (`what`) and the call.
ffi::Error WaitPeerWord(Backend& backend, const OpConfig& config, int stream, const uint32_t* word, uint32_t value,
                        int peer, const char* what) {
  ffi::Error status = backend.WaitWord(stream, word, value);
  if (status.success() || status.message() != kWordTimedOut) return status;
  return MissingPeerError(config, peer, std::string("did not set its '") + what + "' word of the group's channel to " +
                                            std::to_string(value) + " (it holds " + std::to_string(ReadWord(word)) +
                                            ") within " + ShortNumber(config.timeout_s) + " s");
}

// `stream` waits until `word`, posted by rank `peer`'s device, equals this call's `epoch` (a symmetric
// site's), then checks the launch the data came from. A CPU backend that gave up, or found another
// launch's data, returns an error naming the peer, the word and the call.
ffi::Error WaitPeerCounter(Backend& backend, const OpConfig& config, int stream, const uint32_t* word,
                           const uint32_t* epoch, const LaunchCheck& check, int peer, const char* what) {
  const std::vector<PeerWait> waits{{{word, 0, check}, peer, what}};
  return PeerWaitsError(config, epoch, waits, backend.WaitCounters(stream, CountersOf(epoch, waits)));
}

// Waits on the host until peer `peer`'s host has enqueued what `counter` counts up to call `call`
// (runtime/channel.h says why), spinning for config.spin_s, then sleeping, at most config.timeout_s.
ffi::Error WaitForPeerHost(const OpConfig& config, const std::atomic<uint32_t>& counter, uint32_t call, int peer,
                           const char* what) {
  if (WordReached(counter.load(std::memory_order_acquire), call)) return ffi::Error::Success();
  const TimeSection timed(Registry::Get().channel_waits());
  const auto start = std::chrono::steady_clock::now();
  const auto spin_until = start + std::chrono::duration<double>(config.spin_s);
  const auto deadline = start + std::chrono::duration<double>(config.timeout_s);
  while (!WordReached(counter.load(std::memory_order_acquire), call)) {
    const auto now = std::chrono::steady_clock::now();
    if (now > deadline) {
      return MissingPeerError(config, peer, std::string("has not enqueued ") + what + " of call " +
                                                std::to_string(call) + " of the group's channel within " +
                                                ShortNumber(config.timeout_s) + " s",
                              "; a peer failed or never launched this op");
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return ffi::Error::Success();
}
}  // namespace

ffi::Error WaitOnce(Backend& backend, const OpConfig& config, int stream, const Ready& ready, Ready* waited,
                    int peer, const char* what) {
  if (ready.Same(*waited)) return ffi::Error::Success();
  *waited = ready;
  if (ready.word == nullptr) return backend.Wait(stream, ready.event);
  if (ready.epoch != nullptr) {
    return WaitPeerCounter(backend, config, stream, ready.word, ready.epoch, ready.check, peer, what);
  }
  return WaitPeerWord(backend, config, stream, ready.word, ready.value, peer, what);
}

std::vector<int> OpConfig::LocalOrdinals() const {
  std::vector<int> local;
  for (int ordinal : group_local) {
    if (ordinal >= 0) local.push_back(ordinal);
  }
  return local;
}

CallSession::CallSession(const OpConfig& config, std::vector<int64_t> signature)
    : config_(config), signature_(std::move(signature)) {
  // A group mixing pull, push and symmetric calls is an error, not a hang.
  signature_.push_back(config.symmetric ? 2 : config.push ? 1 : 0);
  occurrence_ = Registry::Get().Device(config.ctx.device_ordinal).NextOccurrence(config.run_id, config.ctx.op_id);
  if (config.cross_process()) ipc_scope_.emplace();
}

namespace {
ffi::Error IpcClosedError(const OpConfig& config) {
  return MakeError(config.ctx, "ficco_jax.runtime.ipc.close() has begun in this process; copy-engine calls across "
                               "processes cannot run after it");
}
}  // namespace

CallSession::~CallSession() {
  if (staging_exposed_) RetireStaging(config_.ctx.device_ordinal);
}

// Across processes the owner's data goes through its staging buffer (ipc.h). Inputs XLA owns
// (all-gather x, reduce-scatter y, all-to-all x) are copied there as below; data the call computes
// itself (matmul_rs / matmul_a2a partials) is written there in place instead, with no staging copy
// (CallSession::StageInPlace, below). A copied call, owner r and one peer p, E events and P pieces
// (P = 1 for all_gather: one `ready`):
//
//   r staging stream: .. wait(p's pulls_done of the previous call) [tail] ..........  | wait(p's pulls_done)
//   r compute (XLA) : write data [ev_0] .. [ev_E-1] wait(tail) copy piece k [staged_k] .. matmuls ..  (join)
//   p copy streams  :                                 wait(staged_k) pull piece k ..  [pulls_done]
//
//   [ev_k]              piece k is valid in XLA's buffer only from the event that guards it; the
//                       copies run after it on XLA's stream, so stream order is the wait.
//   wait(staged_k)      peers pull a piece once it is in the staging buffer.
//   wait(pulls_done)    the next call's staging copies overwrite the region: they must not start
//                       before every peer finished pulling this call's data. The staging stream
//                       waits for the peers' pulls_done events right after the done phase
//                       (ProtectStaging), before the release phase, while those events still hold
//                       this call's records (JoinAndRelease explains the reuse), and the next
//                       staging copy, or in-place write, waits for the staging stream's tail.
//                       Being stream-ordered, the wait protects every later call of this device,
//                       whatever its group and whatever stream XLA runs it on; no double
//                       buffering is needed, and the host never waits for the GPU.
// If the call fails between the first staging copy and ProtectStaging, no such wait is in place:
// the region is retired (kept allocated, never written again; ~CallSession) and the next call
// gets a new one.
// Cost of a copied exposure: one more device-local copy of the exposed bytes per call, on XLA's
// stream ahead of the call's own matmuls (CallSession::Stage says why): 31 us for 64 MiB on an
// H200.
ffi::Error CallSession::Exchange(Backend& backend, const Exposure& exposure, std::vector<Post>* posts) {
  if (!config_.cross_process()) {
    // On a channel every part was published as it was written (StageInPlace, Publish).
    if (gen_ != nullptr && exposure.buffer == in_place_) return ChannelPosts(exposure, posts);
    return Meet(Phase::kExchange, exposure.buffer, exposure.events, posts);
  }
  if (exposure.bytes == 0) return Meet(Phase::kExchange, nullptr, exposure.events, posts);
  if (in_place_ != nullptr && exposure.buffer == in_place_) {
    return Meet(Phase::kExchange, in_place_, exposure.events, posts, exposure.bytes);
  }
  if (staged_from_ != exposure.buffer) FICCO_RETURN_IF_ERROR(Stage(backend, exposure));
  return Meet(Phase::kExchange, staged_region_, staged_events_, posts, exposure.bytes);
}

// The staging copies of Exchange, enqueued before compute work that does not need the peers
// (ag_matmul's own-shard matmul), on XLA's stream. The copy is within one GPU, and such
// copies behave as SM work (device/dma.h): on its own stream it waited for the matmul beside it to free
// the SMs (2 x H200, one process per GPU: the staging copy of x, 64 MiB, began ~0.35 ms
// into a 0.43 ms matmul every call, whatever its place in host order, with
// cudaMemcpyBatchAsync's copy-engine hint or 32 hardware queues), and each peer's pull and
// matmul waited for it. On XLA's stream it runs first, at full speed, then the matmul; the data
// it copies was written before it on that stream, so it needs no wait for the exposure's events.
ffi::Error CallSession::Stage(Backend& backend, const Exposure& exposure) {
  if (!config_.cross_process() || exposure.bytes == 0) return ffi::Error::Success();
  if (in_place_ != nullptr && exposure.buffer == in_place_) return ffi::Error::Success();
  const CallContext& ctx = config_.ctx;
  const int64_t num_events = static_cast<int64_t>(exposure.events.size());
  if (staged_from_ != nullptr) {
    return MakeInvalid(ctx, "a second exposure staged in one call (a bug)");
  }
  if (exposure.bytes < 0 || exposure.buffer == nullptr || exposure.pieces < 1 || num_events < 1 ||
      num_events % exposure.pieces != 0 || exposure.bytes % exposure.pieces != 0) {
    return MakeInvalid(ctx, "exposure of " + std::to_string(exposure.bytes) + " bytes in " +
                                std::to_string(exposure.pieces) + " pieces with " + std::to_string(num_events) +
                                " events: pieces must divide both (a bug)");
  }
  void* staging = nullptr;
  FICCO_RETURN_IF_ERROR(AcquireStaging(backend, exposure.bytes, &staging));
  // As in StageInPlace: the region is written only after the staging stream's waits for the
  // peers' pulls of earlier calls (ProtectStaging).
  Event tail;
  FICCO_RETURN_IF_ERROR(backend.Record(Backend::kStaging, &tail));
  FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, tail));
  const int64_t piece_bytes = exposure.bytes / exposure.pieces;
  std::vector<Event> staged(exposure.pieces);
  for (int64_t k = 0; k < exposure.pieces; ++k) {
    FICCO_RETURN_IF_ERROR(backend.Copy(Backend::kCompute, Offset(staging, k * piece_bytes),
                                       Offset(exposure.buffer, k * piece_bytes), piece_bytes));
    FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &staged[k]));
  }
  staged_events_.assign(num_events, nullptr);
  for (int64_t i = 0; i < num_events; ++i) staged_events_[i] = staged[i * exposure.pieces / num_events];
  staged_region_ = staging;
  staged_from_ = exposure.buffer;
  return ffi::Error::Success();
}

// The staging stream (the slot after the copy streams, so their count must leave it free) and this
// device's staging region of `bytes`, from now on exposed: retired if the call fails before
// ProtectStaging (~CallSession).
// A group that gave up is refused first: a region taken and then retired by every failing call
// would stay allocated for each of them.
ffi::Error CallSession::AcquireStaging(Backend& backend, int64_t bytes, void** region) {
  if (!ipc_scope_ || !ipc_scope_->open()) return IpcClosedError(config_);
  FICCO_RETURN_IF_ERROR(backend.Prepare(kCopyStreamSlots, config_.LocalOrdinals(), config_.symmetric));
  FICCO_RETURN_IF_ERROR(FailIfGroupGaveUp(config_));
  FICCO_RETURN_IF_ERROR(StagingBuffer(config_, static_cast<uint64_t>(bytes), region));
  staging_exposed_ = true;
  return ffi::Error::Success();
}

// Partials written straight into the staging buffer skip the staging copy (one HBM read and write
// of (n-1)/n of matmul_rs's output per call). Ordering: the compute stream waits for the staging
// stream's tail, so these writes come after every earlier staging copy and after the waits for
// the peers' pulls of earlier calls (ProtectStaging) — the same guarantee a staging copy has. The
// next call's staging copies wait for this call's peers' pulls, which follow these writes.
ffi::Error CallSession::StageInPlace(Backend& backend, int64_t bytes, int64_t pieces, void** region) {
  *region = nullptr;
  if (!config_.cross_process()) {
    // On a channel EnterChannel's waits on XLA's stream come before the writes.
    FICCO_RETURN_IF_ERROR(EnterChannel(backend, bytes, pieces));
    if (gen_ != nullptr) *region = gen_->Region(config_.rank);
    in_place_ = *region;
    return ffi::Error::Success();
  }
  if (bytes <= 0) return ffi::Error::Success();
  FICCO_RETURN_IF_ERROR(AcquireStaging(backend, bytes, region));
  in_place_ = *region;
  Event tail;
  FICCO_RETURN_IF_ERROR(backend.Record(Backend::kStaging, &tail));
  return backend.Wait(Backend::kCompute, tail);
}

ffi::Error CallSession::ProtectStaging(Backend& backend, const std::vector<Post>& done_posts) {
  if (!staging_exposed_) return ffi::Error::Success();
  for (int rank = 0; rank < config_.n(); ++rank) {
    if (rank == config_.rank) continue;
    for (Event pulls_done : done_posts[rank].events) FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kStaging, pulls_done));
  }
  staging_exposed_ = false;
  return ffi::Error::Success();
}

ffi::Error CallSession::Meet(Phase phase, const void* buffer, std::vector<Event> events, std::vector<Post>* posts,
                             int64_t bytes) {
  return MeetAt(KeyOf(phase), phase, Post{config_.ctx.device_ordinal, signature_, buffer, std::move(events)}, posts,
                bytes);
}

ffi::Error CallSession::MeetAt(const RendezvousKey& key, Phase phase, Post post, std::vector<Post>* posts,
                               int64_t bytes, double timeout_s) {
  const std::vector<int64_t> signature = post.signature;
  if (config_.cross_process()) {
    // Peers in other processes of this host: the host mailbox, buffers and events as IPC handles,
    // every post tagged with this call's ordinal in the group, its phase and its launch.
    if (!ipc_scope_ || !ipc_scope_->open()) return IpcClosedError(config_);
    if (ipc_call_ == 0) FICCO_RETURN_IF_ERROR(NextIpcCall(config_, &ipc_call_));
    FICCO_RETURN_IF_ERROR(MeetAcrossProcesses(config_, phase, ipc_call_, post, bytes, posts));
  } else {
    FICCO_RETURN_IF_ERROR(Registry::Get().rendezvous().Arrive(key, Who(timeout_s), std::move(post), posts));
  }
  for (int rank = 0; rank < config_.n(); ++rank) {
    const Post& peer = (*posts)[rank];
    if (peer.signature != signature) {
      return MakeInvalid(config_.ctx, "rank " + std::to_string(rank) + " (device " + std::to_string(config_.group[rank]) +
                                          ") runs this op with [" + JoinNumbers(peer.signature) + "] but rank " +
                                          std::to_string(config_.rank) + " with [" + JoinNumbers(signature) +
                                          "] (shapes, dtype, schedule)");
    }
  }
  if (config_.watch != nullptr) config_.watch->NotePeers(config_, phase, *posts);
  return ffi::Error::Success();
}

ffi::Error CallSession::EnterChannel(Backend& backend, int64_t bytes, int64_t pieces) {
  if (config_.cross_process() || config_.push || config_.symmetric || config_.n() < 2 || bytes <= 0 ||
      bytes > config_.channel_bytes ||
      pieces > kChannelMaxPieces) {
    return ffi::Error::Success();
  }
  Channel& channel = Registry::Get().channels().Of(config_.group);
  std::shared_ptr<ChannelGeneration> gen = channel.Current();
  int64_t retired_run = 0;
  const std::string retired = gen != nullptr && gen->retired() ? channel.Retired(&retired_run) : "";
  if (!retired.empty() && retired_run == config_.run_id) {
    return MakeError(config_.ctx, "group [" + JoinNumbers(config_.group) + "]: a call of this launch failed on its "
                                  "channel, so this one cannot run; " + retired);
  }
  if (gen == nullptr || gen->retired() || gen->capacity() < bytes) {
    FICCO_RETURN_IF_ERROR(SetUpChannel(backend, channel, gen == nullptr ? 0 : gen->number() + 1, bytes, &gen));
  }
  const uint64_t count = gen->NextCall(config_.rank);
  const uint32_t call = static_cast<uint32_t>(count);  // what the words carry
  const int differs = gen->CheckSignature(config_.rank, call, SignatureHash(signature_));
  if (differs >= 0) {
    return MakeInvalid(config_.ctx, "rank " + std::to_string(differs) + " (device " +
                                        std::to_string(config_.group[differs]) + ") of group [" +
                                        JoinNumbers(config_.group) + "] ran another op (shapes, dtype or schedule) "
                                        "at this call of the group's channel: the devices of a group must run the "
                                        "same copy-engine calls in the same order");
  }
  gen_ = std::move(gen);
  call_ = call;
  if (count == 1) return ffi::Error::Success();  // a fresh region: nobody has read it
  for (int reader = 0; reader < config_.n(); ++reader) {
    if (reader == config_.rank) continue;
    FICCO_RETURN_IF_ERROR(WaitForPeerHost(config_, gen_->Released(reader), call_ - 1, reader,
                                          "the end of its pulls (its 'done' word)"));
    uint32_t* done = gen_->Done(config_.rank, reader);
    if (config_.watch != nullptr) config_.watch->NoteWord(config_, reader, "done", 0, done, call_ - 1);
    FICCO_RETURN_IF_ERROR(WaitPeerWord(backend, config_, Backend::kCompute, done, call_ - 1, reader, "done"));
  }
  return ffi::Error::Success();
}

void CallSession::EndChannelCall() {
  if (gen_ != nullptr) gen_->Released(config_.rank).store(call_, std::memory_order_release);
}

// A generation's regions are sized to the call that makes it, rounded up to a power of two (so that
// growing calls make few generations), at most config.channel_bytes.
ffi::Error CallSession::SetUpChannel(Backend& backend, Channel& channel, int64_t number, int64_t bytes,
                                     std::shared_ptr<ChannelGeneration>* generation) {
  int64_t capacity = 1;
  while (capacity < bytes) capacity *= 2;
  capacity = std::max(bytes, std::min(capacity, config_.channel_bytes));
  Post post{config_.ctx.device_ordinal, signature_, nullptr, {}};
  post.signature.insert(post.signature.end(), {number, capacity});
  void* region = nullptr;
  FICCO_RETURN_IF_ERROR(backend.AllocateRegion(capacity, &region));
  post.buffer = region;
  if (config_.rank == 0) {
    FICCO_RETURN_IF_ERROR(backend.AllocateWords(ChannelGeneration::WordCount(config_.n()), &post.words));
  }
  // Keyed by this launch: ranks that are still in a launch whose call failed cannot meet ranks that
  // are already in the next one.
  const RendezvousKey key{config_.run_id, config_.ctx.op_id, -1 - number, Phase::kSetup, config_.group_index};
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(MeetAt(key, Phase::kSetup, std::move(post), &posts));
  *generation = channel.Install(number, capacity, posts);
  return ffi::Error::Success();
}

// The site's allocations are made and exchanged in one meeting at its first call on each device (keyed
// by this launch: a setup that failed on some rank is tried again, afresh, at the next launch); the
// signature compared there covers the shapes, dtypes and schedule, hence the slots' size and chunks.
ffi::Error CallSession::SymmetricSiteOf(Backend& backend, int64_t slot_bytes, std::shared_ptr<SymmetricSite>* out) {
  SymmetricSites& sites = Registry::Get().symmetric();
  const SymmetricSites::Key key{config_.ctx.op_id, config_.group, config_.chunks, slot_bytes};
  std::shared_ptr<SymmetricSite> site = sites.Find(key);
  if (site == nullptr || site->WatchOf(config_.rank).started == nullptr) {
    const int64_t bytes = SymmetricSite::Bytes(config_.n(), config_.chunks, slot_bytes);
    void* region = nullptr;
    FICCO_RETURN_IF_ERROR(backend.AllocateRegion(bytes, &region));
    if (config_.cross_process()) FICCO_RETURN_IF_ERROR(ExportRegion(config_, region, static_cast<uint64_t>(bytes)));
    uint32_t* watch = nullptr;  // started, finished, stopped, parted (3)
    FICCO_RETURN_IF_ERROR(backend.AllocateWords(6, &watch));
    uint32_t* launch = nullptr;
    FICCO_RETURN_IF_ERROR(sites.LaunchWord(backend, {config_.ctx.op_id, config_.ctx.device_ordinal, config_.group},
                                           &launch));
    // Keyed by the call's occurrence too: two sites of one op id (a folded batch moves other blocks
    // under it) set up in one launch are two meetings, not one rank arriving twice.
    const RendezvousKey meeting{config_.run_id, config_.ctx.op_id, occurrence_, Phase::kSymmetric,
                                config_.group_index};
    std::vector<Post> posts;
    FICCO_RETURN_IF_ERROR(MeetAt(meeting, Phase::kSymmetric, Post{config_.ctx.device_ordinal, signature_, region, {}},
                                 &posts, bytes));
    std::vector<char*> bases;
    for (const Post& post : posts) bases.push_back(static_cast<char*>(const_cast<void*>(post.buffer)));
    site = sites.Install(key, std::move(bases), config_.rank);
    if (config_.cross_process()) sites.MarkCrossProcess(key);
    site->SetWatch(config_.rank, {watch, watch + 1, watch + 2, watch + 3, launch});
    if (config_.watchdog_s > 0) Registry::Get().watchdog().WatchSite(config_, site, watch, watch + 1, watch + 3);
  }
  if (config_.launch_from_run) {
    FICCO_RETURN_IF_ERROR(
        backend.SetWord(Backend::kCompute, site->WatchOf(config_.rank).launch, static_cast<uint32_t>(config_.run_id)));
  }
  const std::string failed = site->Failed();
  if (!failed.empty()) {
    return MakeError(config_.ctx, "an earlier call of this copy-engine site failed in this process (" + failed +
                                      "); the group's counters may be out of step, so the site cannot run again "
                                      "here: restart the process");
  }
  *out = std::move(site);
  return ffi::Error::Success();
}

ffi::Error CallSession::Publish(Backend& backend, int64_t piece, int64_t pieces) {
  if (gen_ == nullptr) return ffi::Error::Success();
  const int reader = config_.TargetOfSlot(static_cast<int>(piece * (config_.n() - 1) / pieces));
  return backend.SetWord(Backend::kCompute, gen_->Ready(config_.rank, reader, piece), call_);
}

ffi::Error CallSession::ChannelPosts(const Exposure& exposure, std::vector<Post>* posts) {
  const int64_t events = static_cast<int64_t>(exposure.events.size());
  if (exposure.pieces < 1 || events < exposure.pieces || events % exposure.pieces != 0) {
    return MakeInvalid(config_.ctx, "exposure in " + std::to_string(exposure.pieces) + " pieces with " +
                                        std::to_string(events) + " events: pieces must divide the events (a bug)");
  }
  // Every ready word of ours is enqueued (Publish): say so, then wait until every owner's are.
  gen_->Published(config_.rank).store(call_, std::memory_order_release);
  for (int owner = 0; owner < config_.n(); ++owner) {
    if (owner == config_.rank) continue;
    FICCO_RETURN_IF_ERROR(WaitForPeerHost(config_, gen_->Published(owner), call_, owner, "its data's 'ready' words"));
  }
  posts->assign(config_.n(), Post{});
  for (int owner = 0; owner < config_.n(); ++owner) {
    Post& post = (*posts)[owner];
    post.ordinal = config_.group[owner];
    post.buffer = gen_->Region(owner);
    if (owner == config_.rank) continue;
    post.events.assign(events, nullptr);
    post.ready.resize(events);
    for (int64_t i = 0; i < events; ++i) post.ready[i] = gen_->Ready(owner, config_.rank, i * exposure.pieces / events);
    post.done = gen_->Done(owner, config_.rank);
    post.value = call_;
    if (config_.watch == nullptr) continue;
    // This device reads only the owner's send slot for it (Publish sets no other word for it).
    const int64_t slot = (config_.rank - owner - 1 + config_.n()) % config_.n();
    const int64_t per_slot = exposure.pieces / (config_.n() - 1);
    for (int64_t piece = slot * per_slot; piece < (slot + 1) * per_slot; ++piece) {
      config_.watch->NoteWord(config_, owner, "ready", piece, gen_->Ready(owner, config_.rank, piece), call_);
    }
  }
  return ffi::Error::Success();
}

ffi::Error CallSession::Announce(Phase phase, Announcement* all) {
  if (config_.cross_process()) return MakeInvalid(config_.ctx, "an announcement across processes (a bug)");
  return Registry::Get().rendezvous().Announce(KeyOf(phase), Who(), all);
}

RendezvousKey CallSession::KeyOf(Phase phase) const {
  return {config_.run_id, config_.ctx.op_id, occurrence_, phase, config_.group_index};
}

Arrival CallSession::Who(double timeout_s) const {
  return {&config_.ctx, &config_.group, config_.rank, timeout_s > 0.0 ? timeout_s : config_.timeout_s, config_.spin_s};
}

namespace {
// kPushed posts carry no buffer; a rank whose pushes did not all happen posts this marker instead.
const char kPushFailed = 0;

// XLA's stream waits for the last work of every copy stream this call used, each tried even after
// one failed (a stream left unjoined may still write memory XLA reuses); the first error is returned.
// The events recorded are returned in `last` (null where recording failed).
ffi::Error JoinCopyStreams(Backend& backend, const OpConfig& config, std::vector<Event>* last = nullptr) {
  ffi::Error first = ffi::Error::Success();
  std::vector<Event> recorded(CopyStreamsUsed(config), nullptr);
  for (int stream = 0; stream < CopyStreamsUsed(config); ++stream) {
    ffi::Error status = backend.Record(stream, &recorded[stream]);
    // A record that failed leaves the stream's copies with nothing to wait on: try once more before
    // giving up on it (the error is still reported).
    if (status.failure() && backend.Record(stream, &recorded[stream]).success()) {
      (void)backend.Wait(Backend::kCompute, recorded[stream]);
    } else if (status.success()) {
      status = backend.Wait(Backend::kCompute, recorded[stream]);
    }
    if (status.failure() && first.success()) first = std::move(status);
  }
  if (last != nullptr) *last = std::move(recorded);
  return first;
}

// XLA's stream waits for every recorded event of `landed` (a chunk never recorded, of a peer that
// failed, is null and skipped; the CPU backend's are null and need no wait). Every wait is tried,
// even after one fails (the point is that none of the writes into this device is left unwaited);
// the first error is returned.
ffi::Error WaitForLanded(Backend& backend, const Landed& landed) {
  ffi::Error first = ffi::Error::Success();
  Event waited = nullptr;
  for (const std::vector<Ready>& slot : landed) {
    for (const Ready& ready : slot) {
      if (ready.event == nullptr) continue;  // (a word: what a symmetric call's peers post, not its own copies)
      ffi::Error status = WaitOnce(backend, Backend::kCompute, ready.event, &waited);
      if (status.failure() && first.success()) first = std::move(status);
    }
  }
  return first;
}

// The copy loop of both directions. Slot s pairs this device with SourceOfSlot(s) (pull: that owner's
// data comes here) or TargetOfSlot(s) (push: ours goes there); the slot's copies run on
// StreamOfSlot(s); chunk j waits for `source_ready(s, j)` (each distinct event once per stream), is
// enqueued by `copy_chunks`, and its event recorded into recorded[s][j] (kPerSlot: after the slot's
// last chunk, into every recorded[s][j] of it); a symmetric call records none (`recorded` null).
// Where the source marks a slot ready at once (ReadyMarks::kPerSlot) and nothing here takes a chunk as
// it lands (kPerSlot), the slot's chunks go in one copy, after all of their readiness: one stream
// would run them in order anyway, and every copy enqueued costs a call into the driver.
//
// Before its first copy a stream waits for the entry event of the device it writes: the target's
// (push) or this device's own (pull, `own_entry`). A copy stream is not XLA's stream: without that
// wait it starts as soon as the source is ready, while the written device's XLA stream may still
// run the work before this call, and XLA's buffer assignment may have given the memory of this
// call's results to that work (its temporaries, a cuBLAS workspace). Pulls that started early
// corrupted the work before the call and left an XLA matmul waiting for ever on 2 x H100
// (docs/design.md, "Copies wait for the device they write").
ffi::Error CopyChunks(Backend& backend, const OpConfig& config, bool push, const std::vector<Post>& peers,
                      Event own_entry, const ChunkReady& source_ready, ReadyMarks readiness,
                      const ChunkCopy& copy_chunks, LandedEvents marks, const SymmetricCall* symmetric,
                      Landed* recorded) {
  std::vector<Ready> waited(CopyStreamsUsed(config));
  std::vector<Event> entered(CopyStreamsUsed(config), nullptr);
  const bool whole_slots = readiness == ReadyMarks::kPerSlot && marks == LandedEvents::kPerSlot;
  const int64_t span = whole_slots ? config.chunks : 1;  // chunks per copy
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    const int peer = push ? config.TargetOfSlot(slot) : config.SourceOfSlot(slot);
    const int stream = config.StreamOfSlot(slot);
    // A symmetric call writes the target's slot of its site, which XLA never uses: instead of the
    // target's entry it waits until the target has read the previous call's block from it, which its
    // start on XLA's stream did (SymmetricCall::Begin), and each copy stream entered the call there
    // (EnterCopyStreams).
    if (symmetric == nullptr) {
      FICCO_RETURN_IF_ERROR(WaitOnce(backend, stream, push ? peers[peer].events[0] : own_entry, &entered[stream]));
    } else if (waited[stream].event == nullptr) {
      waited[stream] = Ready(own_entry);
    }
    for (int64_t j = 0; j < config.chunks; j += span) {
      const int64_t end = j + span;
      ffi::Error status = ffi::Error::Success();
      for (int64_t i = j; i < end && status.success(); ++i) {
        status = WaitOnce(backend, config, stream, source_ready(slot, i), &waited[stream], peer, "ready");
      }
      if (status.success()) status = copy_chunks(stream, peer, peers[peer], slot, j, span);
      // The owner may overwrite its region once this device pulled everything of it.
      if (status.success() && end == config.chunks && peers[peer].done != nullptr) {
        status = backend.SetWord(stream, peers[peer].done, peers[peer].value);
      }
      // A symmetric target learns from the site's words what landed (per chunk, or once per slot).
      const int64_t first = marks == LandedEvents::kPerSlot ? 0 : j;
      if (status.success() && symmetric != nullptr) status = symmetric->PostLanded(backend, stream, slot, first, end);
      // A failed chunk is marked too: whatever of the slot was enqueued before the failure must
      // still be waited for by the device it writes (AwaitLanded). A symmetric call's copies are
      // marked by its words alone: its join, or its failure, waits for its copy streams' last work.
      if (status.success() && marks == LandedEvents::kPerSlot && end < config.chunks) continue;
      if (symmetric != nullptr) {
        FICCO_RETURN_IF_ERROR(status);
        continue;
      }
      Event event = nullptr;
      ffi::Error recorded_status = backend.Record(stream, &event);
      std::vector<Ready>& marked = (*recorded)[slot];
      std::fill(marked.begin() + first, marked.begin() + end, Ready(event));
      FICCO_RETURN_IF_ERROR(status);
      FICCO_RETURN_IF_ERROR(recorded_status);
    }
  }
  return ffi::Error::Success();
}
}  // namespace

ffi::Error AwaitLanded(Backend& backend, const OpConfig& config, const Landed& landed, ffi::Error error) {
  (void)WaitForLanded(backend, landed);  // best effort: the call fails anyway
  (void)JoinCopyStreams(backend, config);
  return error;
}

ffi::Error PullChunks(Backend& backend, const OpConfig& config, const std::vector<Post>& owners, Event entry,
                      const ChunkReady& source_ready, ReadyMarks readiness, const ChunkCopy& copy_chunks,
                      LandedEvents marks, Landed* landed) {
  return CopyChunks(backend, config, /*push=*/false, owners, entry, source_ready, readiness, copy_chunks, marks,
                    /*symmetric=*/nullptr, landed);
}

ffi::Error PushChunks(Backend& backend, const OpConfig& config, const std::vector<Post>& targets,
                      const ChunkReady& source_ready, ReadyMarks readiness, const ChunkCopy& copy_chunks,
                      LandedEvents marks, Landed* pushed) {
  return CopyChunks(backend, config, /*push=*/true, targets, /*own_entry=*/nullptr, source_ready, readiness,
                    copy_chunks, marks, /*symmetric=*/nullptr, pushed);
}

ffi::Error PushSymmetric(Backend& backend, const OpConfig& config, const SymmetricCall& symmetric, Event entry,
                         const ChunkReady& source_ready, ReadyMarks readiness, const ChunkCopy& copy_chunks,
                         LandedEvents marks) {
  const std::vector<Post> none(config.n());  // the destinations are the site's slots (copy_chunks knows them)
  return CopyChunks(backend, config, /*push=*/true, none, entry, source_ready, readiness, copy_chunks, marks,
                    &symmetric, /*recorded=*/nullptr);  // the site's words mark the copies
}

ffi::Error EnterCopyStreams(Backend& backend, const OpConfig& config, Event entry) {
  for (int stream = 0; stream < CopyStreamsUsed(config); ++stream) FICCO_RETURN_IF_ERROR(backend.Wait(stream, entry));
  return ffi::Error::Success();
}

Landed SymmetricLanded(const OpConfig& config, const SymmetricCall& symmetric) {
  Landed landed(config.n() - 1, std::vector<Ready>(config.chunks));
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    for (int64_t j = 0; j < config.chunks; ++j) {
      const PeerWait wait = symmetric.LandedWait(slot, j);
      landed[slot][j] = Ready(wait.wait.word, symmetric.Epoch(), wait.wait.check);
    }
  }
  return landed;
}

ffi::Error CallSession::Push(Backend& backend, void* destination, Event entry, const PushFn& push, bool consumed,
                             Landed* landed) {
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(Meet(Phase::kExchange, destination, {entry}, &posts));  // all or none: no push yet
  const int slots = config_.n() - 1;
  Landed pushed(slots, std::vector<Ready>(config_.chunks));
  ffi::Error mine = push(posts, &pushed);
  if (mine.failure()) {
    // A chunk whose event was never recorded (its record failed, or the loop stopped before it) is
    // covered by its stream's tail, recorded now after everything enqueued there: the receivers wait
    // for that instead of skipping a null event. (The CPU backend's events are null: its copies are
    // done when enqueued.)
    std::vector<Event> tails;
    (void)JoinCopyStreams(backend, config_, &tails);
    for (int slot = 0; slot < slots; ++slot) {
      for (Ready& ready : pushed[slot]) {
        if (ready.event == nullptr) ready = Ready(tails[config_.StreamOfSlot(slot)]);
      }
    }
  }
  std::vector<Event> flat;
  for (const std::vector<Ready>& slot : pushed) {
    for (const Ready& ready : slot) flat.push_back(ready.event);
  }
  // Every rank that passed the exchange comes here on every path, a call later at most: wait for it
  // as long as the watchdog waits for a stuck device, since returning without its pushed events lets
  // its writes land in memory XLA reuses.
  const double pushed_timeout_s = std::max(config_.timeout_s, config_.watchdog_s);
  ffi::Error met = MeetAt(KeyOf(Phase::kPushed), Phase::kPushed,
                          Post{config_.ctx.device_ordinal, signature_, mine.failure() ? &kPushFailed : nullptr,
                               std::move(flat)},
                          &posts, 0, pushed_timeout_s);
  if (met.failure()) {
    // A peer never came (its host is stuck): what it pushed here is unknown, and XLA would reuse
    // this device's buffers under its writes. Like the watchdog for a stuck device, end the process
    // with the reason rather than return.
    (void)JoinCopyStreams(backend, config_);
    if (config_.watchdog_s > 0) {
      std::fprintf(stderr, "ficco_jax: %s; its peers' pushes into this device cannot be waited for, so the "
                           "process ends (as the watchdog ends a stuck device's, FICCO_WATCHDOG_S)\n",
                   met.message().c_str());
      std::fflush(stderr);
      std::abort();
    }
    return mine.failure() ? std::move(mine) : std::move(met);
  }
  landed->assign(slots, {});
  int failed_peer = -1;
  for (int slot = 0; slot < slots; ++slot) {
    const int source = config_.SourceOfSlot(slot);
    const std::vector<Event>& theirs = posts[source].events;
    (*landed)[slot].assign(theirs.begin() + slot * config_.chunks, theirs.begin() + (slot + 1) * config_.chunks);
    if (posts[source].buffer == &kPushFailed) failed_peer = source;
  }
  if (mine.success() && failed_peer < 0) return consumed ? ffi::Error::Success() : WaitForLanded(backend, *landed);
  if (mine.success()) {
    mine = MakeError(config_.ctx, "rank " + std::to_string(failed_peer) + " (device " +
                                      std::to_string(config_.group[failed_peer]) +
                                      ") failed before all of its pushes were enqueued; its error says why");
  }
  return AwaitLanded(backend, config_, *landed, std::move(mine));
}

int CopyStreamsUsed(const OpConfig& config) {
  if (config.order == Order::kRing) return 1;
  return std::max(1, std::min(config.copy_streams, config.n() - 1));
}

// The join: nothing this call wrote or exposed may be touched by XLA until every copy that
// writes this device's buffers (its own copy streams) and every copy that reads them (peers'
// copy streams, reading x or send) has finished.
//
//   copy streams : ... pulls ... [pulls_done]
//   compute      : ... matmuls ... wait(own pulls_done) wait(peers' pulls_done) -> return
//
// Event reuse: events come from a per-device pool and are re-recorded by later calls. A
// cudaStreamWaitEvent uses the record that is current when the wait is *enqueued*, so an event
// may be re-recorded only after every peer has enqueued its waits on it. Peers enqueue their
// waits on our ready/chunk events before arriving at "done" (or "pushed"), and on our pulls_done
// events right after "done"; the "release" phase comes after all of them, and only from there may
// our events go back to the pool. (On errors they are not returned: a peer may still wait on them.)
//
// In one process nobody waits at "release": each rank announces that it got there and returns
// (Rendezvous::Announce), and the watchdog gives the call's events back once its device work is
// done *and* every rank of the group has announced (watchdog.h). A rank that re-records an event
// of this call before a peer waited on it would make that peer wait for a later record — on 2 GPUs,
// for work behind the peer's own next call: a deadlock — and the announcement rules that out as the
// meeting did, without the third host meeting per call. Across processes the events are exported
// into a bounded table (ipc_mailbox.h) and go back at a release meeting, as before.
ffi::Error JoinAndRelease(Backend& backend, const OpConfig& config, CallSession& session,
                          const SymmetricCall* symmetric) {
  // Every copy stream is joined before any error returns; a stream whose join failed leaves this
  // call's copies unaccounted for, and the call fails (its peers then fail at their next meeting).
  std::vector<Event> pulls_done;
  FICCO_RETURN_IF_ERROR(JoinCopyStreams(backend, config, &pulls_done));
  if (symmetric != nullptr) {
    // Every reader of the slots is enqueued before, on XLA's stream or joined into it: they are
    // released with the call's end. No peer waits on this call's events (its peers read the site's
    // words), and its own streams have enqueued their waits on them: they go back to the pool at
    // once. Nothing to meet.
    FICCO_RETURN_IF_ERROR(symmetric->End(backend));
    backend.ReleaseEvents();
    backend.Pool().Release(backend.TakeReusable());
    return ffi::Error::Success();
  }
  if (session.on_channel()) {
    // Peers read only the channel's region, which the next call's waits protect (EnterChannel), and
    // none waits on this call's events: they go back once its device work is done.
    session.EndChannelCall();
    backend.ReleaseEvents();
    if (config.watch != nullptr) config.watch->ReleaseAfter(nullptr);
    return ffi::Error::Success();
  }
  std::vector<Post> posts;
  // transfer=push: no peer's copy touches this device's buffers but its pushes into them, and XLA's
  // stream already waits for every one of those (the consumers per chunk, CallSession::Push for the
  // rest), so there is nothing for the done meeting to add: it is skipped. The release meeting stays:
  // peers enqueue their waits on our pushed events after kPushed, before they reach it.
  if (!config.push) {
    FICCO_RETURN_IF_ERROR(session.Meet(Phase::kDone, nullptr, pulls_done, &posts));
    for (int rank = 0; rank < config.n(); ++rank) {
      if (rank == config.rank) continue;
      for (Event event : posts[rank].events) FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, event));
    }
    FICCO_RETURN_IF_ERROR(session.ProtectStaging(backend, posts));
  }
  if (config.cross_process()) {
    FICCO_RETURN_IF_ERROR(session.Meet(Phase::kRelease, nullptr, {}, &posts));
    backend.ReleaseEvents();
    return ffi::Error::Success();
  }
  Announcement released;
  FICCO_RETURN_IF_ERROR(session.Announce(Phase::kRelease, &released));
  backend.ReleaseEvents();
  if (config.watch != nullptr) config.watch->ReleaseAfter(std::move(released));
  return ffi::Error::Success();
}

ffi::Error BeginCall(Backend& backend, const OpConfig& config, int64_t rows, const char* what) {
  if (config.push && config.cross_process()) {
    return MakeInvalid(config.ctx, "transfer=push writes into the peers' XLA buffers, which other processes "
                                   "cannot open; a group across processes needs transfer=pull");
  }
  if (config.chunks < 1 || rows % config.chunks != 0) {
    return MakeInvalid(config.ctx, std::string(what) + " = " + std::to_string(rows) +
                                       " must divide by chunks = " + std::to_string(config.chunks));
  }
  // A symmetric call copies its results out of the site on the staging stream (exec/gather.cc).
  return backend.Prepare(config.symmetric ? kCopyStreamSlots : CopyStreamsUsed(config), config.LocalOrdinals(),
                         config.symmetric);
}

}  // namespace ficco
