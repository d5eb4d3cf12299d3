#include "runtime/placement.h"

#include <algorithm>
#include <string>
#include <type_traits>

#include "base/text.h"
#include "runtime/registry.h"

namespace ficco {

ffi::TypeId Placement::id = {};

std::optional<ResolvedGroup> Placement::Find(int ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find(ordinal);
  if (it == groups_.end()) return std::nullopt;
  return it->second;
}

void Placement::Keep(int ordinal, const ResolvedGroup& group) {
  std::lock_guard<std::mutex> lock(mu_);
  groups_[ordinal] = group;
}

void DeviceIds::Set(const std::map<int, int64_t>& ids, int64_t job) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [ordinal, id] : ids) ids_[ordinal] = id;
  job_ = job;
}

int64_t DeviceIds::Job() {
  std::lock_guard<std::mutex> lock(mu_);
  return job_;
}

std::optional<int64_t> DeviceIds::Of(int ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ids_.find(ordinal);
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

std::optional<int> DeviceIds::OrdinalOf(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [ordinal, known] : ids_) {
    if (known == id) return ordinal;
  }
  return std::nullopt;
}

namespace {

// The first word of a roster's post in the host mailbox ("roster" in ASCII): never a signature's.
constexpr int64_t kRosterWord = 0x726f73746572;

// An error's code, whichever form this XLA's FFI header gives it in (optional or plain).
template <typename Code>
ffi::ErrorCode CodeOf(const Code& code) {
  if constexpr (std::is_same_v<Code, ffi::ErrorCode>) {
    return code;
  } else {
    return code.value_or(ffi::ErrorCode::kInternal);
  }
}

std::vector<int> Row(ffi::Span<const int64_t> values, int64_t start, int64_t n) {
  return std::vector<int>(values.begin() + start, values.begin() + start + n);
}

// A group's devices are distinct, or the program is not one copy-engine ops can run.
ffi::Error Distinct(const CallContext& ctx, const std::vector<int>& devices, const std::vector<int>& positions) {
  std::vector<int> sorted = devices;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) return ffi::Error::Success();
  return MakeInvalid(ctx, "the group at [" + JoinNumbers(positions) + "] runs on devices [" + JoinNumbers(devices) +
                              "]: one device holds two positions of one group; copy-engine ops need one device "
                              "per position (a mesh of distinct devices, no pmap replicas)");
}

// The members of an in-process group post their ordinals to each other once.
ffi::Error MeetRoster(const CallContext& ctx, const GroupSpec& spec, int64_t run_id, ResolvedGroup* group) {
  const std::vector<int> positions = Row(spec.positions, group->group_index * spec.n, spec.n);
  const RendezvousKey key{run_id, ctx.op_id,
                          Registry::Get().Device(ctx.device_ordinal).NextRosterOccurrence(run_id, ctx.op_id),
                          Phase::kRoster, group->group_index};
  Arrival who{&ctx, &positions, group->rank, spec.timeout_s, spec.spin_s};
  Post mine;
  mine.ordinal = ctx.device_ordinal;
  std::vector<Post> posts;
  ffi::Error met = Registry::Get().rendezvous().Arrive(key, who, std::move(mine), &posts);
  if (met.failure()) {
    return ffi::Error(CodeOf(met.errc()), met.message() + " (the members of the group at positions [" +
                                      JoinNumbers(positions) + "] learn each other's devices at their first call)");
  }
  group->group.clear();
  for (const Post& post : posts) group->group.push_back(post.ordinal);
  group->group_local = group->group;
  return Distinct(ctx, group->group, positions);
}

