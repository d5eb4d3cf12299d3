#include "runtime/watchdog.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "base/text.h"
#include "runtime/registry.h"
#include "runtime/symmetric.h"

namespace ficco {
namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at unfinished calls. A finished call's events wait this long at
// most before they can be reused, so the pool holds a few more events than calls in flight.
constexpr auto kPollInterval = std::chrono::milliseconds(2);
// How often it reads the symmetric sites' counters while no call is watched (sites stay watched for
// the life of the process; their timeouts are seconds).
constexpr auto kSitePollInterval = std::chrono::milliseconds(50);

double SecondsSince(Clock::time_point then) {
  return std::chrono::duration<double>(Clock::now() - then).count();
}

std::string Seconds(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", seconds);
  return buf;
}

}  // namespace

std::string ScheduleText(int64_t chunks, Order order, GemmMode gemm, int copy_streams, bool push, bool symmetric) {
  std::string text = std::string("dma/") + (order == Order::kRing ? "ring" : "direct") + "/c" + std::to_string(chunks);
  if (gemm == GemmMode::kGrouped) text += "/grouped";
  if (gemm == GemmMode::kColumns) text += "/columns";
  if (copy_streams != 1) text += "/s" + std::to_string(copy_streams);
  if (push) text += "/push";
  if (symmetric) text += "/symmetric";
  return text;
}

WatchedOp::WatchedOp(const OpConfig& config)
    : target(config.ctx.target), op_id(config.ctx.op_id), device(config.ctx.device_ordinal), rank(config.rank),
      group(config.group), chunks(config.chunks), order(config.order), gemm(config.gemm),
      copy_streams(config.copy_streams), push(config.push), symmetric(config.symmetric),
      site(std::string(config.site)), timeout_s(config.watchdog_s) {}

std::string WatchedOp::Describe() const {
  return "op " + std::to_string(op_id) + " (" + target + "), " +
         ScheduleText(chunks, order, gemm, copy_streams, push, symmetric) + ", on device " + std::to_string(device) +
         ": rank " + std::to_string(rank) + " of group [" + JoinNumbers(group) + "]";
}

// ---------------------------------------------------------------------------------------------
// CallWatch
// ---------------------------------------------------------------------------------------------
CallWatch::CallWatch(Backend& backend, const OpConfig& config) : call_(std::make_shared<WatchedCall>()) {
  static_cast<WatchedOp&>(*call_) = WatchedOp(config);
  call_->pool = &backend.Pool();
  call_->registered = Clock::now();
  if (backend.RecordMark(&call_->started).failure()) call_->started = nullptr;  // counts as started
  Registry::Get().watchdog().Watch(call_);
}

CallWatch::~CallWatch() {
  if (!finished_) {  // a path that returned without Finish: the device work is unknown, keep nothing
    std::lock_guard<std::mutex> lock(call_->mu);
    call_->returned = true;
  }
}

void CallWatch::Finish(Backend& backend) {
  Event finished = nullptr;
  const bool recorded = backend.RecordMark(&finished).success();
  std::vector<Event> reusable = backend.TakeReusable();
  std::lock_guard<std::mutex> lock(call_->mu);
  call_->finished = recorded ? finished : nullptr;
  if (recorded) call_->reusable = std::move(reusable);
  call_->returned = true;
  finished_ = true;
}

void CallWatch::ReleaseAfter(Announcement all) {
  std::lock_guard<std::mutex> lock(call_->mu);
  call_->released = std::move(all);
}

// ---------------------------------------------------------------------------------------------
// Watchdog
// ---------------------------------------------------------------------------------------------
void Watchdog::StartLocked() {
  if (thread_) return;
  // Detached: it never ends (the registry is never destroyed), and at exit it may find CUDA gone,
  // which Done() reads as done.
  thread_ = std::make_unique<std::thread>([this] { Loop(); });
  thread_->detach();
}

void Watchdog::Watch(std::shared_ptr<WatchedCall> call) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool was_idle = calls_.empty();  // the thread sleeps without a deadline, or slowly, only then
  calls_.push_back(std::move(call));
  StartLocked();
  if (was_idle) cv_.notify_one();  // otherwise it polls: a call's path pays no wake-up
}

void Watchdog::WatchSite(const OpConfig& config, std::shared_ptr<SymmetricSite> state, const uint32_t* started,
                         const uint32_t* finished, const uint32_t* parted) {
  auto site = std::make_shared<WatchedSite>(config);
  site->started = started;
  site->finished = finished;
  site->parted = parted;
  site->state = std::move(state);
  std::lock_guard<std::mutex> lock(mu_);
  const bool was_idle = calls_.empty() && sites_.empty();
  sites_.push_back(std::move(site));
  StartLocked();
  if (was_idle) cv_.notify_one();
}

