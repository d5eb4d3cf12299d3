#include "testing/faults.h"

#include "runtime/registry.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <unordered_map>
#include <utility>

namespace ficco {
namespace {

const char* ModeName(InjectedFault::Mode mode) {
  switch (mode) {
    case InjectedFault::Mode::kSkip: return "skip";
    case InjectedFault::Mode::kFail: return "fail";
    case InjectedFault::Mode::kStall: return "stall";
    case InjectedFault::Mode::kStale: return "stale";
    case InjectedFault::Mode::kCheck: return "check";
  }
  return "?";
}

std::atomic<int64_t> unjoined_calls{0};

// The armed rank's backend: forwards everything to the real one, except where the fault strikes,
// and checks that every copy it enqueued is joined by XLA's stream before the call returns.
class FaultyBackend final : public Backend {
 public:
  FaultyBackend(std::unique_ptr<Backend> inner, InjectedFault fault, const OpConfig& config)
      : inner_(std::move(inner)), fault_(fault), config_(config) {}
  // The backend goes when its call's handler returns.
  ~FaultyBackend() override {
    for (int stream = 0; stream < kCopyStreamSlots; ++stream) {
      if (copies_[stream] <= joined_[stream]) continue;
      unjoined_calls.fetch_add(1, std::memory_order_relaxed);
      std::fprintf(stderr, "ficco_jax test check: %s returned while %lld copies on copy stream %d were not "
                           "waited for by XLA's stream\n",
                   config_.ctx.target, static_cast<long long>(copies_[stream] - joined_[stream]), stream);
      return;
    }
  }

