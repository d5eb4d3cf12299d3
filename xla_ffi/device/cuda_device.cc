// The CUDA state of one device, created on first use and kept for the life of the process.
#include "device/cuda_device.h"

#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include <cuda.h>

namespace ficco {

namespace {
// cuBLASLt workspace per device; Hopper kernels want at least 32 MiB for the best algorithms.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
}  // namespace

CaptureRelaxed::CaptureRelaxed() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
CaptureRelaxed::~CaptureRelaxed() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }

ffi::Error CudaDevice::Prepare(const CallContext& ctx, int copy_streams, const std::vector<int>& peers,
                               bool peer_stores, CudaResources** out) {
  std::lock_guard<std::mutex> lock(mu_);
  const CaptureRelaxed relaxed;  // a first call may be captured (command buffers)
  FICCO_CHECK_CUDA(cudaSetDevice(ordinal_));
  if (copy_streams > kCopyStreamSlots) {  // kMaxCopyStreams pull streams + the staging stream
    return MakeInvalid(ctx, "copy_streams = " + std::to_string(copy_streams) + " exceeds the maximum " +
                                std::to_string(kMaxCopyStreams));
  }
  while (cuda_.num_copy_streams < copy_streams) {
    FICCO_CHECK_CUDA(cudaStreamCreateWithFlags(&cuda_.copy_streams[cuda_.num_copy_streams],
                                               cudaStreamNonBlocking));
    ++cuda_.num_copy_streams;
  }
  // Each made on its own, so that a Prepare that failed halfway (the workspace's cudaMalloc, say)
  // is completed by the next one instead of leaving a handle without its workspace.
  if (cuda_.lt == nullptr) FICCO_CHECK_CUDA(cublasLtCreate(&cuda_.lt));
  if (cuda_.gemm_plans == nullptr) cuda_.gemm_plans = std::make_unique<GemmPlans>();
  if (cuda_.workspace == nullptr) {
    FICCO_CHECK_CUDA(cudaMalloc(&cuda_.workspace, kCublasWorkspaceBytes));
    cuda_.workspace_bytes = kCublasWorkspaceBytes;
  }
  for (int peer : peers) {
    if (peer == ordinal_ || cuda_.peers_enabled.count(peer)) continue;
    int can_access = 0;
    FICCO_CHECK_CUDA(cudaDeviceCanAccessPeer(&can_access, ordinal_, peer));
    if (can_access) {
      cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // clear the sticky-free "already enabled" error
      } else {
        FICCO_CHECK_CUDA(status);
      }
    }
    // Without peer access cudaMemcpyAsync still works (staged by the driver), only slower; a
    // kernel's store into the peer's memory faults.
    cuda_.peers_enabled.insert(peer);
    if (!can_access) cuda_.peers_unreachable.insert(peer);
  }
  for (int peer : peers) {
    if (peer_stores && peer != ordinal_ && cuda_.peers_unreachable.count(peer)) {
      return MakeInvalid(ctx, "device " + std::to_string(ordinal_) + " has no peer access to device " +
                                  std::to_string(peer) + " (cudaDeviceCanAccessPeer is 0), and a symmetric site's "
                                  "devices write each other's counters: use transfer='pull' (the default) for this "
                                  "group");
    }
  }
  *out = &cuda_;
  return ffi::Error::Success();
}

ffi::Error CudaDevice::AcquireEvent(const CallContext& ctx, cudaEvent_t* event, bool interprocess) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<cudaEvent_t>& pool = interprocess ? cuda_.free_ipc_events : cuda_.free_events;
    if (!pool.empty()) {
      *event = pool.back();
      pool.pop_back();
      return ffi::Error::Success();
    }
  }
  FICCO_CHECK_CUDA(cudaSetDevice(ordinal_));
  FICCO_CHECK_CUDA(cudaEventCreateWithFlags(
      event, interprocess ? (cudaEventDisableTiming | cudaEventInterprocess) : cudaEventDisableTiming));
  made_.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

void CudaDevice::ReleaseEvents(const std::vector<cudaEvent_t>& events, bool interprocess) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<cudaEvent_t>& pool = interprocess ? cuda_.free_ipc_events : cuda_.free_events;
  pool.insert(pool.end(), events.begin(), events.end());
}

bool CudaDevice::Done(Event event) {
  // Not ready is the only answer that leaves something to wait for; an error (a failed launch, a
  // context torn down at exit) leaves nothing.
  return event == nullptr || cudaEventQuery(static_cast<cudaEvent_t>(event)) != cudaErrorNotReady;
}

int64_t CudaDevice::Free() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(cuda_.free_events.size() + cuda_.free_ipc_events.size());  // as Made() counts
}

void CudaDevice::Release(const std::vector<Event>& events) {
  std::vector<cudaEvent_t> cuda_events;
  for (Event event : events) cuda_events.push_back(static_cast<cudaEvent_t>(event));
  ReleaseEvents(cuda_events, /*interprocess=*/false);
}

