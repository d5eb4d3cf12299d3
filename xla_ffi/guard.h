// The one wrapper every FFI handler runs its op in: decode the attributes, make the platform's
// Backend, run the op's Impl; nothing thrown escapes (an exception becomes ffi::Error).
#ifndef FICCO_JAX_XLA_FFI_GUARD_H_
#define FICCO_JAX_XLA_FFI_GUARD_H_

#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "backends.h"
#include "handlers.h"

namespace ficco {

using BackendFactory = std::function<std::unique_ptr<Backend>(const OpConfig&)>;
using OpBody = std::function<ffi::Error(Backend&, const OpConfig&)>;

// GPU peers reach a rendezvous within microseconds of each other: CUDA handlers spin this long
// before sleeping (see Arrival::spin_s). CPU handlers sleep at once.
inline constexpr double kCudaRendezvousSpinSeconds = 100e-6;

inline ffi::Error Guard(const char* target, int32_t ordinal, ffi::RunId run_id, const OpAttrs& attrs,
                        const BackendFactory& make_backend, double spin_s, const OpBody& body) {
  try {
    OpConfig config;
    FICCO_RETURN_IF_ERROR(DecodeConfig(attrs, target, ordinal, run_id.run_id, &config));
    config.spin_s = spin_s;
    std::unique_ptr<Backend> backend = make_backend(config);
    return body(*backend, config);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("ficco_jax: ") + target + ": unexpected exception: " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string("ficco_jax: ") + target + ": unexpected exception");
  }
}

inline ffi::Error GuardCpu(const char* target, int32_t ordinal, ffi::RunId run_id, const OpAttrs& attrs,
                           const OpBody& body) {
  return Guard(target, ordinal, run_id, attrs, [](const OpConfig& config) { return MakeCpuBackend(config.ctx); },
               0.0, body);
}

#ifdef FICCO_WITH_CUDA
inline ffi::Error GuardCuda(const char* target, cudaStream_t stream, int32_t ordinal, ffi::RunId run_id,
                            const OpAttrs& attrs, const OpBody& body) {
  // A group across processes records interprocess events: peers in other processes wait on them.
  return Guard(target, ordinal, run_id, attrs,
               [stream](const OpConfig& config) {
                 return MakeCudaBackend(config.ctx, stream, /*interprocess_events=*/config.cross_process());
               },
               kCudaRendezvousSpinSeconds, body);
}
#endif

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_GUARD_H_
