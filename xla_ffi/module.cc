// The nanobind module `ficco_jax._ffi`: hands every FFI target (ffi/targets.h) to Python as
// PyCapsules per platform, and answers capability and IPC queries.
#include <csignal>
#include <cstdlib>
#include <execinfo.h>
#include <unistd.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "ffi/targets.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "runtime/ipc.h"
#include "runtime/registry.h"
#include "xla/ffi/api/c_api.h"

namespace ficco {
namespace {

namespace nb = nanobind;

#ifdef FICCO_WITH_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

// {target: {"cpu": capsule, "CUDA": capsule}} (CUDA only in the CUDA build).
nb::dict Registrations() {
  nb::dict targets;
  for (const TargetEntries& target : Targets()) {
    nb::dict platforms;
    platforms["cpu"] = nb::capsule(reinterpret_cast<void*>(target.cpu));
    if (target.cuda != nullptr) platforms["CUDA"] = nb::capsule(reinterpret_cast<void*>(target.cuda));
    targets[target.name] = platforms;
  }
  return targets;
}

nb::dict BuildInfo() {
  nb::dict info;
  const std::string abi =
      std::string("xla-ffi-api-") + std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["version"] = nb::str(FICCO_VERSION);
  info["cuda"] = nb::bool_(kCudaBuilt);
  info["ipc"] = nb::bool_(kCudaBuilt);  // copy engines across processes of one host (runtime/ipc.h)
  info["abi"] = nb::str(abi.c_str());
  return info;
}

// The host mailbox's exchange with plain integers, for tests of its protocol across processes
// (tests/test_ipc_mailbox.py): every rank calls it once per post; returns every rank's
// (op_id, signature, buffer_export, buffer_offset, event_ids) or raises RuntimeError.
using WireTuple = std::tuple<int64_t, std::vector<int64_t>, int64_t, int64_t, std::vector<int32_t>>;
std::vector<WireTuple> MailboxExchange(int64_t job, std::vector<int> members, int rank, int64_t op_id,
                                       std::vector<int64_t> signature, int64_t buffer_export, int64_t buffer_offset,
                                       std::vector<int32_t> event_ids, double timeout_s) {
  CallContext ctx{"mailbox_test", op_id, rank};
  WirePost mine;
  mine.op_id = op_id;
  mine.signature = std::move(signature);
  mine.buffer_export = buffer_export;
  mine.buffer_offset = buffer_offset;
  mine.event_ids = std::move(event_ids);
  mine.raw_events.assign(mine.event_ids.size(), 0);
  std::vector<WirePost> posts;
  ::xla::ffi::Error error = ::xla::ffi::Error::Success();
  {
    nanobind::gil_scoped_release release;
    HostMailbox* mailbox = nullptr;
    error = Registry::Get().Mailbox(ctx, job, &mailbox);
    if (error.success()) {
      MailboxArrival who{&ctx, &members, rank, "test", timeout_s};
      error = mailbox->Exchange(who, mine, &posts);
    }
  }
  if (error.failure()) throw std::runtime_error(error.message());
  std::vector<WireTuple> out;
  for (const WirePost& p : posts) {
    out.emplace_back(p.op_id, p.signature, p.buffer_export, p.buffer_offset, p.event_ids);
  }
  return out;
}

// A debugging aid (FICCO_SEGV_TRACE=1): on SIGSEGV/SIGABRT print the native stack to stderr,
// then die with the signal as before. Off by default; async-signal-safe calls only.
void PrintNativeStack(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char head[] = "ficco_jax: fatal signal; native stack:\n";
  (void)!write(STDERR_FILENO, head, sizeof(head) - 1);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void MaybeInstallCrashTrace() {
  const char* flag = std::getenv("FICCO_SEGV_TRACE");
  if (flag == nullptr || flag[0] == '\0' || flag[0] == '0') return;
  std::signal(SIGSEGV, PrintNativeStack);
  std::signal(SIGABRT, PrintNativeStack);
}

}  // namespace

void DefineIpcFunctions(nb::module_& m);  // module_ipc.cc

}  // namespace ficco

NB_MODULE(_ffi, m) {
  ficco::MaybeInstallCrashTrace();
  m.def("build_info", &ficco::BuildInfo);
  m.def("registrations", &ficco::Registrations);
  m.def("_mailbox_exchange", &ficco::MailboxExchange);
  ficco::DefineIpcFunctions(m);
}
