// The gather -> consume pipeline (executor.h): all_gather, ag_matmul, all_to_all, a2a_matmul.
// Also the pieces both pipelines share: the signature, the chunk copy, the block matmuls.
#include <initializer_list>

#include "exec/executor.h"

namespace ficco {

// w's layout (types.b_transposed) is left out: each rank multiplies by its own w, which no peer reads.
std::vector<int64_t> ScheduleSignature(const OpConfig& config, SignatureKind kind, const MatmulTypes& types,
                                       std::initializer_list<int64_t> shape) {
  std::vector<int64_t> signature{static_cast<int64_t>(kind), static_cast<int64_t>(types.a),
                                 static_cast<int64_t>(types.b), static_cast<int64_t>(types.c)};
  signature.insert(signature.end(), shape.begin(), shape.end());
  signature.insert(signature.end(), {config.chunks, static_cast<int64_t>(config.order),
                                     static_cast<int64_t>(config.gemm), config.copy_streams, config.n()});
  return signature;
}

ffi::Error CopyBlockChunks(Backend& backend, const OpConfig& config, const BlockLayout& layout, int stream,
                           const void* src, int64_t src_block, void* dst, int64_t dst_block, int64_t j,
                           int64_t count) {
  const int64_t q = layout.rows / config.chunks;
  return backend.CopyPieces(stream, Offset(dst, layout.At(dst_block, 0, j * q)),
                            Offset(src, layout.At(src_block, 0, j * q)), count * q * layout.row_bytes, layout.groups,
                            layout.rows * layout.row_bytes);
}

ffi::Error BlockMatmul::RunColumns(Backend& backend, const void* in_base, int64_t in_block, void* out_base,
                                   int64_t out_block, int64_t row, int64_t count, int64_t col, int64_t width,
                                   const void* add_base, int64_t add_block) const {
  // Columns [col, col + width) of w: of its rows ([inner, cols]), or its leading rows when stored
  // transposed ([cols, inner]); of the result's rows.
  const int64_t w_offset = (types.b_transposed ? col * inner : col) * static_cast<int64_t>(ByteWidth(types.b));
  const int64_t res_offset = col * static_cast<int64_t>(ByteWidth(types.c));
  // Every group in one launch: group g reads in's and writes res's group g, times w[g].
  GemmProblem problem{Offset(in_base, in.At(in_block, 0, row)), Offset(w, w_offset),
                      Offset(out_base, res.At(out_block, 0, row) + res_offset), count, inner, width, types,
                      add_base ? Offset(add_base, res.At(add_block, 0, row) + res_offset) : nullptr};
  if (width != cols) {
    problem.b_ld = types.b_transposed ? inner : cols;
    problem.c_ld = cols;
  }
  if (in.groups > 1) {
    problem.batch = in.groups;
    problem.a_stride = in.rows * inner;
    problem.b_stride = inner * cols;
    problem.c_stride = res.rows * cols;
  }
  return backend.Gemm(problem);
}

ffi::Error CopyOutSymmetric(Backend& backend, const OpConfig& config, const SymmetricCall& symmetric, Event entry,
                            const Landed& landed, const BlockLayout& layout, void* dst,
                            const std::function<int64_t(int slot)>& dst_block, std::vector<Event>* copied) {
  // Copies within the device, on the stream of the staging copies (Backend::kStaging), off the way of
  // this call's own sends on the copy streams. With no peer there is nothing to copy and the stream
  // stays out of the call: under a capture, XLA's stream must join back every stream that joined it,
  // and it waits here for the copies' events alone (AwaitCopyOuts).
  const int stream = Backend::kStaging;
  if (config.n() < 2) return ffi::Error::Success();
  FICCO_RETURN_IF_ERROR(backend.Wait(stream, entry));
  for (int slot = 0; slot < config.n() - 1; ++slot) {
    Ready waited;
    for (const Ready& ready : landed[slot]) {
      FICCO_RETURN_IF_ERROR(WaitOnce(backend, config, stream, ready, &waited, config.SourceOfSlot(slot), "landed"));
    }
    FICCO_RETURN_IF_ERROR(
        backend.Copy(stream, Offset(dst, layout.At(dst_block(slot), 0, 0)), symmetric.Landing(slot), layout.Block()));
    Event done;
    FICCO_RETURN_IF_ERROR(backend.Record(stream, &done));
    copied->push_back(done);
  }
  return ffi::Error::Success();
}

ffi::Error FailSymmetric(Backend& backend, const OpConfig& config, const SymmetricCall& symmetric, ffi::Error error) {
  symmetric.Fail(error.message());
  if (config.n() > 1) {  // the copy-out stream: a copy may have been enqueued before its event failed
    Event last = nullptr;
    if (backend.Record(Backend::kStaging, &last).success()) (void)backend.Wait(Backend::kCompute, last);
  }
  error = AwaitLanded(backend, config, /*landed=*/{}, std::move(error));
  (void)symmetric.End(backend);  // the call ends, failed: the watchdog has no call of it to watch
  return error;
}

ffi::Error BeginSymmetric(Backend& backend, const OpConfig& config, const SymmetricCall& symmetric) {
  bool counted = false;
  ffi::Error begun = symmetric.Begin(backend, &counted);
  return begun.failure() && counted ? FailSymmetric(backend, config, symmetric, std::move(begun)) : begun;
}

ffi::Error AwaitCopyOuts(Backend& backend, const std::vector<Event>& copied, ffi::Error status) {
  for (Event event : copied) {
    ffi::Error waited = backend.Wait(Backend::kCompute, event);
    if (status.success()) status = std::move(waited);
  }
  return status;
}

namespace {

// One call of the gather pipeline on rank r.
class Gather {
 public:
  Gather(Backend& backend, const OpConfig& config, const GatherArgs& a)
      : backend_(backend), config_(config), a_(a), matmul_(a.w != nullptr),
        mm_{a.layout, {a.layout.groups, a.layout.rows, a.cols * static_cast<int64_t>(ByteWidth(a.types.c))},
            a.w, a.inner, a.cols, a.types} {}

