// Buffer checks shared by the Impls (ffi/ops.cc): error messages give what was expected and what
// was found.
#ifndef FICCO_JAX_XLA_FFI_FFI_BUFFERS_H_
#define FICCO_JAX_XLA_FFI_FFI_BUFFERS_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/errors.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// "[2, 3]"
std::string Shape(ffi::AnyBuffer buffer);
// `buffer` has exactly `dims` (the message names `name`).
ffi::Error ExpectShape(const CallContext& ctx, const char* name, ffi::AnyBuffer buffer, std::vector<int64_t> dims);
// Every buffer has one supported dtype.
ffi::Error SameDtype(const CallContext& ctx, std::initializer_list<ffi::AnyBuffer> buffers, Dtype* dtype);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_FFI_BUFFERS_H_
