// XLA FFI bindings of the ficco targets (one handler symbol per target and platform) and the
// nanobind module `ficco_jax._ffi` that hands them to Python as PyCapsules.
//
// Every handler: decode the attributes (handlers.cc), make the platform's Backend, run the
// op's Impl. No exception or CUDA error escapes: Impls return ffi::Error and Guard() catches
// anything thrown (e.g. std::bad_alloc).
#include <csignal>
#include <cstdlib>
#include <execinfo.h>
#include <unistd.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "a2a.h"
#include "guard.h"
#include "ipc.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/c_api.h"

// The all-to-all targets' handler symbols live in handlers_a2a.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoAllToAllCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoA2aMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoMatmulA2aCpu);
// The contention probe of `characterize` lives in probe.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoContentionProbeCpu);
#ifdef FICCO_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoContentionProbeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoAllToAllCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoA2aMatmulCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoMatmulA2aCuda);
#endif

namespace ficco {
namespace {

namespace nb = nanobind;

// ---------------------------------------------------------------------------------------------
// CPU handlers
// ---------------------------------------------------------------------------------------------
ffi::Error AgMatmulCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> gathered, OpAttrs attrs) {
  return GuardCpu(kAgMatmulTarget, ordinal, run, attrs, [&](Backend& b, const OpConfig& c) {
    return AgMatmulImpl(b, c, x, w, *out, *gathered);
  });
}

ffi::Error MatmulRsCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer y, ffi::AnyBuffer w,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> send,
                       ffi::Result<ffi::AnyBuffer> recv, OpAttrs attrs) {
  return GuardCpu(kMatmulRsTarget, ordinal, run, attrs, [&](Backend& b, const OpConfig& c) {
    return MatmulRsImpl(b, c, y, w, *out, *send, *recv);
  });
}

ffi::Error AllGatherCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                        OpAttrs attrs) {
  return GuardCpu(kAllGatherTarget, ordinal, run, attrs,
                  [&](Backend& b, const OpConfig& c) { return AllGatherImpl(b, c, x, *out); });
}

ffi::Error ReduceScatterCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> recv, OpAttrs attrs) {
  return GuardCpu(kReduceScatterTarget, ordinal, run, attrs,
                  [&](Backend& b, const OpConfig& c) { return ReduceScatterImpl(b, c, x, *out, *recv); });
}

// ---------------------------------------------------------------------------------------------
// CUDA handlers: the same, with XLA's stream as the compute stream.
// ---------------------------------------------------------------------------------------------
#ifdef FICCO_WITH_CUDA
ffi::Error AgMatmulCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x,
                        ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> gathered,
                        OpAttrs attrs) {
  return GuardCuda(kAgMatmulTarget, stream, ordinal, run, attrs, [&](Backend& b, const OpConfig& c) {
    return AgMatmulImpl(b, c, x, w, *out, *gathered);
  });
}

ffi::Error MatmulRsCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer y,
                        ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> send,
                        ffi::Result<ffi::AnyBuffer> recv, OpAttrs attrs) {
  return GuardCuda(kMatmulRsTarget, stream, ordinal, run, attrs, [&](Backend& b, const OpConfig& c) {
    return MatmulRsImpl(b, c, y, w, *out, *send, *recv);
  });
}

ffi::Error AllGatherCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, OpAttrs attrs) {
  return GuardCuda(kAllGatherTarget, stream, ordinal, run, attrs,
               [&](Backend& b, const OpConfig& c) { return AllGatherImpl(b, c, x, *out); });
}

ffi::Error ReduceScatterCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> recv, OpAttrs attrs) {
  return GuardCuda(kReduceScatterTarget, stream, ordinal, run, attrs,
               [&](Backend& b, const OpConfig& c) { return ReduceScatterImpl(b, c, x, *out, *recv); });
}
#endif  // FICCO_WITH_CUDA

}  // namespace
}  // namespace ficco

