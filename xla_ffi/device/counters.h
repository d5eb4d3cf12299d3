// The counter kernels of the calls that order themselves on the devices (transfer=symmetric,
// runtime/symmetric.h; Backend::CountCall, WaitCounter, PostCounter). One thread each: they move a
// few words, and what they cost is their launch (about 2 us of device time each inside a CUDA graph
// on one H200, 2026-12-01, where a stream memory operation cost about 3). Pure launchers: no FFI
// types.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_COUNTERS_H_
#define FICCO_JAX_XLA_FFI_DEVICE_COUNTERS_H_

#include <cstdint>

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>

namespace ficco {

// The most words one PostCounter kernel writes; more take several launches.
constexpr int kPostCounterWords = 16;

// ++*counter; then, where `mirror` is given, *mirror = *counter. Where `stopped` is given and nonzero
// it counts nothing and never returns (the watchdog reports the stream).
cudaError_t LaunchCountCall(uint32_t* counter, uint32_t* mirror, const uint32_t* stopped, cudaStream_t stream);
// Returns once *word == *counter + offset (the comparison made on the device, so a replayed graph
// compares the values of its own execution). Where `tag` is given, then compares *tag with *launch:
// if they differ, writes {slot + 1, *launch, *tag} into `parted` (in that order of visibility: the
// first word last) and never returns.
cudaError_t LaunchWaitCounter(const uint32_t* word, const uint32_t* counter, int32_t offset, const uint32_t* tag,
                              const uint32_t* launch, uint32_t* parted, int slot, cudaStream_t stream);
// *tag = *launch where `tag` is given; then, after a system-wide fence, *words[i] = *counter for
// i < count (count <= kPostCounterWords).
cudaError_t LaunchPostCounter(uint32_t* const* words, int count, const uint32_t* counter, uint32_t* tag,
                              const uint32_t* launch, cudaStream_t stream);

}  // namespace ficco

#endif  // FICCO_WITH_CUDA
#endif  // FICCO_JAX_XLA_FFI_DEVICE_COUNTERS_H_
