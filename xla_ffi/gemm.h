// Chunk matmuls: c[rows, cols] = a[rows, inner] @ b[inner, cols], row-major, contiguous,
// f32 accumulation, one rounding to the output dtype. Pure launchers: no FFI types.
#ifndef FICCO_JAX_XLA_FFI_GEMM_H_
#define FICCO_JAX_XLA_FFI_GEMM_H_

#include <cstdint>

#include "dtype.h"

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
// cuBLASLt on `stream`. Returns the first failing status.
cublasStatus_t GemmCublasLt(const GemmProblem& problem, cublasLtHandle_t handle, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_GEMM_H_
