// The nanobind module `ficco_jax._ffi`: hands every FFI target (ffi/targets.h) to Python as
// PyCapsules per platform, and answers capability and IPC queries; its `testing` submodule holds
// the test-only entry points (testing/module_testing.cc).
#include <csignal>
#include <cstdlib>
#include <execinfo.h>
#include <unistd.h>

#include <map>
#include <string>

#include "ffi/attrs.h"
#include "ffi/contract.h"
#include "ffi/targets.h"
#include "runtime/placement.h"
#include "runtime/registry.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {
namespace {

namespace nb = nanobind;

#ifdef FICCO_WITH_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

nb::capsule Capsule(FfiEntry entry) { return nb::capsule(reinterpret_cast<void*>(entry)); }

// The stages of one entry: {"instantiate": the stage that makes its Placement (runtime/placement.h),
// "execute": the entry}.
nb::dict Stages(const TargetEntries& target, FfiEntry execute) {
  nb::dict stages;
  stages["instantiate"] = Capsule(target.instantiate);
  stages["execute"] = Capsule(execute);
  return stages;
}

// {target: {"cpu": stages, "CUDA": stages}} (CUDA only in the CUDA build), and for every target with
// a symmetric form {target + "_symmetric": ...}: the same CPU entry (no command buffers there), and
// on CUDA the stages of the entry marked command-buffer compatible, with its "initialize" stage and
// "traits": XLA's trait bits for the bundle (ffi/handler.h).
nb::dict Registrations() {
  nb::dict targets;
  for (const TargetEntries& target : Targets()) {
    nb::dict platforms;
    platforms["cpu"] = Stages(target, target.cpu);
    if (target.cuda != nullptr) platforms["CUDA"] = Stages(target, target.cuda);
    targets[target.name] = platforms;
    if (!target.symmetric) continue;
    nb::dict symmetric;
    symmetric["cpu"] = Stages(target, target.cpu);
    if (target.cuda_symmetric != nullptr) {
      nb::dict bundle = Stages(target, target.cuda_symmetric);
      bundle["initialize"] = Capsule(target.cuda_symmetric_initialize);
      bundle["traits"] = nb::int_(static_cast<int>(XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE));
      symmetric["CUDA"] = bundle;
    }
    targets[(std::string(target.name) + "_symmetric").c_str()] = symmetric;
  }
  return targets;
}

// The FFI types the targets keep as state, {name: {"type_id": ..., "type_info": ...}}, for
// jax.ffi.register_ffi_type on every platform before the targets are registered.
nb::dict Types() {
  static const XLA_FFI_TypeInfo placement_info = xla::ffi::MakeTypeInfo<Placement>();
  nb::dict registration;
  registration["type_id"] = nb::capsule(reinterpret_cast<void*>(&Placement::id));
  registration["type_info"] = nb::capsule(reinterpret_cast<void*>(const_cast<XLA_FFI_TypeInfo*>(&placement_info)));
  nb::dict types;
  types["ficco_jax.Placement"] = registration;
  return types;
}

template <size_t N>
nb::dict Codes(const AttributeCode (&codes)[N]) {
  nb::dict out;
  for (const AttributeCode& entry : codes) out[entry.name] = entry.code;
  return out;
}

// The contract of the calls (ffi/contract.h, ffi/attrs.h): its version, every target's attribute
// names in order, and the codes of the schedule's fields. The lowering takes the codes from here, and
// tests/test_contract.py checks that it writes exactly these attributes.
nb::dict Contract() {
  nb::dict contract;
  contract["version"] = kContractVersion;
  nb::list op, probe;
#define FICCO_ATTRIBUTE_NAME(type, name) names.append(#name);
  {
    nb::list& names = op;
    FICCO_OP_ATTRIBUTES(FICCO_ATTRIBUTE_NAME)
  }
  {
    nb::list& names = probe;
    FICCO_PROBE_ATTRIBUTES(FICCO_ATTRIBUTE_NAME)
  }
#undef FICCO_ATTRIBUTE_NAME
  contract["attributes"] = op;
  contract["probe_attributes"] = probe;
  contract["order"] = Codes(kOrderCodes);
  contract["gemm"] = Codes(kGemmCodes);
  contract["transfer"] = Codes(kTransferCodes);
  return contract;
}

// {local device ordinal: global device id} of this process's devices, and its jax.distributed job
// (runtime/placement.h).
void SetDeviceIds(const nb::dict& ids, int64_t job) {
  std::map<int, int64_t> table;
  for (auto [ordinal, id] : ids) table[nb::cast<int>(ordinal)] = nb::cast<int64_t>(id);
  Registry::Get().device_ids().Set(table, job);
}

nb::dict BuildInfo() {
  nb::dict info;
  const std::string abi =
      std::string("xla-ffi-api-") + std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["version"] = nb::str(FICCO_VERSION);
  info["cuda"] = nb::bool_(kCudaBuilt);
  info["ipc"] = nb::bool_(kCudaBuilt);  // copy engines across processes of one host (runtime/ipc.h)
  info["symmetric"] = nb::bool_(true);   // the <target>_symmetric forms (transfer=symmetric: runtime/symmetric.h)
  info["placement"] = nb::bool_(true);
  info["contract"] = nb::int_(kContractVersion);  // the calls' operands and attributes (ffi/contract.h)   // groups resolved from the run: a position operand (runtime/placement.h)
  info["abi"] = nb::str(abi.c_str());
  return info;
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

void DefineIpcFunctions(nb::module_& m);   // module_ipc.cc
void DefineTestingModule(nb::module_& m);  // testing/module_testing.cc

}  // namespace ficco

NB_MODULE(_ffi, m) {
  ficco::MaybeInstallCrashTrace();
  m.def("build_info", &ficco::BuildInfo);
  m.def("registrations", &ficco::Registrations);
  m.def("types", &ficco::Types);
  m.def("contract", &ficco::Contract);
  m.def("set_device_ids", &ficco::SetDeviceIds);
  ficco::DefineIpcFunctions(m);
  ficco::DefineTestingModule(m);
}