  ffi::Error Prepare(int copy_streams, const std::vector<int>& group, bool peer_stores) override {
    if (fault_.mode == InjectedFault::Mode::kSkip) return Injected();
    if (fault_.mode == InjectedFault::Mode::kStall && config_.cross_process()) {
      return MakeInvalid(config_.ctx, "the stall fault applies to groups inside one process");
    }
    if (fault_.mode == InjectedFault::Mode::kStale && !config_.launch_from_run) {
      return MakeInvalid(config_.ctx, "the stale fault applies where calls number their launches (the CPU backend)");
    }
    return inner_->Prepare(copy_streams, group, peer_stores);
  }
  ffi::Error Record(int stream, Event* event) override {
    if (fault_.mode == InjectedFault::Mode::kStall && stream == kCompute) {
      if (never_ == nullptr) FICCO_RETURN_IF_ERROR(inner_->RecordNever(&never_));
      *event = never_;
      return ffi::Error::Success();
    }
    FICCO_RETURN_IF_ERROR(FailAtTransfer(stream));
    FICCO_RETURN_IF_ERROR(inner_->Record(stream, event));
    if (IsCopyStream(stream)) covers_[*event] = {stream, copies_[stream]};
    return ffi::Error::Success();
  }
  ffi::Error Wait(int stream, Event event) override {
    // stall: this rank's own streams do not wait for the event it posts in place of its records,
    // as its XLA stream is what never gets there: its handler runs on (a matmul plan's timing
    // synchronises with XLA's stream), and only its peers wait for ever.
    if (fault_.mode == InjectedFault::Mode::kStall && event != nullptr && event == never_) {
      return ffi::Error::Success();
    }
    FICCO_RETURN_IF_ERROR(FailAtTransfer(stream));
    FICCO_RETURN_IF_ERROR(inner_->Wait(stream, event));
    const auto covered = covers_.find(event);
    if (stream == kCompute && covered != covers_.end()) {
      int64_t& joined = joined_[covered->second.first];
      joined = std::max(joined, covered->second.second);
    }
    return ffi::Error::Success();
  }
  ffi::Error CopyPieces(int stream, void* dst, const void* src, size_t bytes, int64_t pieces,
                        int64_t pitch) override {
    FICCO_RETURN_IF_ERROR(FailAtTransfer(stream));
    FICCO_RETURN_IF_ERROR(inner_->CopyPieces(stream, dst, src, bytes, pieces, pitch));
    if (IsCopyStream(stream)) ++copies_[stream];
    return ffi::Error::Success();
  }
  // stall: the words it sets are never set, as its device never gets there.
  ffi::Error SetWord(int stream, uint32_t* word, uint32_t value) override {
    if (fault_.mode == InjectedFault::Mode::kStall) return ffi::Error::Success();
    FICCO_RETURN_IF_ERROR(FailAtTransfer(stream));
    return inner_->SetWord(stream, word, value);
  }
  ffi::Error WaitWord(int stream, const uint32_t* word, uint32_t value) override {
    FICCO_RETURN_IF_ERROR(FailAtTransfer(stream));
    return inner_->WaitWord(stream, word, value);
  }
  // stall: its device never reaches the call, so it never counts it either.
  ffi::Error CountCall(int stream, uint32_t* counter, uint32_t* mirror, const uint32_t* stopped,
                       const std::vector<CounterWait>& then) override {
    if (fault_.mode == InjectedFault::Mode::kStall) return ffi::Error::Success();
    FICCO_RETURN_IF_ERROR(FailAtTransfer(stream));
    return inner_->CountCall(stream, counter, mirror, stopped, then);
  }
  ffi::Error WaitCounters(int stream, const CounterWaits& waits) override {
    FICCO_RETURN_IF_ERROR(FailAtTransfer(stream));
    return inner_->WaitCounters(stream, waits);
  }
  // stall: as SetWord, the counters it posts for its peers are never posted. stale: its data goes
  // out tagged with the launch after its own (the word is host memory there: Prepare checks).
  ffi::Error PostCounter(int stream, const std::vector<uint32_t*>& words, const uint32_t* counter,
                         const LaunchCheck& check) override {
    if (fault_.mode == InjectedFault::Mode::kStall) return ffi::Error::Success();
    FICCO_RETURN_IF_ERROR(FailAtTransfer(stream));
    if (fault_.mode == InjectedFault::Mode::kStale && check.tag != nullptr) {
      stale_ = ReadWord(check.launch) + 1u;
      LaunchCheck other = check;
      other.launch = &stale_;
      return inner_->PostCounter(stream, words, counter, other);
    }
    return inner_->PostCounter(stream, words, counter, check);
  }
  bool Capturing() override { return inner_->Capturing(); }
  ffi::Error AllocateWords(int64_t count, uint32_t** words) override { return inner_->AllocateWords(count, words); }
  ffi::Error AllocateRegion(int64_t bytes, void** region) override { return inner_->AllocateRegion(bytes, region); }
  ffi::Error RecordMark(Event* event) override { return inner_->RecordMark(event); }
  ffi::Error RecordNever(Event* event) override { return inner_->RecordNever(event); }
  ffi::Error Gemm(const GemmProblem& problem) override { return inner_->Gemm(problem); }
  ffi::Error Reduce(const ReduceProblem& problem, const CounterWaits& after) override {
    return inner_->Reduce(problem, after);
  }
  void ReleaseEvents() override { inner_->ReleaseEvents(); }
  std::vector<Event> TakeReusable() override { return inner_->TakeReusable(); }
  EventPool& Pool() override { return inner_->Pool(); }

 private:
  ffi::Error Injected() const {
    return MakeError(config_.ctx, std::string("injected fault '") + ModeName(fault_.mode) + "' on rank " +
                                      std::to_string(config_.rank) + " (ficco_jax._ffi.testing.inject_fault)");
  }
  static bool IsCopyStream(int stream) { return stream >= 0 && stream < kCopyStreamSlots; }
  // The transfers are the copy streams' work; the staging stream (kStaging) copies within the device.
  ffi::Error FailAtTransfer(int stream) {
    if (fault_.mode != InjectedFault::Mode::kFail || failed_ || stream < 0 || stream >= kMaxCopyStreams) {
      return ffi::Error::Success();
    }
    if (++transfers_ < fault_.fail_at) return ffi::Error::Success();
    failed_ = true;
    return Injected();
  }

