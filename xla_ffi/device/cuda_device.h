// The CUDA state of one device: copy streams, the event pools, the cuBLASLt handle, workspace and
// plans, peer access, and the staging buffers of groups across processes. The registry
// (runtime/registry.h) keeps one per device ordinal; the CUDA backend and runtime/ipc_cuda.cc use it.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_CUDA_DEVICE_H_
#define FICCO_JAX_XLA_FFI_DEVICE_CUDA_DEVICE_H_

#ifdef FICCO_WITH_CUDA
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "base/errors.h"
#include "device/backend.h"
#include "device/gemm.h"

namespace ficco {

// CUDA resources of one device, created once (CudaDevice::Prepare) and reused by every call.
struct CudaResources {
  // A fixed array so that a stream handle never moves while another call reads it.
  std::array<cudaStream_t, kCopyStreamSlots> copy_streams = {};
  int num_copy_streams = 0;  // grows to the largest count asked for (kStagingStream + 1 with staging)
  std::vector<cudaEvent_t> free_events;    // the event pool (see Backend::ReleaseEvents)
  cublasLtHandle_t lt = nullptr;
  std::unique_ptr<GemmPlans> gemm_plans;  // cuBLASLt plans by problem shape
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::set<int> peers_enabled;      // every peer asked about, with access or not
  std::set<int> peers_unreachable;  // of those, the ones this device has no peer access to

  // Groups across processes of this host (runtime/ipc_cuda.cc), guarded by ipc_mu. Interprocess events
  // have their own pool: every event of a cross-process call may be waited on by another process.
  std::mutex ipc_mu;
  std::vector<cudaEvent_t> free_ipc_events;
  std::map<cudaEvent_t, int32_t> exported_events;            // our interprocess event -> its id
  // The staging buffer: the only memory this device exports (XLA's own allocations cannot be:
  // docs/multiprocess.md). `staging` is the current region; regions it outgrew, or that a failed
  // call may still expose to a peer, are `retired` and freed only by IpcClose.
  struct StagingRegion {
    char* base = nullptr;
    uint64_t bytes = 0;
    int32_t export_id = -1;  // its id in the mailbox's export table (the generation peers open)
  };
  StagingRegion staging;
  std::vector<StagingRegion> retired_staging;
  // The allocations of symmetric sites (runtime/symmetric.h) of groups across processes, exported
  // like the staging buffer; never freed (IpcClose leaves them: a site's peers may still post into them).
  std::vector<StagingRegion> symmetric_regions;
  int64_t staging_generations = 0;  // regions allocated so far
  struct Opened {
    char* base = nullptr;
    uint64_t bytes = 0;
  };
  std::map<std::pair<int, int32_t>, Opened> opened_allocations;    // (peer device, its id) -> mapping
  std::map<std::pair<int, int32_t>, cudaEvent_t> opened_events;    // (peer device, its id) -> event
  int64_t ipc_exchanges = 0;
};

// Lets this thread make the calls a stream capture forbids (allocations, enabling peer access,
// synchronising a stream of its own) while XLA captures its stream into a command buffer: the
// thread's capture mode is relaxed for the guard's life, then restored.
class CaptureRelaxed {
 public:
  CaptureRelaxed();
  ~CaptureRelaxed();
  CaptureRelaxed(const CaptureRelaxed&) = delete;
  CaptureRelaxed& operator=(const CaptureRelaxed&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

class CudaDevice final : public EventPool {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {}

  // Creates on first use: at least `copy_streams` copy streams, the cuBLASLt handle and
  // workspace, and peer access to each of `peers`. Thread-safe; `ctx` names the caller in errors.
  ffi::Error Prepare(const CallContext& ctx, int copy_streams, const std::vector<int>& peers, bool peer_stores,
                     CudaResources** out);
  // `interprocess`: an event other processes can wait on (cudaEventInterprocess), from its own pool.
  ffi::Error AcquireEvent(const CallContext& ctx, cudaEvent_t* event, bool interprocess = false);
  void ReleaseEvents(const std::vector<cudaEvent_t>& events, bool interprocess = false);
  // EventPool, for the watchdog: the in-process events.
  bool Done(Event event) override;
  void Release(const std::vector<Event>& events) override;
  int64_t Made() override { return made_.load(std::memory_order_relaxed); }
  int64_t Free() override;
  // `stream` blocks until the process ends (the stall fault's peer that never records its event):
  // a host function that never returns. Not a kernel: one that never ends holds part of the
  // device, and on 2 x H100 the stalled rank's own handler then never returned.
  ffi::Error BlockForever(const CallContext& ctx, cudaStream_t stream);
  // The resources Prepare made (nullptr before the first Prepare).
  CudaResources* resources();
  // A zeroed region of `bytes` of this device's memory (Backend::AllocateRegion): the group
  // channels' (runtime/channel.h), the symmetric sites' (runtime/symmetric.h).
  ffi::Error AllocateRegion(const CallContext& ctx, int64_t bytes, void** region);

  // Words (device/backend.h): pinned host memory mapped into every device, at the same address
  // on host and devices (unified addressing).
  static ffi::Error AllocateWords(const CallContext& ctx, int64_t count, uint32_t** words);
  // The stream memory operations of the driver: `stream` writes `value` to `word` after its earlier
  // work, behind a fence; or waits until (int32_t)(word - value) >= 0.
  static ffi::Error SetWord(const CallContext& ctx, cudaStream_t stream, uint32_t* word, uint32_t value);
  static ffi::Error WaitWord(const CallContext& ctx, cudaStream_t stream, const uint32_t* word, uint32_t value);

 private:
  const int ordinal_;
  std::atomic<int64_t> made_{0};  // events created, both pools
  std::mutex mu_;
  CudaResources cuda_;
  cudaStream_t setup_stream_ = nullptr;  // AllocateRegion's zeroing
};

}  // namespace ficco

#endif  // FICCO_WITH_CUDA
#endif  // FICCO_JAX_XLA_FFI_DEVICE_CUDA_DEVICE_H_
