// The FFI-facing layer between the bindings (module.cc) and the executor: decodes the one
// attribute struct shared by every target into an OpConfig, checks buffers, and runs the op.
#ifndef FICCO_JAX_XLA_FFI_HANDLERS_H_
#define FICCO_JAX_XLA_FFI_HANDLERS_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "executor.h"

namespace ficco {

inline constexpr char kAgMatmulTarget[] = "ficco_ag_matmul";
inline constexpr char kMatmulRsTarget[] = "ficco_matmul_rs";
inline constexpr char kAllGatherTarget[] = "ficco_all_gather";
inline constexpr char kReduceScatterTarget[] = "ficco_reduce_scatter";

// The attributes of every ficco target (dma.py writes them; see its _attributes()).
struct OpAttrs {
  int64_t op_id;                  // unique per call site, set at trace time
  // Device groups of the mesh axis, flat, members in rank order: device ordinals of this process,
  // or global device ids when ipc_job != 0 (groups across processes of this host).
  ffi::Span<const int64_t> groups;
  ffi::Span<const int64_t> local_ordinals;  // per member of `groups`: its ordinal here, -1 if remote
  int64_t ipc_job;                // 0: every group is in this process; else the host mailbox's job id
  int64_t group_size;             // n
  int64_t chunks;
  int64_t order;                  // 0 ring, 1 direct
  int64_t gemm;                   // 0 per_chunk, 1 grouped
  int64_t copy_streams;
  int64_t timeout_ms;
  int64_t fault;                  // -1 none, else mode * 1000 + rank (mode 1 skip, 2 fail)
  // ag_matmul / a2a_matmul: 1 when the caller drops `gathered` / `received` (no return of it, no VJP
  // residual): this device's own rows / block are then not copied in (the matmuls read them from x);
  // the peers' rows still land there.
  int64_t skip_own_rows;
  int64_t transfer;               // 0 pull (the receiver's copy streams read), 1 push (the sender's write)
};

// Buffer checks shared by the Impls: "[2, 3]"; `buffer` has exactly `dims` (the message names
// `name`); every buffer has one supported dtype.
std::string Shape(ffi::AnyBuffer buffer);
ffi::Error ExpectShape(const CallContext& ctx, const char* name, ffi::AnyBuffer buffer, std::vector<int64_t> dims);
ffi::Error SameDtype(const CallContext& ctx, std::initializer_list<ffi::AnyBuffer> buffers, Dtype* dtype);

ffi::Error DecodeConfig(const OpAttrs& attrs, const char* target, int32_t device_ordinal, int64_t run_id,
                        OpConfig* config);

ffi::Error AgMatmulImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::AnyBuffer out, ffi::AnyBuffer gathered);
ffi::Error MatmulRsImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer y, ffi::AnyBuffer w,
                        ffi::AnyBuffer out, ffi::AnyBuffer send, ffi::AnyBuffer recv);
ffi::Error AllGatherImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer out);
ffi::Error ReduceScatterImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer out,
                             ffi::AnyBuffer recv);

}  // namespace ficco

// How XLA decodes OpAttrs from the attribute dictionary (every target binds .Attrs<OpAttrs>()).
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ficco::OpAttrs, ::xla::ffi::StructMember<int64_t>("op_id"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("groups"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("local_ordinals"),
    ::xla::ffi::StructMember<int64_t>("ipc_job"),
    ::xla::ffi::StructMember<int64_t>("group_size"), ::xla::ffi::StructMember<int64_t>("chunks"),
    ::xla::ffi::StructMember<int64_t>("order"), ::xla::ffi::StructMember<int64_t>("gemm"),
    ::xla::ffi::StructMember<int64_t>("copy_streams"), ::xla::ffi::StructMember<int64_t>("timeout_ms"),
    ::xla::ffi::StructMember<int64_t>("fault"), ::xla::ffi::StructMember<int64_t>("skip_own_rows"),
    ::xla::ffi::StructMember<int64_t>("transfer"));

#endif  // FICCO_JAX_XLA_FFI_HANDLERS_H_
