#include "runtime/symmetric.h"

#include <utility>

#include "base/text.h"

namespace ficco {

SymmetricSite::SymmetricSite(int n, int64_t chunks, int64_t slot_bytes, std::vector<char*> bases)
    : n_(n), chunks_(chunks), slot_bytes_(slot_bytes), bases_(std::move(bases)), views_(n), watches_(n) {}

void SymmetricSite::SetView(int viewer, std::vector<char*> bases) {
  if (viewer < 0 || viewer >= n_ || static_cast<int>(bases.size()) != n_ || !views_[viewer].empty()) return;
  views_[viewer] = std::move(bases);
}

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
  // The first error recorded, and the rank that saw it: a peer that waited for the rank that failed
  // records first as often as that rank does, and its error names the rank it waited for.
  if (failed_.empty()) failed_ = rank < 0 ? why : "first error, seen by rank " + std::to_string(rank) + ": " + why;
  for (const Watch& watch : watches_) {
    if (watch.stopped != nullptr) __atomic_store_n(watch.stopped, 1u, __ATOMIC_RELEASE);
  }
}

std::string SymmetricSite::Failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

std::shared_ptr<SymmetricSite> SymmetricSites::Find(const Key& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = sites_.find(key);
  return found == sites_.end() ? nullptr : found->second;
}

std::shared_ptr<SymmetricSite> SymmetricSites::Install(const Key& key, std::vector<char*> bases, int viewer) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<SymmetricSite>& site = sites_[key];
  if (site == nullptr) {
    site = std::make_shared<SymmetricSite>(static_cast<int>(std::get<1>(key).size()), std::get<2>(key),
                                           std::get<3>(key), bases);
  }
  // Every local rank keeps the addresses its own meeting gave it: across processes another local
  // rank's mappings were opened through another device.
  site->SetView(viewer, std::move(bases));
  return site;
}

void SymmetricSites::MarkCrossProcess(const Key& key) {
  std::lock_guard<std::mutex> lock(mu_);
  cross_process_.push_back(key);
}

void SymmetricSites::FailCrossProcess(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Key& key : cross_process_) {
    auto found = sites_.find(key);
    if (found != sites_.end()) found->second->Fail(-1, why);
  }
}

CounterWaits CountersOf(const uint32_t* epoch, const std::vector<PeerWait>& waits) {
  CounterWaits counters{epoch, {}};
  for (const PeerWait& wait : waits) counters.words.push_back(wait.wait);
  return counters;
}

// The message names the rank as a meeting's timeout names the late ones ("missing ranks [p]").
ffi::Error PeerWaitsError(const OpConfig& config, const uint32_t* epoch, const std::vector<PeerWait>& waits,
                          ffi::Error status) {
  if (status.success()) return status;
  const bool parted = status.message() == kLaunchParted;
  if (!parted && status.message() != kWordTimedOut) return status;
  for (const PeerWait& wait : waits) {
    const int peer = wait.peer;
    const std::string device = " (device " + std::to_string(config.group[peer]) + ")";
    const uint32_t call = ReadWord(epoch) + static_cast<uint32_t>(wait.wait.offset);
    const LaunchCheck& check = wait.wait.check;
    if (parted && check.tag != nullptr && ReadWord(check.tag) != ReadWord(check.launch)) {
      return MakeError(config.ctx, "rank " + std::to_string(config.rank) + "'s call " +
                                       std::to_string(ReadWord(epoch)) + " of this copy-engine site runs in launch " +
                                       std::to_string(ReadWord(check.launch)) + ", but rank " + std::to_string(peer) +
                                       device + " sent its data of that call in launch " +
                                       std::to_string(ReadWord(check.tag)) + LaunchPartedAdvice());
    }
    if (!parted && ReadWord(wait.wait.word) != call) {
      return MakeError(config.ctx, "group [" + JoinNumbers(config.group) + "], rank " + std::to_string(config.rank) +
                                       ": rank " + std::to_string(peer) + device + " did not post its '" + wait.what +
                                       "' counter of call " + std::to_string(call) +
                                       " of this symmetric site (it holds " + std::to_string(ReadWord(wait.wait.word)) +
                                       ") within " + ShortNumber(config.timeout_s) + " s: missing ranks [" +
                                       std::to_string(peer) +
                                       "]; a peer failed, or runs another copy-engine call: the devices of a group "
                                       "must run the same calls in the same order");
    }
  }
  // Every word has come since the wait gave up: a peer was late by about the timeout.
  return MakeError(config.ctx, "group [" + JoinNumbers(config.group) + "], rank " + std::to_string(config.rank) +
                                   ": a counter wait of this symmetric site gave up after " +
                                   ShortNumber(config.timeout_s) + " s (" + std::string(status.message()) +
                                   "); what it waited for came just after: a peer was that late");
}

