// CUDA launcher of the reduce-scatter sum (see reduce.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "device/counter_waits.cuh"
#include "device/reduce.h"

namespace ficco {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }

// Elements [first, count) with stride `step`, one at a time: the scalar kernel's whole range and the
// vector kernel's tail.
template <typename T>
__device__ __forceinline__ void SumElements(T* out, const T* own, const T* recv, int64_t slot_stride,
                                            int64_t num_slots, int64_t first, int64_t count, int64_t step) {
  for (int64_t i = first; i < count; i += step) {
    float sum = ToFloat(own[i]);
    for (int64_t s = 0; s < num_slots; ++s) sum += ToFloat(recv[s * slot_stride + i]);
    out[i] = FromFloat<T>(sum);
  }
}

// Every block first waits for the partials to land (a symmetric call's words, device/counters.h):
// one thread polls, the block's barrier holds the others until then. Such a grid must never fill the
// device: what it waits for may need a kernel of this very device first (this call's own posts to its
// peers, one-thread kernels on its copy streams, which the peers' sums wait for in turn), and a grid
// whose waiting blocks held every SM would leave it no room: a deadlock across the group. So a sum
// waits in its own kernel only with at most kWaitingBlocks blocks (under one block per SM on an H100
// or H200, a small part of what the device holds): the small sums, where a wait kernel's launch is a
// large part of the cost. A larger sum waits in a kernel of its own first, as before.
constexpr int kWaitingBlocks = 64;
__device__ __forceinline__ void AwaitPartials(NoWaits) {}
__device__ __forceinline__ void AwaitPartials(const CounterWaitList& waits) {
  if (threadIdx.x == 0) AwaitCounters(waits);
  __syncthreads();
}

// One element per thread and step: any alignment and stride.
template <typename T, typename Waits>
__global__ void ReduceSumKernel(T* out, const T* own, const T* recv, int64_t slot_stride,
                                int64_t num_slots, int64_t count, Waits waits) {
  AwaitPartials(waits);
  SumElements(out, own, recv, slot_stride, num_slots, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
              count, static_cast<int64_t>(gridDim.x) * blockDim.x);
}

// 16 bytes per thread and step (8 bf16/f16 or 4 f32), for 16-byte aligned operands whose slot
// stride keeps every slot aligned; the last count % V elements by the scalar loop. The scalar
// kernel (2-byte loads) reached ~1.4 TB/s on an H200 (0.137 ms for 192 MiB), far below
// HBM's bandwidth, and matmul_rs waits for this sum at its end.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kLanes = 16 / sizeof(T);
  T v[kLanes];
};

template <typename T, typename Waits>
__global__ void ReduceSumVectorKernel(T* out, const T* own, const T* recv, int64_t slot_stride,
                                      int64_t num_slots, int64_t count, Waits waits) {
  AwaitPartials(waits);
  constexpr int V = Pack<T>::kLanes;
  const int64_t packs = count / V;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const Pack<T>* own_p = reinterpret_cast<const Pack<T>*>(own);
  Pack<T>* out_p = reinterpret_cast<Pack<T>*>(out);
  for (int64_t i = first; i < packs; i += step) {
    const Pack<T> a = own_p[i];
    float sum[V];
#pragma unroll
    for (int k = 0; k < V; ++k) sum[k] = ToFloat(a.v[k]);
    for (int64_t s = 0; s < num_slots; ++s) {
      const Pack<T> b = reinterpret_cast<const Pack<T>*>(recv + s * slot_stride)[i];
#pragma unroll
      for (int k = 0; k < V; ++k) sum[k] += ToFloat(b.v[k]);
    }
    Pack<T> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = FromFloat<T>(sum[k]);
    out_p[i] = o;
  }
  SumElements(out, own, recv, slot_stride, num_slots, packs * V + first, count, step);
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// An empty sum still makes its waits.
cudaError_t WaitOnly(NoWaits, cudaStream_t) { return cudaSuccess; }
cudaError_t WaitOnly(const CounterWaitList& waits, cudaStream_t stream) { return LaunchWaitCounters(waits, stream); }

template <typename T, typename Waits>
cudaError_t Launch(const ReduceProblem& p, const Waits& waits, cudaStream_t stream) {
  if (p.count == 0) return WaitOnly(waits, stream);
  constexpr int kThreads = 256;
  constexpr int V = Pack<T>::kLanes;
  const bool vector = Aligned16(p.out) && Aligned16(p.own) && Aligned16(p.recv) &&
                      (p.num_slots <= 1 || p.slot_stride % V == 0);
  // Enough blocks to fill an H100/H200 a few times over; the grid-stride loop covers the rest.
  const int64_t per_thread = vector ? V : 1;
  const int64_t wanted = (p.count / per_thread + kThreads) / kThreads;
  const int blocks = static_cast<int>(wanted < 1056 ? (wanted < 1 ? 1 : wanted) : 1056);
  if constexpr (std::is_same_v<Waits, CounterWaitList>) {
    if (blocks > kWaitingBlocks) {
      const cudaError_t waited = LaunchWaitCounters(waits, stream);
      return waited != cudaSuccess ? waited : Launch<T>(p, NoWaits{}, stream);
    }
  }
  if (vector) {
    ReduceSumVectorKernel<T, Waits><<<blocks, kThreads, 0, stream>>>(
        static_cast<T*>(p.out), static_cast<const T*>(p.own), static_cast<const T*>(p.recv),
        p.slot_stride, p.num_slots, p.count, waits);
  } else {
    ReduceSumKernel<T, Waits><<<blocks, kThreads, 0, stream>>>(
        static_cast<T*>(p.out), static_cast<const T*>(p.own), static_cast<const T*>(p.recv),
        p.slot_stride, p.num_slots, p.count, waits);
  }
  return cudaGetLastError();
}

template <typename Waits>
cudaError_t LaunchTyped(const ReduceProblem& p, const Waits& waits, cudaStream_t stream) {
  switch (p.dtype) {
    case Dtype::kF32: return Launch<float>(p, waits, stream);
    case Dtype::kBF16: return Launch<__nv_bfloat16>(p, waits, stream);
    case Dtype::kF16: return Launch<__half>(p, waits, stream);
    case Dtype::kF8E4M3:
    case Dtype::kF8E5M2: break;  // partials are never FP8 (MatmulTypes)
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchReduceSum(const ReduceProblem& p, const CounterWaitList* waits, cudaStream_t stream) {
  if (waits == nullptr || waits->count == 0) return LaunchTyped(p, NoWaits{}, stream);
  if (!ValidWaitList(*waits)) return cudaErrorInvalidValue;
  return LaunchTyped(p, *waits, stream);
}

}  // namespace ficco
