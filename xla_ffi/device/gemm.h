// Chunk matmuls: c[rows, cols] = a[rows, inner] @ b[inner, cols], row-major, contiguous,
// f32 accumulation, one rounding to the output dtype. Pure launchers: no FFI types.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_GEMM_H_
#define FICCO_JAX_XLA_FFI_DEVICE_GEMM_H_

#include <cstdint>

#include "base/dtype.h"

#ifdef FICCO_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

namespace ficco {

struct GemmProblem {
  const void* a;  // [rows, inner]
  const void* b;  // [inner, cols]
  void* c;        // [rows, cols]
  int64_t rows;
  int64_t inner;
  int64_t cols;
  Dtype dtype;
};

// CPU reference loops.
void GemmHost(const GemmProblem& problem);

#ifdef FICCO_WITH_CUDA
struct GemmPlan;  // cuBLASLt descriptors and the chosen algorithm of one problem shape

// The cuBLASLt plans of one device, by (rows, inner, cols, dtype, alignments). Building a plan
// (descriptors, the heuristic's candidates, timing them once on the device) costs host time and
// one synchronisation; a chunked schedule runs the same few shapes on every call, so each is
// planned once. Thread-safe.
class GemmPlans {
 public:
  GemmPlans();
  ~GemmPlans();
  // cuBLASLt on `stream`. Returns the first failing status.
  cublasStatus_t Run(const GemmProblem& problem, cublasLtHandle_t handle, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream);

 private:
  struct Impl;
  Impl* impl_;
};
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_GEMM_H_