namespace {
// Never returns: the stream it is enqueued on stops there (the process ends by abort).
void CUDART_CB NeverReturn(void*) {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}
}  // namespace

ffi::Error CudaDevice::BlockForever(const CallContext& ctx, cudaStream_t stream) {
  FICCO_CHECK_CUDA(cudaLaunchHostFunc(stream, NeverReturn, nullptr));
  return ffi::Error::Success();
}

// Zeroed on a stream of its own, waited for here: XLA's stream may be capturing, and the copy
// streams may hold transfers that wait for peers.
ffi::Error CudaDevice::AllocateRegion(const CallContext& ctx, int64_t bytes, void** region) {
  std::lock_guard<std::mutex> lock(mu_);
  const CaptureRelaxed relaxed;
  FICCO_CHECK_CUDA(cudaSetDevice(ordinal_));
  if (setup_stream_ == nullptr) FICCO_CHECK_CUDA(cudaStreamCreateWithFlags(&setup_stream_, cudaStreamNonBlocking));
  FICCO_CHECK_CUDA(cudaMalloc(region, static_cast<size_t>(bytes)));
  FICCO_CHECK_CUDA(cudaMemsetAsync(*region, 0, static_cast<size_t>(bytes), setup_stream_));
  FICCO_CHECK_CUDA(cudaStreamSynchronize(setup_stream_));
  return ffi::Error::Success();
}

ffi::Error CudaDevice::AllocateWords(const CallContext& ctx, int64_t count, uint32_t** words) {
  const CaptureRelaxed relaxed;
  void* host = nullptr;
  FICCO_CHECK_CUDA(cudaHostAlloc(&host, static_cast<size_t>(count) * sizeof(uint32_t),
                                 cudaHostAllocPortable | cudaHostAllocMapped));
  std::memset(host, 0, static_cast<size_t>(count) * sizeof(uint32_t));
  void* mapped = nullptr;
  FICCO_CHECK_CUDA(cudaHostGetDevicePointer(&mapped, host, 0));
  if (mapped != host) {
    return MakeError(ctx, "pinned host memory is mapped at another address on the device: the group channels need "
                          "unified addressing (set FICCO_CHANNEL_BYTES=0 to meet on the host instead)");
  }
  *words = static_cast<uint32_t*>(host);
  return ffi::Error::Success();
}

namespace {

// cuStreamWriteValue32 and cuStreamWaitValue32 from the driver, through the runtime's entry-point
// query (linking libcuda would stop the extension from loading where there is no driver).
using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
struct StreamMemOps {
  StreamValue32Fn write = nullptr, wait = nullptr;
  cudaError_t status = cudaSuccess;
};

const StreamMemOps& MemOps() {
  static std::once_flag once;
  static StreamMemOps ops;
  std::call_once(once, [] {
    for (auto [name, fn] : {std::pair{"cuStreamWriteValue32", &ops.write}, std::pair{"cuStreamWaitValue32", &ops.wait}}) {
      void* entry = nullptr;
      cudaDriverEntryPointQueryResult result;
      cudaError_t found = cudaGetDriverEntryPointByVersion(name, &entry, 12000, cudaEnableDefault, &result);
      if (found == cudaSuccess && result != cudaDriverEntryPointSuccess) found = cudaErrorSymbolNotFound;
      if (found != cudaSuccess) ops.status = found;
      *fn = reinterpret_cast<StreamValue32Fn>(entry);
    }
  });
  return ops;
}

ffi::Error MemOpResult(const CallContext& ctx, const char* what, CUresult result) {
  if (result == CUDA_SUCCESS) return ffi::Error::Success();
  return MakeError(ctx, std::string(what) + " failed: CUresult " + std::to_string(static_cast<int>(result)));
}

}  // namespace

ffi::Error CudaDevice::SetWord(const CallContext& ctx, cudaStream_t stream, uint32_t* word, uint32_t value) {
  const StreamMemOps& ops = MemOps();
  if (ops.write == nullptr) {
    return MakeError(ctx, std::string("the driver's stream memory operations are unavailable: ") + cudaGetErrorName(ops.status));
  }
  return MemOpResult(ctx, "cuStreamWriteValue32",
                     ops.write(stream, reinterpret_cast<CUdeviceptr>(word), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

ffi::Error CudaDevice::WaitWord(const CallContext& ctx, cudaStream_t stream, const uint32_t* word, uint32_t value) {
  const StreamMemOps& ops = MemOps();
  if (ops.wait == nullptr) {
    return MakeError(ctx, std::string("the driver's stream memory operations are unavailable: ") + cudaGetErrorName(ops.status));
  }
  return MemOpResult(ctx, "cuStreamWaitValue32",
                     ops.wait(stream, reinterpret_cast<CUdeviceptr>(word), value, CU_STREAM_WAIT_VALUE_GEQ));
}

CudaResources* CudaDevice::resources() {
  std::lock_guard<std::mutex> lock(mu_);
  return cuda_.lt == nullptr ? nullptr : &cuda_;
}

}  // namespace ficco
