// The op table of the FFI layer: one line per target (name, Impl, attributes, operands in binding
// order); ffi/handler.h makes both platforms' handlers from it. Operand shapes per device, as
// ficco_jax/lowering/dma/registry.py binds them (n: group size), after every target's first operand,
// the call's position (a u32 partition id: runtime/placement.h):
//   ficco_ag_matmul        x [m, K], w [K, N]           -> out [n*m, N], gathered [n*m, K]
//   ficco_matmul_rs        y [n*m, N], w [N, K]         -> out [m, K], send [n-1, m, K], recv [n-1, m, K]
//   ficco_*_scaled         the two above with FP8 operands: + the f32 scales of both operands after w
//                          (w always column-major), results in bf16, f16 or f32
//   every matmul target's w is column-major (per expert for [E, ., .]) where attribute w_col_major is 1
//   ficco_all_gather       x [m, ...]                   -> out [n*m, ...]
//   ficco_reduce_scatter   x [n*m, ...]                 -> out [m, ...], recv [n-1, m, ...]
//   ficco_all_to_all       x [n, ...]                   -> out [n, ...]
//   ficco_a2a_matmul       x [n, E, C, d], w [E, d, f]  -> out [n, E, C, f], received [n, E, C, d]
//   ficco_matmul_a2a       y [n, E, C, f], w [E, f, d]  -> out [n, E, C, d], send [max(n-1, 1), E, C, d]
//   ficco_contention_probe a [M, K], w [K, N], x [m, ...] -> out [M, N], gathered [n*m, ...]
#include "ffi/targets.h"

#include <type_traits>

#include "ffi/handler.h"
#include "ffi/ops.h"

namespace ficco {
namespace {

using AgMatmul = Target<kAgMatmulTarget, &AgMatmulImpl, OpAttrs, Arg, Arg, Ret, Ret>;
using MatmulRs = Target<kMatmulRsTarget, &MatmulRsImpl, OpAttrs, Arg, Arg, Ret, Ret, Ret>;
using AgMatmulScaled = Target<kAgMatmulScaledTarget, &AgMatmulScaledImpl, OpAttrs, Arg, Arg, Arg, Arg, Ret, Ret>;
using MatmulRsScaled =
    Target<kMatmulRsScaledTarget, &MatmulRsScaledImpl, OpAttrs, Arg, Arg, Arg, Arg, Ret, Ret, Ret>;
using AllGather = Target<kAllGatherTarget, &AllGatherImpl, OpAttrs, Arg, Ret>;
using ReduceScatter = Target<kReduceScatterTarget, &ReduceScatterImpl, OpAttrs, Arg, Ret, Ret>;
using AllToAll = Target<kAllToAllTarget, &AllToAllImpl, OpAttrs, Arg, Ret>;
using A2aMatmul = Target<kA2aMatmulTarget, &A2aMatmulImpl, OpAttrs, Arg, Arg, Ret, Ret>;
using MatmulA2a = Target<kMatmulA2aTarget, &MatmulA2aImpl, OpAttrs, Arg, Arg, Ret, Ret>;
using ContentionProbe = Target<kContentionProbeTarget, &ContentionProbeImpl, ProbeAttrs, Arg, Arg, Arg, Ret, Ret>;

template <typename T>
TargetEntries EntriesOf() {
  // The probe meets its group at every call: it has no symmetric form.
  constexpr bool symmetric = !std::is_same_v<T, ContentionProbe>;
#ifdef FICCO_WITH_CUDA
  return {T::name, &T::Instantiate, &T::CpuEntry, &T::CudaEntry, symmetric,
          symmetric ? &T::CudaSymmetricEntry : nullptr, symmetric ? &T::CudaSymmetricInitialize : nullptr};
#else
  return {T::name, &T::Instantiate, &T::CpuEntry, nullptr, symmetric, nullptr, nullptr};
#endif
}

}  // namespace

const std::vector<TargetEntries>& Targets() {
  static const std::vector<TargetEntries> targets = {
      EntriesOf<AgMatmul>(),  EntriesOf<MatmulRs>(),  EntriesOf<AllGather>(), EntriesOf<ReduceScatter>(),
      EntriesOf<AllToAll>(),  EntriesOf<A2aMatmul>(), EntriesOf<MatmulA2a>(), EntriesOf<ContentionProbe>(),
      EntriesOf<AgMatmulScaled>(), EntriesOf<MatmulRsScaled>(),
  };
  return targets;
}

}  // namespace ficco