void Watchdog::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (calls_.empty() && sites_.empty()) {  // (pending events wait for the next call: only a call needs them)
      cv_.wait(lock);
    } else {
      cv_.wait_for(lock, calls_.empty() ? kSitePollInterval : kPollInterval);
    }
    lock.unlock();
    std::shared_ptr<WatchedCall> stuck = Sweep();
    if (stuck) {
      std::string headline;
      {
        std::lock_guard<std::mutex> call_lock(stuck->mu);
        headline = stuck->Describe() + (stuck->site.empty() ? "" : ", written at " + stuck->site) + ", started " +
                   Seconds(SecondsSince(stuck->started_seen)) + " ago and has not finished (limit " +
                   Seconds(stuck->timeout_s) + ": FICCO_WATCHDOG_S).";
      }
      ReportAndAbort(headline);
    }
    std::string site_headline;
    if (SweepSites(&site_headline)) ReportAndAbort(site_headline);
    lock.lock();
  }
}

// Only this thread writes a site's `pending`, `seen_*` and `since`, once registered. A failed launch
// check needs no timeout: that stream waits for good, and its peers' with it.
std::shared_ptr<WatchedSite> Watchdog::SweepSites(std::string* headline) {
  std::vector<std::shared_ptr<WatchedSite>> sites;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sites.assign(sites_.begin(), sites_.end());
  }
  for (const std::shared_ptr<WatchedSite>& site : sites) {
    const auto where = [&] { return site->Describe() + (site->site.empty() ? "" : ", written at " + site->site); };
    const uint32_t parted_slot = site->parted == nullptr ? 0 : ReadWord(site->parted);
    if (parted_slot != 0) {
      const int peer = (site->rank - static_cast<int>(parted_slot) + 2 * static_cast<int>(site->group.size())) %
                       static_cast<int>(site->group.size());
      *headline = where() + ": its call " + std::to_string(ReadWord(site->started)) + " runs in launch " +
                  std::to_string(ReadWord(site->parted + 1)) + ", but rank " + std::to_string(peer) + " (device " +
                  std::to_string(site->group[peer]) + ") sent its data of that call in launch " +
                  std::to_string(ReadWord(site->parted + 2)) + LaunchPartedAdvice() + ".";
      return site;
    }
    const uint32_t started = ReadWord(site->started), finished = ReadWord(site->finished);
    if (started == finished) {
      site->pending = false;
      continue;
    }
    if (!site->pending || site->seen_started != started || site->seen_finished != finished) {
      site->pending = true;
      site->seen_started = started;
      site->seen_finished = finished;
      site->since = Clock::now();
      continue;
    }
    if (site->timeout_s > 0 && SecondsSince(site->since) > site->timeout_s) {
      *headline = where() + ": its call " + std::to_string(site->seen_started) + " started " +
                  Seconds(SecondsSince(site->since)) + " ago and has not finished (limit " + Seconds(site->timeout_s) +
                  ": FICCO_WATCHDOG_S).";
      return site;
    }
  }
  return nullptr;
}

std::shared_ptr<WatchedCall> Watchdog::Sweep() {
  std::vector<std::shared_ptr<WatchedCall>> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls.assign(calls_.begin(), calls_.end());
  }
  std::vector<std::shared_ptr<WatchedCall>> done;
  std::shared_ptr<WatchedCall> stuck;
  std::map<int, bool> device_looked_at;  // a device's calls finish in order: look at its oldest one
  for (const std::shared_ptr<WatchedCall>& call : calls) {
    std::unique_lock<std::mutex> lock(call->mu);
    if (call->returned && call->finished == nullptr) {  // failed: nothing of it to release or watch
      done.push_back(call);
      continue;
    }
    if (call->returned && call->pool->Done(call->finished)) {
      if (call->released != nullptr && !call->released->load(std::memory_order_acquire)) {
        pending_.push_back({call->pool, std::move(call->reusable), std::move(call->released)});
      } else {
        call->pool->Release(call->reusable);
      }
      // The marks are this call's own: no peer waits on them.
      call->pool->Release(call->started == nullptr ? std::vector<Event>{call->finished}
                                                   : std::vector<Event>{call->started, call->finished});
      done.push_back(call);
      continue;
    }
    if (device_looked_at[call->device]) continue;
    device_looked_at[call->device] = true;
    if (!call->seen_started && call->pool->Done(call->started)) {
      call->seen_started = true;
      call->started_seen = Clock::now();
    }
    if (call->timeout_s > 0 && call->seen_started && SecondsSince(call->started_seen) > call->timeout_s && !stuck) {
      stuck = call;
    }
  }
  // Before the swept calls stop being watched: once every rank of a group returned, all announced,
  // so by the time no call is watched (Watched() == 0) their events are back.
  ReleasePending();
  if (!done.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::shared_ptr<WatchedCall>& call : done) calls_.remove(call);
  }
  return stuck;
}

int64_t Watchdog::Watched() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(calls_.size());
}

