// CountCalls (device/backends.h): how often, and for how long on the host, the executor asks a
// backend to record, wait, copy, multiply and sum.
#include <atomic>
#include <chrono>
#include <utility>

#include "device/backends.h"

namespace ficco {
namespace {

struct Counter {
  std::atomic<int64_t> calls{0}, ns{0};
};
struct Counters {
  Counter record, mark, wait, copy, gemm, reduce;
};
Counters& Totals() {
  static Counters totals;
  return totals;
}

// Adds one call and its host time to `counter` when it goes out of scope.
class Timed {
 public:
  explicit Timed(Counter& counter) : counter_(counter), start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    counter_.calls.fetch_add(1, std::memory_order_relaxed);
    counter_.ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count(),
        std::memory_order_relaxed);
  }

 private:
  Counter& counter_;
  std::chrono::steady_clock::time_point start_;
};

class CountedBackend final : public Backend {
 public:
  explicit CountedBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  ffi::Error Prepare(int copy_streams, const std::vector<int>& group) override {
    return inner_->Prepare(copy_streams, group);
  }
  ffi::Error Record(int stream, Event* event) override {
    Timed timed(Totals().record);
    return inner_->Record(stream, event);
  }
  ffi::Error RecordMark(Event* event) override {
    Timed timed(Totals().mark);
    return inner_->RecordMark(event);
  }
  ffi::Error RecordNever(Event* event) override { return inner_->RecordNever(event); }
  ffi::Error Wait(int stream, Event event) override {
    Timed timed(Totals().wait);
    return inner_->Wait(stream, event);
  }
  ffi::Error Copy(int stream, void* dst, const void* src, size_t bytes) override {
    Timed timed(Totals().copy);
    return inner_->Copy(stream, dst, src, bytes);
  }
  ffi::Error Gemm(const GemmProblem& problem) override {
    Timed timed(Totals().gemm);
    return inner_->Gemm(problem);
  }
  ffi::Error Reduce(const ReduceProblem& problem) override {
    Timed timed(Totals().reduce);
    return inner_->Reduce(problem);
  }
  void ReleaseEvents() override { inner_->ReleaseEvents(); }
  std::vector<Event> TakeReusable() override { return inner_->TakeReusable(); }
  EventPool& Pool() override { return inner_->Pool(); }

 private:
  std::unique_ptr<Backend> inner_;
};

BackendCalls::Kind Read(const Counter& counter) {
  return {counter.calls.load(std::memory_order_relaxed), counter.ns.load(std::memory_order_relaxed)};
}

}  // namespace

std::unique_ptr<Backend> CountCalls(std::unique_ptr<Backend> backend) {
  return std::make_unique<CountedBackend>(std::move(backend));
}

BackendCalls BackendCallTotals() {
  const Counters& c = Totals();
  return {Read(c.record), Read(c.mark), Read(c.wait), Read(c.copy), Read(c.gemm), Read(c.reduce)};
}

}  // namespace ficco
