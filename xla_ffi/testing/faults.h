// Faults injected by tests, never by the library: the plan a test arms for the whole process
// (ficco_jax._ffi.testing.inject_fault, testing/module_testing.cc) and the Backend that carries it
// out on the armed rank. A call consults the plan once, when its handler makes its backend
// (ffi/handler.h); the executor and the call session know nothing of faults.
//
//   skip:<rank>   that rank of every group fails before it meets its peers (its backend's Prepare);
//   fail:<rank>   it joins the exchange, then fails at its first transfer (its first operation on
//                 a copy stream); the cleanup that follows runs as after any failed transfer;
//   fail:<rank>:<k>  the same at its k-th operation on a copy stream (k >= 1), so that k - 1 of them,
//                 copies among them, were enqueued before the failure;
//   stall:<rank>  everything it records on XLA's stream is one event that never completes, and the
//                 channel words it would set are never set, as if its device never reached the
//                 call: the events it posts never complete, its peers'
//                 streams wait for ever and only the watchdog ends the process. Its own streams do
//                 not wait for that event, so its handler returns as a stuck device's would.
//                 In-process groups only (a "never" event cannot be exported to other processes).
//   stale:<rank>  its symmetric calls (runtime/symmetric.h) tag the data they send with the launch
//                 after their own, as a rank that ran one launch fewer or more than its peers would:
//                 their receivers' launch checks fail. CPU backend only (there the host reads the
//                 launch word).
#ifndef FICCO_JAX_XLA_FFI_TESTING_FAULTS_H_
#define FICCO_JAX_XLA_FFI_TESTING_FAULTS_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "device/backend.h"
#include "runtime/op_config.h"

namespace ficco {

//
// While a fault is armed, every call of every rank (the armed rank's and its peers', which meet the
// fault's consequences) is also checked for the rule that a call never returns, failed or not,
// while a copy it enqueued is not yet waited for by XLA's stream: XLA frees or reuses the call's
// buffers once it returns. A call that breaks it counts in UnjoinedCopyCalls().
struct InjectedFault {
  // kCheck: no fault, the check below alone (every other rank of a group while a fault is armed).
  enum class Mode : int { kSkip, kFail, kStall, kStale, kCheck };
  Mode mode;
  int rank;                   // the rank of every group it applies to
  int64_t fail_at = 1;        // fail: the copy-stream operation that fails, counting from 1
};

// "skip:<rank>", "fail:<rank>", "fail:<rank>:<k>", "stall:<rank>" or "stale:<rank>"; "" is no
// fault. False for anything else.
bool ParseFault(std::string_view spec, std::optional<InjectedFault>* fault);

// How many calls returned, while a fault was armed, while a copy they enqueued on a copy stream was not yet
// waited for by XLA's stream (a later record of that stream, waited on by XLA's stream).
int64_t UnjoinedCopyCalls();

// The fault armed for the whole process, if any. Arming one sets the registry's backend wrapper
// (Registry::SetBackendWrapper) to ApplyArmedFault: the only way a fault reaches a call.
class FaultPlan {
 public:
  void Arm(std::optional<InjectedFault> fault);
  // `backend`, or, where a fault is armed for this call's rank, the backend that injects it into
  // this call. One atomic load when nothing is armed.
  std::unique_ptr<Backend> Apply(std::unique_ptr<Backend> backend, const OpConfig& config) const;

 private:
  std::atomic<bool> armed_{false};
  mutable std::mutex mu_;
  InjectedFault fault_{};
};

// The process's one plan.
FaultPlan& TheFaultPlan();
// Arms `fault` (or none) in the plan and hooks the plan into every later call.
void ArmFault(std::optional<InjectedFault> fault);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_TESTING_FAULTS_H_
