// CUDA IPC for groups across processes of one host (see ipc.h): the staging buffers each device
// exports, interprocess events, and translating one call's posts through the mailbox.
//
//   Owner  (posts its staging buffer): region -> export id (its generation), once per region;
//          its events -> export ids, once per event.
//   Puller (reads a peer's):   (peer, generation) -> opened mapping + offset; (peer, event id) ->
//          opened event, each opened once per device and kept until IpcClose.
#include "runtime/ipc.h"

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>

#include "base/text.h"

namespace ficco {
namespace {

// cuPointerGetAttributes from the driver, through the runtime's entry-point query: linking
// libcuda directly would stop the extension from loading on machines without a driver (CPU CI).
using PointerGetAttributesFn = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);

PointerGetAttributesFn PointerGetAttributes(cudaError_t* status) {
  static std::once_flag once;
  static PointerGetAttributesFn fn = nullptr;
  static cudaError_t found = cudaSuccess;
  std::call_once(once, [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult result;
    found = cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &entry, 12000, cudaEnableDefault, &result);
    if (found == cudaSuccess && result != cudaDriverEntryPointSuccess) found = cudaErrorSymbolNotFound;
    fn = reinterpret_cast<PointerGetAttributesFn>(entry);
  });
  *status = found;
  return found == cudaSuccess ? fn : nullptr;
}

std::string QueryPointer(uint64_t pointer, IpcPointerInfo* info) {
  cudaError_t status;
  PointerGetAttributesFn get = PointerGetAttributes(&status);
  if (get == nullptr) {
    return std::string("the driver's cuPointerGetAttributes is unavailable: ") + cudaGetErrorName(status);
  }
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                      CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                      CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  CUdeviceptr base = 0;
  size_t bytes = 0;
  unsigned long long buffer_id = 0;  // NOLINT(runtime/int): the driver's type
  int capable = 0;                   // the driver writes a bool into its first byte
  void* data[] = {&base, &bytes, &buffer_id, &capable};
  CUresult result = get(4, attributes, data, static_cast<CUdeviceptr>(pointer));
  if (result != CUDA_SUCCESS) {
    return "cuPointerGetAttributes(" + std::to_string(pointer) + ") failed: CUresult " + std::to_string(result) +
           " (not a device pointer?)";
  }
  info->base = base;
  info->bytes = bytes;
  info->buffer_id = buffer_id;
  info->ipc_capable = (capable & 0xff) != 0;
  return "";
}

IpcHandleBytes ToBytes(const void* handle, size_t size) {
  IpcHandleBytes out{};
  std::memcpy(out.bytes, handle, std::min<size_t>(size, kIpcHandleBytes));
  return out;
}

struct IpcCall {
  const OpConfig& config;
  HostMailbox* mailbox;
  CudaResources* res;
  int member() const { return config.group[config.rank]; }
};

// Staging regions: at least 8 MiB (the small calls of a program share the first region), then
// at least twice the last one, in 2 MiB steps (the driver's large-page granularity). Twofold
// growth bounds what retired regions hold (less than the current one) and the generations a
// program goes through (a few).
constexpr uint64_t kStagingMinBytes = uint64_t{8} << 20;
constexpr uint64_t kStagingStepBytes = uint64_t{2} << 20;

uint64_t RoundUpToStep(uint64_t bytes) {
  return (std::max<uint64_t>(bytes, 1) + kStagingStepBytes - 1) / kStagingStepBytes * kStagingStepBytes;
}

