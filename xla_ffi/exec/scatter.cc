// The produce -> scatter pipeline (executor.h): reduce_scatter, matmul_rs, matmul_a2a.
#include <algorithm>

#include "exec/executor.h"

namespace ficco {
namespace {

// One call of the scatter pipeline on rank r. The blocks that move have `layout_`; in matmul_rs
// and matmul_a2a send slot s holds our block for rank r+1+s (which pulls it as its slot s, since
// p + 1 + s = r for the puller r and owner p = r-1-s); in reduce_scatter y's block t is for rank t.
class Scatter {
 public:
  Scatter(Backend& backend, const OpConfig& config, const ScatterArgs& a)
      : backend_(backend), config_(config), a_(a), matmul_(a.w != nullptr), reduce_(a.recv != nullptr),
        layout_{a.groups, a.rows, a.cols * static_cast<int64_t>(ByteWidth(a.types.c))},
        mm_{{a.groups, a.rows, a.inner * static_cast<int64_t>(ByteWidth(a.types.a))}, layout_, a.w, a.inner, a.cols,
            a.types} {}

  ffi::Error Run(CallSession& session);

 private:
  // transfer=symmetric (runtime/symmetric.h): pushes into the peers' slots of the site, no meeting.
  ffi::Error RunSymmetric(CallSession& session);
  ffi::Error SendSymmetric(const SymmetricCall& symmetric, const void* send, Event entry,
                           const std::vector<Event>& exposed);
  // Where the peer of slot `slot` (rank `peer`) sends its block for us: a reduce's receive slot,
  // else our output's block of that rank.
  void* Landing() const { return reduce_ ? a_.recv : a_.out; }
  int64_t LandingBlock(int slot, int peer) const { return reduce_ ? slot : peer; }
  ffi::Error Produce(CallSession& session, void* send, std::vector<Event>* written);
  ffi::Error Pull(CallSession& session, const void* send, Event entry, const std::vector<Event>& exposed,
                  Landed* landed);
  ffi::Error Push(CallSession& session, const void* send, Event entry, const std::vector<Event>& exposed,
                  Landed* landed);
  // The reduce's sums of the received partials, slot-major [n-1, rows, cols] at `recv`: a_.recv, or a
  // symmetric site's slots, where they landed.
  ffi::Error SumReceived(const Landed& landed, const void* recv) {
    return SumsInMatmuls() ? SumInMatmuls(landed, recv) : ReduceChunks(landed, recv);
  }
  ffi::Error ReduceChunks(const Landed& landed, const void* recv);
  ffi::Error SumInMatmuls(const Landed& landed, const void* recv);
  ffi::Error AwaitChunks(const Landed& landed, int first_slot, int end_slot, int64_t first, int64_t end);
  // The sum `problem` on XLA's stream once chunks [first, end) of receive slots [first_slot, end_slot)
  // have landed.
  ffi::Error SumAfter(const Landed& landed, int first_slot, int end_slot, int64_t first, int64_t end,
                      const ReduceProblem& problem);
  // Enqueues chunks [j, j + count) of block `src_block` of `src` into block `dst_block` of `dst`: row
  // chunks (CopyBlockChunks), or column chunks, each row's piece of them in one 2D copy.
  ffi::Error CopyChunks(int stream, const void* src, int64_t src_block, void* dst, int64_t dst_block, int64_t j,
                        int64_t count);
  // gemm=columns (matmul_rs): chunk j is columns [j * w, (j + 1) * w) of a block, w = cols / chunks, all of
  // its rows; a chunk matmul reads only those columns of w.
  bool Columns() const { return config_.gemm == GemmMode::kColumns; }
  int64_t ChunkCols() const { return a_.cols / config_.chunks; }
  // Only a reduce summing chunk by chunk takes a chunk as it lands (call_session.h, LandedEvents);
  // matmul_rs with gemm=grouped sums the whole block once.
  bool SumsWholeBlock() const { return matmul_ && config_.gemm == GemmMode::kGrouped; }
  // matmul_rs with per-chunk matmuls and more than one chunk: our own block is multiplied after the
  // transfers, in two halves, each adding the first received partial in its epilogue (SumInMatmuls),
  // so no sum runs after the last matmul. With one chunk the own matmul would wait for the whole
  // partial to land, longer than the sum it saves; on one device nothing lands.
  bool SumsInMatmuls() const {
    return matmul_ && reduce_ && config_.gemm != GemmMode::kGrouped && config_.chunks > 1 && config_.n() > 1;
  }
  LandedEvents Marks() const {
    return reduce_ && !SumsWholeBlock() ? LandedEvents::kPerChunk : LandedEvents::kPerSlot;
  }
  // Per-chunk matmuls write the send slots chunk by chunk; y, and a block's one matmul, are ready at once.
  ReadyMarks Readiness() const {
    return matmul_ && config_.gemm != GemmMode::kGrouped ? ReadyMarks::kPerChunk : ReadyMarks::kPerSlot;
  }
  // The parts of the send slots as peers read them (staged, or published on a channel): a reduce's
  // row chunks are contiguous pieces, one per (slot, chunk); an expert block's chunks (strided rows of
  // every group) and column chunks are not, so their pieces are whole slots.
  int64_t SendPieces() const {
    return reduce_ && !Columns() ? (config_.n() - 1) * config_.chunks : config_.n() - 1;
  }

