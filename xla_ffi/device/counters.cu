// CUDA launchers of the counter kernels (see counters.h).
#include "device/counter_waits.cuh"
#include "device/counters.h"

namespace ficco {
namespace {

struct Words {
  uint32_t* at[kPostCounterWords];
};

// A stopped site's call (runtime/symmetric.h) must not pair with its peers' calls: it posts itself
// started, counting nothing, and waits here for good, so that the watchdog reports the site and why
// it stopped.
template <typename Waits>
__global__ void CountCallKernel(uint32_t* counter, uint32_t* mirror, const uint32_t* stopped, Waits then) {
  if (stopped != nullptr && LoadWord(stopped) != 0u) {
    if (mirror != nullptr) StoreWord(mirror, LoadWord(counter) + 1u);
    __threadfence_system();
    StopHere();
  }
  const uint32_t value = LoadWord(counter) + 1u;
  StoreWord(counter, value);
  if (mirror != nullptr) {
    __threadfence_system();
    StoreWord(mirror, value);
  }
  AwaitCounters(then);
}

__global__ void WaitCountersKernel(CounterWaitList waits) { AwaitCounters(waits); }

// The fence first: every write of this stream's earlier work (a copy's, a kernel's), and the tag, is
// visible to every device before a peer can see the word and read what it guards.
__global__ void PostCounterKernel(Words words, int count, const uint32_t* counter, uint32_t* tag,
                                  const uint32_t* launch) {
  if (tag != nullptr) StoreWord(tag, LoadWord(launch));
  __threadfence_system();
  const uint32_t value = LoadWord(counter);
  for (int i = 0; i < count; ++i) StoreWord(words.at[i], value);
  __threadfence_system();
}

}  // namespace

bool ValidWaitList(const CounterWaitList& list) {
  if (list.count < 0 || list.count > kCounterWaitWords || (list.count > 0 && list.counter == nullptr)) return false;
  for (int i = 0; i < list.count; ++i) {
    if (list.word[i] == nullptr) return false;
    if (list.tag[i] != nullptr && (list.launch == nullptr || list.parted == nullptr)) return false;
  }
  return true;
}

cudaError_t LaunchCountCall(uint32_t* counter, uint32_t* mirror, const uint32_t* stopped,
                            const CounterWaitList* then, cudaStream_t stream) {
  if (then == nullptr || then->count == 0) {
    CountCallKernel<<<1, 1, 0, stream>>>(counter, mirror, stopped, NoWaits{});
  } else if (ValidWaitList(*then)) {
    CountCallKernel<<<1, 1, 0, stream>>>(counter, mirror, stopped, *then);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchWaitCounters(const CounterWaitList& waits, cudaStream_t stream) {
  if (!ValidWaitList(waits)) return cudaErrorInvalidValue;
  if (waits.count == 0) return cudaSuccess;
  WaitCountersKernel<<<1, 1, 0, stream>>>(waits);
  return cudaGetLastError();
}

cudaError_t LaunchPostCounter(uint32_t* const* words, int count, const uint32_t* counter, uint32_t* tag,
                              const uint32_t* launch, cudaStream_t stream) {
  if (count < 0 || count > kPostCounterWords || (tag != nullptr && launch == nullptr)) return cudaErrorInvalidValue;
  Words packed{};
  for (int i = 0; i < count; ++i) packed.at[i] = words[i];
  PostCounterKernel<<<1, 1, 0, stream>>>(packed, count, counter, tag, launch);
  return cudaGetLastError();
}

}  // namespace ficco
