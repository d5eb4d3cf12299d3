// The Impls of the ficco targets: check the buffers against each other and the group, fill the
// op's executor arguments, run it. FFI buffer types in, a pure executor call out (exec/).
#ifndef FICCO_JAX_XLA_FFI_FFI_OPS_H_
#define FICCO_JAX_XLA_FFI_FFI_OPS_H_

#include "device/backend.h"
#include "ffi/attrs.h"
#include "runtime/op_config.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

inline constexpr char kAgMatmulTarget[] = "ficco_ag_matmul";
inline constexpr char kMatmulRsTarget[] = "ficco_matmul_rs";
inline constexpr char kAgMatmulScaledTarget[] = "ficco_ag_matmul_scaled";
inline constexpr char kMatmulRsScaledTarget[] = "ficco_matmul_rs_scaled";
inline constexpr char kAllGatherTarget[] = "ficco_all_gather";
inline constexpr char kReduceScatterTarget[] = "ficco_reduce_scatter";
inline constexpr char kAllToAllTarget[] = "ficco_all_to_all";
inline constexpr char kA2aMatmulTarget[] = "ficco_a2a_matmul";
inline constexpr char kMatmulA2aTarget[] = "ficco_matmul_a2a";
inline constexpr char kContentionProbeTarget[] = "ficco_contention_probe";

using Buffer = ffi::AnyBuffer;

ffi::Error AgMatmulImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer w, Buffer out, Buffer gathered);
ffi::Error MatmulRsImpl(Backend& backend, const OpConfig& config, Buffer y, Buffer w, Buffer out, Buffer send,
                        Buffer recv);
// FP8 operands with per-tensor f32 scales; w column-major ([N, K] in memory for w [K, N]: w_col_major,
// which the other matmul targets take per call).
ffi::Error AgMatmulScaledImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer w, Buffer x_scale,
                              Buffer w_scale, Buffer out, Buffer gathered);
ffi::Error MatmulRsScaledImpl(Backend& backend, const OpConfig& config, Buffer y, Buffer w, Buffer y_scale,
                              Buffer w_scale, Buffer out, Buffer send, Buffer recv);
ffi::Error AllGatherImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer out);
ffi::Error ReduceScatterImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer out, Buffer recv);
ffi::Error AllToAllImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer out);
ffi::Error A2aMatmulImpl(Backend& backend, const OpConfig& config, Buffer x, Buffer w, Buffer out, Buffer received);
ffi::Error MatmulA2aImpl(Backend& backend, const OpConfig& config, Buffer y, Buffer w, Buffer out, Buffer send);
ffi::Error ContentionProbeImpl(Backend& backend, const OpConfig& config, const ProbeAttrs& attrs, Buffer a, Buffer w,
                               Buffer x, Buffer out, Buffer gathered);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_FFI_OPS_H_
