// All-to-all on copy engines, alone and with the expert matmuls of a MoE layer (expert parallelism).
//
// Every buffer is n per-peer blocks, [n, groups, rows, row] row-major (groups = the local experts
// E, rows = the capacity C; the standalone all_to_all has groups = 1). Block p of the input goes
// to rank p; block p of the result came from rank p (jax.lax.all_to_all, split 0, concat 0, tiled).
// Chunks cut `rows` inside every block, so chunk j of a block is `groups` contiguous pieces.
//
// Roles inside one call of rank r (group of n, peer slots s = 0 .. n-2, ring distance s + 1):
//   all_to_all / dispatch (pull):
//     Owner:  records `ready` (x is valid) and posts x; its own block goes x[r] -> received[r].
//     Puller: from peer p = r-1-s, pulls p's block r, chunk by chunk, into received[p];
//             dispatch then multiplies each landed chunk by its experts' weights.
//   combine (matmul then pull):
//     Owner:  computes its results for rank r+1+s into send slot s, chunk by chunk, one event
//             per chunk, and posts `send`; its own block's results go straight into out[r].
//     Puller: from peer p = r-1-s (whose slot s is addressed to r), pulls each chunk once its
//             event fired into out[p].
// `ring` issues one transfer at a time on one copy stream (rank r-1 first); `direct` spreads the
// peers over the copy streams. On an NVSwitch node every owner is one hop away, so both pull
// from the owner directly; the neighbour relay of the xla ring schedule is not needed here.
#ifndef FICCO_JAX_XLA_FFI_A2A_H_
#define FICCO_JAX_XLA_FFI_A2A_H_

#include <cstdint>

#include "handlers.h"

namespace ficco {

inline constexpr char kAllToAllTarget[] = "ficco_all_to_all";
inline constexpr char kA2aMatmulTarget[] = "ficco_a2a_matmul";
inline constexpr char kMatmulA2aTarget[] = "ficco_matmul_a2a";

struct AllToAllArgs {         // all_to_all and a2a_matmul (dispatch)
  const void* x;              // [n, groups, rows, row_bytes]
  void* received;             // [n, groups, rows, row_bytes]
  int64_t groups;
  int64_t rows;
  int64_t row_bytes;
  // a2a_matmul only (w == nullptr for all_to_all): out[p, e] = received[p, e] @ w[e]
  const void* w = nullptr;    // [groups, inner, cols]
  void* out = nullptr;        // [n, groups, rows, cols]
  int64_t inner = 0, cols = 0;
  Dtype dtype = Dtype::kF32;
};

struct MatmulAllToAllArgs {   // matmul_a2a (combine): out = all_to_all(y[p, e] @ w[e])
  const void* y;              // [n, groups, rows, inner]
  const void* w;              // [groups, inner, cols]
  void* out;                  // [n, groups, rows, cols]
  void* send;                 // [n-1, groups, rows, cols]: slot s holds the results for rank r+1+s
  int64_t groups;
  int64_t rows;
  int64_t inner;
  int64_t cols;
  Dtype dtype = Dtype::kF32;
};

ffi::Error RunAllToAll(Backend& backend, const OpConfig& config, const AllToAllArgs& args);
ffi::Error RunMatmulAllToAll(Backend& backend, const OpConfig& config, const MatmulAllToAllArgs& args);

// FFI-facing: check the buffers, fill the args, run.
ffi::Error AllToAllImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer out);
ffi::Error A2aMatmulImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::AnyBuffer out, ffi::AnyBuffer received);
ffi::Error MatmulA2aImpl(Backend& backend, const OpConfig& config, ffi::AnyBuffer y, ffi::AnyBuffer w,
                         ffi::AnyBuffer out, ffi::AnyBuffer send);

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_A2A_H_
