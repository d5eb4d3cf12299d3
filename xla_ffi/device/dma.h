// Chunk transfers: byte ranges from a peer's buffer into a local one (or the other way round).
// Pure launchers: no FFI types, no ordering logic (the executor owns ordering).
#ifndef FICCO_JAX_XLA_FFI_DEVICE_DMA_H_
#define FICCO_JAX_XLA_FFI_DEVICE_DMA_H_

#include <cstddef>
#include <cstdint>

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ficco {

// `pieces` runs of `bytes` each, run i from src + i * pitch into dst + i * pitch (pitch >= bytes).
// CPU: synchronous copies (host memory of all virtual CPU devices is one address space).
void CopyPiecesHost(void* dst, const void* src, size_t bytes, int64_t pieces, int64_t pitch);

#ifdef FICCO_WITH_CUDA
// CUDA: one asynchronous device-to-device copy on `stream` (a copy stream of the destination
// device): a contiguous one where the runs touch or there is one, else a 2D copy (the same chunk
// of every group of an expert block, one submission instead of one per group). With unified
// addressing and peer access the copy engine reads the peer's memory directly over NVLink; no SM is
// used. Copies within one GPU are another matter: they behaved as SM work on 2 x H200 (beside a
// matmul they started only as its last wave drained; alone, 64 MiB took 31 us, about 4 TB/s of HBM
// traffic), and cudaMemcpyBatchAsync's hint to prefer a copy engine
// (cudaMemcpyFlagPreferOverlapWithCompute) changed nothing measurable, so it is not used; the
// executor keeps such copies off the matmuls' way instead (CallSession::Stage).
cudaError_t CopyPiecesAsync(void* dst, const void* src, size_t bytes, int64_t pieces, int64_t pitch,
                            cudaStream_t stream);
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_DMA_H_
