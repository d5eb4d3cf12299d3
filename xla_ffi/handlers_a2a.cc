// FFI layer of the all-to-all targets: buffer checks (Impls) and the handler symbols that
// module.cc hands to Python. Same shape as module.cc's handlers: decode the attributes, make the
// platform's Backend, run the Impl; nothing thrown escapes.
#include <algorithm>
#include <string>

#include "a2a.h"
#include "guard.h"

namespace ficco {

// ---------------------------------------------------------------------------------------------
// Impls
// ---------------------------------------------------------------------------------------------
ffi::Error AllToAllImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer out) {
  const CallContext& ctx = config.ctx;
  const int64_t n = config.n();
  auto dims = x.dimensions();
  if (dims.size() < 1 || dims[0] != n || x.element_type() != out.element_type() ||
      out.size_bytes() != x.size_bytes() || out.dimensions().size() != dims.size()) {
    return MakeInvalid(ctx, "all_to_all: x " + Shape(x) + " and out " + Shape(out) +
                                " must both be [n, ...] of one dtype and shape, n = " + std::to_string(n));
  }
  AllToAllArgs args;
  args.x = x.untyped_data();
  args.received = out.untyped_data();
  args.groups = 1;
  args.rows = dims.size() >= 2 ? dims[1] : 1;  // chunks cut the first dimension of a block
  const int64_t block_bytes = static_cast<int64_t>(x.size_bytes()) / n;
  args.row_bytes = args.rows == 0 ? 0 : block_bytes / args.rows;
  return RunAllToAll(backend, config, args);
}

ffi::Error A2aMatmulImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::AnyBuffer out, ffi::AnyBuffer received) {
  const CallContext& ctx = config.ctx;
  AllToAllArgs args;
  FICCO_RETURN_IF_ERROR(SameDtype(ctx, {x, w, out, received}, &args.dtype));
  const int64_t n = config.n();
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 4 || wd.size() != 3 || xd[0] != n || xd[1] != wd[0] || xd[3] != wd[1]) {
    return MakeInvalid(ctx, "a2a_matmul needs x [n, E, C, d] and w [E, d, f] with n = " + std::to_string(n) +
                                "; found x " + Shape(x) + ", w " + Shape(w));
  }
  const int64_t e = xd[1], c = xd[2], d = xd[3], f = wd[2];
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "out", out, {n, e, c, f}));
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "received", received, {n, e, c, d}));
  args.x = x.untyped_data();
  args.received = received.untyped_data();
  args.groups = e;
  args.rows = c;
  args.row_bytes = d * static_cast<int64_t>(ByteWidth(args.dtype));
  args.w = w.untyped_data();
  args.out = out.untyped_data();
  args.inner = d;
  args.cols = f;
  return RunAllToAll(backend, config, args);
}

ffi::Error MatmulA2aImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer y, ffi::AnyBuffer w,
                         ffi::AnyBuffer out, ffi::AnyBuffer send) {
  const CallContext& ctx = config.ctx;
  MatmulAllToAllArgs args;
  FICCO_RETURN_IF_ERROR(SameDtype(ctx, {y, w, out, send}, &args.dtype));
  const int64_t n = config.n();
  auto yd = y.dimensions();
  auto wd = w.dimensions();
  if (yd.size() != 4 || wd.size() != 3 || yd[0] != n || yd[1] != wd[0] || yd[3] != wd[1]) {
    return MakeInvalid(ctx, "matmul_a2a needs y [n, E, C, f] and w [E, f, d] with n = " + std::to_string(n) +
                                "; found y " + Shape(y) + ", w " + Shape(w));
  }
  const int64_t e = yd[1], c = yd[2], d = wd[2];
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "out", out, {n, e, c, d}));
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "send", send, {std::max<int64_t>(n - 1, 1), e, c, d}));
  args.y = y.untyped_data();
  args.w = w.untyped_data();
  args.out = out.untyped_data();
  args.send = send.untyped_data();
  args.groups = e;
  args.rows = c;
  args.inner = yd[3];
  args.cols = d;
  return RunMatmulAllToAll(backend, config, args);
}

// ---------------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------------
namespace {

ffi::Error AllToAllCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                       OpAttrs attrs) {
  return GuardCpu(kAllToAllTarget, ordinal, run, attrs,
                  [&](Backend& b, const OpConfig& c) { return AllToAllImpl(b, c, x, *out); });
}

