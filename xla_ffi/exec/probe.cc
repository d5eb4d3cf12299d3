// A measurement for `python -m ficco_jax characterize`: `repeats` matmuls on XLA's stream while
// the copy streams pull every peer's x (an all-gather on copy engines), or the same matmuls with
// no pulls. The time difference is the matmul's slowdown under copy-engine traffic, which no op
// can show on its own: every ficco call joins XLA's stream before it returns, so XLA never runs
// an unrelated matmul beside our copies.
//
//   copy stream 0 : wait(ready) wait(peers' ready) pull(p1) pull(p2) ... own rows     (pull = 1 only)
//   compute       : ready  matmul x repeats  ........  join
// (`gathered` is written only after this device's own `ready`: call_session.cc, CopyChunks, says why.)
#include "exec/executor.h"

namespace ficco {

ffi::Error RunProbe(Backend& backend, const OpConfig& config, const ProbeArgs& p) {
  FICCO_RETURN_IF_ERROR(backend.Prepare(1, config.group, /*peer_stores=*/false));
  CallSession session(config, {static_cast<int64_t>(SignatureKind::kContentionProbe), static_cast<int64_t>(p.types.a),
                               static_cast<int64_t>(p.types.b), static_cast<int64_t>(p.types.c), p.rows, p.inner, p.cols, p.shard_bytes, p.repeats, p.pull ? 1 : 0, config.n()});
  Event ready;
  FICCO_RETURN_IF_ERROR(backend.Record(Backend::kCompute, &ready));
  std::vector<Post> posts;
  FICCO_RETURN_IF_ERROR(session.Meet(Phase::kExchange, p.x, {ready}, &posts));
  FICCO_RETURN_IF_ERROR(backend.Wait(0, ready));
  if (p.pull) {
    for (int slot = 0; slot < config.n() - 1; ++slot) {
      const int peer = config.SourceOfSlot(slot);
      FICCO_RETURN_IF_ERROR(backend.Wait(0, posts[peer].events[0]));
      FICCO_RETURN_IF_ERROR(backend.Copy(0, Offset(p.gathered, peer * p.shard_bytes), posts[peer].buffer, p.shard_bytes));
    }
  }
  FICCO_RETURN_IF_ERROR(backend.Copy(0, Offset(p.gathered, config.rank * p.shard_bytes), p.x, p.shard_bytes));
  for (int64_t i = 0; i < p.repeats; ++i) {
    FICCO_RETURN_IF_ERROR(backend.Gemm({p.a, p.w, p.out, p.rows, p.inner, p.cols, p.types}));
  }
  return JoinAndRelease(backend, config, session);
}

}  // namespace ficco
