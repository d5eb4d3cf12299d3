// Groups whose devices live in several processes of one host: peers in other processes read a
// staging buffer this extension allocates and exports (ipc_cuda.cc), and the devices meet in the
// host mailbox (ipc_mailbox.h) instead of the in-process rendezvous.
//
// Why staging: XLA's buffers cannot be exported. On the GPU run (4 x H200, jax 0.11.2) every XLA
// allocation was a cuMemCreate (VMM) range, not legacy-IPC capable, with the default BFC
// allocator (one 112 GB reservation) and with XLA_PYTHON_CLIENT_ALLOCATOR=platform alike. So
// each device owns a staging buffer in memory that CAN be shared (cudaMalloc, legacy CUDA IPC;
// docs/multiprocess.md says why not a VMM region passed as a file descriptor), and per call
//   Owner:  copies what its peers will read (the all-gather shard, the all-to-all blocks) from
//           XLA's buffer into its staging buffer on XLA's stream ahead of its matmuls, or writes it
//           there in the first place (the matmul_rs / matmul_a2a partials), records one
//           interprocess event per piece, posts (staging id, offset, events);
//   Puller: waits on those events and pulls from the peer's staging buffer into its own XLA
//           buffers (local writes: nothing of the puller is exported).
// The executor does the copies (CallSession::Stage / Exchange, call_session.cc); this file provides the
// buffer, the exports and the meeting.
//
// Steps, as for the in-process path (exchange once, per call only record, copy, wait):
//   once per staging region: exported with cudaIpcGetMemHandle and published in the mailbox's
//     export table; the export id is the region's generation, carried in every post; a peer
//     opens each (device, generation) once (cudaIpcOpenMemHandle) and keeps the mapping.
//   once per event: interprocess events (cudaEventInterprocess) are exported the first time they
//     are posted and opened once by each peer.
//   per call phase: posts carry (generation, offset) and event ids through the mailbox; the host
//     spins on the mailbox (with the rendezvous timeout), the GPU streams wait on the opened
//     events exactly as on in-process events.
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_IPC_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_IPC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/op_config.h"
#include "runtime/registry.h"