// A new staging region of at least `bytes` replaces the current one, which is retired (a peer
// may still pull from it; IpcClose frees it). Caller holds res->ipc_mu.
ffi::Error GrowStaging(const CallContext& ctx, CudaResources* res, uint64_t bytes) {
  uint64_t want = RoundUpToStep(std::max({bytes, kStagingMinBytes, 2 * res->staging.bytes}));
  FICCO_CHECK_CUDA(cudaSetDevice(ctx.device_ordinal));
  void* base = nullptr;
  cudaError_t status = cudaMalloc(&base, want);
  if (status == cudaErrorMemoryAllocation && want > RoundUpToStep(bytes)) {
    (void)cudaGetLastError();  // not sticky; cleared so that nobody else reports it
    want = RoundUpToStep(bytes);
    status = cudaMalloc(&base, want);
  }
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return MakeError(ctx, "cudaMalloc(" + std::to_string(want) + " bytes) for the staging buffer of copy engines "
                              "across processes failed: " + cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + "); XLA preallocates most of the GPU's memory for "
                              "itself (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default): lower it to leave room "
                              "for the staging buffer (about the largest exposed operand, up to twice that), "
                              "or use comm='xla'");
  }
  IpcPointerInfo info;
  std::string problem = QueryPointer(reinterpret_cast<uint64_t>(base), &info);
  if (problem.empty() && !info.ipc_capable) {
    problem = "cudaMalloc returned memory that legacy CUDA IPC cannot export "
              "(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 0; MIG instances and some virtualised GPUs "
              "do not support CUDA IPC)";
  } else if (problem.empty() && info.base != reinterpret_cast<uint64_t>(base)) {
    problem = "cudaMalloc returned " + std::to_string(reinterpret_cast<uint64_t>(base)) +
              " inside an allocation starting at " + std::to_string(info.base) + "; legacy IPC exports whole "
              "allocations only";
  }
  if (!problem.empty()) {
    (void)cudaFree(base);
    (void)cudaGetLastError();
    return MakeError(ctx, "the staging buffer for copy engines across processes cannot be shared: " + problem +
                              "; use comm='xla' across processes");
  }
  if (res->staging.base != nullptr) res->retired_staging.push_back(res->staging);
  res->staging = CudaResources::StagingRegion{static_cast<char*>(base), want, -1};
  ++res->staging_generations;
  return ffi::Error::Success();
}

// The exportable region holding `p`: the current staging region or a symmetric site's allocation.
// Caller holds res->ipc_mu.
CudaResources::StagingRegion* ExportableRegion(CudaResources* res, const char* p) {
  const auto holds = [p](const CudaResources::StagingRegion& r) {
    return r.base != nullptr && p >= r.base && p < r.base + r.bytes;
  };
  if (holds(res->staging)) return &res->staging;
  for (CudaResources::StagingRegion& region : res->symmetric_regions) {
    if (holds(region)) return &region;
  }
  return nullptr;
}

// Owner: `pointer` (inside this device's current staging region or a symmetric site's allocation:
// nothing else is ever exported) as (export id, offset), exporting the region the first time a post
// refers to it.
ffi::Error ExportStaging(const IpcCall& call, const void* pointer, int64_t* id, int64_t* offset) {
  const CallContext& ctx = call.config.ctx;
  if (pointer == nullptr) {
    *id = -1;
    *offset = 0;
    return ffi::Error::Success();
  }
  std::lock_guard<std::mutex> lock(call.res->ipc_mu);
  const char* p = static_cast<const char*>(pointer);
  CudaResources::StagingRegion* found = ExportableRegion(call.res, p);
  if (found == nullptr) {
    return MakeError(ctx, "a post across processes exposes " + std::to_string(reinterpret_cast<uint64_t>(pointer)) +
                              ", which is not in this device's staging buffer or a symmetric site (a bug: only "
                              "those are exported; XLA's allocations cannot be)");
  }
  CudaResources::StagingRegion& region = *found;
  *offset = static_cast<int64_t>(p - region.base);
  if (region.export_id < 0) {
    cudaIpcMemHandle_t handle;
    FICCO_CHECK_CUDA(cudaIpcGetMemHandle(&handle, region.base));
    int32_t exported = -1;
    FICCO_RETURN_IF_ERROR(call.mailbox->PublishExport(ctx, call.member(), ToBytes(&handle, sizeof(handle)),
                                                      region.bytes, &exported));
    region.export_id = exported;
  }
  *id = region.export_id;
  return ffi::Error::Success();
}

// Owner: the export id of an interprocess event, exporting it the first time.
ffi::Error ExportEvent(const IpcCall& call, Event event, int32_t* id) {
  const CallContext& ctx = call.config.ctx;
  cudaEvent_t cuda_event = static_cast<cudaEvent_t>(event);
  std::lock_guard<std::mutex> lock(call.res->ipc_mu);
  auto found = call.res->exported_events.find(cuda_event);
  if (found != call.res->exported_events.end()) {
    *id = found->second;
    return ffi::Error::Success();
  }
  cudaIpcEventHandle_t handle;
  FICCO_CHECK_CUDA(cudaIpcGetEventHandle(&handle, cuda_event));
  FICCO_RETURN_IF_ERROR(call.mailbox->PublishEvent(ctx, call.member(), ToBytes(&handle, sizeof(handle)), id));
  call.res->exported_events[cuda_event] = *id;
  return ffi::Error::Success();
}

