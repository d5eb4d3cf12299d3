"""Mixed precision on 2 GPUs as users write it: bf16 weights and activations with f32 accumulation
(`preferred_element_type=float32`), one training step wrapped both ways the README shows,
`overlap(value_and_grad(loss))` and `value_and_grad(overlap(loss))`, on copy-engine schedules. Every
all-gather and reduce-scatter site of the forward and the backward is rewritten, copy-engine calls
run, and the loss and the gradients match the plain step's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import ficco_jax
from gpu_common import GPU_MARKS, GPUS
from helpers import max_rel_err, mixed_precision_mlp

pytestmark = GPU_MARKS

F32 = jnp.float32
ROWS, WIDTH, HIDDEN = 1024, 2048, 4096  # rows per device; the MLP's width and hidden size (split over tp)


@pytest.mark.parametrize("schedule", ["dma/direct/c1", "dma/direct/c2/grouped", "dma/direct/c4"])
def test_wrap_orders_of_a_mixed_precision_step_gpu(schedule):
    mesh = Mesh(np.array(GPUS[:2]), ("tp",))
    layer = mixed_precision_mlp(mesh)
    loss = lambda x, w1, w2: jnp.mean(layer(x, w1, w2) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2 * ROWS, WIDTH)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((WIDTH, HIDDEN)) / np.sqrt(WIDTH), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((HIDDEN, WIDTH)) / np.sqrt(HIDDEN), jnp.bfloat16)
    plain = jax.value_and_grad(loss, argnums=(0, 1, 2))
    outside = ficco_jax.overlap(plain, schedule=schedule)
    inside = jax.value_and_grad(ficco_jax.overlap(loss, schedule=schedule), argnums=(0, 1, 2))

    report = ficco_jax.explain(outside, x, w1, w2)
    assert [r.op for r in report.sites] == ["ag_matmul", "matmul_rs"] * 2 and not report.near_misses, str(report)
    want_value, want_grads = jax.jit(plain)(x, w1, w2)
    for fn in (outside, inside):
        compiled = jax.jit(fn).lower(x, w1, w2).compile().as_text()
        for target in ("ficco_ag_matmul", "ficco_matmul_rs"):
            assert f'custom_call_target="{target}"' in compiled, target
        value, grads = jax.jit(fn)(x, w1, w2)
        assert value.dtype == F32 and max_rel_err(value, want_value) < 1e-3, max_rel_err(value, want_value)
        for name, got, want in zip(("x", "w1", "w2"), grads, want_grads):
            # bf16 gradients: one rounding each, sums in another order than XLA's
            assert got.dtype == jnp.bfloat16 and max_rel_err(got, want) < 2e-2, (name, max_rel_err(got, want))
