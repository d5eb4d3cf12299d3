#include "executor.h"

#include "ipc.h"
#include "text.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace ficco {
namespace {

const char* Offset(const void* base, int64_t bytes) { return static_cast<const char*>(base) + bytes; }
char* Offset(void* base, int64_t bytes) { return static_cast<char*>(base) + bytes; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Building blocks shared by every op's executor (declared in executor.h)
// ---------------------------------------------------------------------------------------------
std::vector<int> OpConfig::LocalOrdinals() const {
  std::vector<int> local;
  for (int ordinal : group_local) {
    if (ordinal >= 0) local.push_back(ordinal);
  }
  return local;
}

CallSession::CallSession(const OpConfig& config, std::vector<int64_t> signature)
    : config_(config), signature_(std::move(signature)) {
  occurrence_ = Registry::Get().Device(config.ctx.device_ordinal).NextOccurrence(config.run_id, config.ctx.op_id);
}

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
//   wait(ev_k)          piece k is valid in XLA's buffer only from the event that guards it (on
//                       XLA's stream, where the copies run, this holds by stream order).
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
// H200. With FICCO_STAGE_STREAM=copy the copies run on the staging stream instead (then the
// compute stream's join waits for the last of them, AwaitStagingCopies).
ffi::Error CallSession::Exchange(Backend& backend, const Exposure& exposure, std::vector<Post>* posts) {
  if (!config_.cross_process()) return Meet(Phase::kExchange, exposure.buffer, exposure.events, posts);
  if (exposure.bytes == 0) return Meet(Phase::kExchange, nullptr, exposure.events, posts);
  if (in_place_ != nullptr && exposure.buffer == in_place_) return Meet(Phase::kExchange, in_place_, exposure.events, posts);
  if (staged_from_ != exposure.buffer) FICCO_RETURN_IF_ERROR(Stage(backend, exposure));
  return Meet(Phase::kExchange, staged_region_, staged_events_, posts);
}

// The staging copies of Exchange, enqueued before compute work that does not need the peers
// (ag_matmul's own-shard matmul), on XLA's stream by default. The copy is within one GPU, and such
// copies behave as SM work (dma.h): on its own stream it waited for the matmul beside it to free
// the SMs (2 x H200, one process per GPU, session 5: the staging copy of x, 64 MiB, began ~0.35 ms
// into a 0.43 ms matmul every call, whatever its place in host order, with
// cudaMemcpyBatchAsync's copy-engine hint or 32 hardware queues), and each peer's pull and
// matmul waited for it. On XLA's stream it runs first, at full speed, then the matmul.
// FICCO_STAGE_STREAM=copy puts it back on the staging stream (read once; for A/B timings).
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
  static const bool on_staging_stream = [] {
    const char* choice = std::getenv("FICCO_STAGE_STREAM");
    return choice != nullptr && std::strcmp(choice, "copy") == 0;
  }();
  const int stream = on_staging_stream ? Backend::kStaging : Backend::kCompute;
  if (stream == Backend::kCompute) {
    // As in StageInPlace: the region is written only after the staging stream's waits for the
    // peers' pulls of earlier calls (ProtectStaging).
    Event tail;
    FICCO_RETURN_IF_ERROR(backend.Record(Backend::kStaging, &tail));
    FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, tail));
  }
  const int64_t piece_bytes = exposure.bytes / exposure.pieces;
  std::vector<Event> staged(exposure.pieces);
  for (int64_t k = 0; k < exposure.pieces; ++k) {
    // Events are recorded in index order on one stream: the last one of piece k covers all of it.
    const Event written = exposure.events[(k + 1) * num_events / exposure.pieces - 1];
    FICCO_RETURN_IF_ERROR(backend.Wait(stream, written));
    FICCO_RETURN_IF_ERROR(backend.Copy(stream, Offset(staging, k * piece_bytes),
                                       Offset(exposure.buffer, k * piece_bytes), piece_bytes));
    FICCO_RETURN_IF_ERROR(backend.Record(stream, &staged[k]));
  }
  staged_last_ = staged.back();
  staged_events_.assign(num_events, nullptr);
  for (int64_t i = 0; i < num_events; ++i) staged_events_[i] = staged[i * exposure.pieces / num_events];
  staged_region_ = staging;
  staged_from_ = exposure.buffer;
  return ffi::Error::Success();
}

