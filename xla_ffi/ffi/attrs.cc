#include "ffi/attrs.h"

#include <string>

#include "device/backend.h"

namespace ficco {

int64_t GroupStart(ffi::Span<const int64_t> local_ordinals, int64_t n, int32_t device_ordinal) {
  int64_t start = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(local_ordinals.size()); ++i) {
    if (local_ordinals[i] == device_ordinal) start = i / n * n;
  }
  return start;
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
  const int64_t start = GroupStart(attrs.local_ordinals, n, device_ordinal);
  if (start >= 0) {
    config->group_index = start / n;
    for (int64_t i = start; i < start + n; ++i) {
      if (attrs.local_ordinals[i] == device_ordinal) config->rank = static_cast<int>(i - start);
    }
    config->group.assign(attrs.groups.begin() + start, attrs.groups.begin() + start + n);
    config->group_local.assign(attrs.local_ordinals.begin() + start, attrs.local_ordinals.begin() + start + n);
  }
  if (config->group.empty()) {
    return MakeInvalid(ctx, "device ordinal " + std::to_string(device_ordinal) +
                                " is not in any group of this op; the mesh the op was lowered for does "
                                "not match the devices it runs on");
  }
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