std::string LaunchPartedAdvice() {
  return ": a launch ended early on some device of the group (an op failed there, or a launch failed and the program "
         "ran on), so the group's calls no longer pair up; restart the process";
}

ffi::Error SymmetricSites::LaunchesOf(Backend& backend, const LaunchKey& key, Launches** launches) {
  Launches& found = launches_[key];
  if (found.word == nullptr) {
    void* word = nullptr;
    FICCO_RETURN_IF_ERROR(backend.AllocateRegion(sizeof(uint32_t), &word));
    found.word = static_cast<uint32_t*>(word);
  }
  *launches = &found;
  return ffi::Error::Success();
}

ffi::Error SymmetricSites::LaunchWord(Backend& backend, const LaunchKey& key, uint32_t** word) {
  std::lock_guard<std::mutex> lock(launches_mu_);
  Launches* launches = nullptr;
  FICCO_RETURN_IF_ERROR(LaunchesOf(backend, key, &launches));
  *word = launches->word;
  return ffi::Error::Success();
}

ffi::Error SymmetricSites::CountLaunch(Backend& backend, const LaunchKey& key) {
  // XLA runs the initialize stage outside its command buffers, so a capture here is one of the whole
  // launch by its caller: a host count now would count the capture once and none of its replays,
  // and a word write would be replayed with a stale number. So a captured launch is not counted on
  // any rank of the group (they run one program, captured alike) and their numbers stay equal; a
  // launch captured on some ranks only is not caught (docs/design.md, "Launches").
  if (backend.Capturing()) return ffi::Error::Success();
  std::lock_guard<std::mutex> lock(launches_mu_);
  Launches* launches = nullptr;
  FICCO_RETURN_IF_ERROR(LaunchesOf(backend, key, &launches));
  return backend.SetWord(Backend::kCompute, launches->word, ++launches->count);
}

SymmetricCall::SymmetricCall(const OpConfig& config, std::shared_ptr<SymmetricSite> site, bool per_chunk)
    : config_(config), site_(std::move(site)), watch_(site_->WatchOf(config_.rank)), per_chunk_(per_chunk) {}

ffi::Error SymmetricCall::Begin(Backend& backend, bool* counted_call) const {
  std::vector<PeerWait> frees;
  for (int slot = 0; slot < config_.n() - 1; ++slot) {
    frees.push_back({{site_->Free(config_.rank, slot, config_.rank), -1, {}}, config_.TargetOfSlot(slot), "free"});
  }
  ffi::Error status =
      backend.CountCall(Backend::kCompute, site_->Epoch(config_.rank, config_.rank), watch_.started, watch_.stopped,
                        CountersOf(Epoch(), frees).words);
  *counted_call = !(status.failure() && status.message() == kCallStopped);
  if (!*counted_call) {
    return MakeError(config_.ctx, "this copy-engine site stopped (" + site_->Failed() + "): restart the process");
  }
  return PeerWaitsError(config_, Epoch(), frees, std::move(status));
}

ffi::Error SymmetricCall::PostLanded(Backend& backend, int stream, int slot, int64_t first, int64_t end) const {
  const int target = config_.TargetOfSlot(slot);
  std::vector<uint32_t*> words;
  if (per_chunk_) {
    for (int64_t j = first; j < end; ++j) words.push_back(site_->Landed(target, slot, j, config_.rank));
  } else if (end == site_->chunks()) {
    words.push_back(site_->Landed(target, slot, site_->chunks() - 1, config_.rank));
  }
  if (words.empty()) return ffi::Error::Success();
  LaunchCheck tagged;
  tagged.tag = site_->Tag(target, slot, config_.rank);
  tagged.launch = watch_.launch;
  return backend.PostCounter(stream, words, Epoch(), tagged);
}

ffi::Error SymmetricCall::End(Backend& backend) const {
  std::vector<uint32_t*> words;
  for (int slot = 0; slot < config_.n() - 1; ++slot) {
    words.push_back(site_->Free(config_.SourceOfSlot(slot), slot, config_.rank));
  }
  if (watch_.finished != nullptr) words.push_back(watch_.finished);
  if (words.empty()) return ffi::Error::Success();
  return backend.PostCounter(Backend::kCompute, words, Epoch(), LaunchCheck{});
}

}  // namespace ficco