// ---------------------------------------------------------------------------------------------
// Handler symbols. Not marked command-buffer compatible: the host rendezvous must run on every
// execution, which a captured CUDA graph would skip.
// ---------------------------------------------------------------------------------------------
namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAgMatmulCpu, ficco::AgMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()  // device ordinal
                                  .Ctx<ffi::RunId>()          // launch id, shared by all devices
                                  .Arg<ffi::AnyBuffer>()      // x [m, K]
                                  .Arg<ffi::AnyBuffer>()      // w [K, N]
                                  .Ret<ffi::AnyBuffer>()      // out [n*m, N]
                                  .Ret<ffi::AnyBuffer>()      // gathered [n*m, K]
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoMatmulRsCpu, ficco::MatmulRsCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()  // device ordinal
                                  .Ctx<ffi::RunId>()          // launch id
                                  .Arg<ffi::AnyBuffer>()      // y [n*m, N]
                                  .Arg<ffi::AnyBuffer>()      // w [N, K]
                                  .Ret<ffi::AnyBuffer>()      // out [m, K]
                                  .Ret<ffi::AnyBuffer>()      // send workspace [n-1, m, K]
                                  .Ret<ffi::AnyBuffer>()      // recv workspace [n-1, m, K]
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAllGatherCpu, ficco::AllGatherCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()  // device ordinal
                                  .Ctx<ffi::RunId>()          // launch id
                                  .Arg<ffi::AnyBuffer>()      // x [m, ...]
                                  .Ret<ffi::AnyBuffer>()      // out [n*m, ...]
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoReduceScatterCpu, ficco::ReduceScatterCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()  // device ordinal
                                  .Ctx<ffi::RunId>()          // launch id
                                  .Arg<ffi::AnyBuffer>()      // x [n*m, ...]
                                  .Ret<ffi::AnyBuffer>()      // out [m, ...]
                                  .Ret<ffi::AnyBuffer>()      // recv workspace [n-1, m, ...]
                                  .Attrs<ficco::OpAttrs>());

#ifdef FICCO_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAgMatmulCuda, ficco::AgMatmulCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device ordinal
                                  .Ctx<ffi::RunId>()                         // launch id
                                  .Arg<ffi::AnyBuffer>()                     // x
                                  .Arg<ffi::AnyBuffer>()                     // w
                                  .Ret<ffi::AnyBuffer>()                     // out
                                  .Ret<ffi::AnyBuffer>()                     // gathered
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoMatmulRsCuda, ficco::MatmulRsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device ordinal
                                  .Ctx<ffi::RunId>()                         // launch id
                                  .Arg<ffi::AnyBuffer>()                     // y
                                  .Arg<ffi::AnyBuffer>()                     // w
                                  .Ret<ffi::AnyBuffer>()                     // out
                                  .Ret<ffi::AnyBuffer>()                     // send workspace
                                  .Ret<ffi::AnyBuffer>()                     // recv workspace
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAllGatherCuda, ficco::AllGatherCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device ordinal
                                  .Ctx<ffi::RunId>()                         // launch id
                                  .Arg<ffi::AnyBuffer>()                     // x
                                  .Ret<ffi::AnyBuffer>()                     // out
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoReduceScatterCuda, ficco::ReduceScatterCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device ordinal
                                  .Ctx<ffi::RunId>()                         // launch id
                                  .Arg<ffi::AnyBuffer>()                     // x
                                  .Ret<ffi::AnyBuffer>()                     // out
                                  .Ret<ffi::AnyBuffer>()                     // recv workspace
                                  .Attrs<ficco::OpAttrs>());
#endif  // FICCO_WITH_CUDA

