#include "device/dma.h"

#include <cstring>

namespace ficco {

void CopyChunkHost(void* dst, const void* src, size_t bytes) {
  if (bytes != 0) std::memcpy(dst, src, bytes);
}

#ifdef FICCO_WITH_CUDA
cudaError_t CopyChunkAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}
#endif

}  // namespace ficco
