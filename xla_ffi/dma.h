// Chunk transfers: one contiguous byte range from a peer's buffer into a local one.
// Pure launchers: no FFI types, no ordering logic (the executor owns ordering).
#ifndef FICCO_JAX_XLA_FFI_DMA_H_
#define FICCO_JAX_XLA_FFI_DMA_H_

#include <cstddef>

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ficco {

// CPU: a synchronous copy (host memory of all virtual CPU devices is one address space).
void CopyChunkHost(void* dst, const void* src, size_t bytes);

#ifdef FICCO_WITH_CUDA
// How CopyChunkAsync enqueues: cudaMemcpyBatchAsync with the hint to prefer a copy engine (the
// default where the runtime has it, CUDA 12.8+), or plain cudaMemcpyAsync (FICCO_COPY_API=memcpy,
// read once; older runtimes). The choice is the driver's either way: the hint can be ignored.
enum class CopyApi { kMemcpy, kBatchPreferCopyEngine };
CopyApi ActiveCopyApi();
const char* CopyApiName(CopyApi api);

// CUDA: an asynchronous device-to-device copy on `stream` (a copy stream of the destination
// device). With unified addressing and peer access the copy engine reads the peer's memory
// directly over NVLink; no SM is used. Copies within one GPU (the staging copies across
// processes, own rows) are where the driver may use SM kernels instead: hence the hint above.
cudaError_t CopyChunkAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream);
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DMA_H_
