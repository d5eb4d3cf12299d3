// The executors of all_to_all, a2a_matmul (dispatch) and matmul_a2a (combine); roles in a2a.h.
// Rendezvous, fault injection and the join are the shared building blocks of executor.h.
#include "a2a.h"

namespace ficco {
namespace {

// Byte offsets inside a [n, groups, rows, row] buffer with `row_bytes` bytes per row.
struct BlockLayout {
  int64_t groups, rows, row_bytes;
  int64_t Block() const { return groups * rows * row_bytes; }
  int64_t At(int64_t block, int64_t group, int64_t row) const {
    return ((block * groups + group) * rows + row) * row_bytes;
  }
};

// Signature kinds of the a2a targets (executor.cc uses 1 .. 4 for its ops).
enum SignatureKind : int64_t { kAllToAllKind = 5, kA2aMatmulKind = 6, kMatmulA2aKind = 7 };

// Dispatch, compute stream: each local expert's matmul on every landed chunk, peers in pull order.
ffi::Error DispatchMatmuls(Backend& backend, const OpConfig& config, const AllToAllArgs& a,
                           const std::vector<std::vector<Event>>& landed) {
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));
  const BlockLayout in{a.groups, a.rows, a.row_bytes};
  const BlockLayout res{a.groups, a.rows, a.cols * esize};
  const int64_t q = a.rows / config.chunks;
  auto expert_gemm = [&](int peer, int64_t e, int64_t row, int64_t rows) {
    return backend.Gemm({Offset(a.received, in.At(peer, e, row)), Offset(a.w, e * a.inner * a.cols * esize),
                         Offset(a.out, res.At(peer, e, row)), rows, a.inner, a.cols, a.dtype});
  };
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    const int peer = config.SourceOfSlot(slot);
    for (int64_t j = 0; j < config.chunks; ++j) {
      FICCO_RETURN_IF_ERROR(backend.Wait(Backend::kCompute, landed[slot][j]));
      if (config.gemm != GemmMode::kPerChunk) continue;
      for (int64_t e = 0; e < a.groups; ++e) FICCO_RETURN_IF_ERROR(expert_gemm(peer, e, j * q, q));
    }
    if (config.gemm == GemmMode::kGrouped) {
      for (int64_t e = 0; e < a.groups; ++e) FICCO_RETURN_IF_ERROR(expert_gemm(peer, e, 0, a.rows));
    }
  }
  return ffi::Error::Success();
}

// Combine, compute stream before the exchange: the results for every peer (send slots, one event
// per chunk), then our own block straight into `out`. gemm=grouped: one matmul per expert and
// peer block, one event for all of its chunks (they still move separately).
ffi::Error CombineMatmuls(Backend& backend, const OpConfig& config, const MatmulAllToAllArgs& a,
                          std::vector<Event>* written) {
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));
  const BlockLayout in{a.groups, a.rows, a.inner * esize};
  const BlockLayout res{a.groups, a.rows, a.cols * esize};
  const int64_t q = a.rows / config.chunks;
  auto expert_gemm = [&](int64_t source_block, void* dst, int64_t dst_block, int64_t e, int64_t row, int64_t rows) {
    return backend.Gemm({Offset(a.y, in.At(source_block, e, row)), Offset(a.w, e * a.inner * a.cols * esize),
                         Offset(dst, res.At(dst_block, e, row)), rows, a.inner, a.cols, a.dtype});
  };
  written->assign((config.n() - 1) * config.chunks, nullptr);
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    const int target = config.TargetOfSlot(slot);
    if (config.gemm == GemmMode::kGrouped) {
      for (int64_t e = 0; e < a.groups; ++e) FICCO_RETURN_IF_ERROR(expert_gemm(target, a.send, slot, e, 0, a.rows));
      Event done;
      FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &done));
      for (int64_t j = 0; j < config.chunks; ++j) (*written)[slot * config.chunks + j] = done;
      continue;
    }
    for (int64_t j = 0; j < config.chunks; ++j) {
      for (int64_t e = 0; e < a.groups; ++e) FICCO_RETURN_IF_ERROR(expert_gemm(target, a.send, slot, e, j * q, q));
      FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &(*written)[slot * config.chunks + j]));
    }
  }
  for (int64_t e = 0; e < a.groups; ++e) FICCO_RETURN_IF_ERROR(expert_gemm(config.rank, a.out, config.rank, e, 0, a.rows));
  return ffi::Error::Success();
}

}  // namespace

