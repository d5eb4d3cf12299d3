#include "device/gemm.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

namespace ficco {

namespace {

void GemmHostOne(const GemmProblem& p) {
  const MatmulTypes& t = p.types;
  std::vector<float> b(static_cast<size_t>(p.inner * p.cols));  // [inner, cols]
  const int64_t b_ld = p.BLd(), c_ld = p.CLd();
  for (int64_t k = 0; k < p.inner; ++k) {
    for (int64_t j = 0; j < p.cols; ++j) {
      b[k * p.cols + j] = LoadAsFloat(p.b, t.b_transposed ? j * b_ld + k : k * b_ld + j, t.b);
    }
  }
  // On the CPU backend the scales are host scalars.
  const float scale = (t.a_scale ? *t.a_scale : 1.0f) * (t.b_scale ? *t.b_scale : 1.0f);
  std::vector<float> row(static_cast<size_t>(p.cols));
  for (int64_t i = 0; i < p.rows; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t k = 0; k < p.inner; ++k) {
      const float a_ik = LoadAsFloat(p.a, i * p.inner + k, t.a);
      const float* b_k = &b[static_cast<size_t>(k * p.cols)];
      for (int64_t j = 0; j < p.cols; ++j) row[j] += a_ik * b_k[j];
    }
    for (int64_t j = 0; j < p.cols; ++j) {
      const float added = p.accumulate ? LoadAsFloat(p.accumulate, i * c_ld + j, t.c) : 0.0f;
      StoreFromFloat(p.c, i * c_ld + j, t.c, scale * row[j] + added);
    }
  }
}

}  // namespace

void GemmHost(const GemmProblem& p) {
  const int64_t a_width = ByteWidth(p.types.a), b_width = ByteWidth(p.types.b), c_width = ByteWidth(p.types.c);
  for (int64_t i = 0; i < p.batch; ++i) {
    GemmProblem one = p;
    one.a = static_cast<const char*>(p.a) + i * p.a_stride * a_width;
    one.b = static_cast<const char*>(p.b) + i * p.b_stride * b_width;
    one.c = static_cast<char*>(p.c) + i * p.c_stride * c_width;
    if (p.accumulate) one.accumulate = static_cast<const char*>(p.accumulate) + i * p.c_stride * c_width;
    GemmHostOne(one);
  }
}

