// XLA FFI bindings of the ficco targets (one handler symbol per target and platform) and the
// nanobind module `ficco_jax._ffi` that hands them to Python as PyCapsules.
//
// Every handler: decode the attributes (handlers.cc), make the platform's Backend, run the
// op's Impl. No exception or CUDA error escapes: Impls return ffi::Error and Guard() catches
// anything thrown (e.g. std::bad_alloc).
#include <string>

#include "a2a.h"
#include "guard.h"
#include "nanobind/nanobind.h"
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

}  // namespace

NB_MODULE(_ffi, m) {
  m.def("build_info", []() {
    nanobind::dict info;
    const std::string abi = std::string("xla-ffi-api-") + std::to_string(XLA_FFI_API_MAJOR) + "." +
                            std::to_string(XLA_FFI_API_MINOR);
    info["version"] = nanobind::str(FICCO_VERSION);
    info["cuda"] = nanobind::bool_(kCudaBuilt);
    info["abi"] = nanobind::str(abi.c_str());
    return info;
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
