// CountCalls (device/backends.h): how often, and for how long on the host, the executor asks a
// backend to record, wait, copy, multiply, sum, set and wait for words, and count, wait for and post
// counters.
#include <utility>

#include "base/timed.h"
#include "device/backends.h"

namespace ficco {
namespace {

struct Counters {
  TimedCount record, mark, wait, copy, gemm, reduce, set_word, wait_word, counter;
};
Counters& Totals() {
  static Counters totals;
  return totals;
}

class CountedBackend final : public Backend {
 public:
  explicit CountedBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  ffi::Error Prepare(int copy_streams, const std::vector<int>& group, bool peer_stores) override {
    return inner_->Prepare(copy_streams, group, peer_stores);
  }
  ffi::Error Record(int stream, Event* event) override {
    TimeSection timed(Totals().record);
    return inner_->Record(stream, event);
  }
  ffi::Error RecordMark(Event* event) override {
    TimeSection timed(Totals().mark);
    return inner_->RecordMark(event);
  }
  ffi::Error RecordNever(Event* event) override { return inner_->RecordNever(event); }
  ffi::Error Wait(int stream, Event event) override {
    TimeSection timed(Totals().wait);
    return inner_->Wait(stream, event);
  }
  ffi::Error CopyPieces(int stream, void* dst, const void* src, size_t bytes, int64_t pieces,
                        int64_t pitch) override {
    TimeSection timed(Totals().copy);
    return inner_->CopyPieces(stream, dst, src, bytes, pieces, pitch);
  }
  ffi::Error AllocateWords(int64_t count, uint32_t** words) override { return inner_->AllocateWords(count, words); }
  ffi::Error AllocateRegion(int64_t bytes, void** region) override { return inner_->AllocateRegion(bytes, region); }
  ffi::Error SetWord(int stream, uint32_t* word, uint32_t value) override {
    TimeSection timed(Totals().set_word);
    return inner_->SetWord(stream, word, value);
  }
  ffi::Error WaitWord(int stream, const uint32_t* word, uint32_t value) override {
    TimeSection timed(Totals().wait_word);
    return inner_->WaitWord(stream, word, value);
  }
  ffi::Error CountCall(int stream, uint32_t* counter, uint32_t* mirror, const uint32_t* stopped,
                       const std::vector<CounterWait>& then) override {
    TimeSection timed(Totals().counter);
    return inner_->CountCall(stream, counter, mirror, stopped, then);
  }
  ffi::Error WaitCounters(int stream, const CounterWaits& waits) override {
    TimeSection timed(Totals().counter);
    return inner_->WaitCounters(stream, waits);
  }
  ffi::Error PostCounter(int stream, const std::vector<uint32_t*>& words, const uint32_t* counter,
                         const LaunchCheck& check) override {
    TimeSection timed(Totals().counter);
    return inner_->PostCounter(stream, words, counter, check);
  }
  bool Capturing() override { return inner_->Capturing(); }
  ffi::Error Gemm(const GemmProblem& problem) override {
    TimeSection timed(Totals().gemm);
    return inner_->Gemm(problem);
  }
  ffi::Error Reduce(const ReduceProblem& problem, const CounterWaits& after) override {
    TimeSection timed(Totals().reduce);
    return inner_->Reduce(problem, after);
  }
  void ReleaseEvents() override { inner_->ReleaseEvents(); }
  std::vector<Event> TakeReusable() override { return inner_->TakeReusable(); }
  EventPool& Pool() override { return inner_->Pool(); }

 private:
  std::unique_ptr<Backend> inner_;
};

BackendCalls::Kind Read(const TimedCount& count) { return {count.Calls(), count.Ns()}; }

}  // namespace

std::unique_ptr<Backend> CountCalls(std::unique_ptr<Backend> backend) {
  return std::make_unique<CountedBackend>(std::move(backend));
}

BackendCalls BackendCallTotals() {
  const Counters& c = Totals();
  return {Read(c.record), Read(c.mark),     Read(c.wait),      Read(c.copy),   Read(c.gemm),
          Read(c.reduce), Read(c.set_word), Read(c.wait_word), Read(c.counter)};
}

}  // namespace ficco
