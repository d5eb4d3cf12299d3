// The elementwise sum used by reduce-scatter schedules:
//   out[i] = own[i] + sum_s recv[s * slot_stride + i]   for i < count,
// accumulated in f32 and rounded once to the output dtype. `out` may alias `own`.
// Pure launchers: no FFI types.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_REDUCE_H_
#define FICCO_JAX_XLA_FFI_DEVICE_REDUCE_H_

#include <cstdint>

#include "base/dtype.h"

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "device/counters.h"
#endif

namespace ficco {

struct ReduceProblem {
  void* out;
  const void* own;
  const void* recv;      // slot 0 of the receive workspace, at this chunk's offset
  int64_t slot_stride;   // elements between consecutive receive slots
  int64_t num_slots;
  int64_t count;         // elements to reduce
  Dtype dtype;
};

void ReduceSumHost(const ReduceProblem& problem);

#ifdef FICCO_WITH_CUDA
// Where `waits` is given (at most kCounterWaitWords), the sum waits for them first (device/counters.h):
// the waits of a symmetric call for its partials, made by every block of a small sum's grid, with no
// kernel of their own; a wide sum's in a kernel before it (reduce.cu, kWaitingBlocks, says why).
cudaError_t LaunchReduceSum(const ReduceProblem& problem, const CounterWaitList* waits, cudaStream_t stream);
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_REDUCE_H_
