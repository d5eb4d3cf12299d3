#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "device/backends.h"
#include "device/dma.h"

namespace ficco {
namespace {

struct HostEvent {
  std::atomic<bool> done{false};
};

class HostEventPool final : public EventPool {
 public:
  // An event whose flag is `done`; from the pool, or new.
  HostEvent* Acquire(bool done) {
    HostEvent* event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        event = free_.back();
        free_.pop_back();
      }
    }
    if (event == nullptr) {
      owned_mu_.lock();
      owned_.push_back(std::make_unique<HostEvent>());
      event = owned_.back().get();
      owned_mu_.unlock();
    }
    event->done.store(done, std::memory_order_release);
    return event;
  }

  bool Done(Event event) override {
    return event == nullptr || static_cast<HostEvent*>(event)->done.load(std::memory_order_acquire);
  }

  void Release(const std::vector<Event>& events) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (Event event : events) free_.push_back(static_cast<HostEvent*>(event));
  }

  int64_t Made() override {
    std::lock_guard<std::mutex> lock(owned_mu_);
    return static_cast<int64_t>(owned_.size());
  }

 private:
  std::mutex mu_;
  std::vector<HostEvent*> free_;
  std::mutex owned_mu_;
  std::vector<std::unique_ptr<HostEvent>> owned_;  // every event ever made: they live as long as the pool
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(const CallContext& ctx, EventPool& pool) : ctx_(ctx), pool_(static_cast<HostEventPool&>(pool)) {}

  ffi::Error Prepare(int, const std::vector<int>&) override { return ffi::Error::Success(); }
  ffi::Error Record(int, Event* event) override {
    *event = pool_.Acquire(/*done=*/true);
    acquired_.push_back(*event);
    return ffi::Error::Success();
  }
  ffi::Error RecordMark(Event* event) override {
    *event = pool_.Acquire(/*done=*/true);
    return ffi::Error::Success();
  }
  ffi::Error RecordNever(Event* event) override {
    *event = pool_.Acquire(/*done=*/false);  // never released: nothing may reuse it
    return ffi::Error::Success();
  }
  // Every event is set when recorded, so this returns at once, except for a peer's RecordNever
  // event: then the calling thread waits here until the watchdog ends the process.
  ffi::Error Wait(int, Event event) override {
    while (!pool_.Done(event)) std::this_thread::sleep_for(std::chrono::microseconds(200));
    return ffi::Error::Success();
  }
  ffi::Error Copy(int, void* dst, const void* src, size_t bytes) override {
    CopyChunkHost(dst, src, bytes);
    return ffi::Error::Success();
  }
  ffi::Error Gemm(const GemmProblem& problem) override {
    GemmHost(problem);
    return ffi::Error::Success();
  }
  ffi::Error Reduce(const ReduceProblem& problem) override {
    ReduceSumHost(problem);
    return ffi::Error::Success();
  }
  void ReleaseEvents() override { reusable_ = true; }
  std::vector<Event> TakeReusable() override {
    std::vector<Event> events;
    if (reusable_) events.swap(acquired_);
    return events;
  }
  EventPool& Pool() override { return pool_; }

 private:
  CallContext ctx_;
  HostEventPool& pool_;
  std::vector<Event> acquired_;
  bool reusable_ = false;
};

}  // namespace

std::unique_ptr<EventPool> MakeHostEventPool() { return std::make_unique<HostEventPool>(); }

std::unique_ptr<Backend> MakeCpuBackend(const CallContext& ctx, EventPool& pool) {
  return std::make_unique<CpuBackend>(ctx, pool);
}

}  // namespace ficco
