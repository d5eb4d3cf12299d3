#include "ffi/ops.h"

#include <algorithm>
#include <string>

#include "exec/executor.h"
#include "ffi/buffers.h"

namespace ficco {
namespace {

constexpr char kRowsPerDevice[] = "rows per device";
constexpr char kRowsPerOutputBlock[] = "rows per output block";
constexpr char kRowsPerPeerBlock[] = "rows per peer block (the capacity C)";

int64_t RowBytes(int64_t elements, Dtype dtype) { return elements * static_cast<int64_t>(ByteWidth(dtype)); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// gather -> consume
// ---------------------------------------------------------------------------------------------
// ag_matmul, unscaled (scales == nullptr) or FP8 with the scales of x and w.
static ffi::Error AgMatmul(Backend& backend, const OpConfig& config, Buffer x, Buffer w, const Buffer* scales,
                           Buffer out, Buffer gathered) {
  const CallContext& ctx = config.ctx;
  MatmulTypes types;
  FICCO_RETURN_IF_ERROR(MatmulDtypes(config, x, w, out, scales != nullptr, scales, &types));
  if (gathered.element_type() != x.element_type()) return MakeInvalid(ctx, "gathered must have x's dtype");
  if (x.dimensions().size() != 2 || w.dimensions().size() != 2 || x.dimensions()[1] != w.dimensions()[0]) {
    return MakeInvalid(ctx, "ag_matmul needs x [m, K] and w [K, N]; found x " + Shape(x) + ", w " + Shape(w));
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], cols = w.dimensions()[1], n = config.n();
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "out", out, {n * m, cols}));
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "gathered", gathered, {n * m, k}));
  return RunGather(backend, config,
                   {SignatureKind::kAgMatmul, kRowsPerDevice, x.untyped_data(), /*x_per_peer=*/false,
                    gathered.untyped_data(), {1, m, RowBytes(k, types.a)}, w.untyped_data(), out.untyped_data(), k,
                    cols, types});
}

ffi::Error AgMatmulImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer w, Buffer out, Buffer gathered) {
  return AgMatmul(backend, config, x, w, nullptr, out, gathered);
}

ffi::Error AgMatmulScaledImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer w, Buffer x_scale,
                              Buffer w_scale, Buffer out, Buffer gathered) {
  const Buffer scales[2] = {x_scale, w_scale};
  return AgMatmul(backend, config, x, w, scales, out, gathered);
}

ffi::Error AllGatherImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer out) {
  const int64_t n = config.n();
  if (x.dimensions().size() < 1 || x.element_type() != out.element_type() ||
      out.dimensions().size() != x.dimensions().size() || out.dimensions()[0] != n * x.dimensions()[0] ||
      out.size_bytes() != static_cast<size_t>(n) * x.size_bytes()) {
    return MakeInvalid(config.ctx, "all_gather: x " + Shape(x) + " and out " + Shape(out) +
                                       " must be [m, ...] and [n*m, ...] of one dtype, n = " + std::to_string(n));
  }
  const int64_t m = x.dimensions()[0];
  const int64_t row_bytes = m == 0 ? 0 : static_cast<int64_t>(x.size_bytes()) / m;
  return RunGather(backend, config,
                   {SignatureKind::kAllGather, kRowsPerDevice, x.untyped_data(), /*x_per_peer=*/false,
                    out.untyped_data(), {1, m, row_bytes}});
}

ffi::Error AllToAllImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer out) {
  const int64_t n = config.n();
  auto dims = x.dimensions();
  if (dims.size() < 1 || dims[0] != n || x.element_type() != out.element_type() ||
      out.size_bytes() != x.size_bytes() || out.dimensions().size() != dims.size()) {
    return MakeInvalid(config.ctx, "all_to_all: x " + Shape(x) + " and out " + Shape(out) +
                                       " must both be [n, ...] of one dtype and shape, n = " + std::to_string(n));
  }
  const int64_t rows = dims.size() >= 2 ? dims[1] : 1;  // chunks cut the first dimension of a block
  const int64_t block_bytes = static_cast<int64_t>(x.size_bytes()) / n;
  return RunGather(backend, config,
                   {SignatureKind::kAllToAll, kRowsPerPeerBlock, x.untyped_data(), /*x_per_peer=*/true,
                    out.untyped_data(), {1, rows, rows == 0 ? 0 : block_bytes / rows}});
}

