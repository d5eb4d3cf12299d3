#include "ffi/buffers.h"

#include "base/text.h"

namespace ficco {

// Buffer checks shared by every op's Impl (declared in buffers.h).
std::string Shape(ffi::AnyBuffer buffer) {
  return "[" + JoinNumbers(buffer.dimensions()) + "]";
}

static ffi::Error ToDtype(const CallContext& ctx, ffi::DataType type, Dtype* dtype) {
  switch (type) {
    case ffi::DataType::F32: *dtype = Dtype::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *dtype = Dtype::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *dtype = Dtype::kF16; return ffi::Error::Success();
    default:
      return MakeInvalid(ctx, "unsupported dtype " + std::to_string(static_cast<int>(type)) +
                                  "; expected bfloat16, float16 or float32");
  }
}

// `buffer` must have exactly `dims`; `name` and `role` go into the message.
ffi::Error ExpectShape(const CallContext& ctx, const char* name, ffi::AnyBuffer buffer,
                       std::vector<int64_t> dims) {
  auto found = buffer.dimensions();
  bool same = found.size() == dims.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = found[i] == dims[i];
  if (same) return ffi::Error::Success();
  return MakeInvalid(ctx, std::string(name) + " has shape " + Shape(buffer) + ", expected [" + JoinNumbers(dims) + "]");
}

ffi::Error SameDtype(const CallContext& ctx, std::initializer_list<ffi::AnyBuffer> buffers, Dtype* dtype) {
  ffi::DataType first = buffers.begin()->element_type();
  for (ffi::AnyBuffer buffer : buffers) {
    if (buffer.element_type() != first) return MakeInvalid(ctx, "operands and results must share one dtype");
  }
  return ToDtype(ctx, first, dtype);
}

}  // namespace ficco
