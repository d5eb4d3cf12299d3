#include "device/dma.h"

#include <climits>
#include <cstring>

namespace ficco {

void CopyPiecesHost(void* dst, const void* src, size_t bytes, int64_t pieces, int64_t pitch) {
  if (bytes == 0) return;
  for (int64_t i = 0; i < pieces; ++i) {
    std::memcpy(static_cast<char*>(dst) + i * pitch, static_cast<const char*>(src) + i * pitch, bytes);
  }
}

#ifdef FICCO_WITH_CUDA
cudaError_t CopyPiecesAsync(void* dst, const void* src, size_t bytes, int64_t pieces, int64_t pitch,
                            cudaStream_t stream) {
  if (bytes == 0 || pieces == 0) return cudaSuccess;
  if (pieces == 1 || static_cast<size_t>(pitch) == bytes) {
    return cudaMemcpyAsync(dst, src, bytes * pieces, cudaMemcpyDeviceToDevice, stream);
  }
  // A 2D copy's pitch may not exceed the device's limit (cudaDevAttrMaxPitch: 2^31 - 1 on Hopper).
  if (pitch <= INT_MAX) {
    return cudaMemcpy2DAsync(dst, pitch, src, pitch, bytes, pieces, cudaMemcpyDeviceToDevice, stream);
  }
  for (int64_t i = 0; i < pieces; ++i) {
    const cudaError_t status = cudaMemcpyAsync(static_cast<char*>(dst) + i * pitch,
                                               static_cast<const char*>(src) + i * pitch, bytes,
                                               cudaMemcpyDeviceToDevice, stream);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}
#endif

}  // namespace ficco
