// The split all-gather of ag_matmul with gemm='xla_dot' (executor.h: StartAllGather and friends):
// three targets whose handlers bracket XLA's own dots.
//   ficco_ag_start  (x [m, K]) -> gathered [n*m, K], filled by copy engines after it returns;
//   ficco_ag_wait   (gathered) -> token [1]: XLA's stream waits for chunk `step`;
//   ficco_ag_finish (x, out)   -> token [1]: the join; `out` (the dots' result) only orders it last.
// The tokens carry no data: dma.py threads them through optimization barriers so that each dot
// reads `gathered` only after its wait, and the results only after the finish.
#include "guard.h"

namespace ficco {
namespace {

ffi::Error AgWaitImpl(Backend& backend, const OpConfig& config, int64_t step) {
  return WaitAllGatherChunk(backend, config, step);
}

ffi::Error AgFinishImpl(Backend& backend, const OpConfig& config) { return FinishAllGather(backend, config); }

ffi::Error AgStartCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> gathered,
                      OpAttrs attrs) {
  return GuardCpu(kAgStartTarget, ordinal, run, attrs,
                  [&](Backend& b, const OpConfig& c) { return AgStartImpl(b, c, x, *gathered); });
}

ffi::Error AgWaitCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>, OpAttrs attrs) {
  return GuardCpu(kAgWaitTarget, ordinal, run, attrs,
                  [&](Backend& b, const OpConfig& c) { return AgWaitImpl(b, c, attrs.step); });
}

ffi::Error AgFinishCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>,
                       OpAttrs attrs) {
  return GuardCpu(kAgFinishTarget, ordinal, run, attrs,
                  [&](Backend& b, const OpConfig& c) { return AgFinishImpl(b, c); });
}

#ifdef FICCO_WITH_CUDA
ffi::Error AgStartCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> gathered, OpAttrs attrs) {
  return GuardCuda(kAgStartTarget, stream, ordinal, run, attrs,
                   [&](Backend& b, const OpConfig& c) { return AgStartImpl(b, c, x, *gathered); });
}

ffi::Error AgWaitCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer,
                      ffi::Result<ffi::AnyBuffer>, OpAttrs attrs) {
  return GuardCuda(kAgWaitTarget, stream, ordinal, run, attrs,
                   [&](Backend& b, const OpConfig& c) { return AgWaitImpl(b, c, attrs.step); });
}

ffi::Error AgFinishCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer,
                        ffi::Result<ffi::AnyBuffer>, OpAttrs attrs) {
  return GuardCuda(kAgFinishTarget, stream, ordinal, run, attrs,
                   [&](Backend& b, const OpConfig& c) { return AgFinishImpl(b, c); });
}
#endif  // FICCO_WITH_CUDA

}  // namespace
}  // namespace ficco

// ---------------------------------------------------------------------------------------------
// Handler symbols (module.cc hands them to Python). Not command-buffer compatible: the host
// rendezvous of start and finish must run on every execution.
// ---------------------------------------------------------------------------------------------
namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAgStartCpu, ficco::AgStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()   // x [m, K]
                                  .Ret<ffi::AnyBuffer>()   // gathered [n*m, K]
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAgWaitCpu, ficco::AgWaitCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()   // gathered (read by the dot after the wait)
                                  .Ret<ffi::AnyBuffer>()   // token [1]
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAgFinishCpu, ficco::AgFinishCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()   // x (peers read it until the join)
                                  .Arg<ffi::AnyBuffer>()   // out (orders the finish after every dot)
                                  .Ret<ffi::AnyBuffer>()   // token [1]
                                  .Attrs<ficco::OpAttrs>());

#ifdef FICCO_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAgStartCuda, ficco::AgStartCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAgWaitCuda, ficco::AgWaitCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAgFinishCuda, ficco::AgFinishCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<ficco::OpAttrs>());
#endif  // FICCO_WITH_CUDA
