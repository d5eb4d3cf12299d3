// The counter kernels of the calls that order themselves on the devices (transfer=symmetric,
// runtime/symmetric.h; Backend::CountCall, WaitCounters, PostCounter). One thread each: they move a
// few words, and what they cost is their launch (about 2 us of device time each inside a CUDA graph
// on one H200, 2026-12-01, where a stream memory operation cost about 3), so a call's waits go into as
// few kernels as its order allows: a call's count with its sends' waits for their slots, one
// stream's waits in one kernel, a small reduce-scatter sum's waits for its partials in the sum's
// kernel (device/reduce.h). Pure launchers: no FFI types.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_COUNTERS_H_
#define FICCO_JAX_XLA_FFI_DEVICE_COUNTERS_H_

#include <cstdint>

#ifdef FICCO_WITH_CUDA
#include <cuda_runtime_api.h>

namespace ficco {

// The most words one PostCounter kernel writes, and one wait list waits for; more take several launches.
constexpr int kPostCounterWords = 16;
constexpr int kCounterWaitWords = 16;

// The waits of one kernel, as it takes them (by value): until *word[i] == *counter + offset[i], for
// i < count; then, where tag[i] is given, *tag[i] must equal *launch, else the kernel writes
// {slot[i] + 1, *launch, *tag[i]} into `parted` (in that order of visibility: the first word last) and
// never returns (the watchdog reports it at once).
struct CounterWaitList {
  const uint32_t* counter = nullptr;
  int count = 0;
  const uint32_t* word[kCounterWaitWords] = {};
  int32_t offset[kCounterWaitWords] = {};
  const uint32_t* tag[kCounterWaitWords] = {};
  int slot[kCounterWaitWords] = {};
  const uint32_t* launch = nullptr;
  uint32_t* parted = nullptr;
};

// ++*counter; then, where `mirror` is given, *mirror = *counter; then the waits of `then` (its
// counter is `counter`; null: none). Where `stopped` is given and nonzero it counts nothing and never
// returns (the watchdog reports the stream).
cudaError_t LaunchCountCall(uint32_t* counter, uint32_t* mirror, const uint32_t* stopped,
                            const CounterWaitList* then, cudaStream_t stream);
// Returns once the waits of `waits` are met (the comparisons made on the device, so a replayed graph
// compares the values of its own execution).
cudaError_t LaunchWaitCounters(const CounterWaitList& waits, cudaStream_t stream);
// Whether a launcher takes `list`: at most kCounterWaitWords waits, each with its word, and a launch
// and a parted where a tag is given.
bool ValidWaitList(const CounterWaitList& list);
// *tag = *launch where `tag` is given; then, after a system-wide fence, *words[i] = *counter for
// i < count (count <= kPostCounterWords).
cudaError_t LaunchPostCounter(uint32_t* const* words, int count, const uint32_t* counter, uint32_t* tag,
                              const uint32_t* launch, cudaStream_t stream);

}  // namespace ficco

#endif  // FICCO_WITH_CUDA
#endif  // FICCO_JAX_XLA_FFI_DEVICE_COUNTERS_H_