#ifdef FICCO_WITH_CUDA
namespace {

cudaDataType_t CudaType(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32: return CUDA_R_32F;
    case Dtype::kBF16: return CUDA_R_16BF;
    case Dtype::kF16: return CUDA_R_16F;
    case Dtype::kF8E4M3: return CUDA_R_8F_E4M3;
    case Dtype::kF8E5M2: return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}

#define FICCO_LT_RETURN_IF_ERROR(call)                 \
  do {                                                 \
    cublasStatus_t status_ = (call);                   \
    if (status_ != CUBLAS_STATUS_SUCCESS) return status_; \
  } while (0)

// FICCO_GEMM_LOG=1: one stderr line per new plan (shape, candidates, the chosen algorithm's
// configuration and its time per run on the problem's own buffers), to tell an algorithm gap from
// contention or call overhead when the executor's matmuls are slower than XLA's.
bool GemmLogEnabled() {
  static const bool enabled = [] {
    const char* flag = std::getenv("FICCO_GEMM_LOG");
    return flag != nullptr && flag[0] == '1';
  }();
  return enabled;
}

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

// (rows, inner, cols, dtypes of a, b, c and b's layout, alignment of a, b, c, and of the accumulated
// matrix, 0 for none, then the batch and its strides, then the row strides of b and c): cuBLASLt
// algorithms depend on alignment.
using PlanKey = std::tuple<int64_t, int64_t, int64_t, int, uint32_t, uint32_t, uint32_t, uint32_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t>;

// Whether each scale pointer is set is part of the key: a plan's descriptor keeps the scale
// pointers it was given (SetScales sets only those a call has), so a plan made with scales and
// reused by a call without them would read the first call's scales.
int TypesKey(const MatmulTypes& t) {
  return static_cast<int>(t.a) | static_cast<int>(t.b) << 4 | static_cast<int>(t.c) << 8 |
         static_cast<int>(t.b_transposed) << 12 | static_cast<int>(t.a_scale != nullptr) << 13 |
         static_cast<int>(t.b_scale != nullptr) << 14;
}

// The largest power of two (at most 256) dividing the address: what cuBLASLt may assume. In a batch
// every product's operand must have it, so the stride between them counts too.
uint32_t Alignment(const void* pointer, int64_t stride = 0, Dtype dtype = Dtype::kF32) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(pointer) | static_cast<uintptr_t>(stride * ByteWidth(dtype));
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// The alignments of a, b, c and the accumulated matrix (0 for none), over the whole batch.
struct Alignments {
  uint32_t a, b, c, accumulate;
  explicit Alignments(const GemmProblem& p)
      : a(Alignment(p.a, Stride(p, p.a_stride), p.types.a)),
        b(Alignment(p.b, Stride(p, p.b_stride), p.types.b)),
        c(Alignment(p.c, Stride(p, p.c_stride), p.types.c)),
        accumulate(p.accumulate ? Alignment(p.accumulate, Stride(p, p.c_stride), p.types.c) : 0) {}
  // A single product has no stride.
  static int64_t Stride(const GemmProblem& p, int64_t stride) { return p.batch > 1 ? stride : 0; }
};

PlanKey KeyOf(const GemmProblem& p) {
  const Alignments align(p);
  const auto stride = [&](int64_t s) { return Alignments::Stride(p, s); };
  return PlanKey{p.rows,    p.inner,         p.cols,           TypesKey(p.types),  align.a,          align.b,
                 align.c,   align.accumulate, p.batch,          stride(p.a_stride), stride(p.b_stride),
                 stride(p.c_stride), p.BLd(), p.CLd()};
}

// A batch of products: `count` matrices `stride` elements apart in `layout`.
cublasStatus_t SetBatch(cublasLtMatrixLayout_t layout, int64_t count, int64_t stride) {
  const int32_t batch = static_cast<int32_t>(count);
  FICCO_LT_RETURN_IF_ERROR(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
  return cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                          sizeof(stride));
}

// How many of the heuristic's candidates a new plan times on the device (once per shape). XLA's
// own GEMM autotuner looks at up to 128; with 8 and 32 our chunk matmuls stayed 12-16% and
// 5-13% behind XLA's dot of the same shape on an H200.
constexpr int kAlgoCandidates = 128;

// The fastest few of the first pass are timed again with more repeats (one pass of 3 runs is
// noisy enough to pick a slower algorithm), after a warm-up that brings the GPU to its clocks.
constexpr int kFirstPassRepeats = 3;
constexpr int kFinalists = 4;
constexpr int kFinalRepeats = 10;
constexpr int kWarmupRuns = 5;

// One matmul of `p` with `algo`: beta = 1 and C = p.accumulate where it adds one, else beta = 0.
cublasStatus_t Enqueue(const GemmProblem& p, cublasLtHandle_t handle, const GemmPlan& plan,
                       const cublasLtMatmulAlgo_t& algo, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
  const void* c_in = p.accumulate ? p.accumulate : p.c;
  return cublasLtMatmul(handle, plan.op, &alpha, p.b, plan.a, p.a, plan.b, &beta, c_in, plan.c, p.c, plan.c, &algo,
                        workspace, workspace_bytes, stream);
}

// Times `algo` on the problem's own buffers (the output is overwritten by the real run after):
// milliseconds for `repeats` runs, -1 if it does not run.
float TimeAlgo(const GemmProblem& p, cublasLtHandle_t handle, const GemmPlan& plan,
               const cublasLtMatmulAlgo_t& algo, void* workspace, size_t workspace_bytes,
               cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop, int repeats) {
  auto run = [&] { return Enqueue(p, handle, plan, algo, workspace, workspace_bytes, stream); };
  if (run() != CUBLAS_STATUS_SUCCESS) return -1.0f;
  cudaEventRecord(start, stream);
  for (int i = 0; i < repeats; ++i) run();
  cudaEventRecord(stop, stream);
  float ms = -1.0f;
  if (cudaEventSynchronize(stop) != cudaSuccess || cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
    return -1.0f;
  }
  return ms;
}

// The per-tensor scales of an FP8 problem: cuBLASLt's "A" is our b, its "B" our a. Device
// pointers, read when a matmul is enqueued, so a cached plan takes each call's own.
cublasStatus_t SetScales(const GemmProblem& p, cublasLtMatmulDesc_t op) {
  const void* a_scale = p.types.b_scale;
  const void* b_scale = p.types.a_scale;
  if (a_scale != nullptr) {
    FICCO_LT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  }
  if (b_scale != nullptr) {
    FICCO_LT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  }
  return CUBLAS_STATUS_SUCCESS;
}

// cuBLASLt is column-major. A row-major [rows, cols] matrix is the column-major [cols, rows]
// matrix with the same bytes, so row-major C = A @ B is computed as column-major
// C^T[cols, rows] = B^T[cols, inner] @ A^T[inner, rows]: pass b as cuBLASLt's "A" and a as its
// "B", no transposes, leading dimensions cols, inner and cols (b's and c's row strides, BLd and CLd,
// where they are column slices of wider matrices). A transposed b ([cols, inner]: FP8,
// or a weight taken column-major) is column-major [inner, cols]: cuBLASLt's "A" with op T, leading
// dimension inner.
//
// The layouts of `p` as cuBLASLt sees it (see MakePlan), then up to kAlgoCandidates algorithms
// the heuristic proposes for them, within the workspace and the operands' alignments.
cublasStatus_t FindCandidates(const GemmProblem& p, cublasLtHandle_t handle, size_t workspace_bytes, GemmPlan* plan,
                              std::vector<cublasLtMatmulHeuristicResult_t>* candidates, int* found) {
  const MatmulTypes& t = p.types;
  // f32 inputs use true f32 (no TF32) so results match the XLA reference within 1e-5.
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  if (t.b_transposed) {  // b stored [cols, inner]: cuBLASLt's "A" is column-major [inner, cols], transposed
    const cublasOperation_t transpose = CUBLAS_OP_T;
    FICCO_LT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
    FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->a, CudaType(t.b), p.inner, p.cols, p.BLd()));
  } else {
    FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->a, CudaType(t.b), p.cols, p.inner, p.BLd()));
  }
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, CudaType(t.a), p.inner, p.rows, p.inner));
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->c, CudaType(t.c), p.cols, p.rows, p.CLd()));
  if (p.batch > 1) {  // (cuBLASLt's "A" is our b, its "B" our a)
    FICCO_LT_RETURN_IF_ERROR(SetBatch(plan->a, p.batch, p.b_stride));
    FICCO_LT_RETURN_IF_ERROR(SetBatch(plan->b, p.batch, p.a_stride));
    FICCO_LT_RETURN_IF_ERROR(SetBatch(plan->c, p.batch, p.c_stride));
  }
  FICCO_LT_RETURN_IF_ERROR(SetScales(p, plan->op));
  if (IsFp8(t.a)) {
    // FP8 on Hopper: accumulate in the tensor cores' fast mode (no periodic promotion to f32), as
    // TransformerEngine's forward GEMMs do. On one H100 (2026-11-24) the promoted mode reached 1.56-1.75x
    // the bf16 rate on the per-device anchors, below XLA's own FP8 dot on two of them.
    const int8_t fast_accumulation = 1;
    FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                            &fast_accumulation, sizeof(fast_accumulation)));
  }
  cublasLtMatmulPreference_t preference = nullptr;
  FICCO_LT_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&preference));
  // cuBLASLt's A, B, C (what is read: the accumulated matrix where there is one) and D.
  const Alignments operand(p);
  const uint32_t c_align = p.accumulate ? std::min(operand.accumulate, operand.c) : operand.c;
  const uint32_t align[4] = {operand.b, operand.a, c_align, operand.c};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes));
  for (int i = 0; i < 4 && status == CUBLAS_STATUS_SUCCESS; ++i) {
    status = cublasLtMatmulPreferenceSetAttribute(preference, align_attr[i], &align[i], sizeof(align[i]));
  }
  candidates->resize(kAlgoCandidates);
  *found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->a, plan->b, plan->c, plan->c, preference,
                                            kAlgoCandidates, candidates->data(), found);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  return status;
}

