// The CUDA backend: XLA's stream is the compute stream; transfers run on the device's copy
// streams (device/cuda_device.h) and are ordered against it with pooled events.
#include <algorithm>

#include "device/backends.h"
#include "device/counters.h"
#include "device/dma.h"
#include "device/cuda_device.h"

namespace ficco {
namespace {

class CudaBackend final : public Backend {
 public:
  CudaBackend(const CallContext& ctx, CudaDevice& device, cudaStream_t compute, bool interprocess)
      : ctx_(ctx), compute_(compute), interprocess_(interprocess), device_(device) {}

  ffi::Error Prepare(int copy_streams, const std::vector<int>& group, bool peer_stores) override {
    return device_.Prepare(ctx_, copy_streams, group, peer_stores, &resources_);
  }

  ffi::Error Record(int stream, Event* event) override {
    const CallContext& ctx = ctx_;
    cudaEvent_t cuda_event;
    FICCO_RETURN_IF_ERROR(device_.AcquireEvent(ctx, &cuda_event, interprocess_));
    acquired_.push_back(cuda_event);
    FICCO_CHECK_CUDA(cudaEventRecord(cuda_event, StreamOf(stream)));
    *event = cuda_event;
    return ffi::Error::Success();
  }

  ffi::Error RecordMark(Event* event) override {
    const CallContext& ctx = ctx_;
    cudaEvent_t cuda_event;
    FICCO_RETURN_IF_ERROR(device_.AcquireEvent(ctx, &cuda_event, /*interprocess=*/false));
    FICCO_CHECK_CUDA(cudaEventRecord(cuda_event, compute_));
    *event = cuda_event;
    return ffi::Error::Success();
  }

  // Recorded on a stream of its own behind a kernel that never ends; the event and the stream are
  // never reused (the stall fault ends the process).
  ffi::Error RecordNever(Event* event) override {
    const CallContext& ctx = ctx_;
    cudaStream_t stalled;
    cudaEvent_t cuda_event;
    FICCO_CHECK_CUDA(cudaStreamCreateWithFlags(&stalled, cudaStreamNonBlocking));
    FICCO_RETURN_IF_ERROR(device_.BlockForever(ctx, stalled));
    FICCO_CHECK_CUDA(cudaEventCreateWithFlags(&cuda_event, cudaEventDisableTiming));
    FICCO_CHECK_CUDA(cudaEventRecord(cuda_event, stalled));
    *event = cuda_event;
    return ffi::Error::Success();
  }

  ffi::Error Wait(int stream, Event event) override {
    const CallContext& ctx = ctx_;
    FICCO_CHECK_CUDA(cudaStreamWaitEvent(StreamOf(stream), static_cast<cudaEvent_t>(event), 0));
    return ffi::Error::Success();
  }

  ffi::Error CopyPieces(int stream, void* dst, const void* src, size_t bytes, int64_t pieces,
                        int64_t pitch) override {
    const CallContext& ctx = ctx_;
    FICCO_CHECK_CUDA(CopyPiecesAsync(dst, src, bytes, pieces, pitch, StreamOf(stream)));
    return ffi::Error::Success();
  }

  ffi::Error AllocateWords(int64_t count, uint32_t** words) override {
    return CudaDevice::AllocateWords(ctx_, count, words);
  }

  ffi::Error AllocateRegion(int64_t bytes, void** region) override {
    return device_.AllocateRegion(ctx_, bytes, region);
  }

  ffi::Error SetWord(int stream, uint32_t* word, uint32_t value) override {
    return CudaDevice::SetWord(ctx_, StreamOf(stream), word, value);
  }

  ffi::Error WaitWord(int stream, const uint32_t* word, uint32_t value) override {
    return CudaDevice::WaitWord(ctx_, StreamOf(stream), word, value);
  }

  // The waits go with the count; beyond one kernel's list, in kernels of their own after it.
  ffi::Error CountCall(int stream, uint32_t* counter, uint32_t* mirror, const uint32_t* stopped,
                       const std::vector<CounterWait>& then) override {
    const CallContext& ctx = ctx_;
    const std::vector<CounterWaitList> lists = WaitLists({counter, then});
    FICCO_CHECK_CUDA(LaunchCountCall(counter, mirror, stopped, lists.empty() ? nullptr : &lists[0], StreamOf(stream)));
    for (size_t i = 1; i < lists.size(); ++i) FICCO_CHECK_CUDA(LaunchWaitCounters(lists[i], StreamOf(stream)));
    return ffi::Error::Success();
  }

