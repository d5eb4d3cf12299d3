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
//   Ranks of a group run the group's calls in the same order (every process launches the same
//   SPMD programs in the same order, as NCCL also requires), so the n-th posts belong together;
//   the signature (shapes, dtype, schedule) is compared to catch a mismatch.
// Failure: a rank that waits longer than the timeout marks its box `abandoned` and fails with an
//   error naming the op, the group and the missing ranks; a peer that sees an abandoned box fails
//   at once, and so does every later call of the group (its sequence numbers no longer agree):
//   restart the processes. No path waits without a deadline.
#ifndef FICCO_JAX_XLA_FFI_RUNTIME_IPC_MAILBOX_H_
#define FICCO_JAX_XLA_FFI_RUNTIME_IPC_MAILBOX_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
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
  int64_t op_id = -1;
  std::vector<int64_t> signature;
  int64_t buffer_export = -1;  // the export id (generation) of the poster's staging buffer; -1: none
  int64_t buffer_offset = 0;   // bytes from the staging buffer's base
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
  // Opens (creating if needed) the segment of `job` on this host. Every process of the job on
  // this host opens the same one; the first creates it zero-filled.
  static ffi::Error Open(const CallContext& ctx, int64_t job, std::unique_ptr<HostMailbox>* out);
  ~HostMailbox();
  HostMailbox(const HostMailbox&) = delete;
  HostMailbox& operator=(const HostMailbox&) = delete;

  // Posts `mine` as this rank's next post and returns every rank's (indexed by rank; ours
  // included) once all have posted it. Errors: see the protocol above.
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
  HostMailbox(std::string name, int64_t job, Layout* layout, size_t bytes)
      : name_(std::move(name)), job_(job), layout_(layout), bytes_(bytes) {}
  struct GroupEntry;
  struct DeviceEntry;
  ffi::Error FindGroup(const MailboxArrival& who, GroupEntry** group);
  ffi::Error FindDevice(const CallContext& ctx, int member, bool claim, DeviceEntry** device);

  const std::string name_;
  const int64_t job_;
  Layout* layout_;
  const size_t bytes_;
  std::mutex publish_mu_;  // one publisher at a time per process (device tables are append-only)
};

// The segment name of `job`: "/ficco_jax_<job in hex>".
std::string MailboxName(int64_t job);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_RUNTIME_IPC_MAILBOX_H_