// Times the candidates on the device and keeps the fastest in plan->algo: a warm-up, one short
// pass over every candidate, then the finalists again with more repeats.
void ChooseFastest(const GemmProblem& p, cublasLtHandle_t handle, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop,
                   const std::vector<cublasLtMatmulHeuristicResult_t>& candidates, int found, GemmPlan* plan) {
  TimeAlgo(p, handle, *plan, candidates[0].algo, workspace, workspace_bytes, stream, start, stop, kWarmupRuns);
  std::vector<std::pair<float, int>> first;  // (ms, candidate index) of those that ran
  for (int i = 0; i < found; ++i) {
    const float ms = TimeAlgo(p, handle, *plan, candidates[i].algo, workspace, workspace_bytes, stream, start, stop,
                              kFirstPassRepeats);
    if (ms >= 0.0f) first.emplace_back(ms, i);
  }
  std::sort(first.begin(), first.end());
  float best = -1.0f;
  for (size_t f = 0; f < first.size() && f < static_cast<size_t>(kFinalists); ++f) {
    const int i = first[f].second;
    const float ms = TimeAlgo(p, handle, *plan, candidates[i].algo, workspace, workspace_bytes, stream, start, stop,
                              kFinalRepeats);
    if (ms >= 0.0f && (best < 0.0f || ms < best)) {
      best = ms;
      plan->algo = candidates[i].algo;
    }
  }
}