// Puller: a peer's (generation, offset) as a pointer in this process, opening its staging region
// once. Regions a peer outgrew stay mapped until IpcClose: a pull of ours may still read one.
ffi::Error OpenBuffer(const IpcCall& call, int peer, int64_t id, int64_t offset, int64_t bytes, const void** pointer) {
  const CallContext& ctx = call.config.ctx;
  if (id < 0) {
    *pointer = nullptr;
    return ffi::Error::Success();
  }
  std::lock_guard<std::mutex> lock(call.res->ipc_mu);
  const std::pair<int, int32_t> key{peer, static_cast<int32_t>(id)};
  auto found = call.res->opened_allocations.find(key);
  if (found == call.res->opened_allocations.end()) {  // a generation of this peer not seen before
    IpcHandleBytes bytes;
    uint64_t size = 0;
    FICCO_RETURN_IF_ERROR(call.mailbox->ReadExport(ctx, peer, key.second, &bytes, &size));
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, bytes.bytes, sizeof(handle));
    void* base = nullptr;
    const cudaError_t status = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: keep it from surfacing in XLA's next check
      return MakeError(ctx, std::string("cudaIpcOpenMemHandle(staging buffer generation ") + std::to_string(id) +
                                " of device " + std::to_string(peer) + ") failed: " + cudaGetErrorName(status) +
                                " (" + cudaGetErrorString(status) + "); the processes' GPUs need peer access to "
                                "each other: if CUDA_VISIBLE_DEVICES gives each process one GPU, try making all "
                                "GPUs visible and jax.distributed.initialize(local_device_ids=[i]); containers "
                                "need --ipc=host");
    }
    found = call.res->opened_allocations.emplace(key, CudaResources::Opened{static_cast<char*>(base), size}).first;
  }
  const CudaResources::Opened& opened = found->second;
  // What this device reads lies in [offset, offset + bytes): all of it inside the mapping.
  if (offset < 0 || bytes < 0 || static_cast<uint64_t>(offset) > opened.bytes ||
      static_cast<uint64_t>(bytes) > opened.bytes - static_cast<uint64_t>(offset)) {
    return MakeError(ctx, "device " + std::to_string(peer) + " posted " + std::to_string(bytes) + " bytes at offset " +
                              std::to_string(offset) + " of its staging buffer generation " + std::to_string(id) +
                              ", which has " + std::to_string(opened.bytes) + " bytes; expected offset + bytes <= " +
                              std::to_string(opened.bytes) + " (a corrupt post: restart the processes)");
  }
  *pointer = opened.base + offset;
  return ffi::Error::Success();
}

// Puller: a peer's event id as an event of this process, opening it once.
ffi::Error OpenEvent(const IpcCall& call, int peer, int32_t id, Event* event) {
  const CallContext& ctx = call.config.ctx;
  std::lock_guard<std::mutex> lock(call.res->ipc_mu);
  auto found = call.res->opened_events.find({peer, id});
  if (found != call.res->opened_events.end()) {
    *event = found->second;
    return ffi::Error::Success();
  }
  IpcHandleBytes bytes;
  FICCO_RETURN_IF_ERROR(call.mailbox->ReadEvent(ctx, peer, id, &bytes));
  cudaIpcEventHandle_t handle;
  std::memcpy(&handle, bytes.bytes, sizeof(handle));
  cudaEvent_t opened;
  FICCO_CHECK_CUDA(cudaIpcOpenEventHandle(&opened, handle));
  call.res->opened_events[{peer, id}] = opened;
  *event = opened;
  return ffi::Error::Success();
}

}  // namespace

ffi::Error FailIfGroupGaveUp(const OpConfig& config) {
  HostMailbox* mailbox = nullptr;
  FICCO_RETURN_IF_ERROR(Registry::Get().Mailbox(config.ctx, config.ipc_job, &mailbox));
  const MailboxArrival who{&config.ctx, &config.group, config.rank, PhaseName(Phase::kExchange), config.timeout_s};
  return mailbox->FailIfGaveUp(who);
}

ffi::Error NextIpcCall(const OpConfig& config, uint64_t* call) {
  HostMailbox* mailbox = nullptr;
  FICCO_RETURN_IF_ERROR(Registry::Get().Mailbox(config.ctx, config.ipc_job, &mailbox));
  const MailboxArrival who{&config.ctx, &config.group, config.rank, "call", config.timeout_s};
  return mailbox->NextCall(who, call);
}

