// Groups whose devices live in several processes of one host: the copy engines reach a peer
// process's buffers through CUDA IPC (ipc_cuda.cc), and the devices meet in the host mailbox
// (ipc_mailbox.h) instead of the in-process rendezvous.
//
// Stages, as for the in-process path (exchange once, per call only record, copy, wait):
//   once per allocation: the owner exports the allocation that holds an XLA buffer (XLA's
//     buffers are sub-allocations of a few large ones) with cudaIpcGetMemHandle and publishes the
//     handle in the mailbox; a peer opens it once (cudaIpcOpenMemHandle) and keeps the mapping.
//   once per event: interprocess events (cudaEventInterprocess) are exported the first time they
//     are posted and opened once by each peer.
//   per call phase: a post carries (allocation id, offset) and event ids through the mailbox;
//     the host spins on the mailbox (with the rendezvous timeout), the GPU streams wait on the
//     opened events exactly as on in-process events.
#ifndef FICCO_JAX_XLA_FFI_IPC_H_
#define FICCO_JAX_XLA_FFI_IPC_H_

#include <cstdint>
#include <vector>

#include "executor.h"

namespace ficco {

#ifdef FICCO_WITH_CUDA
// CallSession::Meet for a cross-process group: posts `mine` (this device's buffer and events)
// and returns every rank's post with the peers' buffers and events usable in this process.
ffi::Error MeetAcrossProcesses(const OpConfig& config, Phase phase, const Post& mine, std::vector<Post>* posts);

// Counters of one device's IPC state (for logs and soak checks: opened mappings must not grow).
struct IpcDeviceStats {
  int ordinal = -1;
  int64_t exported_allocations = 0, exported_events = 0, opened_allocations = 0, opened_events = 0;
  int64_t exchanges = 0;
};
std::vector<IpcDeviceStats> IpcStats();

// What the allocation holding `pointer` looks like to CUDA IPC (diagnostics): base, size, the
// driver's buffer id, and whether legacy CUDA IPC can export it. Returns "" or an error.
struct IpcPointerInfo {
  uint64_t base = 0, bytes = 0, buffer_id = 0;
  bool ipc_capable = false;
};
std::string DescribePointer(uint64_t pointer, IpcPointerInfo* info);

// Teardown: waits for this process's devices, closes every opened mapping and event, unmaps and
// unlinks the mailbox. Returns the number of mappings closed; failures are ignored (at exit the
// CUDA context may be gone already).
int64_t IpcClose();
#else
inline ffi::Error MeetAcrossProcesses(const OpConfig& config, Phase, const Post&, std::vector<Post>*) {
  return MakeInvalid(config.ctx, "this group spans processes, which needs the CUDA build's IPC path; the CPU "
                                 "backend reaches only the devices of its own process (use comm='xla')");
}
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_IPC_H_
