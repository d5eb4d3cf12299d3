// The device side of a counter wait list (device/counters.h), for every kernel that waits before its
// work: the counter kernels and the reduce-scatter sum (device/reduce.cu).
#ifndef FICCO_JAX_XLA_FFI_DEVICE_COUNTER_WAITS_CUH_
#define FICCO_JAX_XLA_FFI_DEVICE_COUNTER_WAITS_CUH_

#include "device/counters.h"

namespace ficco {

__device__ __forceinline__ uint32_t LoadWord(const uint32_t* word) {
  return *reinterpret_cast<const volatile uint32_t*>(word);
}
__device__ __forceinline__ void StoreWord(uint32_t* word, uint32_t value) {
  *reinterpret_cast<volatile uint32_t*>(word) = value;
}

// Never returns: what it waits for never comes, or must not be taken (the watchdog reports it).
__device__ __forceinline__ void StopHere() {
  for (;;) __nanosleep(1 << 20);
}

// A kernel's waits where it has none: its parameters stay as small as without the lists (a graph
// node's launch cost grows with them).
struct NoWaits {};
__device__ __forceinline__ void AwaitCounters(NoWaits) {}

// One thread: returns once every wait of `list` is met. The peers that post the words run on other
// devices: poll with a short sleep, which keeps the thread off the memory system between reads. A
// tag of another launch than this rank's stops the stream for good (the watchdog reports `parted` at
// once): what landed is another launch's. The fence after the words orders the reads of what they
// guard (the caller's threads read it after a barrier, or in a later kernel).
__device__ __forceinline__ void AwaitCounters(const CounterWaitList& list) {
  if (list.count == 0) return;
  const uint32_t counter = LoadWord(list.counter);
  for (int i = 0; i < list.count; ++i) {
    const uint32_t want = counter + static_cast<uint32_t>(list.offset[i]);
    while (LoadWord(list.word[i]) != want) __nanosleep(128);
  }
  __threadfence_system();
  for (int i = 0; i < list.count; ++i) {
    if (list.tag[i] == nullptr) continue;
    const uint32_t mine = LoadWord(list.launch), theirs = LoadWord(list.tag[i]);
    if (mine == theirs) continue;
    StoreWord(list.parted + 1, mine);
    StoreWord(list.parted + 2, theirs);
    __threadfence_system();
    StoreWord(list.parted, static_cast<uint32_t>(list.slot[i]) + 1u);
    __threadfence_system();
    StopHere();
  }
}

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_COUNTER_WAITS_CUH_
