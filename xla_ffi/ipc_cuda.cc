// CUDA IPC for groups across processes of one host (see ipc.h): exporting and opening
// allocations and interprocess events, and translating one call's posts through the mailbox.
//
//   Owner  (posts its buffer): pointer -> (allocation base, offset) -> export id, once per
//          allocation; its events -> export ids, once per event.
//   Puller (reads a peer's):   (peer, export id) -> opened mapping + offset; (peer, event id) ->
//          opened event, each opened once per device and kept until IpcClose.
#include "ipc.h"

#include <cuda.h>

#include <cstring>
#include <mutex>

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

// Owner: `pointer` as (export id, offset), exporting its allocation the first time.
ffi::Error ExportBuffer(const IpcCall& call, const void* pointer, int64_t* id, int64_t* offset) {
  const CallContext& ctx = call.config.ctx;
  if (pointer == nullptr) {
    *id = -1;
    *offset = 0;
    return ffi::Error::Success();
  }
  IpcPointerInfo info;
  std::string problem = QueryPointer(reinterpret_cast<uint64_t>(pointer), &info);
  if (!problem.empty()) return MakeError(ctx, "exporting a buffer to peer processes: " + problem);
  *offset = static_cast<int64_t>(reinterpret_cast<uint64_t>(pointer) - info.base);
  std::lock_guard<std::mutex> lock(call.res->ipc_mu);
  auto found = call.res->exported_allocations.find(info.buffer_id);
  if (found != call.res->exported_allocations.end()) {
    *id = found->second;
    return ffi::Error::Success();
  }
  if (!info.ipc_capable) {
    return MakeError(ctx, "XLA's buffer at " + std::to_string(reinterpret_cast<uint64_t>(pointer)) +
                              " lies in an allocation (base " + std::to_string(info.base) + ", " +
                              std::to_string(info.bytes) + " bytes) that legacy CUDA IPC cannot export "
                              "(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 0: a cuMemCreate or "
                              "memory-pool allocation); use XLA's default BFC allocator "
                              "(XLA_PYTHON_CLIENT_ALLOCATOR unset) or comm='xla'");
  }
  cudaIpcMemHandle_t handle;
  FICCO_CHECK_CUDA(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(info.base)));
  int32_t exported = -1;
  FICCO_RETURN_IF_ERROR(call.mailbox->PublishExport(ctx, call.member(), ToBytes(&handle, sizeof(handle)),
                                                    info.bytes, &exported));
  call.res->exported_allocations[info.buffer_id] = exported;
  *id = exported;
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

