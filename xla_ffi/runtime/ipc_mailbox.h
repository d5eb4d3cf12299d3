// The host mailbox of the processes of one job on one host: a POSIX shared-memory segment in which
// the devices of a group that spans processes meet once per call phase, and in which each device
// publishes the IPC handles of its staging buffers and events (ipc_cuda.cc fills those).
//
// It carries integers only (buffer = (export id, offset), events = event ids), so it is
// backend-neutral and its protocol is tested on CPU (tests/test_ipc_mailbox.py).
//
// Protocol of one group (members in rank order, found or claimed by its member ids):
//   every rank owns one RankBox that only it writes. Its n-th post (n = 1, 2, ... over the
//   life of the job: three per call, exchange/done/release) goes to data[n % 2], then `posted`
//   is set to n (release). A rank then spins until every peer's `posted` >= n and reads their
//   data[n % 2]. A peer can overwrite that slot only at its post n + 2, which needs our post
//   n + 1, which we make only after reading: two slots suffice.
//   Posts are paired by number, but a pairing is trusted only if it is the same meeting: every
//   post carries its tag (op id, phase, the group's call ordinal on the poster, the launch's run
//   id), and a post whose tag differs from ours is an error naming both tags. So a process that
//   failed a call before posting and went on to its next launch is caught at the first post it
//   makes there, instead of its data being taken for the launch its peers are still in; and a
//   release post is never read as an exchange.
//   Every field read from a peer's post is checked before use (counts within the layout, offsets
//   and sizes non-negative and not overflowing); what it refers to (a staging buffer, an event) is
//   checked where it is opened (ipc_cuda.cc).
// Failure: a rank that waits longer than the timeout, or sees another meeting's tag, marks its
//   box `abandoned` and fails with an error naming the op, the group and the missing ranks (or
//   both tags); a peer that sees an abandoned box fails at once, and so does every later call of
//   the group (its sequence numbers no longer agree): restart the processes. The first post of a
//   rank waits at least the first-meeting timeout (RegisterMailbox): processes reach their first
//   call minutes apart when one compiles longer. No path waits without a deadline.
// Trust: the segment is created exclusively (O_EXCL) with mode 0600 under an unguessable name (a
//   random token shared through the job's key-value store, never derived from the job id that
//   compiled programs carry); a process that finds it already there opens it only if it belongs to
//   this user with mode 0600 and its header is complete. Processes of one user on one host are
//   trusted not to corrupt it; the checks above keep a corrupt post from reaching memory.
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_IPC_MAILBOX_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_IPC_MAILBOX_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "base/errors.h"

namespace ficco {

// Limits of the segment's fixed layout (a host has at most 8 GPUs today).
inline constexpr int kIpcMaxRanks = 16;         // members of one group
inline constexpr int kIpcMaxGroups = 64;        // distinct groups of one job on one host
inline constexpr int kIpcMaxDevices = 16;       // devices of one host that take part
inline constexpr int kIpcMaxSignature = 16;     // int64s of one op's signature
inline constexpr int kIpcMaxPostEvents = 128;   // events one post exposes ((n-1) * chunks)
inline constexpr int kIpcMaxExports = 1024;     // staging generations one device exports
inline constexpr int kIpcMaxEvents = 2048;      // IPC events one device exports
inline constexpr int kIpcHandleBytes = 64;      // cudaIpcMemHandle_t / cudaIpcEventHandle_t

// What one rank posts in one phase, in integers.
struct WirePost {
  // The tag: which meeting this post belongs to. Every rank's must equal ours.
  int64_t op_id = -1;
  int32_t phase = 0;     // Phase (runtime/registry.h) as an integer
  uint64_t call = 0;     // the poster's ordinal of this call among its calls of the group (1, 2, ...)
  int64_t run_id = 0;    // the launch (XLA's RunId: equal in every process for one launch)
  std::vector<int64_t> signature;
  int64_t buffer_export = -1;  // the export id (generation) of the poster's staging buffer; -1: none
  int64_t buffer_offset = 0;   // bytes from the staging buffer's base
  int64_t buffer_bytes = 0;    // bytes from there that peers may read
  std::vector<int32_t> event_ids;  // the poster's exported event ids
  // The same buffer and events as addresses in the poster's process: what a peer device of the
  // same process uses (a process cannot open its own IPC handles).
  uint64_t raw_buffer = 0;
  std::vector<uint64_t> raw_events;
};

// Who meets: the group's member ids (global device ids) in rank order, and this rank.
struct MailboxArrival {
  const CallContext* ctx;
  const std::vector<int>* members;
  int rank;
  const char* phase_name;
  double timeout_s;
};

// One exported IPC handle (of a staging buffer or an event).
struct IpcHandleBytes {
  char bytes[kIpcHandleBytes];
};

class HostMailbox {
 public:
  // Opens the segment of `job` on this host, named by its registered token (RegisterMailbox):
  // created exclusively by the first process of the job on this host, opened and checked (owner,
  // mode, size, header) by the others.
  static ffi::Error Open(const CallContext& ctx, int64_t job, std::unique_ptr<HostMailbox>* out);
  ~HostMailbox();
  HostMailbox(const HostMailbox&) = delete;
  HostMailbox& operator=(const HostMailbox&) = delete;

