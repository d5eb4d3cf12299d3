#include "handlers.h"

#include "text.h"

namespace ficco {

// Buffer checks shared by every op's Impl (declared in handlers.h).
std::string Shape(ffi::AnyBuffer buffer) {
  return "[" + JoinNumbers(buffer.dimensions()) + "]";
}

ffi::Error ToDtype(const CallContext& ctx, ffi::DataType type, Dtype* dtype) {
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

ffi::Error DecodeConfig(const OpAttrs& attrs, const char* target, int32_t device_ordinal, int64_t run_id,
                        OpConfig* config) {
  config->ctx = CallContext{target, attrs.op_id, device_ordinal};
  const CallContext& ctx = config->ctx;
  config->run_id = run_id;
  const int64_t n = attrs.group_size;
  const int64_t total = static_cast<int64_t>(attrs.groups.size());
  if (n < 1 || total % n != 0) {
    return MakeInvalid(ctx, "groups has " + std::to_string(total) + " ordinals, not a multiple of group_size " +
                                std::to_string(n));
  }
  if (static_cast<int64_t>(attrs.local_ordinals.size()) != total) {
    return MakeInvalid(ctx, "local_ordinals has " + std::to_string(attrs.local_ordinals.size()) +
                                " entries, groups " + std::to_string(total) + "; they must match");
  }
  config->ipc_job = attrs.ipc_job;
  for (int64_t i = 0; i < total; ++i) {
    if (attrs.local_ordinals[i] != device_ordinal) continue;
    config->group_index = i / n;
    config->rank = static_cast<int>(i % n);
    config->group.assign(attrs.groups.begin() + config->group_index * n,
                         attrs.groups.begin() + (config->group_index + 1) * n);
    config->group_local.assign(attrs.local_ordinals.begin() + config->group_index * n,
                               attrs.local_ordinals.begin() + (config->group_index + 1) * n);
  }
  if (config->group.empty()) {
    return MakeInvalid(ctx, "device ordinal " + std::to_string(device_ordinal) +
                                " is not in any group of this op; the mesh the op was lowered for does "
                                "not match the devices it runs on");
  }
  if (attrs.chunks < 1 || attrs.copy_streams < 1 || (attrs.order != 0 && attrs.order != 1) ||
      (attrs.gemm != 0 && attrs.gemm != 1) || (attrs.transfer != 0 && attrs.transfer != 1) || attrs.timeout_ms < 0) {
    return MakeInvalid(ctx, "bad schedule attributes: chunks=" + std::to_string(attrs.chunks) +
                                " order=" + std::to_string(attrs.order) + " gemm=" + std::to_string(attrs.gemm) +
                                " copy_streams=" + std::to_string(attrs.copy_streams) +
                                " transfer=" + std::to_string(attrs.transfer));
  }
  config->chunks = attrs.chunks;
  config->order = static_cast<Order>(attrs.order);
  config->gemm = static_cast<GemmMode>(attrs.gemm);
  config->copy_streams = static_cast<int>(attrs.copy_streams);
  config->timeout_s = static_cast<double>(attrs.timeout_ms) / 1000.0;
  config->fault = attrs.fault < 0 ? Fault::kNone : static_cast<Fault>(attrs.fault / 1000);
  config->fault_rank = attrs.fault < 0 ? -1 : static_cast<int>(attrs.fault % 1000);
  config->skip_own_rows = attrs.skip_own_rows != 0;
  config->push = attrs.transfer == 1;
  return ffi::Error::Success();
}

ffi::Error AgMatmulImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::AnyBuffer out, ffi::AnyBuffer gathered) {
  const CallContext& ctx = config.ctx;
  AllGatherArgs args;
  FICCO_RETURN_IF_ERROR(SameDtype(ctx, {x, w, out, gathered}, &args.dtype));
  if (x.dimensions().size() != 2 || w.dimensions().size() != 2 || x.dimensions()[1] != w.dimensions()[0]) {
    return MakeInvalid(ctx, "ag_matmul needs x [m, K] and w [K, N]; found x " + Shape(x) + ", w " + Shape(w));
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], cols = w.dimensions()[1], n = config.n();
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "out", out, {n * m, cols}));
  FICCO_RETURN_IF_ERROR(ExpectShape(ctx, "gathered", gathered, {n * m, k}));
  args.x = x.untyped_data();
  args.gathered = gathered.untyped_data();
  args.m = m;
  args.row_bytes = k * static_cast<int64_t>(ByteWidth(args.dtype));
  args.w = w.untyped_data();
  args.out = out.untyped_data();
  args.inner = k;
  args.cols = cols;
  return RunAllGather(backend, config, args);
}

ffi::Error MatmulRsImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer y, ffi::AnyBuffer w,
                        ffi::AnyBuffer out, ffi::AnyBuffer send, ffi::AnyBuffer recv) {
  const CallContext& ctx = config.ctx;
  ReduceScatterArgs args;
  FICCO_RETURN_IF_ERROR(SameDtype(ctx, {y, w, out, send, recv}, &args.dtype));
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
  args.y = y.untyped_data();
  args.out = out.untyped_data();
  args.send = send.untyped_data();
  args.recv = recv.untyped_data();
  args.m = m;
  args.row_elems = cols;
  args.w = w.untyped_data();
  args.inner = y.dimensions()[1];
  return RunReduceScatter(backend, config, args);
}

ffi::Error AllGatherImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer out) {
  const CallContext& ctx = config.ctx;
  const int64_t n = config.n();
  if (x.dimensions().size() < 1 || x.element_type() != out.element_type() ||
      out.dimensions().size() != x.dimensions().size() || out.dimensions()[0] != n * x.dimensions()[0] ||
      out.size_bytes() != static_cast<size_t>(n) * x.size_bytes()) {
    return MakeInvalid(ctx, "all_gather: x " + Shape(x) + " and out " + Shape(out) +
                                " must be [m, ...] and [n*m, ...] of one dtype, n = " + std::to_string(n));
  }
  AllGatherArgs args;
  args.x = x.untyped_data();
  args.gathered = out.untyped_data();
  args.m = x.dimensions()[0];
  args.row_bytes = args.m == 0 ? 0 : static_cast<int64_t>(x.size_bytes()) / args.m;
  return RunAllGather(backend, config, args);
}

ffi::Error ReduceScatterImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer out,
                             ffi::AnyBuffer recv) {
  const CallContext& ctx = config.ctx;
  ReduceScatterArgs args;
  FICCO_RETURN_IF_ERROR(SameDtype(ctx, {x, out, recv}, &args.dtype));
  const int64_t n = config.n();
  if (x.dimensions().size() < 1 || x.dimensions()[0] % n != 0 || x.dimensions()[0] == 0) {
    return MakeInvalid(ctx, "reduce_scatter: x " + Shape(x) + " needs a leading dimension divisible by n = " +
                                std::to_string(n));
  }
  args.m = x.dimensions()[0] / n;
  args.row_elems = static_cast<int64_t>(x.element_count()) / x.dimensions()[0];
  if (out.element_count() != static_cast<size_t>(args.m * args.row_elems) ||
      recv.element_count() != static_cast<size_t>((n - 1) * args.m * args.row_elems)) {
    return MakeInvalid(ctx, "reduce_scatter: out " + Shape(out) + " / recv " + Shape(recv) +
                                " do not match x " + Shape(x) + " split " + std::to_string(n) + " ways");
  }
  args.y = x.untyped_data();
  args.out = out.untyped_data();
  args.send = nullptr;
  args.recv = recv.untyped_data();
  return RunReduceScatter(backend, config, args);
}

}  // namespace ficco