  Backend& backend_;
  const OpConfig& config_;
  const ScatterArgs& a_;
  const bool matmul_;
  const bool reduce_;
  const BlockLayout layout_;
  const BlockMatmul mm_;
};

ffi::Error Scatter::Run(CallSession& session) {
  if (config_.symmetric) return RunSymmetric(session);
  // `entry`, this call's start on XLA's stream, opens our landing buffer to the copies that write
  // it, before our matmuls: the peers' pushes, or our own pulls. Owner: the matmuls expose their
  // send slots (one event per chunk); reduce_scatter exposes y, valid from `entry`. Across
  // processes the send slots are written straight into the staging buffer peers read.
  std::vector<Event> exposed;
  void* send = a_.send;
  Event entry = nullptr;
  FICCO_RETURN_IF_ERROR(backend_.Record(Backend::kCompute, &entry));
  if (matmul_) {
    void* in_place = nullptr;
    FICCO_RETURN_IF_ERROR(session.StageInPlace(backend_, (config_.n() - 1) * layout_.Block(), SendPieces(), &in_place));
    if (in_place != nullptr) send = in_place;
    FICCO_RETURN_IF_ERROR(Produce(session, send, &exposed));
  } else {
    exposed.assign((config_.n() - 1) * config_.chunks, entry);
  }
  Landed landed(config_.n() - 1, std::vector<Ready>(config_.chunks));
  // From the first enqueued transfer on, a failure must not return before XLA's stream waits for
  // what was enqueued: XLA frees this call's buffers with the error (AwaitLanded).
  ffi::Error moved = config_.push ? Push(session, send, entry, exposed, &landed)
                                  : Pull(session, send, entry, exposed, &landed);
  if (moved.success() && reduce_) moved = SumReceived(landed, a_.recv);
  if (moved.failure()) return AwaitLanded(backend_, config_, landed, std::move(moved));
  return JoinAndRelease(backend_, config_, session);
}

// The partials are computed into XLA's `send` as before, and each send chunk moves, once written,
// into its target's slot of the site; a reduce then sums where the partials landed, and the other
// ops (matmul_a2a) copy them into their result (CopyOutSymmetric). The join releases the slots.
ffi::Error Scatter::RunSymmetric(CallSession& session) {
  std::shared_ptr<SymmetricSite> site;
  FICCO_RETURN_IF_ERROR(session.SymmetricSiteOf(backend_, layout_.Block(), &site));
  const SymmetricCall symmetric(config_, std::move(site), Marks() == LandedEvents::kPerChunk);
  FICCO_RETURN_IF_ERROR(BeginSymmetric(backend_, config_, symmetric));
  // From here on a failure goes through FailSymmetric: the call was counted.
  std::vector<Event> copied, exposed;
  // y is valid, and this call's epoch counted, from `entry`: the copy streams start there.
  Event entry = nullptr;
  ffi::Error moved = backend_.Record(Backend::kCompute, &entry);
  if (moved.success()) moved = EnterCopyStreams(backend_, config_, entry);
  if (moved.success()) {
    if (matmul_) {
      moved = Produce(session, a_.send, &exposed);
    } else {
      exposed.assign((config_.n() - 1) * config_.chunks, entry);
    }
  }
  if (moved.success()) moved = SendSymmetric(symmetric, a_.send, entry, exposed);
  const Landed landed = SymmetricLanded(config_, symmetric);
  if (moved.success() && reduce_) {
    moved = SumReceived(landed, symmetric.Landing(0));
  } else if (moved.success()) {
    moved = CopyOutSymmetric(backend_, config_, symmetric, entry, landed, layout_, a_.out,
                             [&](int slot) { return config_.SourceOfSlot(slot); }, &copied);
  }
  moved = AwaitCopyOuts(backend_, copied, std::move(moved));
  if (moved.failure()) return FailSymmetric(backend_, config_, symmetric, std::move(moved));
  // A counted call whose join failed still ends (FailSymmetric posts it): else its peers and the
  // watchdog would wait for an end that never comes.
  ffi::Error joined = JoinAndRelease(backend_, config_, session, &symmetric);
  return joined.failure() ? FailSymmetric(backend_, config_, symmetric, std::move(joined)) : joined;
}

// Sender: to the peer t = r+1+s its block — our send slot s, or block t of y — into t's slot s of
// the site, chunk by chunk once each is written.
ffi::Error Scatter::SendSymmetric(const SymmetricCall& symmetric, const void* send, Event entry,
                                  const std::vector<Event>& exposed) {
  return PushSymmetric(backend_, config_, symmetric, entry,
                       [&](int slot, int64_t j) { return Ready(exposed[slot * config_.chunks + j]); }, Readiness(),
                       [&](int stream, int target, const Post&, int slot, int64_t j, int64_t count) {
                         return CopyChunks(stream, matmul_ ? send : a_.y, matmul_ ? slot : target,
                                           symmetric.Destination(slot), 0, j, count);
                       },
                       Marks());
}

// Compute stream, before the exchange: the block for each peer (in the order that peer pulls
// them) into its send slot, one event per chunk, then our own block straight into `out`.
// gemm=grouped: one matmul per peer block, one event for all of its chunks (which then move in one
// copy where nothing takes them chunk by chunk: Readiness). On a channel each send piece is published
// as soon as it is written.
ffi::Error Scatter::Produce(CallSession& session, void* send, std::vector<Event>* written) {
  const int64_t q = a_.rows / config_.chunks;
  written->assign((config_.n() - 1) * config_.chunks, nullptr);
  const bool grouped = config_.gemm == GemmMode::kGrouped;
  for (int slot = 0; slot < config_.n() - 1; ++slot) {
    const int64_t chunks_per_piece = (config_.n() - 1) * config_.chunks / SendPieces();  // (n > 1 here)
    const int target = config_.TargetOfSlot(slot);
    for (int64_t j = 0; j < config_.chunks; ++j) {
      if (grouped && j > 0) {
        (*written)[slot * config_.chunks + j] = (*written)[slot * config_.chunks];
      } else {
        FICCO_RETURN_IF_ERROR(Columns() ? mm_.RunColumns(backend_, a_.y, target, send, slot, 0, a_.rows,
                                                         j * ChunkCols(), ChunkCols())
                                        : mm_.Run(backend_, a_.y, target, send, slot, grouped ? 0 : j * q,
                                                  grouped ? a_.rows : q));
        FICCO_RETURN_IF_ERROR(backend_.Record(Backend::kCompute, &(*written)[slot * config_.chunks + j]));
      }
      const int64_t index = slot * config_.chunks + j;
      if ((index + 1) % chunks_per_piece == 0) {
        FICCO_RETURN_IF_ERROR(session.Publish(backend_, index / chunks_per_piece, SendPieces()));
      }
    }
  }
  if (SumsInMatmuls()) return ffi::Error::Success();  // our block's matmuls follow the transfers
  // A reduce's `out` is one block; the expert ops' `out` has one per rank.
  return mm_.Run(backend_, a_.y, config_.rank, a_.out, reduce_ ? 0 : config_.rank, 0, a_.rows);
}

// Puller: from peer p = r-1-s its block for us, p's send slot s (or block r of p's y), chunk by
// chunk once each is written, into our landing buffer once we entered the call (`entry`).
ffi::Error Scatter::Pull(CallSession& session, const void* send, Event entry, const std::vector<Event>& exposed,
                         Landed* landed) {
  // Peers read send's n-1 blocks (SendPieces), or y's other blocks.
  const int n = config_.n();
  const Exposure exposure = matmul_ ? Exposure{send, (n - 1) * layout_.Block(), SendPieces(), exposed}
                                    : Exposure{a_.y, n * layout_.Block(), 1, exposed};
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Exchange(backend_, exposure, &posts));
  return PullChunks(
      backend_, config_, posts, entry,
      [&](int slot, int64_t j) { return ReadyOf(posts[config_.SourceOfSlot(slot)], slot * config_.chunks + j); },
      Readiness(),
      [&](int stream, int peer, const Post& post, int slot, int64_t j, int64_t count) {
        return CopyChunks(stream, post.buffer, matmul_ ? slot : config_.rank, Landing(), LandingBlock(slot, peer), j,
                          count);
      },
      Marks(), landed);
}

// Sender: to the peer t = r+1+s its block — our send slot s, or block t of y — into t's landing
// buffer (t's receive slot s is fed by t-1-s = r), chunk by chunk once each is written.
ffi::Error Scatter::Push(CallSession& session, const void* send, Event entry, const std::vector<Event>& exposed,
                         Landed* landed) {
  auto push = [&](const std::vector<Post>& targets, Landed* pushed) {
    return PushChunks(backend_, config_, targets,
                      [&](int slot, int64_t j) { return Ready(exposed[slot * config_.chunks + j]); }, Readiness(),
                      [&](int stream, int target, const Post& post, int slot, int64_t j, int64_t count) {
                        return CopyChunks(stream, matmul_ ? send : a_.y, matmul_ ? slot : target,
                                          Destination(post, 0), LandingBlock(slot, config_.rank), j, count);
                      },
                      Marks(), pushed);
  };
  // Only a reduce reads what lands here; otherwise XLA's stream waits for it (CallSession::Push).
  return session.Push(backend_, Landing(), entry, push, /*consumed=*/reduce_, landed);
}

ffi::Error Scatter::CopyChunks(int stream, const void* src, int64_t src_block, void* dst, int64_t dst_block, int64_t j,
                               int64_t count) {
  if (!Columns()) return CopyBlockChunks(backend_, config_, layout_, stream, src, src_block, dst, dst_block, j, count);
  const int64_t offset = j * ChunkCols() * static_cast<int64_t>(ByteWidth(a_.types.c));
  return backend_.CopyPieces(stream, Offset(dst, layout_.At(dst_block, 0, 0) + offset),
                             Offset(src, layout_.At(src_block, 0, 0) + offset),
                             count * ChunkCols() * static_cast<int64_t>(ByteWidth(a_.types.c)), a_.rows,
                             layout_.row_bytes);
}

// XLA's stream waits until chunks [first, end) of receive slots [first_slot, end_slot) have landed
// (each distinct event once: a slot's chunks may share one, call_session.h).
ffi::Error Scatter::AwaitChunks(const Landed& landed, int first_slot, int end_slot, int64_t first, int64_t end) {
  for (int slot = first_slot; slot < end_slot; ++slot) {
    Ready waited;
    for (int64_t j = first; j < end; ++j) {
      FICCO_RETURN_IF_ERROR(WaitOnce(backend_, config_, Backend::kCompute, landed[slot][j], &waited,
                                     config_.SourceOfSlot(slot), "landed"));
    }
  }
  return ffi::Error::Success();
}

// A symmetric call's waits for its words go with the sum (Backend::Reduce), into its own kernel where
// the sum is small (device/reduce.cu says why only then): no kernel for its waits, one per slot and
// chunk before. Events are waited for before it (AwaitChunks).
ffi::Error Scatter::SumAfter(const Landed& landed, int first_slot, int end_slot, int64_t first, int64_t end,
                             const ReduceProblem& problem) {
  std::vector<PeerWait> words;
  const uint32_t* epoch = nullptr;
  for (int slot = first_slot; slot < end_slot; ++slot) {
    for (int64_t j = first; j < end; ++j) {
      const Ready& ready = landed[slot][j];
      if (ready.epoch == nullptr) continue;
      if (!words.empty() && words.back().wait.word == ready.word) continue;  // a slot's chunks may share one
      epoch = ready.epoch;
      words.push_back({{ready.word, 0, ready.check}, config_.SourceOfSlot(slot), "landed"});
    }
  }
  if (words.empty()) {
    FICCO_RETURN_IF_ERROR(AwaitChunks(landed, first_slot, end_slot, first, end));
    return backend_.Reduce(problem, {});
  }
  return PeerWaitsError(config_, epoch, words, backend_.Reduce(problem, CountersOf(epoch, words)));
}

// Compute stream after the transfers: out[chunk] = own[chunk] + sum over slots of recv[slot][chunk].
// matmul_rs with gemm=grouped reduces the whole block once after every chunk has landed.
ffi::Error Scatter::ReduceChunks(const Landed& landed, const void* recv) {
  const int64_t esize = static_cast<int64_t>(ByteWidth(a_.types.c));
  const void* own = matmul_ ? static_cast<const void*>(a_.out) : Offset(a_.y, config_.rank * layout_.Block());
  const int64_t block_elems = a_.rows * a_.cols;
  const int64_t pieces = SumsWholeBlock() ? 1 : config_.chunks;
  const int64_t piece_elems = block_elems / pieces;
  const int64_t chunks_per_piece = config_.chunks / pieces;
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int64_t offset = piece * piece_elems * esize;
    FICCO_RETURN_IF_ERROR(SumAfter(landed, 0, config_.n() - 1, piece * chunks_per_piece, (piece + 1) * chunks_per_piece,
                                   {Offset(a_.out, offset), Offset(own, offset), Offset(recv, offset), block_elems,
                                    config_.n() - 1, piece_elems, a_.types.c}));
  }
  return ffi::Error::Success();
}

