// The executor: runs one schedule of one op on one device — ordering, dependencies, rendezvous and
// joins — through a Backend (device/backend.h), so the CPU backend runs the same composition.
// Two pipelines, each written once and parameterised by the op's block layout:
//
//   gather -> consume  (gather.cc):  all_gather, ag_matmul, all_to_all, a2a_matmul
//     peers' blocks land in `received`, chunk by chunk; the consumer (the matmuls, if any)
//     multiplies each chunk as it lands.
//   produce -> scatter (scatter.cc): reduce_scatter, matmul_rs, matmul_a2a
//     the producer (the matmuls, if any) computes the block for each peer, chunk by chunk; the
//     chunks move to their peers; reduce-scatters then sum what landed.
//
// Every buffer is a row of per-peer blocks, [n, groups, rows, row] row-major (BlockLayout): groups
// are the local experts E of the expert ops (1 otherwise), rows the chunked dimension (rows per
// device m, or the capacity C). Chunks cut `rows` inside every block, so chunk j of a block is
// `groups` pieces of q = rows / chunks rows each. Block p of a gathered result came from rank p;
// block p of a scattered source goes to rank p.
//
// Roles inside one call of device r (group of n, c chunks, peer slots s = 0 .. n-2 at ring
// distance s + 1):
//   Owner:  records `ready` (its inputs, or its send partials, are valid) before the exchange;
//           must not return until every peer's pulls from it are done (the join).
//   Puller: after the exchange, copy streams wait on the owner's event, pull each chunk into
//           local memory and record events for the compute stream (per chunk, or per slot where
//           the consumer takes a slot whole: LandedEvents); slot s reads from rank r-1-s
//           (OpConfig::SourceOfSlot).
// With transfer=push (config.push; groups inside one process) the roles turn round:
//   Receiver: records `entry` (its destination buffer is XLA's to write from here) and posts
//             the destination in the exchange (CallSession::Push).
//   Sender:   its copy streams wait on the target's entry and on its own data's events, write
//             each chunk into the target's buffer and record events as a puller does; a second
//             meeting (kPushed) hands those events to the receivers; slot s writes to rank r+1+s.
// The join: XLA's stream waits for this device's copy streams (now writing peers) and, through
// the kPushed events, for every peer's push into it, before the handler returns; so a push call
// meets twice (exchange, pushed) like a pull call (exchange, done), then announces "release"
// (call_session.cc, JoinAndRelease).
// On its group's channel (matmul_rs and matmul_a2a pulls of small partials in one process:
// runtime/channel.h) a call meets nobody: the owner computes its partials in its channel region and
// marks them with words instead of events, the pullers set a done word instead of meeting at "done",
// and the owner's next call waits for those words before it writes its region again; its own return
// waits only for its own pulls.
// Why push: on 2 x H200 with both GPUs receiving at once, copy-engine ingress was 339 (push) vs
// 311 (pull) GB/s at 40 MiB blocks and 262 vs 162 at 8 MiB (PyTorch streams). Through this
// executor, at the same group size, pushes then timed level with pulls (36 op/schedule pairs,
// median 1.3 % slower), so they are opt-in; three senders per GPU (tp = 4) were not measured.
// `ring` issues one transfer at a time on one copy stream (rank r-1 first); `direct` spreads the
// peers over the copy streams. On an NVSwitch node every owner is one hop away, so both pull from
// the owner directly; the neighbour relay of the xla ring schedule is not needed here.
#ifndef FICCO_JAX_XLA_FFI_EXEC_EXECUTOR_H_
#define FICCO_JAX_XLA_FFI_EXEC_EXECUTOR_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "base/dtype.h"
#include "device/backend.h"
#include "runtime/call_session.h"
#include "runtime/op_config.h"