  std::unique_ptr<Backend> inner_;
  const InjectedFault fault_;
  const OpConfig& config_;
  Event never_ = nullptr;  // stall: this call's one event that never completes
  uint32_t stale_ = 0;     // stale: the launch its data is tagged with
  int64_t transfers_ = 0;  // fail: copy-stream operations so far
  bool failed_ = false;    // fail: the fault has struck; the cleanup after it runs as usual
  // The check: copies enqueued per stream, how many of them XLA's stream has waited for, and for each
  // event recorded on a copy stream, that stream and its copies so far.
  int64_t copies_[kCopyStreamSlots] = {};
  int64_t joined_[kCopyStreamSlots] = {};
  std::unordered_map<Event, std::pair<int, int64_t>> covers_;
};

}  // namespace

bool ParseFault(std::string_view spec, std::optional<InjectedFault>* fault) {
  if (spec.empty()) {
    fault->reset();
    return true;
  }
  const size_t colon = spec.find(':');
  if (colon == std::string_view::npos) return false;
  const std::string_view mode = spec.substr(0, colon);
  std::string_view rank = spec.substr(colon + 1);
  const size_t second = rank.find(':');
  std::string_view at;
  if (second != std::string_view::npos) {
    if (mode != "fail") return false;
    at = rank.substr(second + 1);
    rank = rank.substr(0, second);
  }
  InjectedFault parsed{};
  if (mode == "skip") {
    parsed.mode = InjectedFault::Mode::kSkip;
  } else if (mode == "fail") {
    parsed.mode = InjectedFault::Mode::kFail;
  } else if (mode == "stall") {
    parsed.mode = InjectedFault::Mode::kStall;
  } else if (mode == "stale") {
    parsed.mode = InjectedFault::Mode::kStale;
  } else {
    return false;
  }
  const auto [end, status] = std::from_chars(rank.data(), rank.data() + rank.size(), parsed.rank);
  if (rank.empty() || status != std::errc() || end != rank.data() + rank.size() || parsed.rank < 0) return false;
  if (second != std::string_view::npos) {
    const auto [at_end, at_status] = std::from_chars(at.data(), at.data() + at.size(), parsed.fail_at);
    if (at.empty() || at_status != std::errc() || at_end != at.data() + at.size() || parsed.fail_at < 1) return false;
  }
  *fault = parsed;
  return true;
}

int64_t UnjoinedCopyCalls() { return unjoined_calls.load(std::memory_order_relaxed); }

void FaultPlan::Arm(std::optional<InjectedFault> fault) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fault) fault_ = *fault;
  armed_.store(fault.has_value(), std::memory_order_release);
}

std::unique_ptr<Backend> FaultPlan::Apply(std::unique_ptr<Backend> backend, const OpConfig& config) const {
  if (!armed_.load(std::memory_order_acquire)) return backend;
  InjectedFault fault;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!armed_.load(std::memory_order_relaxed)) return backend;
    fault = fault_;
  }
  // The peers are checked too: a failure reaches them as a missing or failed peer, and their copies
  // must be joined on those paths as well.
  if (fault.rank != config.rank) fault.mode = InjectedFault::Mode::kCheck;
  return std::make_unique<FaultyBackend>(std::move(backend), fault, config);
}

FaultPlan& TheFaultPlan() {
  static FaultPlan* plan = new FaultPlan();  // never destroyed: handlers may run at exit
  return *plan;
}

namespace {
std::unique_ptr<Backend> ApplyArmedFault(std::unique_ptr<Backend> backend, const OpConfig& config) {
  return TheFaultPlan().Apply(std::move(backend), config);
}
}  // namespace

void ArmFault(std::optional<InjectedFault> fault) {
  TheFaultPlan().Arm(fault);
  Registry::Get().SetBackendWrapper(&ApplyArmedFault);
}

}  // namespace ficco
