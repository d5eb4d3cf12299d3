// The schedule and group of one call, decoded once from the op's FFI attributes (ffi/attrs.cc),
// and the ring arithmetic every executor shares.
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_OP_CONFIG_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_OP_CONFIG_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "base/errors.h"

namespace ficco {

enum class Order : int { kRing = 0, kDirect = 1 };
// How a block's matmuls and transfers are cut: c row chunks, a matmul each (kPerChunk); row chunks
// that move apart but one matmul per block (kGrouped); or, for matmul_rs, c column chunks, a matmul
// each (kColumns: each chunk reads only its columns of w, where a thin row chunk reads all of w).
enum class GemmMode : int { kPerChunk = 0, kGrouped = 1, kColumns = 2 };

class CallWatch;  // runtime/watchdog.h

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
  double watchdog_s = 0.0;  // config.WATCHDOG_S: how long device work may take once started; 0: unwatched
  std::string_view site;    // where the op was written ("model.py:42 (mlp)"), for the watchdog's report
                            // (the call's attribute: valid while the call runs; the watchdog copies it)
  CallWatch* watch = nullptr;  // the watch of this call (ffi/handler.h), told of every peer event waited on
  double spin_s = 0.0;  // rendezvous spin before sleeping (set by the CUDA bindings)
  // Every call writes its launch's number (from the run id) into its symmetric site's launch word:
  // where XLA runs no initialize stage to count launches (CPU; runtime/symmetric.h, "Launches").
  bool launch_from_run = false;
  bool skip_own_rows = false;  // ag_matmul / a2a_matmul whose gathered / received output nobody reads
  bool push = false;  // transfer=push: senders write into their peers' buffers (exec/executor.h)
  // transfer=symmetric: senders write into their peers' slots of the site, and the devices order the
  // copies with counters, without meetings (runtime/symmetric.h).
  bool symmetric = false;
  // The matmul's w is column-major (MatmulTypes::b_transposed); a layout of this device's own
  // operand, which no peer reads, so it is not part of the rendezvous signature.
  bool w_col_major = false;
  // config.CHANNEL_BYTES: a call that computes at most this many bytes for its peers runs on its
  // group's channel, without host meetings (runtime/channel.h); 0: every call meets.
  int64_t channel_bytes = 0;

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

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_OP_CONFIG_H_
