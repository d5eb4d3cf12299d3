#include "gemm.h"

#include <vector>

namespace ficco {

void GemmHost(const GemmProblem& p) {
  std::vector<float> b(static_cast<size_t>(p.inner * p.cols));
  for (int64_t i = 0; i < p.inner * p.cols; ++i) b[i] = LoadAsFloat(p.b, i, p.dtype);
  std::vector<float> row(static_cast<size_t>(p.cols));
  for (int64_t i = 0; i < p.rows; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t k = 0; k < p.inner; ++k) {
      const float a_ik = LoadAsFloat(p.a, i * p.inner + k, p.dtype);
      const float* b_k = &b[static_cast<size_t>(k * p.cols)];
      for (int64_t j = 0; j < p.cols; ++j) row[j] += a_ik * b_k[j];
    }
    for (int64_t j = 0; j < p.cols; ++j) StoreFromFloat(p.c, i * p.cols + j, p.dtype, row[j]);
  }
}

#ifdef FICCO_WITH_CUDA
namespace {

cudaDataType_t CudaType(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32: return CUDA_R_32F;
    case Dtype::kBF16: return CUDA_R_16BF;
    case Dtype::kF16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// Owns the cuBLASLt descriptors of one call; destroys them on every path.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~LtDescriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

#define FICCO_LT_RETURN_IF_ERROR(call)                 \
  do {                                                 \
    cublasStatus_t status_ = (call);                   \
    if (status_ != CUBLAS_STATUS_SUCCESS) return status_; \
  } while (0)

}  // namespace

// cuBLASLt is column-major. A row-major [rows, cols] matrix is the column-major [cols, rows]
// matrix with the same bytes, so row-major C = A @ B is computed as column-major
// C^T[cols, rows] = B^T[cols, inner] @ A^T[inner, rows]: pass b as cuBLASLt's "A" and a as its
// "B", no transposes, leading dimensions cols, inner and cols.
cublasStatus_t GemmCublasLt(const GemmProblem& p, cublasLtHandle_t handle, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  const cudaDataType_t type = CudaType(p.dtype);
  // f32 inputs use true f32 (no TF32) so results match the XLA reference within 1e-5.
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  LtDescriptors d;
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&d.op, compute, CUDA_R_32F));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.a, type, p.cols, p.inner, p.cols));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.b, type, p.inner, p.rows, p.inner));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.c, type, p.cols, p.rows, p.cols));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&d.preference));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c,
                                                          d.preference, 1, &heuristic, &found));
  if (found == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(handle, d.op, &alpha, p.b, d.a, p.a, d.b, &beta, p.c, d.c, p.c, d.c,
                        &heuristic.algo, workspace, workspace_bytes, stream);
}
#endif  // FICCO_WITH_CUDA

}  // namespace ficco
