#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <new>
#include <string>
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

  int64_t Free() override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(free_.size());
  }

 private:
  std::mutex mu_;
  std::vector<HostEvent*> free_;
  std::mutex owned_mu_;
  std::vector<std::unique_ptr<HostEvent>> owned_;  // every event ever made: they live as long as the pool
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(const CallContext& ctx, EventPool& pool, double timeout_s)
      : ctx_(ctx), pool_(static_cast<HostEventPool&>(pool)), timeout_s_(timeout_s) {}

  ffi::Error Prepare(int, const std::vector<int>&, bool) override { return ffi::Error::Success(); }
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
  ffi::Error CopyPieces(int, void* dst, const void* src, size_t bytes, int64_t pieces, int64_t pitch) override {
    CopyPiecesHost(dst, src, bytes, pieces, pitch);
    return ffi::Error::Success();
  }
  ffi::Error AllocateWords(int64_t count, uint32_t** words) override {
    *words = new (std::nothrow) uint32_t[count]();
    if (*words == nullptr) return MakeError(ctx_, "out of host memory for " + std::to_string(count) + " words");
    return ffi::Error::Success();
  }
  ffi::Error AllocateRegion(int64_t bytes, void** region) override {
    *region = new (std::nothrow) char[bytes]();
    if (*region == nullptr) return MakeError(ctx_, "out of host memory for a region of " + std::to_string(bytes) + " bytes");
    return ffi::Error::Success();
  }
  ffi::Error SetWord(int, uint32_t* word, uint32_t value) override {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    return ffi::Error::Success();
  }
  ffi::Error WaitWord(int, const uint32_t* word, uint32_t value) override {
    return WaitUntil([&] { return WordReached(ReadWord(word), value); });
  }
  ffi::Error CountCall(int stream, uint32_t* counter, uint32_t* mirror, const uint32_t* stopped,
                       const std::vector<CounterWait>& then) override {
    if (stopped != nullptr && ReadWord(stopped) != 0) return ffi::Error(ffi::ErrorCode::kAborted, kCallStopped);
    const uint32_t value = __atomic_add_fetch(counter, 1u, __ATOMIC_ACQ_REL);
    if (mirror != nullptr) __atomic_store_n(mirror, value, __ATOMIC_RELEASE);
    return WaitCounters(stream, {counter, then});
  }
  ffi::Error WaitCounters(int, const CounterWaits& waits) override {
    for (const CounterWait& wait : waits.words) {
      const uint32_t want = ReadWord(waits.counter) + static_cast<uint32_t>(wait.offset);
      FICCO_RETURN_IF_ERROR(WaitUntil([&] { return ReadWord(wait.word) == want; }));
    }
    for (const CounterWait& wait : waits.words) {
      if (wait.check.tag != nullptr && ReadWord(wait.check.tag) != ReadWord(wait.check.launch)) {
        return ffi::Error(ffi::ErrorCode::kAborted, kLaunchParted);
      }
    }
    return ffi::Error::Success();
  }
  ffi::Error PostCounter(int, const std::vector<uint32_t*>& words, const uint32_t* counter,
                         const LaunchCheck& check) override {
    if (check.tag != nullptr) __atomic_store_n(check.tag, ReadWord(check.launch), __ATOMIC_RELEASE);
    const uint32_t value = ReadWord(counter);
    for (uint32_t* word : words) __atomic_store_n(word, value, __ATOMIC_RELEASE);
    return ffi::Error::Success();
  }
  bool Capturing() override { return false; }
  ffi::Error Gemm(const GemmProblem& problem) override {
    GemmHost(problem);
    return ffi::Error::Success();
  }
  ffi::Error Reduce(const ReduceProblem& problem, const CounterWaits& after) override {
    FICCO_RETURN_IF_ERROR(WaitCounters(kCompute, after));
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
  // The peer that sets a word is another thread: poll, as Wait does, until the timeout.
  template <typename Reached>
  ffi::Error WaitUntil(const Reached& reached) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    while (!reached()) {
      if (std::chrono::steady_clock::now() > deadline) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, kWordTimedOut);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return ffi::Error::Success();
  }

  CallContext ctx_;
  HostEventPool& pool_;
  const double timeout_s_;  // the longest WaitWord waits
  std::vector<Event> acquired_;
  bool reusable_ = false;
};

}  // namespace

std::unique_ptr<EventPool> MakeHostEventPool() { return std::make_unique<HostEventPool>(); }

std::unique_ptr<Backend> MakeCpuBackend(const CallContext& ctx, EventPool& pool, double timeout_s) {
  return std::make_unique<CpuBackend>(ctx, pool, timeout_s);
}

}  // namespace ficco