  ffi::Error Run(CallSession& session);

 private:
  // transfer=symmetric (runtime/symmetric.h): pushes into the peers' slots of the site, no meeting.
  ffi::Error RunSymmetric(CallSession& session);
  // The block of x that goes to rank `to`.
  int64_t SourceBlock(int to) const { return a_.x_per_peer ? to : 0; }
  ffi::Error Pull(CallSession& session, const Exposure& exposure, Event entry, Landed* landed);
  ffi::Error Push(CallSession& session, Event ready, Landed* landed);
  ffi::Error SendSymmetric(const SymmetricCall& symmetric, Event ready);
  ffi::Error CopyOwnBlock(Event ready);
  // The matmuls of the landed blocks: read from `received`, or, on a symmetric site, where they landed.
  ffi::Error Consume(const Landed& landed, const SymmetricCall* symmetric = nullptr);
  // Whether `received` is a result someone reads (else the caller drops it: skip_own_rows).
  bool ReceivedIsRead() const { return !(matmul_ && config_.skip_own_rows); }
  // Only per-chunk matmuls take a chunk as it lands (call_session.h, LandedEvents).
  LandedEvents Marks() const {
    return matmul_ && config_.gemm == GemmMode::kPerChunk ? LandedEvents::kPerChunk : LandedEvents::kPerSlot;
  }