ffi::Error A2aMatmulImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer w, Buffer out, Buffer received) {
  const CallContext& ctx = config.ctx;
  MatmulTypes types;
  FICCO_RETURN_IF_ERROR(MatmulDtypes(config, x, w, out, false, nullptr, &types));
  if (received.element_type() != x.element_type()) return MakeInvalid(ctx, "received must have x's dtype");
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
  return RunGather(backend, config,
                   {SignatureKind::kA2aMatmul, kRowsPerPeerBlock, x.untyped_data(), /*x_per_peer=*/true,
                    received.untyped_data(), {e, c, RowBytes(d, types.a)}, w.untyped_data(), out.untyped_data(), d, f,
                    types});
}

// ---------------------------------------------------------------------------------------------
// produce -> scatter
// ---------------------------------------------------------------------------------------------
// matmul_rs, unscaled (scales == nullptr) or FP8 with the scales of y and w. The partials that
// move and are summed have out's dtype.
static ffi::Error MatmulRs(Backend& backend, const OpConfig& config, Buffer y, Buffer w, const Buffer* scales,
                           Buffer out, Buffer send, Buffer recv) {
  const CallContext& ctx = config.ctx;
  MatmulTypes types;
  FICCO_RETURN_IF_ERROR(MatmulDtypes(config, y, w, out, scales != nullptr, scales, &types));
  if (send.element_type() != out.element_type() || recv.element_type() != out.element_type()) {
    return MakeInvalid(ctx, "send and recv must have out's dtype");
  }
  const int64_t n = config.n();
  if (y.dimensions().size() != 2 || w.dimensions().size() != 2 || y.dimensions()[1] != w.dimensions()[0] ||
      y.dimensions()[0] % n != 0) {
    return MakeInvalid(ctx, "matmul_rs needs y [n*m, N] and w [N, K] with n = " + std::to_string(n) +
                                "; found y " + Shape(y) + ", w " + Shape(w));
  }
  const int64_t m = y.dimensions()[0] / n, cols = w.dimensions()[1];
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "out", out, {m, cols}));
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "send", send, {n - 1, m, cols}));
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "recv", recv, {n - 1, m, cols}));
  return RunScatter(backend, config,
                    {SignatureKind::kMatmulRs, kRowsPerOutputBlock, 1, m, cols, types, y.untyped_data(),
                     w.untyped_data(), y.dimensions()[1], send.untyped_data(), out.untyped_data(), recv.untyped_data()});
}

ffi::Error MatmulRsImpl(Backend& backend, const OpConfig& config, Buffer y, Buffer w, Buffer out, Buffer send,
                        Buffer recv) {
  return MatmulRs(backend, config, y, w, nullptr, out, send, recv);
}

ffi::Error MatmulRsScaledImpl(Backend& backend, const OpConfig& config, Buffer y, Buffer w, Buffer y_scale,
                              Buffer w_scale, Buffer out, Buffer send, Buffer recv) {
  const Buffer scales[2] = {y_scale, w_scale};
  return MatmulRs(backend, config, y, w, scales, out, send, recv);
}