ffi::Error RunAllToAll(Backend& backend, const OpConfig& config, const AllToAllArgs& a) {
  FICCO_RETURN_IF_ERROR(BeginCall(backend, config, a.rows, "rows per peer block (the capacity C)"));
  const bool matmul = a.w != nullptr;
  CallSession session(config, {matmul ? kA2aMatmulKind : kAllToAllKind, static_cast<int>(a.dtype), a.groups, a.rows,
                               a.row_bytes, a.inner, a.cols, config.chunks, static_cast<int>(config.order),
                               static_cast<int>(config.gemm), config.copy_streams, config.n()});
  const int r = config.rank;
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));
  const BlockLayout layout{a.groups, a.rows, a.row_bytes};

  // Owner: x is valid from `ready`; our own tokens for our own experts need no peer.
  Event ready;
  FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &ready));
  const Exposure exposure{a.x, config.n() * layout.Block(), 1, {ready}};
  FICCO_RETURN_IF_ERROR(session.Stage(backend, exposure));  // across processes: before the matmuls
  if (matmul) {
    const BlockLayout res{a.groups, a.rows, a.cols * esize};
    for (int64_t e = 0; e < a.groups; ++e) {
      FICCO_RETURN_IF_ERROR(backend.Gemm({Offset(a.x, layout.At(r, e, 0)), Offset(a.w, e * a.inner * a.cols * esize),
                                          Offset(a.out, res.At(r, e, 0)), a.rows, a.inner, a.cols, a.dtype}));
    }
  }
  std::vector<Post> posts;
  const int64_t q = a.rows / config.chunks;
  std::vector<std::vector<Event>> landed(config.n() - 1, std::vector<Event>(config.chunks));
  if (config.push) {
    // Sender: our block t of x to the peer t = r+1+s, chunk by chunk, into block r of its
    // `received`, once it entered the call (its `ready`) and x is valid (ours).
    auto push = [&](const std::vector<Post>& targets, std::vector<std::vector<Event>>* pushed) {
      return PushChunks(backend, config, targets, [&](int, int64_t) { return ready; },
                        [&](int stream, int target, const Post& post, int, int64_t j) {
                          for (int64_t e = 0; e < a.groups; ++e) {
                            FICCO_RETURN_IF_ERROR(backend.Copy(stream, Destination(post, layout.At(r, e, j * q)),
                                                               Offset(a.x, layout.At(target, e, j * q)), q * a.row_bytes));
                          }
                          return ffi::Error::Success();
                        }, pushed);
    };
    FICCO_RETURN_IF_ERROR(session.Push(backend, a.received, ready, push, /*consumed=*/matmul, &landed));
  } else {
    FICCO_RETURN_IF_ERROR(session.Exchange(backend, exposure, &posts));
    FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kFail));

    // Puller: peer p = r-1-s holds our block at x_p[r]; chunk j is rows [j*q, (j+1)*q) of every group.
    FICCO_RETURN_IF_ERROR(PullChunks(
        backend, config, posts, [&](int slot, int64_t) { return posts[config.SourceOfSlot(slot)].events[0]; },
        [&](int stream, int peer, const Post& post, int, int64_t j) {
          for (int64_t e = 0; e < a.groups; ++e) {
            FICCO_RETURN_IF_ERROR(backend.Copy(stream, Offset(a.received, layout.At(peer, e, j * q)),
                                               Offset(post.buffer, layout.At(r, e, j * q)), q * a.row_bytes));
          }
          return ffi::Error::Success();
        }, &landed));
  }
  // Our own block last on the last copy stream: only the join needs it, and nobody when a2a_matmul's
  // caller drops `received` (skip_own_rows, as in ag_matmul: the matmuls read it from x).
  if (!(matmul && config.skip_own_rows)) {
    const int last_stream = CopyStreamsUsed(config) - 1;
    FICCO_RETURN_IF_ERROR(backend.Wait(last_stream, ready));
    FICCO_RETURN_IF_ERROR(backend.Copy(last_stream, Offset(a.received, layout.At(r, 0, 0)),
                                       Offset(a.x, layout.At(r, 0, 0)), layout.Block()));
  }
  if (matmul) {
    ffi::Error multiplied = DispatchMatmuls(backend, config, a, landed);
    if (multiplied.failure()) return AwaitLanded(backend, config, landed, std::move(multiplied));
  }
  return JoinAndRelease(backend, config, session);
}

