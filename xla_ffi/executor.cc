#include "executor.h"

#include "ipc.h"
#include "text.h"

#include <algorithm>

namespace ficco {
namespace {

const char* Offset(const void* base, int64_t bytes) { return static_cast<const char*>(base) + bytes; }
char* Offset(void* base, int64_t bytes) { return static_cast<char*>(base) + bytes; }

std::string Join(const std::vector<int64_t>& values) { return JoinNumbers(values); }

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
                                          ") runs this op with [" + Join(peer.signature) + "] but rank " +
                                          std::to_string(config_.rank) + " with [" + Join(signature_) +
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
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Meet(Phase::kDone, nullptr, pulls_done, &posts));
  for (int rank = 0; rank < config.n(); ++rank) {
    if (rank == config.rank) continue;
    for (Event event : posts[rank].events) FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, event));
  }
  FICCO_RETURN_IF_ERROR(session.Meet(Phase::kRelease, nullptr, {}, &posts));
  backend.ReleaseEvents();
  return ffi::Error::Success();
}

ffi::Error CheckChunks(const OpConfig& config, int64_t rows, const char* what) {
  if (config.chunks >= 1 && rows % config.chunks == 0) return ffi::Error::Success();
  return MakeInvalid(config.ctx, std::string(what) + " = " + std::to_string(rows) +
                                     " must divide by chunks = " + std::to_string(config.chunks));
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
  FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kSkip));
  FICCO_RETURN_IF_ERROR(CheckChunks(config, a.m, "rows per device"));
  FICCO_RETURN_IF_ERROR(backend.Prepare(CopyStreamsUsed(config), config.LocalOrdinals()));
  const bool matmul = a.w != nullptr;
  CallSession session(config, {matmul ? 1 : 3, static_cast<int>(a.dtype), a.m, a.row_bytes, a.inner,
                               a.cols, config.chunks, static_cast<int>(config.order),
                               static_cast<int>(config.gemm), config.copy_streams, config.n()});
  const int r = config.rank;
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));

  // Owner: x is valid from `ready`; own work that needs no peer starts at once.
  Event ready;
  FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &ready));
  if (matmul) {
    FICCO_RETURN_IF_ERROR(backend.Gemm({a.x, a.w, Offset(a.out, r * a.m * a.cols * esize), a.m, a.inner,
                                        a.cols, a.dtype}));
  }
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Meet(Phase::kExchange, a.x, {ready}, &posts));
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
  // join, so it must not delay the first peer chunk the matmuls wait for.
  const int last_stream = CopyStreamsUsed(config) - 1;
  FICCO_RETURN_IF_ERROR(backend.Wait(last_stream, ready));
  FICCO_RETURN_IF_ERROR(backend.Copy(last_stream, Offset(a.gathered, r * a.m * a.row_bytes), a.x, a.m * a.row_bytes));
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
  FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kSkip));
  FICCO_RETURN_IF_ERROR(CheckChunks(config, a.m, "rows per output block"));
  FICCO_RETURN_IF_ERROR(backend.Prepare(CopyStreamsUsed(config), config.LocalOrdinals()));
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
  std::vector<Event> exposed;
  if (matmul) {
    FICCO_RETURN_IF_ERROR(SendPartials(backend, config, a, &exposed));
  } else {
    Event ready;
    FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &ready));
    exposed.assign((config.n() - 1) * config.chunks, ready);
  }
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Meet(Phase::kExchange, matmul ? a.send : a.y, exposed, &posts));
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
