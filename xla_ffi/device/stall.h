// A kernel that blocks its stream until a host flag is set: the device side of the stall fault
// (CudaDevice::BlockForever), which stands for a peer whose event never completes.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_STALL_H_
#define FICCO_JAX_XLA_FFI_DEVICE_STALL_H_

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>

namespace ficco {

// One thread on `stream` that polls `*flag` (device-visible host memory) until it is nonzero.
cudaError_t LaunchSpinUntilSet(const int* flag, cudaStream_t stream);

}  // namespace ficco
#endif  // FICCO_WITH_CUDA

#endif  // FICCO_JAX_XLA_FFI_DEVICE_STALL_H_
