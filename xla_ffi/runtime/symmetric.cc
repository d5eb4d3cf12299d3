#include "runtime/symmetric.h"

#include <utility>

namespace ficco {

SymmetricSite::SymmetricSite(int n, int64_t chunks, int64_t slot_bytes, std::vector<char*> bases)
    : n_(n), chunks_(chunks), slot_bytes_(slot_bytes), bases_(std::move(bases)), watches_(n) {}

void SymmetricSite::SetWatch(int rank, Watch watch) {
  std::lock_guard<std::mutex> lock(mu_);
  watches_[rank] = watch;
}

SymmetricSite::Watch SymmetricSite::WatchOf(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return watches_[rank];
}

void SymmetricSite::Fail(int rank, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.empty()) failed_ = "rank " + std::to_string(rank) + " failed: " + why;
}

std::string SymmetricSite::Failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

std::shared_ptr<SymmetricSite> SymmetricSites::Find(int64_t op_id, const std::vector<int>& group) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = sites_.find({op_id, group});
  return found == sites_.end() ? nullptr : found->second;
}

std::shared_ptr<SymmetricSite> SymmetricSites::Install(int64_t op_id, const std::vector<int>& group, int64_t chunks,
                                                       int64_t slot_bytes, std::vector<char*> bases) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<SymmetricSite>& site = sites_[{op_id, group}];
  if (site == nullptr) {
    site = std::make_shared<SymmetricSite>(static_cast<int>(group.size()), chunks, slot_bytes, std::move(bases));
  }
  return site;
}

SymmetricCall::SymmetricCall(const OpConfig& config, std::shared_ptr<SymmetricSite> site, bool per_chunk)
    : config_(config), site_(std::move(site)), per_chunk_(per_chunk) {}

ffi::Error SymmetricCall::Begin(Backend& backend) const {
  return backend.CountCall(Backend::kCompute, site_->Epoch(config_.rank), site_->WatchOf(config_.rank).started);
}

ffi::Error SymmetricCall::WaitSlotFree(Backend& backend, int stream, int slot) const {
  return backend.WaitCounter(stream, site_->Free(config_.rank, slot), Epoch(), -1);
}

ffi::Error SymmetricCall::PostLanded(Backend& backend, int stream, int slot, int64_t first, int64_t end) const {
  const int target = config_.TargetOfSlot(slot);
  std::vector<uint32_t*> words;
  if (per_chunk_) {
    for (int64_t j = first; j < end; ++j) words.push_back(site_->Landed(target, slot, j));
  } else if (end == site_->chunks()) {
    words.push_back(site_->Landed(target, slot, site_->chunks() - 1));
  }
  if (words.empty()) return ffi::Error::Success();
  return backend.PostCounter(stream, words, Epoch());
}

ffi::Error SymmetricCall::ReleaseSlots(Backend& backend, int stream) const {
  std::vector<uint32_t*> words;
  for (int slot = 0; slot < config_.n() - 1; ++slot) words.push_back(site_->Free(config_.SourceOfSlot(slot), slot));
  if (words.empty()) return ffi::Error::Success();
  return backend.PostCounter(stream, words, Epoch());
}

ffi::Error SymmetricCall::End(Backend& backend) const {
  uint32_t* finished = site_->WatchOf(config_.rank).finished;
  if (finished == nullptr) return ffi::Error::Success();
  return backend.PostCounter(Backend::kCompute, {finished}, Epoch());
}

}  // namespace ficco