// The staging stream (the slot after the copy streams, so their count must leave it free) and this
// device's staging region of `bytes`, from now on exposed: retired if the call fails before
// ProtectStaging (~CallSession).
ffi::Error CallSession::AcquireStaging(Backend& backend, int64_t bytes, void** region) {
  if (CopyStreamsUsed(config_) > kMaxCopyStreams) {
    return MakeInvalid(config_.ctx, "copy_streams = " + std::to_string(config_.copy_streams) + " exceeds the maximum " +
                                        std::to_string(kMaxCopyStreams));
  }
  FICCO_RETURN_IF_ERROR(backend.Prepare(kCopyStreamSlots, config_.LocalOrdinals()));
  FICCO_RETURN_IF_ERROR(StagingBuffer(config_, static_cast<uint64_t>(bytes), region));
  staging_exposed_ = true;
  return ffi::Error::Success();
}

// Partials written straight into the staging buffer skip the staging copy (one HBM read and write
// of (n-1)/n of matmul_rs's output per call). Ordering: the compute stream waits for the staging
// stream's tail, so these writes come after every earlier staging copy and after the waits for
// the peers' pulls of earlier calls (ProtectStaging) — the same guarantee a staging copy has. The
// next call's staging copies wait for this call's peers' pulls, which follow these writes.
ffi::Error CallSession::StageInPlace(Backend& backend, int64_t bytes, void** region) {
  *region = nullptr;
  if (!config_.cross_process() || bytes <= 0) return ffi::Error::Success();
  FICCO_RETURN_IF_ERROR(AcquireStaging(backend, bytes, region));
  in_place_ = *region;
  Event tail;
  FICCO_RETURN_IF_ERROR(backend.Record(Backend::kStaging, &tail));
  return backend.Wait(Backend::kCompute, tail);
}

ffi::Error CallSession::AwaitStagingCopies(Backend& backend) {
  if (!staging_exposed_ || staged_last_ == nullptr) return ffi::Error::Success();
  return backend.Wait(Backend::kCompute, staged_last_);
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

ffi::Error CallSession::Meet(Phase phase, const void* buffer, std::vector<Event> events, std::vector<Post>* posts) {
  Post post{config_.ctx.device_ordinal, signature_, buffer, std::move(events)};
  if (config_.cross_process()) {
    // Peers in other processes of this host: the host mailbox, buffers and events as IPC handles.
    FICCO_RETURN_IF_ERROR(MeetAcrossProcesses(config_, phase, post, posts));
  } else {
    RendezvousKey key{config_.run_id, config_.ctx.op_id, occurrence_, phase, config_.group_index};
    Arrival who{&config_.ctx, &config_.group, config_.rank, config_.timeout_s, config_.spin_s};
    FICCO_RETURN_IF_ERROR(Registry::Get().rendezvous().Arrive(key, who, std::move(post), posts));
  }
  for (int rank = 0; rank < config_.n(); ++rank) {
    const Post& peer = (*posts)[rank];
    if (peer.signature != signature_) {
      return MakeInvalid(config_.ctx, "rank " + std::to_string(rank) + " (device " + std::to_string(config_.group[rank]) +
                                          ") runs this op with [" + JoinNumbers(peer.signature) + "] but rank " +
                                          std::to_string(config_.rank) + " with [" + JoinNumbers(signature_) +
                                          "] (shapes, dtype, schedule)");
    }
  }
  return ffi::Error::Success();
}

int CopyStreamsUsed(const OpConfig& config) {
  if (config.order == Order::kRing) return 1;
  return std::max(1, std::min(config.copy_streams, config.n() - 1));
}

ffi::Error CheckFault(const OpConfig& config, Fault when) {
  if (config.fault != when || config.rank != config.fault_rank) return ffi::Error::Success();
  return MakeError(config.ctx, std::string("injected fault '") + (when == Fault::kSkip ? "skip" : "fail") +
                                   "' on rank " + std::to_string(config.rank) +
                                   " (config.FAULT_INJECTION is set)");
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
// waits on our ready/chunk events before arriving at "done", and on our pulls_done events right
// after "done"; the "release" phase therefore comes after all of them, and only then do we
// return our events to the pool. (On errors the events are not returned: a peer may still
// wait on them.)
ffi::Error JoinAndRelease(Backend& backend, const OpConfig& config, CallSession& session) {
  std::vector<Event> pulls_done(CopyStreamsUsed(config));
  for (int stream = 0; stream < static_cast<int>(pulls_done.size()); ++stream) {
    FICCO_RETURN_IF_ERROR(backend.Record(stream, &pulls_done[stream]));
    FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, pulls_done[stream]));
  }
  FICCO_RETURN_IF_ERROR(session.AwaitStagingCopies(backend));  // across processes: see CallSession::Exchange
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Meet(Phase::kDone, nullptr, pulls_done, &posts));
  for (int rank = 0; rank < config.n(); ++rank) {
    if (rank == config.rank) continue;
    for (Event event : posts[rank].events) FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, event));
  }
  FICCO_RETURN_IF_ERROR(session.ProtectStaging(backend, posts));
  FICCO_RETURN_IF_ERROR(session.Meet(Phase::kRelease, nullptr, {}, &posts));
  backend.ReleaseEvents();
  return ffi::Error::Success();
}

