// Error plumbing shared by every ficco_jax C++ file.
//
// Nothing may escape an FFI handler except an ffi::Error: launchers return plain CUDA/cuBLAS
// status codes, and FICCO_CHECK_CUDA turns a failing one (CUDA runtime or cuBLAS) into an ffi::Error that names
// the call, the op and the device ordinal. The macro expects a `const CallContext& ctx` in
// scope (the op being run and the device running it).
#ifndef FICCO_JAX_XLA_FFI_BASE_ERRORS_H_
#define FICCO_JAX_XLA_FFI_BASE_ERRORS_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = xla::ffi;

// Who is failing: every error message starts with this.
struct CallContext {
  const char* target = "";  // FFI target name, e.g. "ficco_ag_matmul"
  int64_t op_id = -1;
  int device_ordinal = -1;

  std::string Describe() const {
    return std::string("ficco_jax: op ") + std::to_string(op_id) + " (" + target + ") on device " +
           std::to_string(device_ordinal);
  }
};

inline ffi::Error MakeError(const CallContext& ctx, const std::string& what) {
  return ffi::Error::Internal(ctx.Describe() + ": " + what);
}

inline ffi::Error MakeInvalid(const CallContext& ctx, const std::string& what) {
  return ffi::Error::InvalidArgument(ctx.Describe() + ": " + what);
}

}  // namespace ficco

// Propagate a failing ffi::Error.
#define FICCO_RETURN_IF_ERROR(expr)               \
  do {                                            \
    ::xla::ffi::Error ficco_error_ = (expr);      \
    if (ficco_error_.failure()) return ficco_error_; \
  } while (0)

#ifdef FICCO_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>

namespace ficco {

// What a failing CUDA runtime or cuBLAS status says, for FICCO_CHECK_CUDA's message.
inline bool CallFailed(cudaError_t status) { return status != cudaSuccess; }
inline bool CallFailed(cublasStatus_t status) { return status != CUBLAS_STATUS_SUCCESS; }
inline std::string StatusText(cudaError_t status) {
  return std::string(cudaGetErrorName(status)) + " (" + cudaGetErrorString(status) + ")";
}
inline std::string StatusText(cublasStatus_t status) {
  return "cublasStatus " + std::to_string(static_cast<int>(status));
}

}  // namespace ficco

// The one check of a CUDA runtime or cuBLAS(Lt) call: on failure, returns an ffi::Error that names
// the call, the op and the device (from `ctx`).
#define FICCO_CHECK_CUDA(call)                                                                   \
  do {                                                                                           \
    const auto ficco_status_ = (call);                                                           \
    if (::ficco::CallFailed(ficco_status_)) {                                                    \
      return ::ficco::MakeError(ctx, std::string(#call) + " failed: " + ::ficco::StatusText(ficco_status_)); \
    }                                                                                            \
  } while (0)
#endif  // FICCO_WITH_CUDA

#endif  // FICCO_JAX_XLA_FFI_BASE_ERRORS_H_
