// The two implementations of device/backend.h's Backend: CPU (synchronous, for CI) and CUDA.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_BACKENDS_H_
#define FICCO_JAX_XLA_FFI_DEVICE_BACKENDS_H_

#include <cstdint>
#include <memory>

#include "device/backend.h"

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "device/cuda_device.h"
#endif

namespace ficco {

// The CPU backend's events: host flags, set when recorded (the backend runs everything at once, in
// issue order) except those of RecordNever; Wait blocks until the flag is set. One pool serves
// every CPU device of the process (the registry owns it).
std::unique_ptr<EventPool> MakeHostEventPool();

// Everything runs at once, in issue order; its events come from `pool` (MakeHostEventPool). A word
// wait gives up after `timeout_s`.
std::unique_ptr<Backend> MakeCpuBackend(const CallContext& ctx, EventPool& pool, double timeout_s);

// `backend`, counting each record, wait, copy, matmul and sum it is asked for and the host time it
// takes (a CUDA backend's driver calls, a CPU backend's whole work), summed over the process in
// BackendCallTotals(). `mark` counts the watchdog's marks of each call's start and end.
std::unique_ptr<Backend> CountCalls(std::unique_ptr<Backend> backend);
struct BackendCalls {
  struct Kind {
    int64_t calls = 0, ns = 0;
  };
  Kind record, mark, wait, copy, gemm, reduce, set_word, wait_word, counter;
};
BackendCalls BackendCallTotals();

#ifdef FICCO_WITH_CUDA
// `compute_stream` is XLA's stream for this call on `device` (ctx.device_ordinal). With
// `interprocess_events` every recorded event can be waited on by other processes (runtime/ipc.h).
std::unique_ptr<Backend> MakeCudaBackend(const CallContext& ctx, CudaDevice& device, cudaStream_t compute_stream,
                                         bool interprocess_events = false);
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_BACKENDS_H_
