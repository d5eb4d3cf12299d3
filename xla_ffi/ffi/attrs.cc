#include "ffi/attrs.h"

#include <string>

#include "device/backend.h"

namespace ficco {

ffi::Error DecodeConfig(const OpAttrs& attrs, const char* target, int32_t device_ordinal, int64_t run_id,
                        const PositionReader& read_position, Placement* placement, OpConfig* config) {
  config->ctx = CallContext{target, attrs.op_id, device_ordinal};
  const CallContext& ctx = config->ctx;
  config->run_id = run_id;
  config->ipc_job = attrs.ipc_job;
  if (attrs.timeout_ms < 0) return MakeInvalid(ctx, "timeout_ms=" + std::to_string(attrs.timeout_ms) + " < 0");
  const GroupSpec spec{attrs.groups, attrs.devices, attrs.group_size, attrs.ipc_job,
                       static_cast<double>(attrs.timeout_ms) / 1000.0, config->spin_s};
  ResolvedGroup group;
  FICCO_RETURN_IF_ERROR(ResolveGroup(ctx, spec, read_position, run_id, placement, &group));
  config->group_index = group.group_index;
  config->rank = group.rank;
  config->group = std::move(group.group);
  config->group_local = std::move(group.group_local);
  if (attrs.chunks < 1 || attrs.copy_streams < 1 || (attrs.order != 0 && attrs.order != 1) ||
      (attrs.gemm < 0 || attrs.gemm > 2) || (attrs.transfer < 0 || attrs.transfer > 2) || attrs.timeout_ms < 0 ||
      attrs.watchdog_ms < 0 || (attrs.w_col_major != 0 && attrs.w_col_major != 1) || attrs.channel_bytes < 0) {
    return MakeInvalid(ctx, "bad schedule attributes: chunks=" + std::to_string(attrs.chunks) +
                                " order=" + std::to_string(attrs.order) + " gemm=" + std::to_string(attrs.gemm) +
                                " copy_streams=" + std::to_string(attrs.copy_streams) +
                                " transfer=" + std::to_string(attrs.transfer) +
                                " w_col_major=" + std::to_string(attrs.w_col_major) +
                                " channel_bytes=" + std::to_string(attrs.channel_bytes));
  }
  if (attrs.copy_streams > kMaxCopyStreams) {
    return MakeInvalid(ctx, "copy_streams=" + std::to_string(attrs.copy_streams) + ": a device has at most " +
                                std::to_string(kMaxCopyStreams) + " copy streams (schedule suffix /s1 ... /s" +
                                std::to_string(kMaxCopyStreams) + ")");
  }
  config->chunks = attrs.chunks;
  config->order = static_cast<Order>(attrs.order);
  config->gemm = static_cast<GemmMode>(attrs.gemm);
  config->copy_streams = static_cast<int>(attrs.copy_streams);
  config->timeout_s = static_cast<double>(attrs.timeout_ms) / 1000.0;
  config->watchdog_s = static_cast<double>(attrs.watchdog_ms) / 1000.0;
  config->site = attrs.site;
  config->skip_own_rows = attrs.skip_own_rows != 0;
  config->push = attrs.transfer == 1;
  config->symmetric = attrs.transfer == 2;
  config->w_col_major = attrs.w_col_major == 1;
  config->channel_bytes = attrs.channel_bytes;
  return ffi::Error::Success();
}

}  // namespace ficco