ffi::Error A2aMatmulCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> received, OpAttrs attrs) {
  return GuardCpu(kA2aMatmulTarget, ordinal, run, attrs,
                  [&](Backend& b, const OpConfig& c) { return A2aMatmulImpl(b, c, x, w, *out, *received); });
}

ffi::Error MatmulA2aCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer y, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> send, OpAttrs attrs) {
  return GuardCpu(kMatmulA2aTarget, ordinal, run, attrs,
                  [&](Backend& b, const OpConfig& c) { return MatmulA2aImpl(b, c, y, w, *out, *send); });
}

#ifdef FICCO_WITH_CUDA
ffi::Error AllToAllCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> out, OpAttrs attrs) {
  return GuardCuda(kAllToAllTarget, stream, ordinal, run, attrs,
                   [&](Backend& b, const OpConfig& c) { return AllToAllImpl(b, c, x, *out); });
}

ffi::Error A2aMatmulCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> received, OpAttrs attrs) {
  return GuardCuda(kA2aMatmulTarget, stream, ordinal, run, attrs,
                   [&](Backend& b, const OpConfig& c) { return A2aMatmulImpl(b, c, x, w, *out, *received); });
}

ffi::Error MatmulA2aCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer y, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> send, OpAttrs attrs) {
  return GuardCuda(kMatmulA2aTarget, stream, ordinal, run, attrs,
                   [&](Backend& b, const OpConfig& c) { return MatmulA2aImpl(b, c, y, w, *out, *send); });
}
#endif  // FICCO_WITH_CUDA

}  // namespace
}  // namespace ficco

// ---------------------------------------------------------------------------------------------
// Handler symbols (module.cc declares them and hands them to Python). Not command-buffer
// compatible: the host rendezvous must run on every execution.
// ---------------------------------------------------------------------------------------------
namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAllToAllCpu, ficco::AllToAllCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()  // device ordinal
                                  .Ctx<ffi::RunId>()          // launch id, shared by all devices
                                  .Arg<ffi::AnyBuffer>()      // x [n, ...]
                                  .Ret<ffi::AnyBuffer>()      // out [n, ...]
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoA2aMatmulCpu, ficco::A2aMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()  // device ordinal
                                  .Ctx<ffi::RunId>()          // launch id
                                  .Arg<ffi::AnyBuffer>()      // x [n, E, C, d]
                                  .Arg<ffi::AnyBuffer>()      // w [E, d, f]
                                  .Ret<ffi::AnyBuffer>()      // out [n, E, C, f]
                                  .Ret<ffi::AnyBuffer>()      // received [n, E, C, d]
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoMatmulA2aCpu, ficco::MatmulA2aCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()  // device ordinal
                                  .Ctx<ffi::RunId>()          // launch id
                                  .Arg<ffi::AnyBuffer>()      // y [n, E, C, f]
                                  .Arg<ffi::AnyBuffer>()      // w [E, f, d]
                                  .Ret<ffi::AnyBuffer>()      // out [n, E, C, d]
                                  .Ret<ffi::AnyBuffer>()      // send workspace [max(n-1, 1), E, C, d]
                                  .Attrs<ficco::OpAttrs>());

#ifdef FICCO_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoAllToAllCuda, ficco::AllToAllCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device ordinal
                                  .Ctx<ffi::RunId>()                         // launch id
                                  .Arg<ffi::AnyBuffer>()                     // x
                                  .Ret<ffi::AnyBuffer>()                     // out
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoA2aMatmulCuda, ficco::A2aMatmulCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device ordinal
                                  .Ctx<ffi::RunId>()                         // launch id
                                  .Arg<ffi::AnyBuffer>()                     // x
                                  .Arg<ffi::AnyBuffer>()                     // w
                                  .Ret<ffi::AnyBuffer>()                     // out
                                  .Ret<ffi::AnyBuffer>()                     // received
                                  .Attrs<ficco::OpAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoMatmulA2aCuda, ficco::MatmulA2aCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device ordinal
                                  .Ctx<ffi::RunId>()                         // launch id
                                  .Arg<ffi::AnyBuffer>()                     // y
                                  .Arg<ffi::AnyBuffer>()                     // w
                                  .Ret<ffi::AnyBuffer>()                     // out
                                  .Ret<ffi::AnyBuffer>()                     // send workspace
                                  .Attrs<ficco::OpAttrs>());
#endif  // FICCO_WITH_CUDA
