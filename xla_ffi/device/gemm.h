// Chunk matmuls: c[rows, cols] = a_scale * b_scale * (a[rows, inner] @ b[inner, cols]) (+ accumulate),
// row-major (b and c may be column slices of wider matrices: b_ld, c_ld), f32 accumulation, one
// rounding to the output dtype. Pure launchers: no FFI types.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_GEMM_H_
#define FICCO_JAX_XLA_FFI_DEVICE_GEMM_H_

#include <cstdint>

#include "base/dtype.h"

#ifdef FICCO_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

namespace ficco {

// The element types of one op's matmuls. Operands share a half or f32 dtype and the result is
// that dtype or f32 (mixed precision: bf16 operands, f32 result); or the operands are FP8 (not
// both e5m2), each with a per-tensor f32 scale on the device, and the result bf16, f16 or f32.
// b is row-major [inner, cols], or stored transposed, [cols, inner] (b_transposed: column-major,
// as the transpose of a row-major array is laid out), which FP8 on cuBLASLt needs (the "TN"
// layout); FP8 matmuls accumulate in Hopper's fast mode (gemm.cc says why).
struct MatmulTypes {
  Dtype a = Dtype::kF32, b = Dtype::kF32, c = Dtype::kF32;
  const float* a_scale = nullptr;  // device scalars; nullptr: 1
  const float* b_scale = nullptr;
  bool b_transposed = false;
  static MatmulTypes Uniform(Dtype dtype) { return {dtype, dtype, dtype}; }
};

struct GemmProblem {
  const void* a;  // [rows, inner]
  const void* b;  // [inner, cols], or [cols, inner] when types.b_transposed
  void* c;        // [rows, cols]
  int64_t rows;
  int64_t inner;
  int64_t cols;
  MatmulTypes types;
  // [rows, cols] of c's dtype, added to the product in f32 before the one rounding (cuBLASLt's C
  // with beta = 1: the sum rides in the matmul's epilogue); nullptr: none. May not alias c.
  const void* accumulate = nullptr;
  // `batch` such products in one launch (the local experts of an expert block): product i reads
  // a + i * a_stride, b + i * b_stride and accumulate + i * c_stride and writes c + i * c_stride
  // (strides in elements of each operand's dtype; read only when batch > 1).
  int64_t batch = 1;
  int64_t a_stride = 0, b_stride = 0, c_stride = 0;
  // The distance in elements between consecutive rows of b as stored ([inner, cols], or [cols, inner]
  // when b_transposed) and of c and accumulate; 0: packed. A column slice of a wider matrix (the
  // column chunks of a reduce-scatter's block: exec/scatter.cc) has its full width here.
  int64_t b_ld = 0, c_ld = 0;
  int64_t BLd() const { return b_ld ? b_ld : (types.b_transposed ? inner : cols); }
  int64_t CLd() const { return c_ld ? c_ld : cols; }
};

// CPU reference loops.
void GemmHost(const GemmProblem& problem);

#ifdef FICCO_WITH_CUDA
struct GemmPlan;  // cuBLASLt descriptors and the chosen algorithm of one problem shape

// The cuBLASLt plans of one device, by (rows, inner, cols, batch and strides, dtypes, layout,
// alignments). Building a plan
// (descriptors, the heuristic's candidates, timing them once on the device) costs host time and
// one synchronisation; a chunked schedule runs the same few shapes on every call, so each is
// planned once. Thread-safe.
class GemmPlans {
 public:
  GemmPlans();
  ~GemmPlans();
  // cuBLASLt on `stream`. Returns the first failing status. While `stream` is being captured into a
  // CUDA graph (`capturing`) nothing may run or synchronise: a shape without a plan then takes the
  // heuristic's first algorithm, untimed and not kept, so that the next call run outside a capture
  // plans it as usual.
  cublasStatus_t Run(const GemmProblem& problem, cublasLtHandle_t handle, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream, bool capturing = false);

  struct Impl;  // gemm.cc

 private:
  Impl* impl_;
};
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_GEMM_H_
