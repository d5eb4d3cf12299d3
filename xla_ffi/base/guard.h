// The wall every FFI handler runs its op behind: nothing thrown escapes (an exception, e.g.
// std::bad_alloc, becomes an ffi::Error naming the target); CUDA and cuBLAS failures are already
// ffi::Errors by then (FICCO_CHECK_CUDA, errors.h).
#ifndef FICCO_JAX_XLA_FFI_BASE_GUARD_H_
#define FICCO_JAX_XLA_FFI_BASE_GUARD_H_

#include <exception>
#include <string>
#include <utility>

#include "base/errors.h"

namespace ficco {

// Runs `body` (returning ffi::Error) and turns anything it throws into an ffi::Error.
template <typename Body>
ffi::Error Guard(const char* target, Body&& body) {
  try {
    return std::forward<Body>(body)();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("ficco_jax: ") + target + ": unexpected exception: " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string("ficco_jax: ") + target + ": unexpected exception");
  }
}

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_BASE_GUARD_H_