namespace ficco {

// The first word of a call's rendezvous signature: which op it is, so that two different ops
// meeting under one key are an error, not a wrong answer.
enum class SignatureKind : int64_t {
  kAgMatmul = 1,
  kMatmulRs = 2,
  kAllGather = 3,
  kReduceScatter = 4,
  kAllToAll = 5,
  kA2aMatmul = 6,
  kMatmulA2a = 7,
  kContentionProbe = 8,
};

// Byte offsets inside a [n, groups, rows, row] buffer with `row_bytes` bytes per row.
struct BlockLayout {
  int64_t groups = 1, rows = 0, row_bytes = 0;
  int64_t Block() const { return groups * rows * row_bytes; }
  int64_t At(int64_t block, int64_t group, int64_t row) const {
    return ((block * groups + group) * rows + row) * row_bytes;
  }
};

// gather -> consume. all_gather: x is this rank's one block, sent to every peer; all_to_all: x
// holds one block per peer (x_per_peer). With w: out[p] = received[p] @ w (per group: w[g]).
struct GatherArgs {
  SignatureKind kind;
  const char* rows_name;   // the chunked dimension, as error messages name it
  const void* x;           // [1 or n, groups, rows, row_bytes]
  bool x_per_peer;         // block p of x goes to rank p (all-to-all); else all of x goes to every rank
  void* received;          // [n, groups, rows, row_bytes]: block p came from rank p
  BlockLayout layout;      // of `received` (and of x's blocks)
  const void* w = nullptr; // [groups, inner, cols]; nullptr: no consumer (the collective alone)
  void* out = nullptr;     // [n, groups, rows, cols]
  int64_t inner = 0, cols = 0;
  MatmulTypes types;       // x's (received's) dtype is types.a
};

// produce -> scatter. matmul_rs / matmul_a2a: send slot s = y[block of rank r+1+s] @ w, our own
// block straight into `out`; reduce_scatter: y's blocks are sent as they are. A reduce (recv set)
// then sums: out = own + sum of recv's slots; otherwise the peers' blocks land in out[p].
struct ScatterArgs {
  SignatureKind kind;
  const char* rows_name;
  int64_t groups, rows, cols;  // a result block: [groups, rows, cols] elements
  MatmulTypes types;           // what moves and is summed has types.c (reduce_scatter: a = b = c)
  const void* y;               // [n, groups, rows, inner] (matmul) or [n, 1, rows, cols] (reduce_scatter)
  const void* w = nullptr;     // [groups, inner, cols]; nullptr: reduce_scatter
  int64_t inner = 0;
  void* send = nullptr;        // matmul: [n-1, groups, rows, cols], slot s for rank r+1+s
  void* out;                   // reduce: [rows, cols]; else [n, groups, rows, cols]
  void* recv = nullptr;        // reduce: [n-1, rows, cols], slot s from rank r-1-s; nullptr: no reduce
};

ffi::Error RunGather(Backend& backend, const OpConfig& config, const GatherArgs& args);
ffi::Error RunScatter(Backend& backend, const OpConfig& config, const ScatterArgs& args);

// The contention probe of `characterize` (probe.cc): `repeats` matmuls a @ w on XLA's stream while
// copy stream 0 pulls every peer's x into `gathered` (pull), or the matmuls alone.
struct ProbeArgs {
  const void* a;
  const void* w;
  void* out;
  int64_t rows, inner, cols;
  MatmulTypes types;
  const void* x;          // the shard peers pull
  int64_t shard_bytes;
  void* gathered;         // [n, shard_bytes]
  int64_t repeats;
  bool pull;
};
ffi::Error RunProbe(Backend& backend, const OpConfig& config, const ProbeArgs& args);

// Shared by the pipelines (gather.cc): {kind, dtypes, shape..., schedule, n}.
std::vector<int64_t> ScheduleSignature(const OpConfig& config, SignatureKind kind, const MatmulTypes& types,
                                       std::initializer_list<int64_t> shape);
// Enqueues chunks [j, j + count) of block `src_block` of `src` into block `dst_block` of `dst`, every
// group's rows in one copy (Backend::CopyPieces: its pieces are the groups).
ffi::Error CopyBlockChunks(Backend& backend, const OpConfig& config, const BlockLayout& layout, int stream,
                           const void* src, int64_t src_block, void* dst, int64_t dst_block, int64_t j,
                           int64_t count);
// transfer=symmetric, the receive slots whose blocks are a result (not the op's scratch): slot s on
// its copy stream, after `entry` (XLA's buffers are this call's from there) and its landed words,
// from the site into block `dst_block(s)` of `dst` (laid out as `layout`); `*copied` gets the event
// of each slot's copy, which XLA's stream waits for before the slots are released.
ffi::Error CopyOutSymmetric(Backend& backend, const OpConfig& config, const SymmetricCall& symmetric, Event entry,
                            const Landed& landed, const BlockLayout& layout, void* dst,
                            const std::function<int64_t(int slot)>& dst_block, std::vector<Event>* copied);
// transfer=symmetric, a call that failed after its epoch was counted: its site stops in this process
// (the ranks' counts may have parted: SymmetricSite::Fail), XLA's stream waits for every copy the call
// enqueued (its copy streams' last work, the copy-out stream's too), and the call is posted finished, so that the
// watchdog does not take the failed call for a stuck one. Returns `error`.
ffi::Error FailSymmetric(Backend& backend, const OpConfig& config, const SymmetricCall& symmetric, ffi::Error error);
// transfer=symmetric: the call's first kernel (SymmetricCall::Begin); where it fails after the call
// was counted (on CPU a wait for a target's slot that timed out, on CUDA a later kernel's launch), the
// call ends through FailSymmetric, as any counted call that fails: else the watchdog would take it for
// a stuck one, and the site would run on a count ahead of its peers.
ffi::Error BeginSymmetric(Backend& backend, const OpConfig& config, const SymmetricCall& symmetric);
// transfer=symmetric: XLA's stream waits for the copy-outs (`copied`), on every path, since they write
// XLA's buffers; the slots are then released at the join (SymmetricCall::End). Returns the first error.
ffi::Error AwaitCopyOuts(Backend& backend, const std::vector<Event>& copied, ffi::Error status);
// The matmuls of rows [row, row + count) of one block, for every group g:
// out block = in block @ w[g] (in: [.., groups, rows, inner], out: [.., groups, rows, cols]).
struct BlockMatmul {
  BlockLayout in, res;
  const void* w;
  int64_t inner, cols;
  MatmulTypes types;
  // Rows [row, row + count) of block `in_block` of in_base times w into block `out_block` of out_base;
  // with `add_base`, plus the same rows of its block `add_block` (laid out as the result), added in
  // the matmul's epilogue.
  ffi::Error Run(Backend& backend, const void* in_base, int64_t in_block, void* out_base, int64_t out_block,
                 int64_t row, int64_t count, const void* add_base = nullptr, int64_t add_block = 0) const {
    return RunColumns(backend, in_base, in_block, out_base, out_block, row, count, 0, cols, add_base, add_block);
  }
  // The same for columns [col, col + width) of w and of the result alone (one group).
  ffi::Error RunColumns(Backend& backend, const void* in_base, int64_t in_block, void* out_base, int64_t out_block,
                        int64_t row, int64_t count, int64_t col, int64_t width, const void* add_base = nullptr,
                        int64_t add_block = 0) const;
};

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_EXEC_EXECUTOR_H_
