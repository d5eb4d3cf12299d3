"""ficco_jax.dot_general in Auto-mode programs: jax.jit with in/out shardings on an Auto mesh, the
partitioner choosing the operands' shardings. It equals jax.lax.dot_general (values and gradients)
and lowers, per partition, to the op those shardings imply: ag_matmul, matmul_rs, matmul_psum or
the local dot. Which op ran is read in the compiled program: the copy-engine schedules' custom
calls, and the collectives of the XLA schedules (chunked collective-permutes, no all-gather or
reduce-scatter of their own)."""
import collections
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax.ops.partition_plan import AG, AR, PLAIN, RS, DotDims, choose_plan

from helpers import TOLERANCE, random, rel_err

SCHEDULES = ("xla/ring/c2", "dma/direct/c2")
DENSE = (((2,), (0,)), ((), ()))  # [batch, seq, d] @ [d, f], as Linen's Dense calls it


@pytest.fixture(scope="module")
def mesh():
    # Device order permuted so that device ordinals differ from positions in the mesh.
    devices = np.array(jax.devices()[:8])[[5, 2, 7, 0, 3, 6, 1, 4]]
    return Mesh(devices.reshape(2, 4), ("data", "model"))


def ficco_targets(compiled: str) -> collections.Counter:
    return collections.Counter(re.findall(r'custom_call_target="(ficco_\w+)"', compiled))


def collectives(compiled: str) -> collections.Counter:
    found = re.findall(r"= \S+ (all-gather|reduce-scatter|all-reduce|collective-permute)(?:-start)?\(", compiled)
    return collections.Counter(found)


# -- the plan for given shardings (no compilation) ----------------------------------------------------

def _axes(*entries):
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]


PLANS = {
    # name: (dimension_numbers, ranks, lhs, rhs, result wanted) -> (op, axis, lhs, rhs, result)
    "sequence-parallel gather": (DENSE, (3, 2), _axes("data", "model", None), _axes(None, "model"),
                                 _axes("data", None, "model"),
                                 (AG, "model", _axes("data", "model", None), _axes(None, "model"),
                                  _axes("data", None, "model"))),
    "heads on the weight's second free dim": (DENSE, (3, 3), _axes("data", "model", None), _axes(None, "model", None),
                                              _axes("data", None, "model", None),
                                              (AG, "model", _axes("data", "model", None), _axes(None, "model", None),
                                               _axes("data", None, "model", None))),
    "row-parallel scatter": (DENSE, (3, 2), _axes("data", None, "model"), _axes("model", None),
                             _axes("data", "model", None),
                             (RS, "model", _axes("data", None, "model"), _axes("model", None),
                              _axes("data", "model", None))),
    "two contracting dims, one sharded": ((((2, 3), (0, 1)), ((), ())), (4, 3), _axes("data", None, "model", None),
                                          _axes("model", None, None), _axes("data", "model", None),
                                          (RS, "model", _axes("data", None, "model", None),
                                           _axes("model", None, None), _axes("data", "model", None))),
    "row-parallel all-reduce": (DENSE, (3, 2), _axes("data", None, "model"), _axes("model", None),
                                _axes("data", None, None),
                                (AR, "model", _axes("data", None, "model"), _axes("model", None),
                                 _axes("data", None, None))),
    "weight gradient over data": ((((0, 1), (0, 1)), ((), ())), (3, 3), _axes("data", None, None),
                                  _axes("data", None, "model"), _axes(None, "model"),
                                  (AR, "data", _axes("data", None, None), _axes("data", None, "model"),
                                   _axes(None, "model"))),
    "column-parallel, no communication": (DENSE, (3, 2), _axes("data", None, None), _axes(None, "model"),
                                          _axes("data", None, "model"),
                                          (PLAIN, None, _axes("data", None, None), _axes(None, "model"),
                                           _axes("data", None, "model"))),
    "rows wanted sharded: the weight is gathered": (DENSE, (3, 2), _axes("data", "model", None), _axes(None, "model"),
                                                    _axes("data", "model", None),
                                                    (PLAIN, None, _axes("data", "model", None), _axes(None, None),
                                                     _axes("data", "model", None))),
    "batch dims stay local": ((((3,), (3,)), ((0, 1), (0, 1))), (4, 4), _axes("data", "model", None, None),
                              _axes("data", "model", None, None), _axes("data", "model", None, None),
                              (PLAIN, None, _axes("data", "model", None, None), _axes("data", "model", None, None),
                               _axes("data", "model", None, None))),
}


