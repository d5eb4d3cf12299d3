// The group channels: how the copy-engine calls of a group inside one process run without meeting
// on the host at every call.
//
// A call that meets (call_session.h) posts this execution's buffer pointers and events, because XLA
// may hand a call site other buffers at every execution and because an event's record can only be
// waited for once the waiter knows the record was made. A channel removes both reasons for the
// calls that compute small data for their peers (at most config.CHANNEL_BYTES, 0 by default: off):
// each rank of the group owns a region of its device's memory, exchanged once, and the ranks order
// their copies with words, 32-bit counters in pinned host memory that every device reads and writes
// with the driver's stream memory operations. The k-th call of a group on its channel (every rank
// counts its own calls, and the ranks of a group make the same calls in the same order) then runs as:
//
//   owner r, XLA's stream : wait done[r][t] >= k-1, every reader t | piece -> region r | ready[r][t][piece] = k
//   reader t, copy stream :          wait ready[r][t][piece] >= k | pull from region r | done[r][t] = k
//
// done[r][t] >= k-1 says that t finished pulling r's data of the previous call, so r may overwrite
// its region; ready[r][t][piece] >= k says that this call's piece is in it. A word only ever grows,
// by the work it stands for; nothing else writes it. So a wait passes only for the data it guards,
// never early.
//
// A device never waits for work that a host has yet to enqueue: a rank enqueues its wait for a
// peer's word only once the peer's host has enqueued the write (ChannelGeneration::Published and
// Released, counters the hosts set and read without locks). Without that rule the calls stopped on
// 2 x H100: a device waited for a peer's word while its own host thread sat in a call that waits for
// the device (a matmul plan's timing, a module loaded on first launch), and the peer's host, which
// was to enqueue the word, waited for that thread. With it, a channel orders copies as events do,
// and the host waits are one-sided: a reader waits until each owner has enqueued its data's words,
// an owner until each reader enqueued the end of its pulls of the previous call (usually long
// done). Every call also enqueues the words its peers wait for before its own waits for theirs (the
// owner's steps come first in each executor), so a device whose streams all feed one hardware queue
// (CUDA_DEVICE_MAX_CONNECTIONS=1) never waits for a word that work behind the wait would set.
//
// Only data a call computes for its peers (matmul_rs's and matmul_a2a's send partials) goes through
// a channel: its matmuls write it into the region in place. An input XLA owns (the gathers', the
// all-to-alls', reduce_scatter's) would first be copied there on XLA's stream, and on 2 x H100 that
// copy cost more host time than the meetings it saved (ag_matmul [512, 1024] @ [1024, 1024], c1: a
// handler took 58.8 us per call on a channel, 53.2 with meetings; docs/design.md): those calls meet.
//
// A peer that fails or never comes is noticed on the host: the ranks that wait for it to enqueue
// its words give up after the call's timeout (config.RENDEZVOUS_TIMEOUT_S) with an error that names
// it, as a meeting does. A rank whose call fails retires the channel's generation; its peers' calls
// of the same launch that enter the channel after that fail at once, naming the rank and its error.
// The group's calls of the next launch make a new generation (fresh regions and words) in a meeting
// keyed by that launch, so ranks still inside the failed launch cannot pair with ranks in the next
// one. A device whose peer stops after enqueueing its writes but before its device reaches them (a
// stuck device) waits until the watchdog reports the word, its value and the value awaited.
//
// Words and regions are never freed: a retired generation's may still be read by work in flight. A
// group keeps one region per device of at most config.CHANNEL_BYTES, plus one per generation that a
// failure or a larger call retired.
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_CHANNEL_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ficco {

struct Post;

// The most pieces (events) one exposure may have on a channel; a call with more meets instead.
constexpr int64_t kChannelMaxPieces = 64;

// One generation of a group's channel, made by one meeting of the group.
class ChannelGeneration {
 public:
  // `regions[r]`: rank r's region of `capacity` bytes; `words`: WordCount(n) zeroed words.
  ChannelGeneration(int64_t number, int64_t capacity, std::vector<char*> regions, uint32_t* words);
  static int64_t WordCount(int n) { return int64_t{n} * n * (kChannelMaxPieces + 1); }

  int64_t number() const { return number_; }
  int64_t capacity() const { return capacity_; }
  char* Region(int rank) const { return regions_[rank]; }
  // Set by `owner`'s device once piece `piece` of its data for `reader` is in its region.
  uint32_t* Ready(int owner, int reader, int64_t piece) const {
    return words_ + (int64_t{owner} * n_ + reader) * kChannelMaxPieces + piece;
  }
  // Set by `reader`'s device once it has pulled everything of `owner`'s region it reads.
  uint32_t* Done(int owner, int reader) const {
    return words_ + int64_t{n_} * n_ * kChannelMaxPieces + int64_t{owner} * n_ + reader;
  }

  // Counts one more call of `rank` and returns its number (1, 2, ...).
  // 64-bit: the first call of a generation (1) is the one that waits for no reader, and a 32-bit
  // count would come back to 1 after 2^32 calls. The words carry its low 32 bits (WordReached
  // compares them modulo 2^32).
  uint64_t NextCall(int rank) { return calls_[rank].fetch_add(1, std::memory_order_relaxed) + 1; }

  // What each rank's host has enqueued so far, by call number: every ready word of its data
  // (Published), and every done word of its pulls (Released). A rank enqueues a wait for a peer's
  // word only once the peer's host has enqueued the write it waits for, so that no device ever
  // waits for work a host has yet to enqueue.
  std::atomic<uint32_t>& Published(int rank) { return published_[rank]; }
  std::atomic<uint32_t>& Released(int rank) { return released_[rank]; }
  // The host's check that the ranks run the same op at call `call`, without waiting: each rank
  // notes its signature's hash, then compares it with the note of every peer that already made
  // that call (the second of two ranks to arrive sees the first's note). Returns the first rank
  // whose note differs, or -1.
  int CheckSignature(int rank, uint32_t call, uint32_t hash);

  bool retired() const { return retired_.load(std::memory_order_acquire); }
  void Retire() { retired_.store(true, std::memory_order_release); }

 private:
  static constexpr int kSignatureRing = 64;
  const int64_t number_;
  const int64_t capacity_;
  const int n_;
  const std::vector<char*> regions_;
  uint32_t* const words_;
  std::unique_ptr<std::atomic<uint64_t>[]> calls_;
  std::unique_ptr<std::atomic<uint32_t>[]> published_, released_;
  std::unique_ptr<std::atomic<uint64_t>[]> signatures_;  // [rank][call % kSignatureRing]: (call << 32) | hash
  std::atomic<bool> retired_{false};
};

// The channel of one group (its devices in rank order): its current generation.
class Channel {
 public:
  std::shared_ptr<ChannelGeneration> Current();
  // The generation `number` made by a setup meeting from its posts (each rank's region, rank 0's
  // words), installed by the first rank of the group to get here; the others get the same one.
  std::shared_ptr<ChannelGeneration> Install(int64_t number, int64_t capacity, const std::vector<Post>& posts);
  // Retires the current generation: rank `rank`'s call in launch `run_id` failed with `why`. The
  // group's calls of a later launch make a new generation.
  void Retire(int64_t run_id, int rank, const std::string& why);
  // Why the current generation was retired ("rank 1 failed: ..."), and in which launch; "" if it was not.
  std::string Retired(int64_t* run_id);

 private:
  std::mutex mu_;
  std::shared_ptr<ChannelGeneration> current_;
  int64_t retired_run_ = 0;
  std::string retired_why_;
};

// The process's channels, one per group (by its device ordinals in rank order).
class Channels {
 public:
  Channel& Of(const std::vector<int>& group);
  // The group's channel if it has one, else nullptr.
  Channel* Find(const std::vector<int>& group);

 private:
  std::mutex mu_;
  std::map<std::vector<int>, std::unique_ptr<Channel>> channels_;
};

// A 32-bit hash of a call's signature, for ChannelGeneration::CheckSignature.
uint32_t SignatureHash(const std::vector<int64_t>& signature);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_CHANNEL_H_
