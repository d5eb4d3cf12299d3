// The attributes of the ficco targets, decoded once per call into an OpConfig.
#ifndef FICCO_JAX_XLA_FFI_FFI_ATTRS_H_
#define FICCO_JAX_XLA_FFI_FFI_ATTRS_H_

#include <cstdint>
#include <string_view>

#include "base/errors.h"
#include "runtime/op_config.h"
#include "runtime/placement.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// The attributes of every ficco target, listed once: the struct, XLA's decoding of it and the names
// and codes Python's lowering is checked against (module.cc, `contract()`; tests/test_contract.py) are
// all made from these lists. X(type, name) per attribute, in decoding order.
//
//   ficco_abi      the contract's version (ffi/contract.h), checked before decoding
//   op_id          unique per call site, set at trace time
//   groups         the groups of the mesh axis, flat, members in rank order, as logical positions: the
//                  XLA partition id of each member, handed to every call as its first operand
//                  (runtime/placement.h)
//   devices        the device the lowering saw at each entry of `groups` (global device ids): named
//                  by the meeting of a group across processes, and by errors
//   ipc_job        0: every group is in one process; else the host mailbox's job id
//   group_size     n
//   order, gemm, transfer: codes of kOrderCodes, kGemmCodes, kTransferCodes below
//   timeout_ms     config.RENDEZVOUS_TIMEOUT_S
//   watchdog_ms    config.WATCHDOG_S: device work may take this long once started; 0: unwatched
//   site           where the op was written, for the watchdog's report
//   skip_own_rows  ag_matmul / a2a_matmul: 1 when the caller drops `gathered` / `received` (no return
//                  of it, no VJP residual): this device's own rows / block are then not copied in (the
//                  matmuls read them from x); the peers' rows still land there
//   w_col_major    1: the matmul's w is column-major ([N, K] in memory for w [K, N]; per expert for
//                  [E, K, N]), as a transpose of a row-major array is laid out; always for FP8; 0 for
//                  the collectives
//   channel_bytes  config.CHANNEL_BYTES (runtime/channel.h); 0: every call meets its peers
#define FICCO_OP_ATTRIBUTES(X)                                                                              \
  X(int64_t, ficco_abi) X(int64_t, op_id) X(ffi::Span<const int64_t>, groups)                               \
  X(ffi::Span<const int64_t>, devices) X(int64_t, ipc_job) X(int64_t, group_size) X(int64_t, chunks)        \
  X(int64_t, order) X(int64_t, gemm) X(int64_t, copy_streams) X(int64_t, timeout_ms) X(int64_t, watchdog_ms) \
  X(std::string_view, site) X(int64_t, skip_own_rows) X(int64_t, transfer) X(int64_t, w_col_major)          \
  X(int64_t, channel_bytes)

// The contention probe's (ficco_jax/lowering/dma/probe.py): `repeats` matmuls on the compute stream,
// `pull` 1 to pull every peer's x meanwhile (0: matmuls alone); the others as above.
#define FICCO_PROBE_ATTRIBUTES(X)                                                                           \
  X(int64_t, ficco_abi) X(int64_t, op_id) X(ffi::Span<const int64_t>, groups)                               \
  X(ffi::Span<const int64_t>, devices) X(int64_t, group_size) X(int64_t, timeout_ms) X(int64_t, watchdog_ms) \
  X(int64_t, repeats) X(int64_t, pull) X(int64_t, w_col_major)

#define FICCO_ATTRIBUTE_MEMBER(type, name) type name;
struct OpAttrs {
  FICCO_OP_ATTRIBUTES(FICCO_ATTRIBUTE_MEMBER)
};
struct ProbeAttrs {
  FICCO_PROBE_ATTRIBUTES(FICCO_ATTRIBUTE_MEMBER)
};
#undef FICCO_ATTRIBUTE_MEMBER

// The codes of the schedule's fields, as the attributes carry them (Order, GemmMode: runtime/op_config.h).
struct AttributeCode {
  const char* name;
  int64_t code;
};
inline constexpr AttributeCode kOrderCodes[] = {{"ring", static_cast<int64_t>(Order::kRing)},
                                                {"direct", static_cast<int64_t>(Order::kDirect)}};
inline constexpr AttributeCode kGemmCodes[] = {{"per_chunk", static_cast<int64_t>(GemmMode::kPerChunk)},
                                               {"grouped", static_cast<int64_t>(GemmMode::kGrouped)},
                                               {"columns", static_cast<int64_t>(GemmMode::kColumns)}};
// pull: the receiver's copy streams read; push: the sender's write into the peers' buffers; symmetric:
// the sender's write into the peers' slots of the site (runtime/symmetric.h).
inline constexpr AttributeCode kTransferCodes[] = {{"pull", 0}, {"push", 1}, {"symmetric", 2}};

// The schedule part of a target's attributes, as every target's config decodes it.
inline const OpAttrs& ScheduleAttrs(const OpAttrs& attrs) { return attrs; }
// The probe: one copy stream, direct, one chunk, w's layout as given, meetings (no channel). In-process groups only
// (probe.py refuses groups across processes).
inline OpAttrs ScheduleAttrs(const ProbeAttrs& p) {
  OpAttrs attrs{};
  attrs.ficco_abi = p.ficco_abi;
  attrs.op_id = p.op_id;
  attrs.groups = p.groups;
  attrs.devices = p.devices;
  attrs.group_size = p.group_size;
  attrs.chunks = 1;
  attrs.order = static_cast<int64_t>(Order::kDirect);
  attrs.copy_streams = 1;
  attrs.timeout_ms = p.timeout_ms;
  attrs.watchdog_ms = p.watchdog_ms;
  attrs.site = "probe";
  attrs.w_col_major = p.w_col_major;
  return attrs;
}

// Decodes the call's schedule and resolves its group from the run (runtime/placement.h): from
// `placement`, or from the position `read_position` gives.
ffi::Error DecodeConfig(const OpAttrs& attrs, const char* target, int32_t device_ordinal, int64_t run_id,
                        const PositionReader& read_position, Placement* placement, OpConfig* config);

}  // namespace ficco

// How XLA decodes each struct from the attribute dictionary (every target binds .Attrs<OpAttrs>()):
// its members, by name, in the list's order. (FICCO_APPLY expands the list before XLA's macro splits
// its arguments.)
#define FICCO_ATTRIBUTE_DECODING(type, name) , ::xla::ffi::StructMember<type>(#name)
#define FICCO_APPLY(macro, ...) macro(__VA_ARGS__)
FICCO_APPLY(XLA_FFI_REGISTER_STRUCT_ATTR_DECODING, ficco::OpAttrs FICCO_OP_ATTRIBUTES(FICCO_ATTRIBUTE_DECODING));
FICCO_APPLY(XLA_FFI_REGISTER_STRUCT_ATTR_DECODING, ficco::ProbeAttrs FICCO_PROBE_ATTRIBUTES(FICCO_ATTRIBUTE_DECODING));
#undef FICCO_APPLY
#undef FICCO_ATTRIBUTE_DECODING

#endif  // FICCO_JAX_XLA_FFI_FFI_ATTRS_H_