ffi::Error ReduceScatterImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer out, Buffer recv) {
  const CallContext& ctx = config.ctx;
  Dtype dtype;
  FICCO_RETURN_IF_ERROR(SameDtype(ctx, {x, out, recv}, &dtype));
  const int64_t n = config.n();
  if (x.dimensions().size() < 1 || x.dimensions()[0] % n != 0 || x.dimensions()[0] == 0) {
    return MakeInvalid(ctx, "reduce_scatter: x " + Shape(x) + " needs a leading dimension divisible by n = " +
                                std::to_string(n));
  }
  const int64_t m = x.dimensions()[0] / n;
  const int64_t row_elems = static_cast<int64_t>(x.element_count()) / x.dimensions()[0];
  if (out.element_count() != static_cast<size_t>(m * row_elems) ||
      recv.element_count() != static_cast<size_t>((n - 1) * m * row_elems)) {
    return MakeInvalid(ctx, "reduce_scatter: out " + Shape(out) + " / recv " + Shape(recv) +
                                " do not match x " + Shape(x) + " split " + std::to_string(n) + " ways");
  }
  return RunScatter(backend, config,
                    {SignatureKind::kReduceScatter, kRowsPerOutputBlock, 1, m, row_elems, MatmulTypes::Uniform(dtype),
                     x.untyped_data(),
                     /*w=*/nullptr, /*inner=*/0, /*send=*/nullptr, out.untyped_data(), recv.untyped_data()});
}

ffi::Error MatmulA2aImpl(Backend& backend, const OpConfig& config, Buffer y, Buffer w, Buffer out, Buffer send) {
  const CallContext& ctx = config.ctx;
  MatmulTypes types;
  FICCO_RETURN_IF_ERROR(MatmulDtypes(config, y, w, out, false, nullptr, &types));
  if (send.element_type() != out.element_type()) return MakeInvalid(ctx, "send must have out's dtype");
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
  return RunScatter(backend, config,
                    {SignatureKind::kMatmulA2a, kRowsPerPeerBlock, e, c, d, types, y.untyped_data(), w.untyped_data(),
                     yd[3], send.untyped_data(), out.untyped_data(), /*recv=*/nullptr});
}

// ---------------------------------------------------------------------------------------------
// The contention probe
// ---------------------------------------------------------------------------------------------
ffi::Error ContentionProbeImpl(Backend& backend, const OpConfig& config, const ProbeAttrs& attrs, Buffer a, Buffer w,
                               Buffer x, Buffer out, Buffer gathered) {
  const CallContext& ctx = config.ctx;
  // FP8 operands unscaled (w column-major, as the ops pass it: w_col_major): the matmul rate is what is measured.
  MatmulTypes types;
  const bool fp8 = a.element_type() == ffi::DataType::F8E4M3FN || a.element_type() == ffi::DataType::F8E5M2;
  FICCO_RETURN_IF_ERROR(MatmulDtypes(config, a, w, out, fp8, nullptr, &types));
  const int64_t n = config.n();
  if (a.dimensions().size() != 2 || w.dimensions().size() != 2 || a.dimensions()[1] != w.dimensions()[0] ||
      x.dimensions().size() < 1 || attrs.repeats < 1) {
    return MakeInvalid(ctx, "contention probe needs a [M, K], w [K, N], x [m, ...] and repeats >= 1; found a " +
                                Shape(a) + ", w " + Shape(w) + ", x " + Shape(x) + ", repeats " +
                                std::to_string(attrs.repeats));
  }
  const int64_t rows = a.dimensions()[0], inner = a.dimensions()[1], cols = w.dimensions()[1];
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "out", out, {rows, cols}));
  if (gathered.size_bytes() != static_cast<size_t>(n) * x.size_bytes()) {
    return MakeInvalid(ctx, "contention probe: gathered " + Shape(gathered) + " must hold n = " + std::to_string(n) +
                                " copies of x " + Shape(x));
  }
  return RunProbe(backend, config,
                  {a.untyped_data(), w.untyped_data(), out.untyped_data(), rows, inner, cols, types, x.untyped_data(),
                   static_cast<int64_t>(x.size_bytes()), gathered.untyped_data(), attrs.repeats, attrs.pull != 0});
}

}  // namespace ficco