namespace {
// A peer's post that the tag check let through still has to fit ours: the same number of events
// (the waits index them) and, where both expose a buffer, the same size (the copies read ours).
ffi::Error CheckPeerPost(const OpConfig& config, Phase phase, int rank, const WirePost& theirs, const WirePost& mine) {
  const bool theirs_exposed = theirs.buffer_export >= 0 || theirs.raw_buffer != 0;
  const bool mine_exposed = mine.buffer_export >= 0 || mine.raw_buffer != 0;
  if (theirs.event_ids.size() == mine.event_ids.size() && theirs_exposed == mine_exposed &&
      (!mine_exposed || theirs.buffer_bytes == mine.buffer_bytes)) {
    return ffi::Error::Success();
  }
  return MakeError(config.ctx, std::string("phase '") + PhaseName(phase) + "': rank " + std::to_string(rank) +
                                   " (device " + std::to_string(config.group[rank]) + ") posted " +
                                   std::to_string(theirs.event_ids.size()) + " events and " +
                                   (theirs_exposed ? std::to_string(theirs.buffer_bytes) + " bytes" : "no buffer") +
                                   "; rank " + std::to_string(config.rank) + " posted " +
                                   std::to_string(mine.event_ids.size()) + " events and " +
                                   (mine_exposed ? std::to_string(mine.buffer_bytes) + " bytes" : "no buffer") +
                                   " (the same op must expose the same data on every rank: a corrupt post or "
                                   "different builds; restart the processes)");
}
}  // namespace

ffi::Error MeetAcrossProcesses(const OpConfig& config, Phase phase, uint64_t call_number, const Post& mine,
                               int64_t bytes, std::vector<Post>* posts) {
  const CallContext& ctx = config.ctx;
  // A symmetric site's setup may run while XLA captures (its IPC exports and opens); no other call is
  // captured.
  std::optional<CaptureRelaxed> relaxed;
  if (phase == Phase::kSymmetric) relaxed.emplace();
  HostMailbox* mailbox = nullptr;
  FICCO_RETURN_IF_ERROR(Registry::Get().Mailbox(ctx, config.ipc_job, &mailbox));
  CudaResources* res = Registry::Get().Device(ctx.device_ordinal).cuda().resources();
  if (res == nullptr) return MakeError(ctx, "cross-process rendezvous before the device was prepared (a bug)");
  FICCO_CHECK_CUDA(cudaSetDevice(ctx.device_ordinal));
  IpcCall call{config, mailbox, res};

  // Owner: our staging buffer and events as ids, tagged with the meeting they belong to.
  WirePost wire;
  wire.op_id = ctx.op_id;
  wire.phase = static_cast<int32_t>(phase);
  wire.call = call_number;
  wire.run_id = config.run_id;
  wire.signature = mine.signature;
  FICCO_RETURN_IF_ERROR(ExportStaging(call, mine.buffer, &wire.buffer_export, &wire.buffer_offset));
  wire.buffer_bytes = mine.buffer == nullptr ? 0 : bytes;
  wire.raw_buffer = reinterpret_cast<uint64_t>(mine.buffer);
  wire.event_ids.resize(mine.events.size());
  for (size_t i = 0; i < mine.events.size(); ++i) {
    FICCO_RETURN_IF_ERROR(ExportEvent(call, mine.events[i], &wire.event_ids[i]));
    wire.raw_events.push_back(reinterpret_cast<uint64_t>(mine.events[i]));
  }

  std::vector<WirePost> wires;
  MailboxArrival who{&ctx, &config.group, config.rank, PhaseName(phase), config.timeout_s};
  FICCO_RETURN_IF_ERROR(mailbox->Exchange(who, wire, &wires));
  {
    std::lock_guard<std::mutex> lock(res->ipc_mu);
    ++res->ipc_exchanges;
  }

  // Puller: the peers' ids as pointers and events of this process; our own post stays as it is.
  posts->assign(config.n(), Post{});
  for (int rank = 0; rank < config.n(); ++rank) {
    if (rank == config.rank) {
      (*posts)[rank] = mine;
      continue;
    }
    const WirePost& peer_wire = wires[rank];
    FICCO_RETURN_IF_ERROR(CheckPeerPost(config, phase, rank, peer_wire, wire));
    Post& post = (*posts)[rank];
    const int peer = config.group[rank];
    post.ordinal = peer;
    post.signature = peer_wire.signature;
    if (config.group_local[rank] >= 0) {  // a device of this process: its addresses are ours
      post.buffer = reinterpret_cast<const void*>(peer_wire.raw_buffer);
      for (uint64_t raw : peer_wire.raw_events) post.events.push_back(reinterpret_cast<Event>(raw));
      continue;
    }
    FICCO_RETURN_IF_ERROR(OpenBuffer(call, peer, peer_wire.buffer_export, peer_wire.buffer_offset,
                                     peer_wire.buffer_bytes, &post.buffer));
    post.events.resize(peer_wire.event_ids.size());
    for (size_t i = 0; i < peer_wire.event_ids.size(); ++i) {
      FICCO_RETURN_IF_ERROR(OpenEvent(call, peer, peer_wire.event_ids[i], &post.events[i]));
    }
  }
  return ffi::Error::Success();
}