// Puller: a peer's (export id, offset) as a pointer in this process, opening the allocation once.
ffi::Error OpenBuffer(const IpcCall& call, int peer, int64_t id, int64_t offset, const void** pointer) {
  const CallContext& ctx = call.config.ctx;
  if (id < 0) {
    *pointer = nullptr;
    return ffi::Error::Success();
  }
  std::lock_guard<std::mutex> lock(call.res->ipc_mu);
  CudaResources::Opened& opened = call.res->opened_allocations[{peer, static_cast<int32_t>(id)}];
  if (opened.base == nullptr) {
    IpcHandleBytes bytes;
    uint64_t size = 0;
    FICCO_RETURN_IF_ERROR(call.mailbox->ReadExport(ctx, peer, static_cast<int32_t>(id), &bytes, &size));
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, bytes.bytes, sizeof(handle));
    void* base = nullptr;
    cudaError_t status = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      call.res->opened_allocations.erase({peer, static_cast<int32_t>(id)});
      return MakeError(ctx, std::string("cudaIpcOpenMemHandle(allocation ") + std::to_string(id) + " of device " +
                                std::to_string(peer) + ") failed: " + cudaGetErrorName(status) + " (" +
                                cudaGetErrorString(status) + "); the processes' GPUs need peer access to each "
                                "other: if CUDA_VISIBLE_DEVICES gives each process one GPU, try making all GPUs "
                                "visible and jax.distributed.initialize(local_device_ids=[i]); containers need "
                                "--ipc=host");
    }
    opened.base = static_cast<char*>(base);
    opened.bytes = size;
  }
  if (offset < 0 || static_cast<uint64_t>(offset) >= opened.bytes) {
    return MakeError(ctx, "device " + std::to_string(peer) + " posted offset " + std::to_string(offset) +
                              " beyond its allocation " + std::to_string(id) + " of " + std::to_string(opened.bytes) +
                              " bytes");
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

ffi::Error MeetAcrossProcesses(const OpConfig& config, Phase phase, const Post& mine, std::vector<Post>* posts) {
  const CallContext& ctx = config.ctx;
  HostMailbox* mailbox = nullptr;
  FICCO_RETURN_IF_ERROR(Registry::Get().Mailbox(ctx, config.ipc_job, &mailbox));
  CudaResources* res = Registry::Get().Device(ctx.device_ordinal).cuda_resources();
  if (res == nullptr) return MakeError(ctx, "cross-process rendezvous before the device was prepared (a bug)");
  FICCO_CHECK_CUDA(cudaSetDevice(ctx.device_ordinal));
  IpcCall call{config, mailbox, res};

  // Owner: our buffer and events as ids.
  WirePost wire;
  wire.op_id = ctx.op_id;
  wire.signature = mine.signature;
  FICCO_RETURN_IF_ERROR(ExportBuffer(call, mine.buffer, &wire.buffer_export, &wire.buffer_offset));
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
    Post& post = (*posts)[rank];
    const int peer = config.group[rank];
    post.ordinal = peer;
    post.signature = peer_wire.signature;
    if (config.group_local[rank] >= 0) {  // a device of this process: its addresses are ours
      post.buffer = reinterpret_cast<const void*>(peer_wire.raw_buffer);
      for (uint64_t raw : peer_wire.raw_events) post.events.push_back(reinterpret_cast<Event>(raw));
      continue;
    }
    FICCO_RETURN_IF_ERROR(OpenBuffer(call, peer, peer_wire.buffer_export, peer_wire.buffer_offset, &post.buffer));
    post.events.resize(peer_wire.event_ids.size());
    for (size_t i = 0; i < peer_wire.event_ids.size(); ++i) {
      FICCO_RETURN_IF_ERROR(OpenEvent(call, peer, peer_wire.event_ids[i], &post.events[i]));
    }
  }
  return ffi::Error::Success();
}

std::vector<IpcDeviceStats> IpcStats() {
  std::vector<IpcDeviceStats> stats;
  for (int ordinal : Registry::Get().Ordinals()) {
    CudaResources* res = Registry::Get().Device(ordinal).cuda_resources();
    if (res == nullptr) continue;
    std::lock_guard<std::mutex> lock(res->ipc_mu);
    IpcDeviceStats s;
    s.ordinal = ordinal;
    s.exported_allocations = static_cast<int64_t>(res->exported_allocations.size());
    s.exported_events = static_cast<int64_t>(res->exported_events.size());
    s.opened_allocations = static_cast<int64_t>(res->opened_allocations.size());
    s.opened_events = static_cast<int64_t>(res->opened_events.size());
    s.exchanges = res->ipc_exchanges;
    stats.push_back(s);
  }
  return stats;
}

std::string DescribePointer(uint64_t pointer, IpcPointerInfo* info) { return QueryPointer(pointer, info); }

int64_t IpcClose() {
  int64_t closed = 0;
  for (int ordinal : Registry::Get().Ordinals()) {
    CudaResources* res = Registry::Get().Device(ordinal).cuda_resources();
    if (res == nullptr) continue;
    std::lock_guard<std::mutex> lock(res->ipc_mu);
    if (cudaSetDevice(ordinal) != cudaSuccess) continue;
    (void)cudaDeviceSynchronize();  // no copy may still read a mapping we close
    for (auto& entry : res->opened_allocations) {
      if (entry.second.base != nullptr && cudaIpcCloseMemHandle(entry.second.base) == cudaSuccess) ++closed;
    }
    res->opened_allocations.clear();
    for (auto& entry : res->opened_events) (void)cudaEventDestroy(entry.second);
    res->opened_events.clear();
    (void)cudaGetLastError();
  }
  Registry::Get().CloseMailbox();
  return closed;
}

}  // namespace ficco