@pytest.mark.parametrize("name", PLANS)
def test_plan_of_shardings(name):
    dn, (lhs_ndim, rhs_ndim), lhs, rhs, out, want = PLANS[name]
    plan = choose_plan(DotDims.of(dn, lhs_ndim, rhs_ndim), lhs, rhs, out)
    assert (plan.op, plan.axis, list(plan.lhs), list(plan.rhs), list(plan.out)) == want


def test_sharding_rule_is_the_dots_einsum():
    dims = DotDims.of((((3,), (2,)), ((0,), (0,))), 4, 3)
    assert dims.sharding_rule() == ("a c d b, a e b -> a c d e", ("b",))


# -- programs under jax.jit with in/out shardings ------------------------------------------------------

# name: (lhs shape, rhs shape, dimension_numbers, lhs spec, rhs spec, out spec, ficco custom calls of dma/direct/c2)
CASES = {
    "ag_matmul": ((4, 16, 32), (32, 64), DENSE, P("data", "model", None), P(None, "model"), P("data", None, "model"),
                  {"ficco_ag_matmul": 1}),
    "matmul_rs": ((4, 16, 64), (64, 32), DENSE, P("data", None, "model"), P("model", None), P("data", "model", None),
                  {"ficco_matmul_rs": 1}),
    "matmul_psum": ((4, 16, 64), (64, 32), DENSE, P("data", None, "model"), P("model", None), P("data", None, None),
                    {"ficco_matmul_rs": 1, "ficco_all_gather": 1}),
    "local dot": ((4, 16, 32), (32, 64), DENSE, P("data", None, None), P(None, "model"), P("data", None, "model"), {}),
    "heads": ((4, 16, 32), (32, 8, 4), DENSE, P("data", "model", None), P(None, "model", None),
              P("data", None, "model", None), {"ficco_ag_matmul": 1}),
    "batch dims": ((4, 8, 16, 8), (4, 8, 16, 8), (((3,), (3,)), ((0, 1), (0, 1))), P("data", "model"),
                   P("data", "model"), P("data", "model"), {}),
}


def _program(case, dot, mesh):
    lhs_shape, rhs_shape, dn, lhs_spec, rhs_spec, out_spec, _ = case
    shardings = tuple(NamedSharding(mesh, s) for s in (lhs_spec, rhs_spec))
    out = NamedSharding(mesh, out_spec)

    def loss(lhs, rhs):
        return jnp.sum(jnp.sin(lax.with_sharding_constraint(dot(lhs, rhs, dn), out)))

    forward = jax.jit(lambda lhs, rhs: dot(lhs, rhs, dn), in_shardings=shardings, out_shardings=out)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=shardings, out_shardings=shardings)
    return forward, grad


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", CASES)
def test_equals_lax_dot_general(mesh, rng, name, schedule):
    case = CASES[name]
    lhs, rhs = random(rng, case[0], jnp.float32), random(rng, case[1], jnp.float32)
    forward, grad = _program(case, partial(ficco_jax.dot_general, schedule=schedule), mesh)
    want_forward, want_grad = _program(case, lax.dot_general, mesh)
    assert rel_err(forward(lhs, rhs), want_forward(lhs, rhs)) < TOLERANCE["float32"]
    for got, want in zip(grad(lhs, rhs), want_grad(lhs, rhs)):
        assert rel_err(got, want) < TOLERANCE["float32"]
    compiled = forward.lower(lhs, rhs).compile().as_text()
    if schedule.startswith("dma"):
        assert ficco_targets(compiled) == collections.Counter(case[-1])
    else:
        assert not ficco_targets(compiled)
        if case[-1]:  # the chunks move by collective-permute; no all-gather / reduce-scatter of the whole
            assert collectives(compiled)["collective-permute"] > 0
            assert collectives(compiled)["reduce-scatter"] == 0


def test_bf16_with_f32_accumulation(mesh, rng):
    case = CASES["ag_matmul"]
    lhs, rhs = random(rng, case[0], jnp.bfloat16), random(rng, case[1], jnp.bfloat16)
    ours = partial(ficco_jax.dot_general, preferred_element_type=jnp.float32, schedule="dma/direct/c2")
    plain = partial(lax.dot_general, preferred_element_type=jnp.float32)
    (forward, grad), (want_forward, want_grad) = _program(case, ours, mesh), _program(case, plain, mesh)
    got = forward(lhs, rhs)
    assert got.dtype == jnp.float32
    assert rel_err(got, want_forward(lhs, rhs)) < TOLERANCE["float32"]
    for g, w in zip(grad(lhs, rhs), want_grad(lhs, rhs)):
        assert g.dtype == w.dtype == jnp.bfloat16
        assert rel_err(g, w) < TOLERANCE["bfloat16"]


