// The backend of one device: streams, events, copies, matmuls and reductions. The executor
// (exec/) speaks only to this interface; device/backends.h makes the CPU and the CUDA one.
//
// On CUDA the compute stream is XLA's stream and copies run on copy streams ordered by events; on
// CPU every call runs synchronously in the order issued, so the same issue order is the execution
// order and the CPU backend exercises the rendezvous, chunk indexing and ordering.
#ifndef FICCO_JAX_XLA_FFI_DEVICE_BACKEND_H_
#define FICCO_JAX_XLA_FFI_DEVICE_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/errors.h"
#include "device/gemm.h"
#include "device/reduce.h"

namespace ficco {

// An opaque event handle: a cudaEvent_t on CUDA, unused (nullptr) on CPU.
using Event = void*;

// Copy streams of one device: 0 .. kMaxCopyStreams-1 carry a schedule's transfers; one more,
// kStagingStream, carries the staging copies of groups across processes (runtime/ipc.h). It is
// always the same stream, so that the wait which protects the staging buffer (CallSession,
// runtime/call_session.cc) orders every later staging copy of this device.
constexpr int kMaxCopyStreams = 8;
constexpr int kStagingStream = kMaxCopyStreams;
constexpr int kCopyStreamSlots = kMaxCopyStreams + 1;

// A byte offset into a device buffer.
inline const char* Offset(const void* base, int64_t bytes) { return static_cast<const char*>(base) + bytes; }
inline char* Offset(void* base, int64_t bytes) { return static_cast<char*>(base) + bytes; }

class Backend {
 public:
  static constexpr int kCompute = -1;  // XLA's stream; copy streams are 0 .. copy_streams-1
  // The copy stream of the staging copies (groups across processes, see CallSession::Exchange);
  // Prepare(kCopyStreamSlots, ...) creates it.
  static constexpr int kStaging = kStagingStream;
  virtual ~Backend() = default;
  // Creates persistent resources on first use (copy streams, peer access, cuBLASLt).
  virtual ffi::Error Prepare(int copy_streams, const std::vector<int>& group) = 0;
  // Takes an event from the pool and records it on `stream`.
  virtual ffi::Error Record(int stream, Event* event) = 0;
  // `stream` waits for `event` (possibly recorded on another device).
  virtual ffi::Error Wait(int stream, Event event) = 0;
  virtual ffi::Error Copy(int stream, void* dst, const void* src, size_t bytes) = 0;
  virtual ffi::Error Gemm(const GemmProblem& problem) = 0;       // on the compute stream
  virtual ffi::Error Reduce(const ReduceProblem& problem) = 0;   // on the compute stream
  // Returns this call's events to the pool. Called only after the "release" rendezvous, see
  // JoinAndRelease() in runtime/call_session.cc for why that makes re-recording them safe.
  virtual void ReleaseEvents() = 0;
};

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_DEVICE_BACKEND_H_