namespace ficco {

#ifdef FICCO_WITH_CUDA
// CallSession::Meet for a cross-process group: posts `mine` (this device's staging buffer, or
// nullptr, of which peers read `bytes`, and its events) tagged with the phase, `call` (NextIpcCall)
// and the launch, and returns every rank's post with the peers' buffers and events usable in this
// process. A peer whose tag, event count or exposed size differs from ours is an error naming both.
ffi::Error MeetAcrossProcesses(const OpConfig& config, Phase phase, uint64_t call, const Post& mine, int64_t bytes,
                               std::vector<Post>* posts);
// This device's ordinal for its next call of the group (1, 2, ...), the `call` of its posts' tags.
ffi::Error NextIpcCall(const OpConfig& config, uint64_t* call);

// This device's staging buffer with room for at least `bytes`, growing it if needed. Call after
// Backend::Prepare (the device's resources must exist). Growth allocates a new region (a new
// generation) and retires the old one: a peer may still be pulling from it, so it stays allocated
// until IpcClose (regions grow at least twofold: the retired ones add up to less than the current).
ffi::Error StagingBuffer(const OpConfig& config, uint64_t bytes, void** staging);

// transfer=symmetric across processes: `base` (a symmetric site's allocation of `bytes`, made by
// this device: runtime/symmetric.h) becomes exportable as the staging buffer is, so that the site's
// setup meeting can post it.
ffi::Error ExportRegion(const OpConfig& config, void* base, uint64_t bytes);

// The error a meeting of this call's group would fail with at once because a rank gave up (a peer
// failed or timed out earlier: the processes' calls are out of step for good), if one did.
ffi::Error FailIfGroupGaveUp(const OpConfig& config);

// A call failed between filling the staging buffer and protecting it (call_session.cc): a peer may
// still read the current region, so the next call must not overwrite it. Retires it (kept until
// IpcClose); the next call allocates a new one.
void RetireStaging(int ordinal);

// Counters of one device's IPC state (for logs and soak checks: opened mappings must not grow).
struct IpcDeviceStats {
  int ordinal = -1;
  int64_t exported_allocations = 0, exported_events = 0, opened_allocations = 0, opened_events = 0;
  int64_t exchanges = 0;
  int64_t staging_bytes = 0, staging_generations = 0, retired_staging_bytes = 0;
};
std::vector<IpcDeviceStats> IpcStats();

// What the allocation holding `pointer` looks like to CUDA IPC (diagnostics): base, size, the
// driver's buffer id, and whether legacy CUDA IPC can export it. Returns "" or an error.
struct IpcPointerInfo {
  uint64_t base = 0, bytes = 0, buffer_id = 0;
  bool ipc_capable = false;
};
std::string DescribePointer(uint64_t pointer, IpcPointerInfo* info);

// The staging buffer of local device `ordinal`, grown to at least `bytes` (diagnostics, the
// first check of a multi-process GPU run): its allocation as DescribePointer sees it, its generation,
// and whether cudaIpcGetMemHandle accepts it ("" if so, else the error). Returns "" or an error.
struct IpcStagingInfo {
  IpcPointerInfo allocation;
  int64_t generation = 0;
  uint64_t retired_bytes = 0;
  std::string export_error;
};
std::string DescribeStaging(int ordinal, uint64_t bytes, IpcStagingInfo* info);

// Teardown: refuses new cross-process calls, waits (at most kIpcCloseWaitS) for the calls in flight
// to return, then for this process's devices, closes every opened mapping and event, frees the
// staging buffers, unmaps and unlinks the mailbox. Returns the number of mappings closed, or -1
// where calls were still in flight (then nothing is unmapped: they may still enqueue copies from the
// mappings); failures are ignored (at exit the CUDA context may be gone already).
int64_t IpcClose();

// A cross-process call in flight: IpcClose waits for every one to end before it unmaps what they
// use. `open()` is false once IpcClose has begun: the call must fail instead of using the mappings.
class IpcCallScope {
 public:
  IpcCallScope();
  ~IpcCallScope();
  IpcCallScope(const IpcCallScope&) = delete;
  IpcCallScope& operator=(const IpcCallScope&) = delete;
  bool open() const { return open_; }

 private:
  bool open_ = false;
};
#else
inline ffi::Error MeetAcrossProcesses(const OpConfig& config, Phase, uint64_t, const Post&, int64_t,
                                      std::vector<Post>*) {
  return MakeInvalid(config.ctx, "this group spans processes, which needs the CUDA build's IPC path; the CPU "
                                 "backend reaches only the devices of its own process (use comm='xla')");
}
inline ffi::Error NextIpcCall(const OpConfig& config, uint64_t*) {
  return MakeInvalid(config.ctx, "this group spans processes, which needs the CUDA build's IPC path; the CPU "
                                 "backend reaches only the devices of its own process (use comm='xla')");
}
inline ffi::Error StagingBuffer(const OpConfig& config, uint64_t, void**) {
  return MakeInvalid(config.ctx, "this group spans processes, which needs the CUDA build's IPC path; the CPU "
                                 "backend reaches only the devices of its own process (use comm='xla')");
}
inline ffi::Error ExportRegion(const OpConfig& config, void*, uint64_t) {
  return MakeInvalid(config.ctx, "this group spans processes, which needs the CUDA build's IPC path; the CPU "
                                 "backend reaches only the devices of its own process (use comm='xla')");
}
inline ffi::Error FailIfGroupGaveUp(const OpConfig&) { return ffi::Error::Success(); }
inline void RetireStaging(int) {}
class IpcCallScope {
 public:
  bool open() const { return true; }
};
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_IPC_H_