def test_gspmd_partitioner(mesh, rng):
    """The same op under the GSPMD partitioner (Shardy off): its sharding callbacks instead of the rule."""
    case = CASES["matmul_rs"]
    lhs, rhs = random(rng, case[0], jnp.float32), random(rng, case[1], jnp.float32)
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        forward, grad = _program(case, partial(ficco_jax.dot_general, schedule="dma/direct/c2"), mesh)
        want_forward, want_grad = _program(case, lax.dot_general, mesh)
        assert rel_err(forward(lhs, rhs), want_forward(lhs, rhs)) < TOLERANCE["float32"]
        for got, want in zip(grad(lhs, rhs), want_grad(lhs, rhs)):
            assert rel_err(got, want) < TOLERANCE["float32"]
        assert ficco_targets(forward.lower(lhs, rhs).compile().as_text()) == collections.Counter(case[-1])
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


def test_plain_outside_a_partitioned_program(rng):
    """Eagerly, on one device and inside jax.shard_map it is the plain dot."""
    x, w = random(rng, (2, 4, 8), jnp.float32), random(rng, (8, 6), jnp.float32)
    want = lax.dot_general(x, w, DENSE)
    assert rel_err(ficco_jax.dot_general(x, w, DENSE, schedule="xla/ring/c2"), want) < TOLERANCE["float32"]
    assert rel_err(jax.jit(partial(ficco_jax.dot_general, dimension_numbers=DENSE))(x, w), want) < TOLERANCE["float32"]


def test_refused_schedule_runs_auto(mesh, rng, caplog):
    """A schedule the op refuses for its blocks (2 rows per device, 4 chunks) runs as "auto", with a warning."""
    case = ((4, 4, 32), (32, 64), *CASES["ag_matmul"][2:])
    lhs, rhs = random(rng, case[0], jnp.float32), random(rng, case[1], jnp.float32)
    forward, _ = _program(case, partial(ficco_jax.dot_general, schedule="xla/ring/c4"), mesh)
    want_forward, _ = _program(case, lax.dot_general, mesh)
    with caplog.at_level("WARNING", logger="ficco_jax"):
        assert rel_err(forward(lhs, rhs), want_forward(lhs, rhs)) < TOLERANCE["float32"]
    assert any("takes no schedule xla/ring/c4" in r.getMessage() for r in caplog.records)



@pytest.mark.parametrize("name", ["ag_matmul", "matmul_rs"])
def test_forward_mode_and_second_order(mesh, rng, name):
    """jax.jvp, and a Hessian-vector product (grad of jvp), equal lax.dot_general's."""
    case = CASES[name]
    lhs, rhs, d_lhs, d_rhs = (random(rng, case[i % 2], jnp.float32) for i in range(4))
    shardings = tuple(NamedSharding(mesh, s) for s in case[3:5])
    out = NamedSharding(mesh, case[5])
    ours = partial(ficco_jax.dot_general, schedule="dma/direct/c2")

    def programs(dot):
        def f(a, b):
            return jnp.sin(dot(a, b, case[2]))

        jvp = jax.jit(lambda a, b, da, db: jax.jvp(f, (a, b), (da, db)), in_shardings=shardings * 2,
                      out_shardings=(out, out))
        hvp = jax.jit(jax.grad(lambda a, b, da, db: jnp.sum(jax.jvp(f, (a, b), (da, db))[1] ** 2), argnums=(0, 1)),
                      in_shardings=shardings * 2)
        return jvp, hvp

    (jvp, hvp), (want_jvp, want_hvp) = programs(ours), programs(lax.dot_general)
    args = (lhs, rhs, d_lhs, d_rhs)
    for got, want in zip((*jvp(*args), *hvp(*args)), (*want_jvp(*args), *want_hvp(*args))):
        assert rel_err(got, want) < TOLERANCE["float32"]
    assert ficco_targets(jvp.lower(*args).compile().as_text())  # the tangent's dots are overlapped too
