"""The rewrite layer's one site protocol: every matcher family behind `find_sites`, one `Site`
record per op, and modules that share only public names (8 CPU devices)."""
import ast
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


@pytest.mark.parametrize("schedule", ["xla/ring/c2", "none/ring/c1"])
def test_both_families_rewritten_in_one_body(mesh1d, schedule):
    fn, args = _mixed(mesh1d)
    fused = overlap(fn, schedule=schedule)
    assert [r.op for r in explain(fused, *args).sites] == ["ag_matmul", "a2a_matmul"]
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
        assert not any(m.split(".")[0] == "tools" or ".tools" in m for m in modules), f"{path.name} imports tools"
        private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__future__"]
        assert not private, f"{path.name}:{node.lineno} imports private names {private}"


def test_a_matmuls_all_reduce_is_reported_with_how_to_overlap_it(mesh1d):
    """Row-parallel matmul → psum, its sum read on (Megatron's layout without sequence
    parallelism): explain names it and the reduce-scatter + all-gather form that overlaps; a sum
    the body only returns (data parallelism's weight gradients) and a psum of no matmul are not
    matmul sites."""
    def body(x, w_in, w_out):
        h = jnp.tanh(x @ w_in)                       # column-parallel: h [M, F/n]
        y = x + jax.lax.psum(h @ w_out, "tp")        # row-parallel, all-reduced, read on
        grad_like = jax.lax.psum(x.T @ h, "tp")      # returned only
        return y, grad_like, jax.lax.psum(jnp.sum(y), "tp")

    f = jax.shard_map(body, mesh=mesh1d, in_specs=(P(), P(None, "tp"), P("tp", None)),
                      out_specs=(P(), P(), P()))
    rng = np.random.default_rng(0)
    x, w_in, w_out = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((16, 8), (8, 32), (32, 8)))
    report = explain(f, x, w_in, w_out)
    psums = [r for r in report.near_misses if r.op == "matmul_psum"]
    assert len(psums) == 1 and not report.sites, str(report)
    assert psums[0].axis_name == "tp" and "psum_scatter" in psums[0].reason and "all-gather" in psums[0].reason
    np.testing.assert_allclose(jax.jit(overlap(f))(x, w_in, w_out)[0], f(x, w_in, w_out)[0], rtol=1e-6)