  // This rank's ordinal for its next call of the group (1, 2, ...): the tag's `call`.
  ffi::Error NextCall(const MailboxArrival& who, uint64_t* call);
  // Posts `mine` as this rank's next post and returns every rank's (indexed by rank; ours
  // included) once all have posted it with the same tag. Errors: see the protocol above.
  ffi::Error Exchange(const MailboxArrival& who, const WirePost& mine, std::vector<WirePost>* posts);
  // The error Exchange would return at once because a rank of the group gave up, if one did.
  ffi::Error FailIfGaveUp(const MailboxArrival& who);

  // Device tables: `member` publishes handles; peers read them by (member, id). An id is
  // published before any post refers to it, so a reader that got the id from a post finds it.
  ffi::Error PublishExport(const CallContext& ctx, int member, const IpcHandleBytes& handle, uint64_t bytes,
                           int32_t* id);
  ffi::Error ReadExport(const CallContext& ctx, int member, int32_t id, IpcHandleBytes* handle, uint64_t* bytes);
  ffi::Error PublishEvent(const CallContext& ctx, int member, const IpcHandleBytes& handle, int32_t* id);
  ffi::Error ReadEvent(const CallContext& ctx, int member, int32_t id, IpcHandleBytes* handle);

  // Removes the segment's name (the mapping stays valid until the process exits or Close).
  void Unlink();
  const std::string& name() const { return name_; }
  int64_t job() const { return job_; }

  struct Layout;  // ipc_mailbox.cc

 private:
  HostMailbox(std::string name, int64_t job, Layout* layout, size_t bytes, double first_timeout_s)
      : name_(std::move(name)), job_(job), layout_(layout), bytes_(bytes), first_timeout_s_(first_timeout_s) {}
  struct GroupEntry;
  struct DeviceEntry;
  ffi::Error FindGroup(const MailboxArrival& who, GroupEntry** group);
  ffi::Error FindDevice(const CallContext& ctx, int member, bool claim, DeviceEntry** device);

  const std::string name_;
  const int64_t job_;
  Layout* layout_;
  const size_t bytes_;
  const double first_timeout_s_;
  std::mutex publish_mu_;  // one publisher at a time per process (device tables are append-only)
};

// Names the segment of `job` in this process: "/ficco_jax_<token>", where `token` (32 to 64
// lowercase hex digits) is random, drawn once per job and shared through its key-value store
// (ficco_jax/runtime/ipc.py); `first_timeout_s` is the least a rank's first post waits for its
// peers. Registering another token for a job already registered is an error (returns it).
std::string RegisterMailbox(int64_t job, const std::string& token, double first_timeout_s);
// The registered segment name of `job`, or "" if none was registered.
std::string MailboxName(int64_t job);

// Byte offsets in the segment, for tests that write a corrupt post the way another process could
// (tests/test_ipc_mailbox.py): "rank_box" (group entry 0, rank 1), "rank_box_bytes", "group_bytes",
// and within a rank box "posted", "data1" (the slot of odd posts), and within a post "op_id",
// "phase", "call", "run_id", "signature_len", "buffer_export", "buffer_offset", "buffer_bytes",
// "num_events".
std::vector<std::pair<std::string, int64_t>> MailboxLayoutForTests();

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_IPC_MAILBOX_H_
