// Host-time counters: how many times a section of host code ran and its summed host time, read by
// tests and benchmarks (testing.host_time, testing.backend_calls). A steady_clock read is tens of
// nanoseconds against the microseconds the timed sections take.
#ifndef FICCO_JAX_XLA_FFI_BASE_TIMED_H_
#define FICCO_JAX_XLA_FFI_BASE_TIMED_H_

#include <atomic>
#include <chrono>
#include <cstdint>

namespace ficco {

struct TimedCount {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> ns{0};
  int64_t Calls() const { return calls.load(std::memory_order_relaxed); }
  int64_t Ns() const { return ns.load(std::memory_order_relaxed); }
};

// Adds one section and the host time from its construction to `count` when it goes out of scope,
// on every return path.
class TimeSection {
 public:
  explicit TimeSection(TimedCount& count) : count_(count), start_(std::chrono::steady_clock::now()) {}
  ~TimeSection() {
    count_.calls.fetch_add(1, std::memory_order_relaxed);
    count_.ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count(),
        std::memory_order_relaxed);
  }
  TimeSection(const TimeSection&) = delete;
  TimeSection& operator=(const TimeSection&) = delete;

 private:
  TimedCount& count_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_BASE_TIMED_H_