ffi::Error ExportRegion(const OpConfig& config, void* base, uint64_t bytes) {
  const CallContext& ctx = config.ctx;
  CudaResources* res = Registry::Get().Device(ctx.device_ordinal).cuda().resources();
  if (res == nullptr) return MakeError(ctx, "a symmetric site exported before the device was prepared (a bug)");
  IpcPointerInfo info;
  std::string problem = QueryPointer(reinterpret_cast<uint64_t>(base), &info);
  if (problem.empty() && !info.ipc_capable) {
    problem = "its allocation is not legacy CUDA IPC capable (MIG instances and some virtualised GPUs do not "
              "support CUDA IPC)";
  }
  if (!problem.empty()) {
    return MakeError(ctx, "the symmetric site's buffer cannot be shared with the other processes: " + problem +
                              "; use transfer='pull' or comm='xla' across processes");
  }
  std::lock_guard<std::mutex> lock(res->ipc_mu);
  res->symmetric_regions.push_back(CudaResources::StagingRegion{static_cast<char*>(base), bytes, -1});
  return ffi::Error::Success();
}

ffi::Error StagingBuffer(const OpConfig& config, uint64_t bytes, void** staging) {
  const CallContext& ctx = config.ctx;
  HostMailbox* mailbox = nullptr;  // fails after IpcClose: no new region once the old ones are freed
  FICCO_RETURN_IF_ERROR(Registry::Get().Mailbox(ctx, config.ipc_job, &mailbox));
  CudaResources* res = Registry::Get().Device(ctx.device_ordinal).cuda().resources();
  if (res == nullptr) return MakeError(ctx, "staging buffer asked for before the device was prepared (a bug)");
  std::lock_guard<std::mutex> lock(res->ipc_mu);
  if (res->staging.base == nullptr || res->staging.bytes < bytes) {
    FICCO_RETURN_IF_ERROR(GrowStaging(ctx, res, bytes));
  }
  *staging = res->staging.base;
  return ffi::Error::Success();
}

void RetireStaging(int ordinal) {
  try {  // called from a destructor: nothing may escape
    CudaResources* res = Registry::Get().Device(ordinal).cuda().resources();
    if (res == nullptr) return;
    std::lock_guard<std::mutex> lock(res->ipc_mu);
    if (res->staging.base == nullptr) return;
    res->retired_staging.push_back(res->staging);
    res->staging = CudaResources::StagingRegion{};
  } catch (...) {
  }
}

std::vector<IpcDeviceStats> IpcStats() {
  std::vector<IpcDeviceStats> stats;
  for (int ordinal : Registry::Get().Ordinals()) {
    CudaResources* res = Registry::Get().Device(ordinal).cuda().resources();
    if (res == nullptr) continue;
    std::lock_guard<std::mutex> lock(res->ipc_mu);
    IpcDeviceStats s;
    s.ordinal = ordinal;
    s.exported_allocations = res->staging.export_id >= 0 ? 1 : 0;
    for (const CudaResources::StagingRegion& region : res->retired_staging) {
      if (region.export_id >= 0) ++s.exported_allocations;
      s.retired_staging_bytes += static_cast<int64_t>(region.bytes);
    }
    s.exported_events = static_cast<int64_t>(res->exported_events.size());
    s.opened_allocations = static_cast<int64_t>(res->opened_allocations.size());
    s.opened_events = static_cast<int64_t>(res->opened_events.size());
    s.exchanges = res->ipc_exchanges;
    s.staging_bytes = static_cast<int64_t>(res->staging.bytes);
    s.staging_generations = res->staging_generations;
    stats.push_back(s);
  }
  return stats;
}

