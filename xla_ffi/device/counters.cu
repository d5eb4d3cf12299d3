// CUDA launchers of the counter kernels (see counters.h).
#include "device/counters.h"

namespace ficco {
namespace {

struct Words {
  uint32_t* at[kPostCounterWords];
};

__device__ __forceinline__ uint32_t Load(const uint32_t* word) { return *reinterpret_cast<const volatile uint32_t*>(word); }
__device__ __forceinline__ void Store(uint32_t* word, uint32_t value) { *reinterpret_cast<volatile uint32_t*>(word) = value; }

// A stopped site's call (runtime/symmetric.h) must not pair with its peers' calls: it posts itself
// started, counting nothing, and waits here for good, so that the watchdog reports the site and why
// it stopped.
__global__ void CountCallKernel(uint32_t* counter, uint32_t* mirror, const uint32_t* stopped) {
  if (stopped != nullptr && Load(stopped) != 0u) {
    if (mirror != nullptr) Store(mirror, Load(counter) + 1u);
    __threadfence_system();
    for (;;) __nanosleep(1 << 20);
  }
  const uint32_t value = Load(counter) + 1u;
  Store(counter, value);
  if (mirror != nullptr) {
    __threadfence_system();
    Store(mirror, value);
  }
}

// The peer that posts the word runs on another device: poll with a short sleep, which keeps the
// one thread off the memory system between reads. A tag of another launch than this rank's stops
// the stream for good (the watchdog reports `parted` at once): what landed is another launch's.
__global__ void WaitCounterKernel(const uint32_t* word, const uint32_t* counter, int32_t offset, const uint32_t* tag,
                                  const uint32_t* launch, uint32_t* parted, int slot) {
  const uint32_t want = Load(counter) + static_cast<uint32_t>(offset);
  while (Load(word) != want) __nanosleep(128);
  __threadfence_system();
  if (tag == nullptr) return;
  const uint32_t mine = Load(launch), theirs = Load(tag);
  if (mine == theirs) return;
  Store(parted + 1, mine);
  Store(parted + 2, theirs);
  __threadfence_system();
  Store(parted, static_cast<uint32_t>(slot) + 1u);
  __threadfence_system();
  for (;;) __nanosleep(1 << 20);
}

// The fence first: every write of this stream's earlier work (a copy's, a kernel's), and the tag, is
// visible to every device before a peer can see the word and read what it guards.
__global__ void PostCounterKernel(Words words, int count, const uint32_t* counter, uint32_t* tag,
                                  const uint32_t* launch) {
  if (tag != nullptr) Store(tag, Load(launch));
  __threadfence_system();
  const uint32_t value = Load(counter);
  for (int i = 0; i < count; ++i) Store(words.at[i], value);
  __threadfence_system();
}

}  // namespace

cudaError_t LaunchCountCall(uint32_t* counter, uint32_t* mirror, const uint32_t* stopped, cudaStream_t stream) {
  CountCallKernel<<<1, 1, 0, stream>>>(counter, mirror, stopped);
  return cudaGetLastError();
}

cudaError_t LaunchWaitCounter(const uint32_t* word, const uint32_t* counter, int32_t offset, const uint32_t* tag,
                              const uint32_t* launch, uint32_t* parted, int slot, cudaStream_t stream) {
  if (tag != nullptr && (launch == nullptr || parted == nullptr)) return cudaErrorInvalidValue;
  WaitCounterKernel<<<1, 1, 0, stream>>>(word, counter, offset, tag, launch, parted, slot);
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