ffi::Error BeginCall(Backend& backend, const OpConfig& config, int64_t rows, const char* what) {
  FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kSkip));
  if (config.chunks < 1 || rows % config.chunks != 0) {
    return MakeInvalid(config.ctx, std::string(what) + " = " + std::to_string(rows) +
                                       " must divide by chunks = " + std::to_string(config.chunks));
  }
  return backend.Prepare(CopyStreamsUsed(config), config.LocalOrdinals());
}

// ---------------------------------------------------------------------------------------------
// all_gather and ag_matmul
// ---------------------------------------------------------------------------------------------
namespace {

// Compute stream of ag_matmul: consume the pulled chunks in the order they were issued.
ffi::Error AllGatherMatmuls(Backend& backend, const OpConfig& config, const AllGatherArgs& a,
                            const std::vector<std::vector<Event>>& landed) {
  const int64_t q = a.m / config.chunks;
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    const int64_t peer_row = config.SourceOfSlot(slot) * a.m;
    for (int64_t j = 0; j < config.chunks; ++j) {
      FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, landed[slot][j]));
      if (config.gemm == GemmMode::kPerChunk) {
        const int64_t row = peer_row + j * q;
        FICCO_RETURN_IF_ERROR(backend.Gemm({Offset(a.gathered, row * a.row_bytes), a.w,
                                            Offset(a.out, row * a.cols * esize), q, a.inner, a.cols, a.dtype}));
      }
    }
    if (config.gemm == GemmMode::kGrouped) {
      FICCO_RETURN_IF_ERROR(backend.Gemm({Offset(a.gathered, peer_row * a.row_bytes), a.w,
                                          Offset(a.out, peer_row * a.cols * esize), a.m, a.inner, a.cols, a.dtype}));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error RunAllGather(Backend& backend, const OpConfig& config, const AllGatherArgs& a) {
  FICCO_RETURN_IF_ERROR(BeginCall(backend, config, a.m, "rows per device"));
  const bool matmul = a.w != nullptr;
  CallSession session(config, {matmul ? 1 : 3, static_cast<int>(a.dtype), a.m, a.row_bytes, a.inner,
                               a.cols, config.chunks, static_cast<int>(config.order),
                               static_cast<int>(config.gemm), config.copy_streams, config.n()});
  const int r = config.rank;
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));

  // Owner: x is valid from `ready`; own work that needs no peer starts at once.
  Event ready;
  FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &ready));
  const Exposure exposure{a.x, a.m * a.row_bytes, 1, {ready}};
  FICCO_RETURN_IF_ERROR(session.Stage(backend, exposure));  // across processes: before the matmul (Stage)
  if (matmul) {
    FICCO_RETURN_IF_ERROR(backend.Gemm({a.x, a.w, Offset(a.out, r * a.m * a.cols * esize), a.m, a.inner,
                                        a.cols, a.dtype}));
  }
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Exchange(backend, exposure, &posts));
  FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kFail));

  // Puller: peers by ring distance (r-1 first), each chunk into its rows of `gathered`.
  const int64_t q = a.m / config.chunks;
  std::vector<std::vector<Event>> landed(config.n() - 1, std::vector<Event>(config.chunks));
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    const int peer = config.SourceOfSlot(slot);
    const int stream = config.StreamOfSlot(slot);
    FICCO_RETURN_IF_ERROR(backend.Wait(stream, posts[peer].events[0]));
    for (int64_t j = 0; j < config.chunks; ++j) {
      const int64_t row = peer * a.m + j * q;
      FICCO_RETURN_IF_ERROR(backend.Copy(stream, Offset(a.gathered, row * a.row_bytes),
                                         Offset(posts[peer].buffer, j * q * a.row_bytes), q * a.row_bytes));
      FICCO_RETURN_IF_ERROR(backend.Record(stream, &landed[slot][j]));
    }
  }
  // Our own rows of `gathered` go last on the last copy stream: the copy is only needed by the
  // join, so it must not delay the first peer chunk the matmuls wait for. When nobody reads
  // `gathered` (ag_matmul's plain forward) it is skipped: a 1-device ag_matmul at
  // [8192,8192]@[8192,5120] took 1.018 ms with the copy and 0.985 without (one H200, session 4).
  if (!(matmul && config.skip_own_rows)) {
    const int last_stream = CopyStreamsUsed(config) - 1;
    FICCO_RETURN_IF_ERROR(backend.Wait(last_stream, ready));
    FICCO_RETURN_IF_ERROR(backend.Copy(last_stream, Offset(a.gathered, r * a.m * a.row_bytes), a.x, a.m * a.row_bytes));
  }
  if (matmul) FICCO_RETURN_IF_ERROR(AllGatherMatmuls(backend, config, a, landed));
  return JoinAndRelease(backend, config, session);
}