// The members of a group across processes post their device ids to each other once, in the host
// mailbox's meeting of the group the lowering named (its `devices`): every member names that one
// alike, whichever devices the run gave the positions.
ffi::Error MeetRosterAcrossProcesses(const CallContext& ctx, const GroupSpec& spec, int64_t run_id,
                                     ResolvedGroup* group) {
  const std::vector<int> lowered = Row(spec.devices, group->group_index * spec.n, spec.n);
  const std::optional<int64_t> mine = Registry::Get().device_ids().Of(ctx.device_ordinal);
  if (!mine.has_value() || Registry::Get().device_ids().Job() != spec.ipc_job) {
    return MakeInvalid(ctx, "this op's group spans processes, and it was lowered in another jax.distributed job (job " +
                                std::to_string(spec.ipc_job) +
                                "), whose host mailbox this process does not share; a group across processes "
                                "runs in the job that lowered it: lower (jax.jit) the program again in this job");
  }
  HostMailbox* mailbox = nullptr;
  FICCO_RETURN_IF_ERROR(Registry::Get().Mailbox(ctx, spec.ipc_job, &mailbox));
  WirePost post;  // tagged as every post is (the mailbox compares the tags); call 0: no call of the group yet
  post.op_id = ctx.op_id;
  post.phase = static_cast<int32_t>(Phase::kRoster);
  post.call = 0;
  post.run_id = run_id;
  post.signature = {kRosterWord, group->position, *mine};
  std::vector<WirePost> posts;
  const MailboxArrival who{&ctx, &lowered, group->rank, PhaseName(Phase::kRoster), spec.timeout_s};
  FICCO_RETURN_IF_ERROR(mailbox->Exchange(who, post, &posts));
  group->group.clear();
  group->group_local.clear();
  for (size_t rank = 0; rank < posts.size(); ++rank) {
    const std::vector<int64_t>& words = posts[rank].signature;
    if (posts[rank].op_id != ctx.op_id || words.size() != 3 || words[0] != kRosterWord ||
        words[1] != spec.positions[group->group_index * spec.n + static_cast<int64_t>(rank)]) {
      return MakeError(ctx, "rank " + std::to_string(rank) + " of the group lowered on devices [" +
                                JoinNumbers(lowered) + "] posted something else than its roster for op " +
                                std::to_string(ctx.op_id) + " (op " + std::to_string(posts[rank].op_id) +
                                "): the processes' calls are out of step; restart them");
    }
    group->group.push_back(static_cast<int>(words[2]));
    group->group_local.push_back(Registry::Get().device_ids().OrdinalOf(words[2]).value_or(-1));
  }
  return Distinct(ctx, group->group, lowered);
}

}  // namespace

ffi::Error ResolveGroup(const CallContext& ctx, const GroupSpec& spec, const PositionReader& read_position,
                        int64_t run_id, Placement* placement, ResolvedGroup* out) {
  if (placement != nullptr) {
    if (std::optional<ResolvedGroup> kept = placement->Find(ctx.device_ordinal)) {
      *out = *kept;
      return ffi::Error::Success();
    }
  }
  const int64_t total = static_cast<int64_t>(spec.positions.size());
  if (spec.n < 1 || total % spec.n != 0 || static_cast<int64_t>(spec.devices.size()) != total) {
    return MakeInvalid(ctx, "groups has " + std::to_string(total) + " positions and devices " +
                                std::to_string(spec.devices.size()) + "; both must be the same multiple of group_size " +
                                std::to_string(spec.n));
  }
  int64_t position = -1;
  FICCO_RETURN_IF_ERROR(read_position(&position));
  const int64_t entry = std::find(spec.positions.begin(), spec.positions.end(), position) - spec.positions.begin();
  if (entry >= total) {
    return MakeInvalid(ctx, "this call runs at position " + std::to_string(position) +
                                " of its program's devices, which is in no group of this op (its groups cover " +
                                std::to_string(total) + " positions); the mesh the op was lowered for has another "
                                "shape than the devices it runs on: lower (jax.jit) the program again under that mesh");
  }
  ResolvedGroup group;
  group.position = position;
  group.group_index = entry / spec.n;
  group.rank = static_cast<int>(entry % spec.n);
  FICCO_RETURN_IF_ERROR(spec.ipc_job != 0 ? MeetRosterAcrossProcesses(ctx, spec, run_id, &group)
                                          : MeetRoster(ctx, spec, run_id, &group));
  if (placement != nullptr) placement->Keep(ctx.device_ordinal, group);
  *out = group;
  return ffi::Error::Success();
}

}  // namespace ficco