// ---------------------------------------------------------------------------------------------
// Python module
// ---------------------------------------------------------------------------------------------
namespace {

#ifdef FICCO_WITH_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

template <typename Fn>
nanobind::capsule Capsule(Fn* fn) {
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

nanobind::dict Platforms(XLA_FFI_Error* (*cpu)(XLA_FFI_CallFrame*),
                         XLA_FFI_Error* (*cuda)(XLA_FFI_CallFrame*)) {
  nanobind::dict platforms;
  platforms["cpu"] = Capsule(cpu);
  if (cuda != nullptr) platforms["CUDA"] = Capsule(cuda);
  return platforms;
}

// The host mailbox's exchange with plain integers, for tests of its protocol across processes
// (tests/test_ipc_mailbox.py): every rank calls it once per post; returns every rank's
// (op_id, signature, buffer_export, buffer_offset, event_ids) or raises RuntimeError.
using WireTuple = std::tuple<int64_t, std::vector<int64_t>, int64_t, int64_t, std::vector<int32_t>>;
std::vector<WireTuple> MailboxExchange(int64_t job, std::vector<int> members, int rank, int64_t op_id,
                                       std::vector<int64_t> signature, int64_t buffer_export, int64_t buffer_offset,
                                       std::vector<int32_t> event_ids, double timeout_s) {
  ficco::CallContext ctx{"mailbox_test", op_id, rank};
  ficco::WirePost mine;
  mine.op_id = op_id;
  mine.signature = std::move(signature);
  mine.buffer_export = buffer_export;
  mine.buffer_offset = buffer_offset;
  mine.event_ids = std::move(event_ids);
  mine.raw_events.assign(mine.event_ids.size(), 0);
  std::vector<ficco::WirePost> posts;
  ::xla::ffi::Error error = ::xla::ffi::Error::Success();
  {
    nanobind::gil_scoped_release release;
    ficco::HostMailbox* mailbox = nullptr;
    error = ficco::Registry::Get().Mailbox(ctx, job, &mailbox);
    if (error.success()) {
      ficco::MailboxArrival who{&ctx, &members, rank, "test", timeout_s};
      error = mailbox->Exchange(who, mine, &posts);
    }
  }
  if (error.failure()) throw std::runtime_error(error.message());
  std::vector<WireTuple> out;
  for (const ficco::WirePost& p : posts) {
    out.emplace_back(p.op_id, p.signature, p.buffer_export, p.buffer_offset, p.event_ids);
  }
  return out;
}

}  // namespace

namespace {
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

NB_MODULE(_ffi, m) {
  MaybeInstallCrashTrace();
  m.def("build_info", []() {
    nanobind::dict info;
    const std::string abi = std::string("xla-ffi-api-") + std::to_string(XLA_FFI_API_MAJOR) + "." +
                            std::to_string(XLA_FFI_API_MINOR);
    info["version"] = nanobind::str(FICCO_VERSION);
    info["cuda"] = nanobind::bool_(kCudaBuilt);
    info["ipc"] = nanobind::bool_(kCudaBuilt);  // copy engines across processes of one host (ipc.h)
    info["abi"] = nanobind::str(abi.c_str());
    return info;
  });
  m.def("_mailbox_exchange", &MailboxExchange);
  m.def("mailbox_name", [](int64_t job) { return ficco::MailboxName(job); });
  // At exit: remove the mailbox's name from /dev/shm (mappings stay valid until the process ends).
  m.def("ipc_unlink", []() { ficco::Registry::Get().UnlinkMailbox(); });
  m.def("ipc_stats", []() {
    nanobind::list stats;
#ifdef FICCO_WITH_CUDA
    for (const ficco::IpcDeviceStats& s : ficco::IpcStats()) {
      nanobind::dict d;
      d["ordinal"] = s.ordinal;
      d["exported_allocations"] = s.exported_allocations;
      d["exported_events"] = s.exported_events;
      d["opened_allocations"] = s.opened_allocations;
      d["opened_events"] = s.opened_events;
      d["exchanges"] = s.exchanges;
      d["staging_bytes"] = s.staging_bytes;
      d["staging_generations"] = s.staging_generations;
      d["retired_staging_bytes"] = s.retired_staging_bytes;
      stats.append(d);
    }
#endif
    return stats;
  });
  m.def("ipc_close", []() -> int64_t {
#ifdef FICCO_WITH_CUDA
    nanobind::gil_scoped_release release;
    return ficco::IpcClose();
#else
    ficco::Registry::Get().CloseMailbox();
    return 0;
#endif
  });
  m.def("ipc_describe_pointer", [](uint64_t pointer) {
    nanobind::dict d;
#ifdef FICCO_WITH_CUDA
    ficco::IpcPointerInfo info;
    std::string problem = ficco::DescribePointer(pointer, &info);
    if (!problem.empty()) throw std::runtime_error(problem);
    d["base"] = info.base;
    d["bytes"] = info.bytes;
    d["offset"] = pointer - info.base;
    d["buffer_id"] = info.buffer_id;
    d["ipc_capable"] = info.ipc_capable;
#else
    throw std::runtime_error("ipc_describe_pointer needs the CUDA build");
#endif
    return d;
  });
  m.def("ipc_describe_staging", [](int ordinal, uint64_t bytes) {
    nanobind::dict d;
#ifdef FICCO_WITH_CUDA
    ficco::IpcStagingInfo info;
    std::string problem;
    {
      nanobind::gil_scoped_release release;
      problem = ficco::DescribeStaging(ordinal, bytes, &info);
    }
    if (!problem.empty()) throw std::runtime_error(problem);
    d["ordinal"] = ordinal;
    d["base"] = info.allocation.base;
    d["bytes"] = info.allocation.bytes;
    d["buffer_id"] = info.allocation.buffer_id;
    d["ipc_capable"] = info.allocation.ipc_capable;
    d["generation"] = info.generation;
    d["retired_bytes"] = info.retired_bytes;
    d["export_error"] = info.export_error;
#else
    (void)ordinal;
    (void)bytes;
    throw std::runtime_error("ipc_describe_staging needs the CUDA build");
#endif
    return d;
  });
  m.def("registrations", []() {
    nanobind::dict targets;
#ifdef FICCO_WITH_CUDA
    targets[ficco::kAgMatmulTarget] = Platforms(FiccoAgMatmulCpu, FiccoAgMatmulCuda);
    targets[ficco::kMatmulRsTarget] = Platforms(FiccoMatmulRsCpu, FiccoMatmulRsCuda);
    targets[ficco::kAllGatherTarget] = Platforms(FiccoAllGatherCpu, FiccoAllGatherCuda);
    targets[ficco::kReduceScatterTarget] = Platforms(FiccoReduceScatterCpu, FiccoReduceScatterCuda);
    targets[ficco::kAllToAllTarget] = Platforms(FiccoAllToAllCpu, FiccoAllToAllCuda);
    targets[ficco::kA2aMatmulTarget] = Platforms(FiccoA2aMatmulCpu, FiccoA2aMatmulCuda);
    targets[ficco::kMatmulA2aTarget] = Platforms(FiccoMatmulA2aCpu, FiccoMatmulA2aCuda);
    targets["ficco_contention_probe"] = Platforms(FiccoContentionProbeCpu, FiccoContentionProbeCuda);
#else
    targets[ficco::kAgMatmulTarget] = Platforms(FiccoAgMatmulCpu, nullptr);
    targets[ficco::kMatmulRsTarget] = Platforms(FiccoMatmulRsCpu, nullptr);
    targets[ficco::kAllGatherTarget] = Platforms(FiccoAllGatherCpu, nullptr);
    targets[ficco::kReduceScatterTarget] = Platforms(FiccoReduceScatterCpu, nullptr);
    targets[ficco::kAllToAllTarget] = Platforms(FiccoAllToAllCpu, nullptr);
    targets[ficco::kA2aMatmulTarget] = Platforms(FiccoA2aMatmulCpu, nullptr);
    targets[ficco::kMatmulA2aTarget] = Platforms(FiccoMatmulA2aCpu, nullptr);
    targets["ficco_contention_probe"] = Platforms(FiccoContentionProbeCpu, nullptr);
#endif
    return targets;
  });
}
