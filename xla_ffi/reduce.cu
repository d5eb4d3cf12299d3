// CUDA launcher of the reduce-scatter sum (see reduce.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "reduce.h"

namespace ficco {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__global__ void ReduceSumKernel(T* out, const T* own, const T* recv, int64_t slot_stride,
                                int64_t num_slots, int64_t count) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step) {
    float sum = ToFloat(own[i]);
    for (int64_t s = 0; s < num_slots; ++s) sum += ToFloat(recv[s * slot_stride + i]);
    out[i] = FromFloat<T>(sum);
  }
}

template <typename T>
cudaError_t Launch(const ReduceProblem& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // Enough blocks to fill an H100/H200 a few times over; the grid-stride loop covers the rest.
  const int64_t wanted = (p.count + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 1056 ? wanted : 1056);
  ReduceSumKernel<T><<<blocks, kThreads, 0, stream>>>(
      static_cast<T*>(p.out), static_cast<const T*>(p.own), static_cast<const T*>(p.recv),
      p.slot_stride, p.num_slots, p.count);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchReduceSum(const ReduceProblem& p, cudaStream_t stream) {
  switch (p.dtype) {
    case Dtype::kF32: return Launch<float>(p, stream);
    case Dtype::kBF16: return Launch<__nv_bfloat16>(p, stream);
    case Dtype::kF16: return Launch<__half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ficco
