// Chunk transfers: one contiguous byte range from a peer's buffer into a local one.
// Pure launchers: no FFI types, no ordering logic (the executor owns ordering).
#ifndef FICCO_JAX_XLA_FFI_DEVICE_DMA_H_
#define FICCO_JAX_XLA_FFI_DEVICE_DMA_H_

#include <cstddef>

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ficco {

// CPU: a synchronous copy (host memory of all virtual CPU devices is one address space).
void CopyChunkHost(void* dst, const void* src, size_t bytes);

#ifdef FICCO_WITH_CUDA
// CUDA: an asynchronous device-to-device copy on `stream` (a copy stream of the destination
// device). With unified addressing and peer access the copy engine reads the peer's memory
// directly over NVLink; no SM is used. Copies within one GPU are another matter: they behaved as
// SM work on 2 x H200 (beside a matmul they started only as its last wave drained; alone,
// 64 MiB took 31 us, about 4 TB/s of HBM traffic), and cudaMemcpyBatchAsync's hint to prefer a copy engine
// (cudaMemcpyFlagPreferOverlapWithCompute) changed nothing measurable, so it is not used; the
// executor keeps such copies off the matmuls' way instead (CallSession::Stage).
cudaError_t CopyChunkAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream);
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_DMA_H_