std::string DescribePointer(uint64_t pointer, IpcPointerInfo* info) { return QueryPointer(pointer, info); }

std::string DescribeStaging(int ordinal, uint64_t bytes, IpcStagingInfo* info) {
  const CallContext ctx{"ipc_describe_staging", -1, ordinal};
  CudaResources* res = nullptr;
  ffi::Error prepared = Registry::Get().Device(ordinal).cuda().Prepare(ctx, 1, {}, /*peer_stores=*/false, &res);
  if (prepared.failure()) return prepared.message();
  std::lock_guard<std::mutex> lock(res->ipc_mu);
  if (res->staging.base == nullptr || res->staging.bytes < bytes) {
    ffi::Error grown = GrowStaging(ctx, res, bytes);
    if (grown.failure()) return grown.message();
  }
  std::string problem = QueryPointer(reinterpret_cast<uint64_t>(res->staging.base), &info->allocation);
  if (!problem.empty()) return problem;
  info->generation = res->staging_generations;
  info->retired_bytes = 0;
  for (const CudaResources::StagingRegion& region : res->retired_staging) info->retired_bytes += region.bytes;
  cudaIpcMemHandle_t handle;
  const cudaError_t status = cudaIpcGetMemHandle(&handle, res->staging.base);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    info->export_error = std::string("cudaIpcGetMemHandle failed: ") + cudaGetErrorName(status) + " (" +
                         cudaGetErrorString(status) + ")";
  }
  return "";
}

namespace {
// The cross-process calls in flight and whether IpcClose has begun (process-wide: the mappings and
// the mailbox they guard are).
std::mutex& ScopeMu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
std::condition_variable& ScopeCv() {
  static std::condition_variable* cv = new std::condition_variable();
  return *cv;
}
int64_t in_flight = 0;
bool closing = false;
constexpr double kIpcCloseWaitS = 60.0;
}  // namespace

IpcCallScope::IpcCallScope() {
  std::lock_guard<std::mutex> lock(ScopeMu());
  open_ = !closing;
  if (open_) ++in_flight;
}

IpcCallScope::~IpcCallScope() {
  if (!open_) return;
  std::lock_guard<std::mutex> lock(ScopeMu());
  if (--in_flight == 0) ScopeCv().notify_all();
}

int64_t IpcClose() {
  {
    // New calls fail from here; the ones in flight may still enqueue copies from the mappings below.
    std::unique_lock<std::mutex> lock(ScopeMu());
    closing = true;
    const bool drained = ScopeCv().wait_for(lock, std::chrono::duration<double>(kIpcCloseWaitS),
                                            [] { return in_flight == 0; });
    if (!drained) {
      std::fprintf(stderr, "ficco_jax: ipc.close(): %lld cross-process calls still running after %.0f s; their "
                           "mappings are left open\n", static_cast<long long>(in_flight), kIpcCloseWaitS);
      return -1;
    }
  }
  int64_t closed = 0;
  // A symmetric site across processes reaches its peers through the mappings closed below: it stops
  // (a replayed call waits at its first kernel, reported by the watchdog) instead of writing through them.
  Registry::Get().symmetric().FailCrossProcess("this process closed its CUDA IPC mappings (ipc.close())");
  for (int ordinal : Registry::Get().Ordinals()) {
    CudaResources* res = Registry::Get().Device(ordinal).cuda().resources();
    if (res == nullptr) continue;
    std::lock_guard<std::mutex> lock(res->ipc_mu);
    if (cudaSetDevice(ordinal) != cudaSuccess) continue;
    // No copy may still read a mapping we close, nor a peer our staging buffer: every call's join
    // made XLA's stream wait for the peers' pulls from it, so the device idle means they are done.
    (void)cudaDeviceSynchronize();
    for (auto& entry : res->opened_allocations) {
      if (entry.second.base != nullptr && cudaIpcCloseMemHandle(entry.second.base) == cudaSuccess) ++closed;
    }
    res->opened_allocations.clear();
    for (auto& entry : res->opened_events) (void)cudaEventDestroy(entry.second);
    res->opened_events.clear();
    res->retired_staging.push_back(res->staging);
    for (const CudaResources::StagingRegion& region : res->retired_staging) {
      if (region.base != nullptr) (void)cudaFree(region.base);
    }
    res->retired_staging.clear();
    res->staging = CudaResources::StagingRegion{};
    (void)cudaGetLastError();
  }
  Registry::Get().CloseMailbox();
  return closed;
}

}  // namespace ficco