// FICCO_GEMM_LOG=1: the chosen algorithm's configuration and its time per run (-1 without events).
void LogPlan(const GemmProblem& p, const GemmPlan& plan, int found, float ms) {
  int id = -1, tile = -1, stages = -1, split_k = -1, swizzle = -1;
  size_t written = 0;
  const cublasLtMatmulAlgo_t* algo = &plan.algo;
  cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &written);
  cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
  cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &written);
  cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k, sizeof(split_k), &written);
  cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &written);
  std::fprintf(stderr,
               "ficco gemm plan %lld x [%lld,%lld]@[%lld,%lld] types %#x: %d candidates, chose algo %d tile %d "
               "stages %d split_k %d swizzle %d, %.4f ms per run\n",
               static_cast<long long>(p.batch), static_cast<long long>(p.rows), static_cast<long long>(p.inner),
               static_cast<long long>(p.inner), static_cast<long long>(p.cols), TypesKey(p.types), found, id, tile,
               stages, split_k, swizzle,
               ms >= 0.0f ? ms / kFinalRepeats : -1.0f);
}

// cuBLASLt is column-major. A row-major [rows, cols] matrix is the column-major [cols, rows]
// matrix with the same bytes, so row-major C = A @ B is computed as column-major
// C^T[cols, rows] = B^T[cols, inner] @ A^T[inner, rows]: pass b as cuBLASLt's "A" and a as its
// "B", no transposes, leading dimensions cols, inner and cols.
//
// The algorithm: the heuristic's best guesses are timed on the device and the fastest is kept
// (as XLA's GEMM autotuner does at compile time). The synchronisations this costs happen on the
// first call of each shape only.
cublasStatus_t MakePlan(const GemmProblem& p, cublasLtHandle_t handle, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream, bool timed, GemmPlan* plan) {
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  int found = 0;
  const cublasStatus_t status = FindCandidates(p, handle, workspace_bytes, plan, &candidates, &found);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (found == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  plan->algo = candidates[0].algo;
  if (!timed) return CUBLAS_STATUS_SUCCESS;
  cudaEvent_t start = nullptr, stop = nullptr;
  if (found > 1 && cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess) {
    ChooseFastest(p, handle, workspace, workspace_bytes, stream, start, stop, candidates, found, plan);
  }
  if (GemmLogEnabled()) {
    const float ms = start ? TimeAlgo(p, handle, *plan, plan->algo, workspace, workspace_bytes, stream, start, stop,
                                      kFinalRepeats)
                           : -1.0f;
    LogPlan(p, *plan, found, ms);
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  (void)cudaGetLastError();  // a candidate that failed to launch must not leave a sticky error
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

struct GemmPlans::Impl {
  std::mutex mu;
  std::map<PlanKey, std::unique_ptr<GemmPlan>> plans;
  // Matmuls enqueued on two streams of one device may run at once, and a workspace shared by them
  // would be written by both: the first stream seen uses the device's workspace, every other stream
  // one of its own, of the same size, made the first time it runs a matmul outside a capture (XLA's
  // streams live as long as the device; so do these).
  cudaStream_t first_stream = nullptr;
  bool has_first_stream = false;
  std::map<cudaStream_t, void*> workspaces;
};

namespace {
// The workspace `stream` uses (see Impl). A stream first seen while it is being captured cannot
// allocate: it uses the device's workspace for that call. Caller holds impl->mu.
cublasStatus_t WorkspaceFor(GemmPlans::Impl* impl, cudaStream_t stream, void* device_workspace, size_t bytes,
                            bool capturing, void** workspace) {
  *workspace = device_workspace;
  if (!impl->has_first_stream) {
    impl->first_stream = stream;
    impl->has_first_stream = true;
  }
  if (stream == impl->first_stream || device_workspace == nullptr || bytes == 0) return CUBLAS_STATUS_SUCCESS;
  auto found = impl->workspaces.find(stream);
  if (found != impl->workspaces.end()) {
    *workspace = found->second;
    return CUBLAS_STATUS_SUCCESS;
  }
  if (capturing) return CUBLAS_STATUS_SUCCESS;
  void* own = nullptr;
  if (cudaMalloc(&own, bytes) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: reported as the matmul's allocation failure
    return CUBLAS_STATUS_ALLOC_FAILED;
  }
  impl->workspaces[stream] = own;
  *workspace = own;
  return CUBLAS_STATUS_SUCCESS;
}
}  // namespace

GemmPlans::GemmPlans() : impl_(new Impl) {}
GemmPlans::~GemmPlans() { delete impl_; }

cublasStatus_t GemmPlans::Run(const GemmProblem& p, cublasLtHandle_t handle, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream, bool capturing) {
  // Held through the enqueue: an FP8 plan's scale pointers are set per call on its descriptor.
  std::lock_guard<std::mutex> lock(impl_->mu);
  FICCO_LT_RETURN_IF_ERROR(WorkspaceFor(impl_, stream, workspace, workspace_bytes, capturing, &workspace));
  const PlanKey key = KeyOf(p);
  auto found = impl_->plans.find(key);
  std::unique_ptr<GemmPlan> untimed;  // a capture's plan of a new shape, gone after its enqueue
  const GemmPlan* plan = nullptr;
  if (found != impl_->plans.end()) {
    plan = found->second.get();
  } else if (capturing) {
    untimed = std::make_unique<GemmPlan>();
    FICCO_LT_RETURN_IF_ERROR(MakePlan(p, handle, workspace, workspace_bytes, stream, /*timed=*/false, untimed.get()));
    plan = untimed.get();
  } else {
    auto fresh = std::make_unique<GemmPlan>();
    FICCO_LT_RETURN_IF_ERROR(MakePlan(p, handle, workspace, workspace_bytes, stream, /*timed=*/true, fresh.get()));
    plan = fresh.get();
    impl_->plans[key] = std::move(fresh);
  }
  FICCO_LT_RETURN_IF_ERROR(SetScales(p, plan->op));
  return Enqueue(p, handle, *plan, plan->algo, workspace, workspace_bytes, stream);
}
#endif  // FICCO_WITH_CUDA

}  // namespace ficco