  Backend& backend_;
  const OpConfig& config_;
  const GatherArgs& a_;
  const bool matmul_;
  const BlockMatmul mm_;
};

ffi::Error Gather::Run(CallSession& session) {
  if (config_.symmetric) return RunSymmetric(session);
  const int r = config_.rank;
  // Owner: x is valid from `ready`; own work that needs no peer starts at once.
  Event ready;
  FICCO_RETURN_IF_ERROR(backend_.Record(Backend::kCompute, &ready));
  const Exposure exposure{a_.x, (a_.x_per_peer ? config_.n() : 1) * a_.layout.Block(), 1, {ready}};
  FICCO_RETURN_IF_ERROR(session.Stage(backend_, exposure));  // across processes: before the matmuls (Stage)
  if (matmul_) FICCO_RETURN_IF_ERROR(mm_.Run(backend_, a_.x, SourceBlock(r), a_.out, r, 0, a_.layout.rows));
  Landed landed(config_.n() - 1, std::vector<Ready>(config_.chunks));
  // From the first enqueued transfer on, a failure must not return before XLA's stream waits for
  // what was enqueued: XLA frees this call's buffers with the error (AwaitLanded).
  ffi::Error moved = config_.push ? Push(session, ready, &landed) : Pull(session, exposure, ready, &landed);
  if (moved.success()) moved = CopyOwnBlock(ready);
  if (moved.success() && matmul_) moved = Consume(landed);
  if (moved.failure()) return AwaitLanded(backend_, config_, landed, std::move(moved));
  return JoinAndRelease(backend_, config_, session);
}

// The sends enqueue first (each after its target freed its slot), then our own block's matmul, then
// the landed blocks: where `received` is a result they are copied into it (CopyOutSymmetric), and the
// matmuls read them where they landed; the join releases the slots.
ffi::Error Gather::RunSymmetric(CallSession& session) {
  std::shared_ptr<SymmetricSite> site;
  FICCO_RETURN_IF_ERROR(session.SymmetricSiteOf(backend_, a_.layout.Block(), &site));
  const SymmetricCall symmetric(config_, std::move(site), Marks() == LandedEvents::kPerChunk);
  FICCO_RETURN_IF_ERROR(BeginSymmetric(backend_, config_, symmetric));
  // From here on a failure goes through FailSymmetric: the call was counted.
  std::vector<Event> copied;
  // x is valid, and this call's epoch counted, from `ready`: the copy streams start there.
  Event ready = nullptr;
  ffi::Error moved = backend_.Record(Backend::kCompute, &ready);
  if (moved.success()) moved = EnterCopyStreams(backend_, config_, ready);
  if (moved.success()) moved = SendSymmetric(symmetric, ready);
  if (moved.success() && matmul_) {
    moved = mm_.Run(backend_, a_.x, SourceBlock(config_.rank), a_.out, config_.rank, 0, a_.layout.rows);
  }
  if (moved.success()) moved = CopyOwnBlock(ready);
  const Landed landed = SymmetricLanded(config_, symmetric);
  if (moved.success() && ReceivedIsRead()) {
    moved = CopyOutSymmetric(backend_, config_, symmetric, ready, landed, a_.layout, a_.received,
                             [&](int slot) { return config_.SourceOfSlot(slot); }, &copied);
  }
  if (moved.success() && matmul_) moved = Consume(landed, &symmetric);
  moved = AwaitCopyOuts(backend_, copied, std::move(moved));
  if (moved.failure()) return FailSymmetric(backend_, config_, symmetric, std::move(moved));
  // A counted call whose join failed still ends (FailSymmetric posts it): else its peers and the
  // watchdog would wait for an end that never comes.
  ffi::Error joined = JoinAndRelease(backend_, config_, session, &symmetric);
  return joined.failure() ? FailSymmetric(backend_, config_, symmetric, std::move(joined)) : joined;
}

// Sender: our block for the peer t = r+1+s into t's slot s of the site, chunk by chunk.
ffi::Error Gather::SendSymmetric(const SymmetricCall& symmetric, Event ready) {
  return PushSymmetric(backend_, config_, symmetric, ready, [&](int, int64_t) { return Ready(ready); },
                       ReadyMarks::kPerSlot,
                       [&](int stream, int target, const Post&, int slot, int64_t j, int64_t count) {
                         return CopyBlockChunks(backend_, config_, a_.layout, stream, a_.x, SourceBlock(target),
                                                symmetric.Destination(slot), 0, j, count);
                       },
                       Marks());
}

// Our own block of `received` goes last on the last copy stream: the copy is only needed by the
// join, so it must not delay the first peer chunk the matmuls wait for. When nobody reads
// `received` (skip_own_rows: ag_matmul's plain forward, a2a_matmul whose caller drops it) it is
// skipped, the matmuls read x: a 1-device ag_matmul at [8192,8192]@[8192,5120] took 1.018 ms with
// the copy and 0.985 without (one H200).
ffi::Error Gather::CopyOwnBlock(Event ready) {
  if (matmul_ && config_.skip_own_rows) return ffi::Error::Success();
  const int r = config_.rank;
  const int last_stream = CopyStreamsUsed(config_) - 1;
  // A pull's copy streams have all waited for `ready` already, as their entry (CopyChunks).
  if (config_.push || config_.n() == 1) FICCO_RETURN_IF_ERROR(backend_.Wait(last_stream, ready));
  return backend_.Copy(last_stream, Offset(a_.received, a_.layout.At(r, 0, 0)),
                       Offset(a_.x, a_.layout.At(SourceBlock(r), 0, 0)), a_.layout.Block());
}

// Puller: peers by ring distance (r-1 first); peer p's block for us (x_p's only block, or x_p[r])
// lands chunk by chunk in received[p], once this device entered the call (`entry`, our `ready`).
ffi::Error Gather::Pull(CallSession& session, const Exposure& exposure, Event entry, Landed* landed) {
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Exchange(backend_, exposure, &posts));
  return PullChunks(
      backend_, config_, posts, entry, [&](int slot, int64_t) { return ReadyOf(posts[config_.SourceOfSlot(slot)], 0); },
      ReadyMarks::kPerSlot,
      [&](int stream, int peer, const Post& post, int, int64_t j, int64_t count) {
        return CopyBlockChunks(backend_, config_, a_.layout, stream, post.buffer, SourceBlock(config_.rank),
                               a_.received, peer, j, count);
      },
      Marks(), landed);
}

// Sender: our block for the peer t = r+1+s, chunk by chunk, into block r of its `received`, once t
// entered the call (its `ready` doubles as entry) and x is valid (our `ready`).
ffi::Error Gather::Push(CallSession& session, Event ready, Landed* landed) {
  auto push = [&](const std::vector<Post>& targets, Landed* pushed) {
    return PushChunks(backend_, config_, targets, [&](int, int64_t) { return Ready(ready); }, ReadyMarks::kPerSlot,
                      [&](int stream, int target, const Post& post, int, int64_t j, int64_t count) {
                        return CopyBlockChunks(backend_, config_, a_.layout, stream, a_.x, SourceBlock(target),
                                               Destination(post, 0), config_.rank, j, count);
                      },
                      Marks(), pushed);
  };
  return session.Push(backend_, a_.received, ready, push, /*consumed=*/matmul_, landed);
}

// Compute stream: the matmuls of every landed chunk, peers in pull order (gemm=grouped: one per
// peer block once all of its chunks landed).
ffi::Error Gather::Consume(const Landed& landed, const SymmetricCall* symmetric) {
  const int64_t q = a_.layout.rows / config_.chunks;
  Ready waited;
  for (int slot = 0; slot < config_.n() - 1; ++slot) {
    const int peer = config_.SourceOfSlot(slot);
    // The block: `received`'s block of that peer, or the one block of its slot of the site.
    const void* in = symmetric != nullptr ? symmetric->Landing(slot) : a_.received;
    const int64_t in_block = symmetric != nullptr ? 0 : peer;
    for (int64_t j = 0; j < config_.chunks; ++j) {
      FICCO_RETURN_IF_ERROR(WaitOnce(backend_, config_, Backend::kCompute, landed[slot][j], &waited, peer, "landed"));
      if (config_.gemm == GemmMode::kPerChunk) {
        FICCO_RETURN_IF_ERROR(mm_.Run(backend_, in, in_block, a_.out, peer, j * q, q));
      }
    }
    if (config_.gemm == GemmMode::kGrouped) {
      FICCO_RETURN_IF_ERROR(mm_.Run(backend_, in, in_block, a_.out, peer, 0, a_.layout.rows));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error RunGather(Backend& backend, const OpConfig& config, const GatherArgs& a) {
  if (config.gemm == GemmMode::kColumns) {  // a gathered block arrives by rows: there are no column chunks to move
    return MakeInvalid(config.ctx, "gemm=columns cuts the columns of a reduce-scatter's blocks (matmul_rs); this op "
                                   "takes gemm=per_chunk or grouped");
  }
  FICCO_RETURN_IF_ERROR(BeginCall(backend, config, a.layout.rows, a.rows_name));
  CallSession session(config, ScheduleSignature(config, a.kind, a.types,
                                                {a.layout.groups, a.layout.rows, a.layout.row_bytes, a.inner, a.cols}));
  return Gather(backend, config, a).Run(session);
}

}  // namespace ficco
