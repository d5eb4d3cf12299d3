#include "dma.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace ficco {

void CopyChunkHost(void* dst, const void* src, size_t bytes) {
  if (bytes != 0) std::memcpy(dst, src, bytes);
}

#ifdef FICCO_WITH_CUDA
namespace {

// cudaMemcpyBatchAsync (CUDA 12.8+) takes a hint that plain cudaMemcpyAsync cannot: prefer a copy
// engine, so that the copy overlaps kernels, over the driver's choice, which may copy between
// two buffers of one GPU with SM kernels. Those wait for free SMs: on 2 x H200 across processes
// (session 5) the staging copy of x (64 MiB, same GPU) only started when ag_matmul's own-shard
// matmul freed its SMs, ~0.35 ms late, every call.
#if CUDART_VERSION >= 12080
cudaError_t BatchCopy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  cudaMemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  void* dsts[1] = {dst};
  size_t sizes[1] = {bytes};
  size_t first[1] = {0};
#if CUDART_VERSION >= 13000
  const void* srcs[1] = {src};
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, first, 1, stream);
#else
  void* srcs[1] = {const_cast<void*>(src)};
  size_t failed = 0;
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, first, 1, &failed, stream);
#endif
}
#endif

// Set when the driver refused a batch copy (too old for the call, or the pointers): from then on
// every copy is a plain cudaMemcpyAsync, which the executor ran before this hint existed.
std::atomic<bool> batch_refused{false};

}  // namespace

CopyApi ActiveCopyApi() {
#if CUDART_VERSION >= 12080
  static const CopyApi api = [] {
    const char* choice = std::getenv("FICCO_COPY_API");
    return (choice != nullptr && std::strcmp(choice, "memcpy") == 0) ? CopyApi::kMemcpy : CopyApi::kBatchPreferCopyEngine;
  }();
  return batch_refused.load(std::memory_order_relaxed) ? CopyApi::kMemcpy : api;
#else
  return CopyApi::kMemcpy;
#endif
}

const char* CopyApiName(CopyApi api) {
  return api == CopyApi::kBatchPreferCopyEngine ? "cudaMemcpyBatchAsync(PreferOverlapWithCompute)" : "cudaMemcpyAsync";
}

cudaError_t CopyChunkAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
#if CUDART_VERSION >= 12080
  if (ActiveCopyApi() == CopyApi::kBatchPreferCopyEngine) {
    const cudaError_t status = BatchCopy(dst, src, bytes, stream);
    if (status != cudaErrorNotSupported && status != cudaErrorInvalidValue && status != cudaErrorCallRequiresNewerDriver) {
      return status;
    }
    (void)cudaGetLastError();  // the refusal is not sticky: clear it and copy the old way
    batch_refused.store(true, std::memory_order_relaxed);
  }
#endif
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}
#endif

}  // namespace ficco
