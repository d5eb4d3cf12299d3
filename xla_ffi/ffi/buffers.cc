#include "ffi/buffers.h"

#include "base/text.h"

namespace ficco {

// Buffer checks shared by every op's Impl (declared in buffers.h).
std::string Shape(ffi::AnyBuffer buffer) {
  return "[" + JoinNumbers(buffer.dimensions()) + "]";
}

// An operand's dtype: FP8 where `fp8` (the scaled targets), else bf16, f16 or f32 — never the
// other kind, which a matmul of the wrong form would read as garbage.
static ffi::Error ToDtype(const CallContext& ctx, ffi::DataType type, Dtype* dtype, bool fp8 = false) {
  const char* name = nullptr;
  switch (type) {
    case ffi::DataType::F32: *dtype = Dtype::kF32; name = "float32"; break;
    case ffi::DataType::BF16: *dtype = Dtype::kBF16; name = "bfloat16"; break;
    case ffi::DataType::F16: *dtype = Dtype::kF16; name = "float16"; break;
    case ffi::DataType::F8E4M3FN: *dtype = Dtype::kF8E4M3; name = "float8_e4m3fn"; break;
    case ffi::DataType::F8E5M2: *dtype = Dtype::kF8E5M2; name = "float8_e5m2"; break;
    default: break;
  }
  if (name != nullptr && IsFp8(*dtype) == fp8) return ffi::Error::Success();
  const std::string found = name != nullptr ? name : "type " + std::to_string(static_cast<int>(type));
  return MakeInvalid(ctx, "unsupported dtype " + found + "; expected " +
                              (fp8 ? "float8_e4m3fn or float8_e5m2 (the scaled FP8 targets)"
                                   : "bfloat16, float16 or float32"));
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

ffi::Error MatmulDtypes(const OpConfig& config, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c, bool fp8,
                        const ffi::AnyBuffer* scales, MatmulTypes* types) {
  const CallContext& ctx = config.ctx;
  types->b_transposed = config.w_col_major;
  FICCO_RETURN_IF_ERROR(ToDtype(ctx, a.element_type(), &types->a, fp8));
  FICCO_RETURN_IF_ERROR(ToDtype(ctx, b.element_type(), &types->b, fp8));
  FICCO_RETURN_IF_ERROR(ToDtype(ctx, c.element_type(), &types->c));
  if (fp8) {
    for (int i = 0; scales != nullptr && i < 2; ++i) {
      if (scales[i].element_type() != ffi::DataType::F32 || scales[i].element_count() != 1) {
        return MakeInvalid(ctx, "an FP8 operand's scale must be one float32, found " + Shape(scales[i]));
      }
    }
    if (types->a == Dtype::kF8E5M2 && types->b == Dtype::kF8E5M2) {
      return MakeInvalid(ctx, "float8_e5m2 x float8_e5m2 matmuls are not supported; make one operand float8_e4m3fn");
    }
    if (!types->b_transposed) {
      return MakeInvalid(ctx, "an FP8 matmul takes w column-major (cuBLASLt's FP8 matmuls need the \"TN\" form), "
                              "found w_col_major=0; lower it with w_col_major=1 (ficco_jax/lowering/dma/registry.py)");
    }
    if (scales != nullptr) {
      types->a_scale = static_cast<const float*>(scales[0].untyped_data());
      types->b_scale = static_cast<const float*>(scales[1].untyped_data());
    }
    return ffi::Error::Success();
  }
  if (types->a != types->b || (types->c != types->a && types->c != Dtype::kF32)) {
    return MakeInvalid(ctx, "matmul operands must share one dtype and the result have it or float32");
  }
  return ffi::Error::Success();
}

}  // namespace ficco
