"""The rewrite layer's one site protocol: every matcher family behind `find_sites`, one `Site`
record per op, and modules that share only public names (8 CPU devices)."""
import ast
import functools
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ficco_jax.rewrite import explain, overlap
from ficco_jax.rewrite.matchers import ALL_OPS, FAMILIES, find_sites
from ficco_jax.rewrite.site import Site
from ficco_jax.runtime import extension

REWRITE = pathlib.Path(__file__).resolve().parents[1] / "ficco_jax" / "rewrite"
N, E, C, D, F = 8, 2, 4, 8, 6  # tp size, local experts, capacity, features in and out


def _site_classes():
    found, todo = [], list(Site.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


def test_every_op_has_one_site_class_and_one_matcher_family():
    owners = {op: [cls.__name__ for cls in _site_classes() if op in cls.op_calls] for op in ALL_OPS}
    assert all(len(names) == 1 for names in owners.values()), owners
    primitives = [name for matchers in FAMILIES for name in matchers]
    assert len(primitives) == len(set(primitives)), primitives


def mixed_body(x, w, tokens, w_expert):
    """One tensor-parallel site (all_gather → matmul) and one expert-parallel site (all_to_all →
    per-expert matmul) in the same shard_map body."""
    h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w
    received = jax.lax.all_to_all(tokens, "tp", 0, 0, tiled=True)
    return h, jnp.einsum("pecd,edf->pecf", received, w_expert)


def _mixed(mesh1d):
    fn = jax.shard_map(mixed_body, mesh=mesh1d, in_specs=(P("tp"), P(None, "tp"), P("tp"), P("tp")),
                       out_specs=(P(None, "tp"), P("tp")))
    keys = jax.random.split(jax.random.key(11), 4)
    shapes = [(N * 4, D), (D, N * F), (N * N, E, C, D), (N * E, D, F)]
    return fn, [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


def test_find_sites_runs_every_family(mesh1d):
    fn, args = _mixed(mesh1d)
    body = next(e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "shard_map").params["jaxpr"]
    sites, misses = find_sites(body, {"tp": N}, "sm/", ALL_OPS)
    assert [s.op for s in sites] == ["ag_matmul", "a2a_matmul"] and not misses
    assert all(isinstance(s, Site) and s.axis_name == "tp" and s.axis_size == N for s in sites)
    assert [s.op_shapes() for s in sites] == [((4, D), (D, F)), ((N, E, C, D), (E, D, F))]
    assert [s.record.matmul_2d for s in sites] == [f"[4,{D}]·[{D},{F}]", f"[{N},{E},{C},{D}]·[{E},{D},{F}]"]
    assert all(s.record.where.startswith("sm/eqn ") for s in sites)
    only_tp, tp_misses = find_sites(body, {"tp": N}, "", ("ag_matmul",))
    assert [s.op for s in only_tp] == ["ag_matmul"]
    assert len(tp_misses) == 1 and tp_misses[0].reason.endswith("is not in ops=")


@pytest.mark.parametrize("schedule", ["xla/ring/c2"] + (["dma/direct/c2"] if extension.available() else []))
def test_both_families_rewritten_in_one_body(mesh1d, schedule):
    fn, args = _mixed(mesh1d)
    fused = overlap(fn, schedule=schedule)
    sites = explain(fused, *args).sites
    assert [(r.op, r.schedule, r.rewritten) for r in sites] == [("ag_matmul", schedule, True),
                                                                 ("a2a_matmul", schedule, True)]
    for got, want in zip(jax.jit(fused)(*args), jax.jit(fn)(*args), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _imports(path):
    tree = ast.parse(path.read_text())
    top_level = set(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, node in top_level


@pytest.mark.parametrize("path", sorted(REWRITE.glob("*.py")), ids=lambda p: p.name)
def test_rewrite_modules_share_public_names_only(path):
    for node, top_level in _imports(path):
        modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        ours = (isinstance(node, ast.ImportFrom) and node.level > 0) or any(m.startswith("ficco_jax") for m in modules)
        if not ours:
            continue
        assert top_level, f"{path.name}:{node.lineno}: a function-level import of a ficco_jax module"
        imported = modules + [a.name for a in node.names]  # `from .. import tools` names it as an alias
        assert not any(m.split(".")[0] == "tools" or ".tools" in m for m in imported), f"{path.name} imports tools"
        private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__future__"]
        assert not private, f"{path.name}:{node.lineno} imports private names {private}"


def row_parallel_body(x, w_in, w_out):
    """Megatron's MLP without sequence parallelism: a column-parallel matmul, then a row-parallel
    one whose product is all-reduced and read on; a sum the body only returns (data parallelism's
    weight gradients) and a psum of no matmul are not matmul sites."""
    h = jnp.tanh(x @ w_in)                       # column-parallel: h [M, F/n]
    y = x + jax.lax.psum(h @ w_out, "tp")        # row-parallel, all-reduced, read on
    grad_like = jax.lax.psum(x.T @ h, "tp")      # returned only
    return y, grad_like, jax.lax.psum(jnp.sum(y), "tp")


def _row_parallel(mesh1d, rows=16, check_vma=True):
    f = jax.shard_map(row_parallel_body, mesh=mesh1d, in_specs=(P(), P(None, "tp"), P("tp", None)),
                      out_specs=(P(), P(), P()), check_vma=check_vma)
    rng = np.random.default_rng(0)
    return f, [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((rows, 8), (8, 4 * N), (4 * N, 8))]


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_matmuls_all_reduce_is_a_site_and_auto_keeps_it_plain_on_cpu(mesh1d, check_vma):
    f, args = _row_parallel(mesh1d, check_vma=check_vma)
    report = explain(f, *args)
    assert [r.op for r in report.sites] == ["matmul_psum"] and not report.near_misses, str(report)
    site = report.sites[0]
    assert site.axis_name == "tp" and site.matmul_2d == "[16,4]·[4,8]"
    assert site.schedule == "none (auto)" and "plain path: CPU" in site.note
    for got, want in zip(jax.jit(overlap(f))(*args), jax.jit(f)(*args), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("schedule", ["xla/ring/c2", "xla/bidirectional/c2", "dma/direct/c1/s2"])
def test_a_matmuls_all_reduce_is_rewritten_with_a_given_schedule(mesh1d, schedule, check_vma):
    f, args = _row_parallel(mesh1d, check_vma=check_vma)
    fused = overlap(f, schedule=schedule)
    assert [(r.op, r.schedule, r.note) for r in explain(fused, *args).sites] == [("matmul_psum", schedule, "")]
    for got, want in zip(jax.jit(fused)(*args), jax.jit(f)(*args), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)

    def loss(fn, *args):
        y, grad_like, total = fn(*args)
        return jnp.sum(jnp.sin(y)) + jnp.sum(grad_like ** 2) + total

    got = jax.jit(jax.grad(functools.partial(loss, fused), argnums=(0, 1, 2)))(*args)
    want = jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1, 2)))(*args)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


def test_an_all_reduce_whose_rows_come_from_the_right_operand(mesh1d):
    """``psum(w^T h^T)``: the rhs has the most free elements, so its rows are the op's; the result
    is transposed back into the dot's own order."""
    def body(x, w_in, w_out):
        h = jnp.tanh(x @ w_in)
        return x.T + 1.5 * jax.lax.psum(w_out.T @ h.T, "tp")  # [8, 4] · [4, 16] -> [8, 16]

    f = jax.shard_map(body, mesh=mesh1d, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P())
    _, args = _row_parallel(mesh1d)
    fused = overlap(f, schedule="xla/ring/c2")
    site, = explain(fused, *args).sites
    assert site.op == "matmul_psum" and site.matmul_2d == "[16,4]·[4,8]"
    np.testing.assert_allclose(np.asarray(jax.jit(fused)(*args)), np.asarray(jax.jit(f)(*args)), rtol=1e-5, atol=1e-5)


def test_rows_an_all_reduce_cannot_split_keep_the_plain_path_and_say_why(mesh1d):
    f, args = _row_parallel(mesh1d, rows=12)  # 12 rows cannot be reduce-scattered over 8 devices
    fused = overlap(f, schedule="xla/ring/c2")
    site, = explain(fused, *args).sites
    assert site.schedule == "none (auto)"
    assert "y.shape[0]=12 rows must divide by the axis size 8" in site.note and "pad y to 16 rows" in site.note
    for got, want in zip(jax.jit(fused)(*args), jax.jit(f)(*args), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_all_reduces_it_cannot_take_stay_near_misses_with_their_reason(mesh2d):
    """A product read besides its sum, a sum over two axes, and ops= without matmul_psum."""
    def body(x, w):
        p = x @ w
        return jax.lax.psum(p, "tp") * 2, p, jax.lax.psum(x @ (2 * w), ("dp", "tp")) + 1

    f = jax.shard_map(body, mesh=mesh2d, in_specs=(P(None, ("dp", "tp")), P(("dp", "tp"), None)),
                      out_specs=(P(), P(None, None), P()), check_vma=False)
    rng = np.random.default_rng(1)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((16, 8 * 3), (8 * 3, 5)))
    report = explain(f, x, w)
    reasons = sorted(r.reason for r in report.near_misses if r.op == "matmul_psum")
    assert not report.sites and len(reasons) == 2, str(report)
    assert any("other users" in r for r in reasons) and any("several mesh axes" in r for r in reasons)
    body_only = lambda x, w: jax.lax.psum(x @ w, "tp") * 2  # noqa: E731
    g = jax.shard_map(body_only, mesh=mesh2d, in_specs=(P(None, ("dp", "tp")), P(("dp", "tp"), None)), out_specs=P(),
                      check_vma=False)
    miss, = explain(overlap(g, ops=("matmul_rs",)), x, w).near_misses
    assert miss.op == "matmul_psum" and miss.reason.endswith("is not in ops=")


def _transposes(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "transpose"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _transposes(inner)
    return count


@pytest.mark.parametrize("batch", [1, 2])
def test_a_batch_of_one_sequence_reaches_the_op_without_a_transpose(mesh1d, batch):
    """Gathering the tokens of [batch, tokens, features]: the op's rows are (tokens, batch), a
    transpose for a batch of two, a reshape (no copy) for a batch of one; the results agree."""
    def mlp(x, w):
        return jax.lax.all_gather(x, "tp", axis=1, tiled=True) @ w

    f = jax.shard_map(mlp, mesh=mesh1d, in_specs=(P(None, "tp"), P()), out_specs=P(), check_vma=False)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, 4 * N, D)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((D, F)), jnp.float32)
    fused = overlap(f, schedule="xla/ring/c2")
    assert _transposes(jax.make_jaxpr(fused)(x, w).jaxpr) == (0 if batch == 1 else 2)
    np.testing.assert_allclose(np.asarray(jax.jit(fused)(x, w)), np.asarray(jax.jit(f)(x, w)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["xla/ring/c2"] + (["dma/direct/c2"] if extension.available() else []))
def test_a_matmul_of_two_gathered_operands_is_one_site(mesh2d, schedule):
    """x gathered over tp times w gathered over dp: the first gather's site takes the matmul, the
    second is reported as a near-miss (it had claimed the same matmul and read a value the first
    site no longer computes)."""
    fn = jax.shard_map(lambda x, w: jax.lax.all_gather(x, "tp", axis=0, tiled=True)
                       @ jax.lax.all_gather(w, "dp", axis=1, tiled=True),
                       mesh=mesh2d, in_specs=(P("tp"), P(None, "dp")), out_specs=P("tp"), check_vma=False)
    kx, kw = jax.random.split(jax.random.key(5))
    x, w = jax.random.normal(kx, (16, 8)), jax.random.normal(kw, (8, 16))
    fused = overlap(fn, schedule=schedule)
    report = explain(fused, x, w)
    assert [r.op for r in report.sites] == ["ag_matmul"], str(report)
    assert [r.reason.split(": ", 1)[-1] for r in report.near_misses] == [
        "the matmul already belongs to another site (both of its operands are gathered)"], str(report)
    np.testing.assert_allclose(np.asarray(fused(x, w)), np.asarray(fn(x, w)), rtol=1e-5, atol=1e-5)


def test_an_all_to_all_of_several_blocks_per_peer_is_a_near_miss_and_runs_as_written(mesh1d):
    """A tiled all_to_all whose leading dimension holds 2 blocks per peer is valid JAX; the expert
    ops take one block per peer, so the site is reported, not rewritten, under any schedule."""
    def dispatch(x, w):
        return jnp.einsum("pecd,edf->pecf", jax.lax.all_to_all(x, "tp", 0, 0, tiled=True), w)

    f = jax.shard_map(dispatch, mesh=mesh1d, in_specs=(P("tp"), P("tp")), out_specs=P("tp"))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((N * 2 * N, E, C, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((N * E, D, F)), jnp.float32)
    for schedule in ("auto", "xla/direct/c1"):
        report = explain(overlap(f, schedule=schedule), x, w)
        assert not report.sites and "holds 16 blocks on an axis of 8 devices" in report.near_misses[0].reason, str(report)
        np.testing.assert_array_equal(np.asarray(jax.jit(overlap(f, schedule=schedule))(x, w)), np.asarray(jax.jit(f)(x, w)))


def test_a_site_whose_op_refuses_its_operands_stays_as_written_and_says_why(mesh1d):
    """An empty weight: plain JAX gives an empty product; the op refuses it, so the site is a
    near-miss naming the op's reason, and the program runs as written."""
    f = jax.shard_map(lambda x, w: jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w, mesh=mesh1d,
                      in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    x, w = jnp.asarray(np.random.default_rng(4).standard_normal((64, 16)), jnp.float32), jnp.zeros((16, 0))
    report = explain(overlap(f, schedule="xla/ring/c2"), x, w)
    assert not report.sites and report.near_misses[0].reason.startswith("the op refuses its operands: "), str(report)
    assert "empty dimension" in report.near_misses[0].reason
    assert overlap(f)(x, w).shape == f(x, w).shape == (64, 0)