void Watchdog::ReleasePending() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->released->load(std::memory_order_acquire)) {
      it->pool->Release(it->events);
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

void Watchdog::ReportAndAbort(const std::string& headline) {
  const std::string report = "ficco_jax watchdog: " + headline + "\n" + ReportCalls() + ReportSites() +
                             "ficco_jax watchdog: ending the process; set FICCO_WATCHDOG_S=0 to wait instead (e.g. "
                             "to attach a debugger), or a larger value for calls that legitimately take longer.\n";
  std::fputs(report.c_str(), stderr);
  std::fflush(stderr);
  std::abort();
}

// Every symmetric site of this process with a call in flight, once, with each rank's counts of its
// calls (ranks of other processes are not seen here): a rank that has not started the call its peers
// are in, or that is stuck in an earlier one, is the one to look at.
std::string Watchdog::ReportSites() {
  std::vector<std::shared_ptr<WatchedSite>> sites;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sites.assign(sites_.begin(), sites_.end());
  }
  std::string report;
  std::vector<const SymmetricSite*> reported;
  for (const std::shared_ptr<WatchedSite>& site : sites) {
    const SymmetricSite* state = site->state.get();
    if (std::find(reported.begin(), reported.end(), state) != reported.end()) continue;
    const int n = static_cast<int>(site->group.size());
    std::vector<SymmetricSite::Watch> watches(n);
    uint32_t latest = 0;
    bool in_flight = false;
    for (int rank = 0; rank < n; ++rank) {
      watches[rank] = site->state->WatchOf(rank);
      if (watches[rank].started == nullptr) continue;
      const uint32_t started = ReadWord(watches[rank].started);
      in_flight = in_flight || started != ReadWord(watches[rank].finished);
      if (WordReached(started, latest)) latest = started;
    }
    if (!in_flight) continue;
    reported.push_back(state);
    if (report.empty()) report = "Symmetric sites of this process with a call in flight:\n";
    report += "  op " + std::to_string(site->op_id) + " (" + site->target + "), " +
              ScheduleText(site->chunks, site->order, site->gemm, site->copy_streams, site->push, site->symmetric) +
              ", group [" +
              JoinNumbers(site->group) + "]" + (site->site.empty() ? "" : ", written at " + site->site) + ":\n";
    const std::string failed = site->state->Failed();
    if (!failed.empty()) report += "    the site stopped in this process: " + failed + "\n";
    for (int rank = 0; rank < n; ++rank) {
      report += "    rank " + std::to_string(rank) + " (device " + std::to_string(site->group[rank]) + "): ";
      if (watches[rank].started == nullptr) {
        report += "in another process, or has not set the site up\n";
        continue;
      }
      const uint32_t started = ReadWord(watches[rank].started), finished = ReadWord(watches[rank].finished);
      report += "started call " + std::to_string(started) + ", finished " + std::to_string(finished) +
                (started != latest ? "; has not started call " + std::to_string(latest) + ", which its peers are in"
                 : started != finished ? "; waits for its peers' counters of that call"
                                       : "") + "\n";
    }
  }
  return report;
}

std::string Watchdog::ReportCalls() {
  std::vector<std::shared_ptr<WatchedCall>> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls.assign(calls_.begin(), calls_.end());
  }
  if (calls.empty()) return "";
  std::string report = "Unfinished copy-engine calls of this process, oldest first:\n";
  for (const std::shared_ptr<WatchedCall>& call : calls) {
    std::lock_guard<std::mutex> lock(call->mu);
    const bool started = call->pool->Done(call->started);
    report += "  " + call->Describe() + (call->site.empty() ? "" : " (" + call->site + ")") + ": " +
              (!started ? "not started: the device is busy with, or stuck in, earlier work"
               : call->returned ? "its device work started and has not finished"
                                : "its handler has not returned: it waits on the host, in a meeting of its group or "
                                  "(CPU backend) for a peer's event or word") + "\n";
    if (!started) continue;
    int pending = 0;
    for (const PeerEvent& wait : call->waits) {
      if (call->pool->Done(wait.event)) continue;
      ++pending;
      report += "    waits for rank " + std::to_string(wait.rank) + " (device " + std::to_string(wait.device) +
                "): event " + std::to_string(wait.index) + " of its '" + PhaseName(wait.phase) +
                "' post, not complete\n";
    }
    bool words_pending = false;
    for (const PeerWord& wait : call->words) {
      const uint32_t now = ReadWord(wait.word);
      if (WordReached(now, wait.value)) continue;
      ++pending;
      words_pending = true;
      report += "    waits for rank " + std::to_string(wait.rank) + " (device " + std::to_string(wait.device) +
                "): its '" + wait.what + "' word" +
                (std::string(wait.what) == "ready" ? " " + std::to_string(wait.index) : std::string()) +
                " of the group's channel to reach " + std::to_string(wait.value) + ", it holds " +
                std::to_string(now) + "\n";
    }
    if (words_pending) {
      int64_t run_id = 0;
      Channel* channel = Registry::Get().channels().Find(call->group);
      const std::string retired = channel == nullptr ? "" : channel->Retired(&run_id);
      if (!retired.empty()) report += "    the group's channel was retired: " + retired + "\n";
    }
    if (pending == 0) {
      report += "    none of the peer events or words it waits for is pending\n";
    }
  }
  return report;
}

}  // namespace ficco
