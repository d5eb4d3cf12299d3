// Which devices form a call's group: found from the run, never from the trace.
//
// A compiled program does not belong to the devices it was traced on: JAX reuses one lowering for
// every mesh of the same shape, a `jax.export` artifact is compiled for whatever devices load it,
// and one pipeline stage runs on several submeshes. So the lowering writes no device into a call's
// attributes. It writes positions: `groups` lists, group by group and in rank order, the logical
// positions (XLA partition ids: the index of a device in the executable's device assignment, which
// for a mesh is its place in `mesh.devices.flat`) that form each group of the op's mesh axis. At run
// time each call is handed its own position as its first operand (XLA's `partition-id`), which gives
// its group and its rank; the members' devices are then learned from the run itself:
//
//   * in one process, the members meet once (a roster meeting of the rendezvous, keyed by the launch,
//     the op and the group) and each posts its device ordinal;
//   * across processes of one host, the members post their global device ids to each other once in
//     the host mailbox, in the meeting of the group the lowering named (`devices`, global ids), which
//     every member names alike; a program lowered in another jax.distributed job is refused (its
//     mailbox is another job's).
//
// The result is kept in the call's Placement: XLA's per-executable state of the FFI target (made by
// the target's instantiate stage, one per compiled executable), so each executable resolves its group
// once per device, at its first call, and a device that runs two executables of one lowering (two
// device orders, two submeshes) keeps two groups. Everything keyed by a group downstream (sites,
// symmetric buffers, channels, watchdog records) is keyed by the resolved devices, so two
// assignments never share them.
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_PLACEMENT_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_PLACEMENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "base/errors.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// A device's group, resolved: what OpConfig's group fields hold (runtime/op_config.h).
struct ResolvedGroup {
  int64_t position = -1;     // this device's logical position (partition id)
  int64_t group_index = 0;   // its row of the op's `groups`
  int rank = 0;
  std::vector<int> group;        // members in rank order: ordinals here, global ids across processes
  std::vector<int> group_local;  // each member's ordinal in this process, -1 for another process's
};

// XLA's state of one FFI target in one compiled executable: the groups its devices resolved.
class Placement {
 public:
  static ffi::TypeId id;  // set when Python registers the type with XLA (ficco_jax/runtime/extension.py)

  std::optional<ResolvedGroup> Find(int ordinal);
  void Keep(int ordinal, const ResolvedGroup& group);

 private:
  std::mutex mu_;
  std::map<int, ResolvedGroup> groups_;
};

// The global device id of each local device ordinal of this process and the jax.distributed job it
// is in, set from Python when it lowers an op whose group spans processes
// (ficco_jax/runtime/extension.py): what a member of such a group posts to its peers.
class DeviceIds {
 public:
  void Set(const std::map<int, int64_t>& ids, int64_t job);
  int64_t Job();
  std::optional<int64_t> Of(int ordinal);
  std::optional<int> OrdinalOf(int64_t id);

 private:
  std::mutex mu_;
  std::map<int, int64_t> ids_;
  int64_t job_ = 0;
};

// The static part of a call's group, as the lowering wrote it.
struct GroupSpec {
  ffi::Span<const int64_t> positions;  // groups of `n` positions each, rank order
  ffi::Span<const int64_t> devices;    // the device the lowering saw at each entry of `positions` (global ids)
  int64_t n = 1;
  int64_t ipc_job = 0;                 // != 0: groups across processes of this host
  double timeout_s = 5.0;
  double spin_s = 0.0;
};

// Reads this call's position from its operand (on a GPU: one copy to the host, waited for).
using PositionReader = std::function<ffi::Error(int64_t* position)>;

// The group of the device `ctx.device_ordinal` in launch `run_id`: found in `placement` (may be
// null: nothing is kept), else resolved from the position `read_position` gives and kept there.
ffi::Error ResolveGroup(const CallContext& ctx, const GroupSpec& spec, const PositionReader& read_position,
                        int64_t run_id, Placement* placement, ResolvedGroup* out);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_PLACEMENT_H_
