#include "device/stall.h"

namespace ficco {
namespace {

__global__ void SpinUntilSet(const volatile int* flag) {
  while (*flag == 0) __nanosleep(100000);
}

}  // namespace

cudaError_t LaunchSpinUntilSet(const int* flag, cudaStream_t stream) {
  SpinUntilSet<<<1, 1, 0, stream>>>(flag);
  return cudaGetLastError();
}

}  // namespace ficco
