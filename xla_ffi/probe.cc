// A measurement target for `python -m ficco_jax characterize`: `repeats` matmuls on XLA's stream
// while the copy streams pull every peer's x (an all-gather on copy engines), or the same matmuls
// with no pulls. The time difference is the matmul's slowdown under copy-engine traffic, which
// no op can show on its own: every ficco call joins XLA's stream before it returns, so XLA never
// runs an unrelated matmul beside our copies.
//
//   copy stream 0 : wait(peers' ready) pull(p1) pull(p2) ... own rows     (pull = 1 only)
//   compute       : ready  matmul x repeats  ........  join
#include <string>

#include "guard.h"

namespace ficco {

struct ProbeAttrs {
  int64_t op_id;
  ffi::Span<const int64_t> groups;
  int64_t group_size;
  int64_t timeout_ms;
  int64_t repeats;  // matmuls on the compute stream
  int64_t pull;     // 1: pull every peer's x meanwhile; 0: matmuls alone
};

inline constexpr char kContentionProbeTarget[] = "ficco_contention_probe";

namespace {

ffi::Error RunProbe(Backend& backend, const OpConfig& config, ffi::AnyBuffer a, ffi::AnyBuffer w, ffi::AnyBuffer x,
                    ffi::AnyBuffer out, ffi::AnyBuffer gathered, int64_t repeats, bool pull) {
  const CallContext& ctx = config.ctx;
  Dtype dtype;
  FICCO_RETURN_IF_ERROR(SameDtype(ctx, {a, w, out}, &dtype));
  const int64_t n = config.n();
  if (a.dimensions().size() != 2 || w.dimensions().size() != 2 || a.dimensions()[1] != w.dimensions()[0] ||
      x.dimensions().size() < 1 || repeats < 1) {
    return MakeInvalid(ctx, "contention probe needs a [M, K], w [K, N], x [m, ...] and repeats >= 1; found a " +
                                Shape(a) + ", w " + Shape(w) + ", x " + Shape(x) + ", repeats " + std::to_string(repeats));
  }
  const int64_t rows = a.dimensions()[0], inner = a.dimensions()[1], cols = w.dimensions()[1];
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "out", out, {rows, cols}));
  if (gathered.size_bytes() != static_cast<size_t>(n) * x.size_bytes()) {
    return MakeInvalid(ctx, "contention probe: gathered " + Shape(gathered) + " must hold n = " + std::to_string(n) +
                                " copies of x " + Shape(x));
  }
  FICCO_RETURN_IF_ERROR(backend.Prepare(1, config.group));
  CallSession session(config, {5, static_cast<int64_t>(dtype), rows, inner, cols,
                               static_cast<int64_t>(x.size_bytes()), repeats, pull ? 1 : 0, n});
  Event ready;
  FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &ready));
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Meet(Phase::kExchange, x.untyped_data(), {ready}, &posts));
  const size_t shard = x.size_bytes();
  char* dst = static_cast<char*>(gathered.untyped_data());
  if (pull) {
    for (int slot = 0; slot < n - 1; ++slot) {
      const int peer = config.SourceOfSlot(slot);
      FICCO_RETURN_IF_ERROR(backend.Wait(0, posts[peer].events[0]));
      FICCO_RETURN_IF_ERROR(backend.Copy(0, dst + peer * shard, posts[peer].buffer, shard));
    }
  }
  FICCO_RETURN_IF_ERROR(backend.Wait(0, ready));
  FICCO_RETURN_IF_ERROR(backend.Copy(0, dst + config.rank * shard, x.untyped_data(), shard));
  for (int64_t i = 0; i < repeats; ++i) {
    FICCO_RETURN_IF_ERROR(backend.Gemm({a.untyped_data(), w.untyped_data(), out.untyped_data(), rows, inner, cols, dtype}));
  }
  return JoinAndRelease(backend, config, session);
}

OpAttrs AsOpAttrs(const ProbeAttrs& p) {
  // One copy stream, direct, one chunk; no fault injection in a measurement.
  // In-process groups only (dma_probe.py refuses groups across processes): ordinals are local.
  return OpAttrs{p.op_id, p.groups, p.groups, 0, p.group_size, 1, 1, 0, 1, p.timeout_ms, -1, 0};
}

ffi::Error ProbeCpu(int32_t ordinal, ffi::RunId run, ffi::AnyBuffer a, ffi::AnyBuffer w, ffi::AnyBuffer x,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> gathered, ProbeAttrs attrs) {
  return GuardCpu(kContentionProbeTarget, ordinal, run, AsOpAttrs(attrs), [&](Backend& b, const OpConfig& c) {
    return RunProbe(b, c, a, w, x, *out, *gathered, attrs.repeats, attrs.pull != 0);
  });
}

#ifdef FICCO_WITH_CUDA
ffi::Error ProbeCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer a, ffi::AnyBuffer w,
                     ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> gathered,
                     ProbeAttrs attrs) {
  return GuardCuda(kContentionProbeTarget, stream, ordinal, run, AsOpAttrs(attrs), [&](Backend& b, const OpConfig& c) {
    return RunProbe(b, c, a, w, x, *out, *gathered, attrs.repeats, attrs.pull != 0);
  });
}
#endif

}  // namespace
}  // namespace ficco

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ficco::ProbeAttrs, ::xla::ffi::StructMember<int64_t>("op_id"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("groups"),
    ::xla::ffi::StructMember<int64_t>("group_size"), ::xla::ffi::StructMember<int64_t>("timeout_ms"),
    ::xla::ffi::StructMember<int64_t>("repeats"), ::xla::ffi::StructMember<int64_t>("pull"));

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoContentionProbeCpu, ficco::ProbeCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()  // device ordinal
                                  .Ctx<ffi::RunId>()          // launch id
                                  .Arg<ffi::AnyBuffer>()      // a [M, K]
                                  .Arg<ffi::AnyBuffer>()      // w [K, N]
                                  .Arg<ffi::AnyBuffer>()      // x [m, ...], the shard peers pull
                                  .Ret<ffi::AnyBuffer>()      // out [M, N]
                                  .Ret<ffi::AnyBuffer>()      // gathered [n*m, ...] (peers' rows only with pull)
                                  .Attrs<ficco::ProbeAttrs>());

#ifdef FICCO_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoContentionProbeCuda, ficco::ProbeCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device ordinal
                                  .Ctx<ffi::RunId>()                         // launch id
                                  .Arg<ffi::AnyBuffer>()                     // a
                                  .Arg<ffi::AnyBuffer>()                     // w
                                  .Arg<ffi::AnyBuffer>()                     // x
                                  .Ret<ffi::AnyBuffer>()                     // out
                                  .Ret<ffi::AnyBuffer>()                     // gathered
                                  .Attrs<ficco::ProbeAttrs>());
#endif