// ---------------------------------------------------------------------------------------------
// reduce_scatter and matmul_rs
// ---------------------------------------------------------------------------------------------
namespace {

// Compute stream of matmul_rs, before the exchange: the partial for each peer (in the order
// that peer pulls them), then our own block straight into `out`. Returns one event per
// (slot, chunk) that marks the partial as written.
ffi::Error SendPartials(Backend& backend, const OpConfig& config, const ReduceScatterArgs& a,
                        std::vector<Event>* written) {
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));
  const int64_t q = a.m / config.chunks;
  const int64_t block_bytes = a.m * a.row_elems * esize;
  const int64_t y_row_bytes = a.inner * esize;
  written->assign((config.n() - 1) * config.chunks, nullptr);
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    const int64_t target_row = config.TargetOfSlot(slot) * a.m;
    void* send = Offset(a.send, slot * block_bytes);
    if (config.gemm == GemmMode::kGrouped) {
      // One matmul per peer block; its chunks still move separately.
      FICCO_RETURN_IF_ERROR(backend.Gemm({Offset(a.y, target_row * y_row_bytes), a.w, send, a.m, a.inner,
                                          a.row_elems, a.dtype}));
      Event done;
      FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &done));
      std::fill_n(written->begin() + slot * config.chunks, config.chunks, done);
      continue;
    }
    for (int64_t j = 0; j < config.chunks; ++j) {
      FICCO_RETURN_IF_ERROR(backend.Gemm({Offset(a.y, (target_row + j * q) * y_row_bytes), a.w,
                                          Offset(send, j * q * a.row_elems * esize), q, a.inner,
                                          a.row_elems, a.dtype}));
      FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &(*written)[slot * config.chunks + j]));
    }
  }
  const int64_t own_row = config.rank * a.m;
  return backend.Gemm({Offset(a.y, own_row * y_row_bytes), a.w, a.out, a.m, a.inner, a.row_elems, a.dtype});
}