  ffi::Error WaitCounters(int stream, const CounterWaits& waits) override {
    const CallContext& ctx = ctx_;
    for (const CounterWaitList& list : WaitLists(waits)) FICCO_CHECK_CUDA(LaunchWaitCounters(list, StreamOf(stream)));
    return ffi::Error::Success();
  }

  // The tag goes with the first kernel: every later one runs after it on the stream.
  ffi::Error PostCounter(int stream, const std::vector<uint32_t*>& words, const uint32_t* counter,
                         const LaunchCheck& check) override {
    const CallContext& ctx = ctx_;
    for (size_t first = 0; first < words.size(); first += kPostCounterWords) {
      const int count = static_cast<int>(std::min<size_t>(kPostCounterWords, words.size() - first));
      FICCO_CHECK_CUDA(LaunchPostCounter(words.data() + first, count, counter, first == 0 ? check.tag : nullptr,
                                         check.launch, StreamOf(stream)));
    }
    return ffi::Error::Success();
  }

  bool Capturing() override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(compute_, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
  }

  ffi::Error Gemm(const GemmProblem& problem) override {
    const CallContext& ctx = ctx_;
    FICCO_CHECK_CUDA(resources_->gemm_plans->Run(problem, resources_->lt, resources_->workspace,
                                                   resources_->workspace_bytes, compute_, Capturing()));
    return ffi::Error::Success();
  }

  // The last list of waits goes with the sum; any before it, in kernels of their own.
  ffi::Error Reduce(const ReduceProblem& problem, const CounterWaits& after) override {
    const CallContext& ctx = ctx_;
    const std::vector<CounterWaitList> lists = WaitLists(after);
    for (size_t i = 0; i + 1 < lists.size(); ++i) FICCO_CHECK_CUDA(LaunchWaitCounters(lists[i], compute_));
    FICCO_CHECK_CUDA(LaunchReduceSum(problem, lists.empty() ? nullptr : &lists.back(), compute_));
    return ffi::Error::Success();
  }

  void ReleaseEvents() override {
    if (interprocess_) {
      device_.ReleaseEvents(acquired_, /*interprocess=*/true);
      acquired_.clear();
    } else {
      reusable_ = true;
    }
  }

  std::vector<Event> TakeReusable() override {
    std::vector<Event> events;
    if (reusable_) events.assign(acquired_.begin(), acquired_.end());
    acquired_.clear();
    return events;
  }

  EventPool& Pool() override { return device_; }

 private:
  // `waits` as the kernels take them: kCounterWaitWords at most per list; none for no waits.
  static std::vector<CounterWaitList> WaitLists(const CounterWaits& waits) {
    std::vector<CounterWaitList> lists;
    for (size_t i = 0; i < waits.words.size(); ++i) {
      if (i % kCounterWaitWords == 0) {
        lists.emplace_back();
        lists.back().counter = waits.counter;
      }
      CounterWaitList& list = lists.back();
      const CounterWait& wait = waits.words[i];
      list.word[list.count] = wait.word;
      list.offset[list.count] = wait.offset;
      list.tag[list.count] = wait.check.tag;
      list.slot[list.count] = wait.check.slot;
      if (wait.check.tag != nullptr) {
        list.launch = wait.check.launch;
        list.parted = wait.check.parted;
      }
      ++list.count;
    }
    return lists;
  }

  cudaStream_t StreamOf(int stream) const {
    return stream == kCompute ? compute_ : resources_->copy_streams[stream];
  }

  CallContext ctx_;
  cudaStream_t compute_;
  const bool interprocess_;  // a group across processes: events from the interprocess pool
  CudaDevice& device_;
  CudaResources* resources_ = nullptr;
  std::vector<cudaEvent_t> acquired_;  // returned to the pool only after ReleaseEvents()
  bool reusable_ = false;              // ReleaseEvents() was called (in-process events)
};

}  // namespace

std::unique_ptr<Backend> MakeCudaBackend(const CallContext& ctx, CudaDevice& device, cudaStream_t compute_stream,
                                         bool interprocess_events) {
  return std::make_unique<CudaBackend>(ctx, device, compute_stream, interprocess_events);
}

}  // namespace ficco
