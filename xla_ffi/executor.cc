// The executors of all_gather / ag_matmul and reduce_scatter / matmul_rs: one schedule per call,
// built from the shared blocks of call_session.cc.
#include "executor.h"

#include <algorithm>

namespace ficco {

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
  const int64_t q = a.m / config.chunks;
  std::vector<std::vector<Event>> landed(config.n() - 1, std::vector<Event>(config.chunks));
  if (config.push) {
    // Sender: x to every peer (r+1 first), each chunk into our rows of its `gathered`, once the
    // peer entered this call (its `ready` doubles as entry) and x is valid (our `ready`).
    auto push = [&](const std::vector<Post>& targets, std::vector<std::vector<Event>>* pushed) {
      return PushChunks(backend, config, targets, [&](int, int64_t) { return ready; },
                        [&](int stream, int, const Post& target, int, int64_t j) {
                          return backend.Copy(stream, Destination(target, (r * a.m + j * q) * a.row_bytes),
                                              Offset(a.x, j * q * a.row_bytes), q * a.row_bytes);
                        }, pushed);
    };
    FICCO_RETURN_IF_ERROR(session.Push(backend, a.gathered, ready, push, /*consumed=*/matmul, &landed));
  } else {
    FICCO_RETURN_IF_ERROR(session.Exchange(backend, exposure, &posts));
    FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kFail));
    // Puller: peers by ring distance (r-1 first), each chunk into its rows of `gathered`.
    FICCO_RETURN_IF_ERROR(PullChunks(
        backend, config, posts, [&](int slot, int64_t) { return posts[config.SourceOfSlot(slot)].events[0]; },
        [&](int stream, int peer, const Post& post, int, int64_t j) {
          return backend.Copy(stream, Offset(a.gathered, (peer * a.m + j * q) * a.row_bytes),
                              Offset(post.buffer, j * q * a.row_bytes), q * a.row_bytes);
        }, &landed));
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
  if (matmul) {
    ffi::Error multiplied = AllGatherMatmuls(backend, config, a, landed);
    if (multiplied.failure()) return AwaitLanded(backend, config, landed, std::move(multiplied));
  }
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
  // With transfer=push, `entry` opens our `recv` to the peers' writes, before our own matmuls.
  std::vector<Event> exposed;
  ReduceScatterArgs args = a;
  Event entry = nullptr;
  if (config.push) FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &entry));
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
  std::vector<std::vector<Event>> landed(config.n() - 1, std::vector<Event>(config.chunks));
  if (config.push) {
    // Sender: to the peer t = r+1+s its block — our send slot s (matmul_rs) or rows [t*m, (t+1)*m)
    // of y (reduce_scatter) — into slot s of t's recv (t's receive slot s is fed by t-1-s = r).
    auto push = [&](const std::vector<Post>& targets, std::vector<std::vector<Event>>* pushed) {
      return PushChunks(backend, config, targets, [&](int slot, int64_t j) { return exposed[slot * config.chunks + j]; },
                        [&](int stream, int target, const Post& post, int slot, int64_t j) {
                          const void* source = matmul ? Offset(args.send, slot * block_bytes)
                                                      : Offset(a.y, target * block_bytes);
                          return backend.Copy(stream, Destination(post, slot * block_bytes + j * chunk_bytes),
                                              Offset(source, j * chunk_bytes), chunk_bytes);
                        }, pushed);
    };
    FICCO_RETURN_IF_ERROR(session.Push(backend, a.recv, entry, push, /*consumed=*/true, &landed));
  } else {
    // Peers read send's n-1 blocks (one piece per (slot, chunk) event), or y's other blocks.
    const Exposure exposure = matmul ? Exposure{args.send, (config.n() - 1) * block_bytes,
                                                static_cast<int64_t>(exposed.size()), exposed}
                                     : Exposure{a.y, config.n() * block_bytes, 1, exposed};
    FICCO_RETURN_IF_ERROR(session.Exchange(backend, exposure, &posts));
    FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kFail));

    // Puller: from peer p = r-1-s, its block for us. In matmul_rs that is p's send slot s (p's
    // slot s targets p+1+s = r); in reduce_scatter it is rows [r*m, (r+1)*m) of p's y.
    FICCO_RETURN_IF_ERROR(PullChunks(
        backend, config, posts,
        [&](int slot, int64_t j) { return posts[config.SourceOfSlot(slot)].events[slot * config.chunks + j]; },
        [&](int stream, int, const Post& peer, int slot, int64_t j) {
          const void* source = Offset(peer.buffer, (matmul ? slot : r) * block_bytes);
          return backend.Copy(stream, Offset(a.recv, slot * block_bytes + j * chunk_bytes),
                              Offset(source, j * chunk_bytes), chunk_bytes);
        }, &landed));
  }
  const void* own = matmul ? static_cast<const void*>(a.out) : Offset(a.y, r * block_bytes);
  ffi::Error reduced = ReduceChunks(backend, config, a, own, landed);
  if (reduced.failure()) return AwaitLanded(backend, config, landed, std::move(reduced));
  return JoinAndRelease(backend, config, session);
}

}  // namespace ficco