// Compute stream after the pulls: out[chunk] = own[chunk] + sum over slots of recv[slot][chunk].
// gemm=grouped reduces the whole block once after every chunk has landed.
ffi::Error ReduceChunks(Backend& backend, const OpConfig& config, const ReduceScatterArgs& a,
                        const void* own, const std::vector<std::vector<Event>>& landed) {
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));
  const int64_t block_elems = a.m * a.row_elems;
  const bool grouped = config.gemm == GemmMode::kGrouped && a.w != nullptr;
  const int64_t pieces = grouped ? 1 : config.chunks;
  const int64_t piece_elems = block_elems / pieces;
  const int64_t chunks_per_piece = config.chunks / pieces;
  for (int64_t piece = 0; piece < pieces; ++piece) {
    for (int slot = 0; slot < config.n() - 1; ++slot) {
      for (int64_t j = piece * chunks_per_piece; j < (piece + 1) * chunks_per_piece; ++j) {
        FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, landed[slot][j]));
      }
    }
    const int64_t offset = piece * piece_elems * esize;
    FICCO_RETURN_IF_ERROR(backend.Reduce({Offset(a.out, offset), Offset(own, offset), Offset(a.recv, offset),
                                          block_elems, config.n() - 1, piece_elems, a.dtype}));
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error RunReduceScatter(Backend& backend, const OpConfig& config, const ReduceScatterArgs& a) {
  FICCO_RETURN_IF_ERROR(BeginCall(backend, config, a.m, "rows per output block"));
  const bool matmul = a.w != nullptr;
  CallSession session(config, {matmul ? 2 : 4, static_cast<int>(a.dtype), a.m, a.row_elems, a.inner,
                               config.chunks, static_cast<int>(config.order), static_cast<int>(config.gemm),
                               config.copy_streams, config.n()});
  const int r = config.rank;
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));
  const int64_t block_bytes = a.m * a.row_elems * esize;
  const int64_t q = a.m / config.chunks;
  const int64_t chunk_bytes = q * a.row_elems * esize;

  // Owner: matmul_rs exposes its send partials (one event per chunk); reduce_scatter exposes y.
  // Across processes the partials are written straight into the staging buffer peers read.
  std::vector<Event> exposed;
  ReduceScatterArgs args = a;
  if (matmul) {
    void* in_place = nullptr;
    FICCO_RETURN_IF_ERROR(session.StageInPlace(backend, (config.n() - 1) * block_bytes, &in_place));
    if (in_place != nullptr) args.send = in_place;
    FICCO_RETURN_IF_ERROR(SendPartials(backend, config, args, &exposed));
  } else {
    Event ready;
    FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &ready));
    exposed.assign((config.n() - 1) * config.chunks, ready);
  }
  std::vector<Post> posts;
  // Peers read send's n-1 blocks (one piece per (slot, chunk) event), or y's other blocks.
  const Exposure exposure = matmul ? Exposure{args.send, (config.n() - 1) * block_bytes,
                                              static_cast<int64_t>(exposed.size()), exposed}
                                   : Exposure{a.y, config.n() * block_bytes, 1, exposed};
  FICCO_RETURN_IF_ERROR(session.Exchange(backend, exposure, &posts));
  FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kFail));

  // Puller: from peer p = r-1-s, its block for us. In matmul_rs that is p's send slot s (p's
  // slot s targets p+1+s = r); in reduce_scatter it is rows [r*m, (r+1)*m) of p's y.
  std::vector<std::vector<Event>> landed(config.n() - 1, std::vector<Event>(config.chunks));
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    const Post& peer = posts[config.SourceOfSlot(slot)];
    const int stream = config.StreamOfSlot(slot);
    const void* source = matmul ? Offset(peer.buffer, slot * block_bytes) : Offset(peer.buffer, r * block_bytes);
    for (int64_t j = 0; j < config.chunks; ++j) {
      FICCO_RETURN_IF_ERROR(backend.Wait(stream, peer.events[slot * config.chunks + j]));
      FICCO_RETURN_IF_ERROR(backend.Copy(stream, Offset(a.recv, slot * block_bytes + j * chunk_bytes),
                                         Offset(source, j * chunk_bytes), chunk_bytes));
      FICCO_RETURN_IF_ERROR(backend.Record(stream, &landed[slot][j]));
    }
  }
  const void* own = matmul ? static_cast<const void*>(a.out) : Offset(a.y, r * block_bytes);
  FICCO_RETURN_IF_ERROR(ReduceChunks(backend, config, a, own, landed));
  return JoinAndRelease(backend, config, session);
}

}  // namespace ficco