ffi::Error RunMatmulAllToAll(Backend& backend, const OpConfig& config, const MatmulAllToAllArgs& a) {
  FICCO_RETURN_IF_ERROR(BeginCall(backend, config, a.rows, "rows per peer block (the capacity C)"));
  CallSession session(config, {kMatmulA2aKind, static_cast<int>(a.dtype), a.groups, a.rows, a.inner, a.cols,
                               config.chunks, static_cast<int>(config.order), static_cast<int>(config.gemm),
                               config.copy_streams, config.n()});
  const int64_t esize = static_cast<int64_t>(ByteWidth(a.dtype));
  const BlockLayout layout{a.groups, a.rows, a.cols * esize};

  // Owner: the results for every peer, one event per chunk, exposed through `send` (across
  // processes: written straight into the staging buffer peers read, CallSession::StageInPlace).
  // With transfer=push, `entry` opens our `out` to the peers' writes (their blocks of it).
  std::vector<Event> written;
  MatmulAllToAllArgs args = a;
  Event entry = nullptr;
  if (config.push) FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &entry));
  void* in_place = nullptr;
  FICCO_RETURN_IF_ERROR(session.StageInPlace(backend, (config.n() - 1) * layout.Block(), &in_place));
  if (in_place != nullptr) args.send = in_place;
  FICCO_RETURN_IF_ERROR(CombineMatmuls(backend, config, args, &written));
  std::vector<Post> posts;
  const int64_t q = a.rows / config.chunks;
  if (config.push) {
    // Sender: send slot s to the peer t = r+1+s, into block r of its `out`, chunk by chunk once
    // each is computed. Nothing here reads what lands: XLA's stream waits for it (Push).
    auto push = [&](const std::vector<Post>& targets, std::vector<std::vector<Event>>* pushed) {
      return PushChunks(backend, config, targets, [&](int slot, int64_t j) { return written[slot * config.chunks + j]; },
                        [&](int stream, int, const Post& post, int slot, int64_t j) {
                          for (int64_t e = 0; e < a.groups; ++e) {
                            FICCO_RETURN_IF_ERROR(backend.Copy(stream, Destination(post, layout.At(config.rank, e, j * q)),
                                                               Offset(args.send, layout.At(slot, e, j * q)),
                                                               q * layout.row_bytes));
                          }
                          return ffi::Error::Success();
                        }, pushed);
    };
    std::vector<std::vector<Event>> landed;
    FICCO_RETURN_IF_ERROR(session.Push(backend, a.out, entry, push, /*consumed=*/false, &landed));
    return JoinAndRelease(backend, config, session);
  }
  // One piece per send slot: a slot's chunks are strided rows of every group, not contiguous.
  FICCO_RETURN_IF_ERROR(session.Exchange(
      backend, {args.send, (config.n() - 1) * layout.Block(), config.n() - 1, written}, &posts));
  FICCO_RETURN_IF_ERROR(CheckFault(config, Fault::kFail));

  // Puller: peer p = r-1-s computed its send slot s for us (p + 1 + s = r). Nothing here reads
  // what lands but the join (its events go unused).
  std::vector<std::vector<Event>> landed(config.n() - 1, std::vector<Event>(config.chunks));
  FICCO_RETURN_IF_ERROR(PullChunks(
      backend, config, posts,
      [&](int slot, int64_t j) { return posts[config.SourceOfSlot(slot)].events[slot * config.chunks + j]; },
      [&](int stream, int peer, const Post& post, int slot, int64_t j) {
        for (int64_t e = 0; e < a.groups; ++e) {
          FICCO_RETURN_IF_ERROR(backend.Copy(stream, Offset(a.out, layout.At(peer, e, j * q)),
                                             Offset(post.buffer, layout.At(slot, e, j * q)), q * layout.row_bytes));
        }
        return ffi::Error::Success();
      }, &landed));
  return JoinAndRelease(backend, config, session);
}

}  // namespace ficco
