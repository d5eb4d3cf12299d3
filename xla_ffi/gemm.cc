#include "gemm.h"

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
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

#define FICCO_LT_RETURN_IF_ERROR(call)                 \
  do {                                                 \
    cublasStatus_t status_ = (call);                   \
    if (status_ != CUBLAS_STATUS_SUCCESS) return status_; \
  } while (0)

}  // namespace

// Owns the cuBLASLt descriptors of one problem shape and the algorithm chosen for it.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo = {};
  ~GemmPlan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

namespace {

using PlanKey = std::tuple<int64_t, int64_t, int64_t, int>;

// cuBLASLt is column-major. A row-major [rows, cols] matrix is the column-major [cols, rows]
// matrix with the same bytes, so row-major C = A @ B is computed as column-major
// C^T[cols, rows] = B^T[cols, inner] @ A^T[inner, rows]: pass b as cuBLASLt's "A" and a as its
// "B", no transposes, leading dimensions cols, inner and cols.
cublasStatus_t MakePlan(const GemmProblem& p, cublasLtHandle_t handle, size_t workspace_bytes,
                        GemmPlan* plan) {
  const cudaDataType_t type = CudaType(p.dtype);
  // f32 inputs use true f32 (no TF32) so results match the XLA reference within 1e-5.
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->a, type, p.cols, p.inner, p.cols));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, type, p.inner, p.rows, p.inner));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->c, type, p.cols, p.rows, p.cols));
  cublasLtMatmulPreference_t preference = nullptr;
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&preference));
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes));
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->a, plan->b, plan->c, plan->c,
                                            preference, 1, &heuristic, &found);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (found == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  plan->algo = heuristic.algo;
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

struct GemmPlans::Impl {
  std::mutex mu;
  std::map<PlanKey, std::unique_ptr<GemmPlan>> plans;
};

GemmPlans::GemmPlans() : impl_(new Impl) {}
GemmPlans::~GemmPlans() { delete impl_; }

cublasStatus_t GemmPlans::Run(const GemmProblem& p, cublasLtHandle_t handle, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  const GemmPlan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    std::unique_ptr<GemmPlan>& slot = impl_->plans[PlanKey{p.rows, p.inner, p.cols, static_cast<int>(p.dtype)}];
    if (!slot) {
      auto fresh = std::make_unique<GemmPlan>();
      FICCO_LT_RETURN_IF_ERROR(MakePlan(p, handle, workspace_bytes, fresh.get()));
      slot = std::move(fresh);
    }
    plan = slot.get();  // plans are never erased, so the pointer stays valid after unlocking
  }
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(handle, plan->op, &alpha, p.b, plan->a, p.a, plan->b, &beta, p.c, plan->c, p.c,
                        plan->c, &plan->algo, workspace, workspace_bytes, stream);
}
#endif  // FICCO_WITH_CUDA

}  // namespace ficco