// Compute stream after the transfers (SumsInMatmuls): our own block in two matmuls of half its chunks
// each, out = own + recv[0] with the landed partial of slot 0 added in the epilogue (in f32, rounded
// once), then, on more than two devices, + the other slots' partials by a sum in place once they landed
// (the matmul waits for slot 0 alone). The first
// half's partials were sent in the first half of the peers' send matmuls and the second half's by
// their end, so unless the copies are slower than the matmuls neither waits; two matmuls, not one
// per chunk, keep the own block's matmuls large. gemm=columns: the halves are the block's left and
// right columns, and on more than two devices the other slots' partials are summed once, after both
// (their column halves are not contiguous).
ffi::Error Scatter::SumInMatmuls(const Landed& landed, const void* recv) {
  const int64_t q = a_.rows / config_.chunks;
  const int64_t esize = static_cast<int64_t>(ByteWidth(a_.types.c));
  const int64_t block_elems = a_.rows * a_.cols;
  const int64_t bounds[3] = {0, config_.chunks / 2, config_.chunks};
  for (int half = 0; half < 2; ++half) {
    const int64_t first = bounds[half], end = bounds[half + 1];
    FICCO_RETURN_IF_ERROR(AwaitChunks(landed, 0, 1, first, end));  // the matmul adds slot 0 only
    FICCO_RETURN_IF_ERROR(Columns() ? mm_.RunColumns(backend_, a_.y, config_.rank, a_.out, 0, 0, a_.rows,
                                                     first * ChunkCols(), (end - first) * ChunkCols(), recv, 0)
                                    : mm_.Run(backend_, a_.y, config_.rank, a_.out, 0, first * q, (end - first) * q,
                                              recv, 0));
    if (config_.n() == 2 || Columns()) continue;
    const int64_t offset = first * q * a_.cols * esize;
    FICCO_RETURN_IF_ERROR(SumAfter(landed, 1, config_.n() - 1, first, end,
                                   {Offset(a_.out, offset), Offset(a_.out, offset),
                                    Offset(recv, block_elems * esize + offset), block_elems, config_.n() - 2,
                                    (end - first) * q * a_.cols, a_.types.c}));
  }
  if (config_.n() == 2 || !Columns()) return ffi::Error::Success();
  return SumAfter(landed, 1, config_.n() - 1, 0, config_.chunks,
                  {a_.out, a_.out, Offset(recv, block_elems * esize), block_elems, config_.n() - 2, block_elems,
                   a_.types.c});
}

}  // namespace

ffi::Error RunScatter(Backend& backend, const OpConfig& config, const ScatterArgs& a) {
  if (config.gemm == GemmMode::kColumns && (a.w == nullptr || a.recv == nullptr || a.groups != 1)) {
    return MakeInvalid(config.ctx, "gemm=columns cuts the columns of matmul_rs's blocks; this op takes "
                                   "gemm=per_chunk or grouped");
  }
  const bool columns = config.gemm == GemmMode::kColumns;  // the chunks cut a block's columns, not its rows
  FICCO_RETURN_IF_ERROR(
      BeginCall(backend, config, columns ? a.cols : a.rows, columns ? "the columns of a block" : a.rows_name));
  CallSession session(config, ScheduleSignature(config, a.kind, a.types, {a.groups, a.rows, a.inner, a.cols}));
  return Scatter(backend, config, a).Run(session);
}

}  // namespace ficco
