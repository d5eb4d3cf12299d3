#include "runtime/channel.h"

#include "runtime/registry.h"

namespace ficco {

ChannelGeneration::ChannelGeneration(int64_t number, int64_t capacity, std::vector<char*> regions, uint32_t* words)
    : number_(number), capacity_(capacity), n_(static_cast<int>(regions.size())), regions_(std::move(regions)),
      words_(words), calls_(new std::atomic<uint64_t>[n_]), published_(new std::atomic<uint32_t>[n_]),
      released_(new std::atomic<uint32_t>[n_]), signatures_(new std::atomic<uint64_t>[n_ * kSignatureRing]) {
  for (int rank = 0; rank < n_; ++rank) {
    calls_[rank].store(0, std::memory_order_relaxed);
    published_[rank].store(0, std::memory_order_relaxed);
    released_[rank].store(0, std::memory_order_relaxed);
  }
  for (int i = 0; i < n_ * kSignatureRing; ++i) signatures_[i].store(0, std::memory_order_relaxed);
}

int ChannelGeneration::CheckSignature(int rank, uint32_t call, uint32_t hash) {
  const uint64_t mine = (uint64_t{call} << 32) | hash;
  const int slot = static_cast<int>(call % kSignatureRing);
  signatures_[rank * kSignatureRing + slot].store(mine, std::memory_order_seq_cst);
  for (int peer = 0; peer < n_; ++peer) {
    if (peer == rank) continue;
    const uint64_t theirs = signatures_[peer * kSignatureRing + slot].load(std::memory_order_seq_cst);
    if ((theirs >> 32) == call && theirs != mine) return peer;
  }
  return -1;
}

std::shared_ptr<ChannelGeneration> Channel::Current() {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

std::shared_ptr<ChannelGeneration> Channel::Install(int64_t number, int64_t capacity, const std::vector<Post>& posts) {
  std::lock_guard<std::mutex> lock(mu_);
  if (current_ != nullptr && current_->number() == number) return current_;
  std::vector<char*> regions;
  for (const Post& post : posts) regions.push_back(static_cast<char*>(const_cast<void*>(post.buffer)));
  current_ = std::make_shared<ChannelGeneration>(number, capacity, std::move(regions), posts[0].words);
  return current_;
}

void Channel::Retire(int64_t run_id, int rank, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (current_ == nullptr || current_->retired()) return;
  current_->Retire();
  retired_run_ = run_id;
  retired_why_ = "rank " + std::to_string(rank) + " failed: " + why;
}

std::string Channel::Retired(int64_t* run_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (current_ == nullptr || !current_->retired()) return "";
  *run_id = retired_run_;
  return retired_why_;
}

Channel& Channels::Of(const std::vector<int>& group) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<Channel>& channel = channels_[group];
  if (channel == nullptr) channel = std::make_unique<Channel>();
  return *channel;
}

Channel* Channels::Find(const std::vector<int>& group) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = channels_.find(group);
  return it == channels_.end() ? nullptr : it->second.get();
}

uint32_t SignatureHash(const std::vector<int64_t>& signature) {
  uint32_t hash = 2166136261u;  // FNV-1a over the words' bytes
  for (int64_t word : signature) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= static_cast<uint32_t>((static_cast<uint64_t>(word) >> (8 * byte)) & 0xff);
      hash *= 16777619u;
    }
  }
  return hash;
}

}  // namespace ficco
