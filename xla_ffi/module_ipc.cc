// The IPC functions of `ficco_jax._ffi` (ficco_jax/runtime/ipc.py): the host mailbox's name and teardown,
// and diagnostics of the staging buffers and of XLA's allocations as CUDA IPC sees them.
#include <stdexcept>
#include <string>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "runtime/ipc.h"
#include "runtime/registry.h"

namespace ficco {
namespace {

namespace nb = nanobind;

nb::list IpcStatsList() {
  nb::list stats;
#ifdef FICCO_WITH_CUDA
  for (const IpcDeviceStats& s : IpcStats()) {
    nb::dict d;
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
}

int64_t CloseIpc() {
#ifdef FICCO_WITH_CUDA
  nb::gil_scoped_release release;
  return IpcClose();
#else
  Registry::Get().CloseMailbox();
  return 0;
#endif
}

#ifdef FICCO_WITH_CUDA
void PutAllocation(nb::dict& d, const IpcPointerInfo& info) {
  d["base"] = info.base;
  d["bytes"] = info.bytes;
  d["buffer_id"] = info.buffer_id;
  d["ipc_capable"] = info.ipc_capable;
}
#endif

nb::dict DescribePointerDict(uint64_t pointer) {
  nb::dict d;
#ifdef FICCO_WITH_CUDA
  IpcPointerInfo info;
  std::string problem = DescribePointer(pointer, &info);
  if (!problem.empty()) throw std::runtime_error(problem);
  PutAllocation(d, info);
  d["offset"] = pointer - info.base;
#else
  (void)pointer;
  throw std::runtime_error("ipc_describe_pointer needs the CUDA build");
#endif
  return d;
}

nb::dict DescribeStagingDict(int ordinal, uint64_t bytes) {
  nb::dict d;
#ifdef FICCO_WITH_CUDA
  IpcStagingInfo info;
  std::string problem;
  {
    nb::gil_scoped_release release;
    problem = DescribeStaging(ordinal, bytes, &info);
  }
  if (!problem.empty()) throw std::runtime_error(problem);
  d["ordinal"] = ordinal;
  PutAllocation(d, info.allocation);
  d["generation"] = info.generation;
  d["retired_bytes"] = info.retired_bytes;
  d["export_error"] = info.export_error;
#else
  (void)ordinal;
  (void)bytes;
  throw std::runtime_error("ipc_describe_staging needs the CUDA build");
#endif
  return d;
}

}  // namespace

void DefineIpcFunctions(nb::module_& m) {
  m.def("mailbox_name", [](int64_t job) { return MailboxName(job); });
  // Names the host mailbox of `job` by its random token (ficco_jax/runtime/ipc.py, job_id()).
  m.def("ipc_register_mailbox", [](int64_t job, const std::string& token, double first_timeout_s) {
    const std::string problem = RegisterMailbox(job, token, first_timeout_s);
    if (!problem.empty()) throw std::invalid_argument(problem);
  });
  // At exit: remove the mailbox's name from /dev/shm (mappings stay valid until the process ends).
  m.def("ipc_unlink", []() { Registry::Get().UnlinkMailbox(); });
  m.def("ipc_stats", &IpcStatsList);
  m.def("ipc_close", &CloseIpc);
  m.def("ipc_describe_pointer", &DescribePointerDict);
  m.def("ipc_describe_staging", &DescribeStagingDict);
}

}  // namespace ficco
