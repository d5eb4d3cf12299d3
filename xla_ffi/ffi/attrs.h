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

// The attributes of every ficco target (ficco_jax/lowering/dma/registry.py writes them: _lowering).
struct OpAttrs {
  int64_t ficco_abi;              // the contract's version (ffi/contract.h), checked before decoding
  int64_t op_id;                  // unique per call site, set at trace time
  // The groups of the mesh axis, flat, members in rank order, as logical positions: the XLA
  // partition id of each member, handed to every call as its first operand (runtime/placement.h).
  ffi::Span<const int64_t> groups;
  // The device the lowering saw at each entry of `groups` (global device ids): checked by groups
  // across processes, named by errors.
  ffi::Span<const int64_t> devices;
  int64_t ipc_job;                // 0: every group is in one process; else the host mailbox's job id
  int64_t group_size;             // n
  int64_t chunks;
  int64_t order;                  // 0 ring, 1 direct
  int64_t gemm;                   // 0 per_chunk, 1 grouped, 2 columns
  int64_t copy_streams;
  int64_t timeout_ms;
  int64_t watchdog_ms;            // config.WATCHDOG_S: device work may take this long once started; 0: unwatched
  std::string_view site;          // where the op was written, for the watchdog's report
  // ag_matmul / a2a_matmul: 1 when the caller drops `gathered` / `received` (no return of it, no VJP
  // residual): this device's own rows / block are then not copied in (the matmuls read them from x);
  // the peers' rows still land there.
  int64_t skip_own_rows;
  // 0 pull (the receiver's copy streams read), 1 push (the sender's write into the peers' buffers),
  // 2 symmetric (the sender's write into the peers' slots of the site: runtime/symmetric.h)
  int64_t transfer;
  // 1: the matmul's w is column-major ([N, K] in memory for w [K, N]; per expert for [E, K, N]), as
  // a transpose of a row-major array is laid out; always for FP8. 0 for the collectives.
  int64_t w_col_major;
  int64_t channel_bytes;          // config.CHANNEL_BYTES (runtime/channel.h); 0: every call meets its peers
};

// The contention probe's attributes (ficco_jax/lowering/dma/probe.py writes them).
struct ProbeAttrs {
  int64_t ficco_abi;
  int64_t op_id;
  ffi::Span<const int64_t> groups;   // positions, as OpAttrs
  ffi::Span<const int64_t> devices;
  int64_t group_size;
  int64_t timeout_ms;
  int64_t watchdog_ms;
  int64_t repeats;  // matmuls on the compute stream
  int64_t pull;     // 1: pull every peer's x meanwhile; 0: matmuls alone
  int64_t w_col_major;  // as OpAttrs: 1 for FP8 operands
};

// The schedule part of a target's attributes, as every target's config decodes it.
inline const OpAttrs& ScheduleAttrs(const OpAttrs& attrs) { return attrs; }
// The probe: one copy stream, direct, one chunk, w's layout as given, meetings (no channel). In-process groups only
// (probe.py refuses groups across processes).
inline OpAttrs ScheduleAttrs(const ProbeAttrs& p) {
  return OpAttrs{p.ficco_abi, p.op_id, p.groups, p.devices, 0, p.group_size, 1, 1, 0, 1, p.timeout_ms, p.watchdog_ms, "probe", 0, 0,
                 p.w_col_major, 0};
}

// Decodes the call's schedule and resolves its group from the run (runtime/placement.h): from
// `placement`, or from the position `read_position` gives.
ffi::Error DecodeConfig(const OpAttrs& attrs, const char* target, int32_t device_ordinal, int64_t run_id,
                        const PositionReader& read_position, Placement* placement, OpConfig* config);

}  // namespace ficco

// How XLA decodes OpAttrs from the attribute dictionary (every target binds .Attrs<OpAttrs>()).
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ficco::OpAttrs, ::xla::ffi::StructMember<int64_t>("ficco_abi"), ::xla::ffi::StructMember<int64_t>("op_id"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("groups"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("devices"),
    ::xla::ffi::StructMember<int64_t>("ipc_job"),
    ::xla::ffi::StructMember<int64_t>("group_size"), ::xla::ffi::StructMember<int64_t>("chunks"),
    ::xla::ffi::StructMember<int64_t>("order"), ::xla::ffi::StructMember<int64_t>("gemm"),
    ::xla::ffi::StructMember<int64_t>("copy_streams"), ::xla::ffi::StructMember<int64_t>("timeout_ms"),
    ::xla::ffi::StructMember<int64_t>("watchdog_ms"), ::xla::ffi::StructMember<std::string_view>("site"),
    ::xla::ffi::StructMember<int64_t>("skip_own_rows"),
    ::xla::ffi::StructMember<int64_t>("transfer"), ::xla::ffi::StructMember<int64_t>("w_col_major"),
    ::xla::ffi::StructMember<int64_t>("channel_bytes"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ficco::ProbeAttrs, ::xla::ffi::StructMember<int64_t>("ficco_abi"), ::xla::ffi::StructMember<int64_t>("op_id"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("groups"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("devices"),
    ::xla::ffi::StructMember<int64_t>("group_size"), ::xla::ffi::StructMember<int64_t>("timeout_ms"),
    ::xla::ffi::StructMember<int64_t>("watchdog_ms"), ::xla::ffi::StructMember<int64_t>("repeats"),
    ::xla::ffi::StructMember<int64_t>("pull"), ::xla::ffi::StructMember<int64_t>("w_col_major"));

#endif  // FICCO_JAX_XLA_FFI_FFI_ATTRS_H_
