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
#include "device/gemm.h"
#include "runtime/op_config.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// "[2, 3]"
std::string Shape(ffi::AnyBuffer buffer);
// `buffer` has exactly `dims` (the message names `name`).
ffi::Error ExpectShape(const CallContext& ctx, const char* name, ffi::AnyBuffer buffer, std::vector<int64_t> dims);
// Every buffer has one supported dtype.
ffi::Error SameDtype(const CallContext& ctx, std::initializer_list<ffi::AnyBuffer> buffers, Dtype* dtype);
// The matmul types of operands `a`, `b` and result `c` (see MatmulTypes), b column-major where
// `config.w_col_major` says so (which FP8 operands need). FP8 operands only where `fp8` allows them;
// `scales` holds their f32 scalars (a's, b's), or is null (both 1).
ffi::Error MatmulDtypes(const OpConfig& config, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c, bool fp8,
                        const ffi::AnyBuffer* scales, MatmulTypes* types);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_FFI_BUFFERS_H_
