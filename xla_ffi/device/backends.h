// The two implementations of device/backend.h's Backend: CPU (synchronous, for CI) and CUDA.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_BACKENDS_H_
#define FICCO_JAX_XLA_FFI_DEVICE_BACKENDS_H_

#include <memory>

#include "device/backend.h"

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "device/cuda_device.h"
#endif

namespace ficco {

// Everything runs at once, in issue order; events are no-ops.
std::unique_ptr<Backend> MakeCpuBackend(const CallContext& ctx);

#ifdef FICCO_WITH_CUDA
// `compute_stream` is XLA's stream for this call on `device` (ctx.device_ordinal). With
// `interprocess_events` every recorded event can be waited on by other processes (runtime/ipc.h).
std::unique_ptr<Backend> MakeCudaBackend(const CallContext& ctx, CudaDevice& device, cudaStream_t compute_stream,
                                         bool interprocess_events = false);
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_BACKENDS_H_
