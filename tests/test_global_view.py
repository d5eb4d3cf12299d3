"""overlap() on global-view code with explicit shardings (no shard_map), 8 CPU devices: the
sites its reshard / out_sharding imply are found, rewritten into the ops when a schedule is
forced (on CPU "auto" keeps the plain path), and the rewritten program equals the written one
in value, gradient and type (FP8 recipes become the scaled ops); the matmuls of GSPMD (Auto-axis)
code become ficco_jax.dot_general, whose op the partitioner picks."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard

from ficco_jax import explain, overlap
from ficco_jax.rewrite.matchers import ALL_OPS, find_sites
from ficco_jax.rewrite.overlap import Report
from ficco_jax.rewrite.shardings import spec_of_axes
from ficco_jax.runtime import extension
from helpers import runs_given

XLA = "xla/ring/c2"
DMA = "dma/direct/c2"
SCHEDULES = [XLA] + [pytest.param(s, marks=pytest.mark.skipif(not extension.available(),
                                                              reason="the ficco_jax extension is not built"))
                      for s in (DMA, "dma/direct/c2/columns")]
# Relative error (norm of the difference over the norm of the reference) allowed per dtype.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
B, S, D, F, H, DH = 4, 16, 32, 64, 8, 4  # batch, sequence, model, ffn, heads, head dim
SEQ_PARALLEL = P("dp", "tp", None)  # activations between blocks: [batch@dp, seq@tp, model]


def _dp_tp_mesh():
    """dp=2 x tp=4, both axes explicit; device order permuted so ordinals differ from ranks."""
    devices = np.array(jax.devices()[:8])[[5, 2, 7, 0, 3, 6, 1, 4]].reshape(2, 4)
    return jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)


@pytest.fixture
def mesh():
    """The (dp, tp) mesh, entered as the context mesh as explicit-mode programs are run."""
    mesh = _dp_tp_mesh()
    with jax.set_mesh(mesh):
        yield mesh


def _random(mesh, specs_shapes, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(specs_shapes))
    return [jax.device_put(jax.random.normal(k, shape, jnp.float32).astype(dtype) * 0.5 + 0.25,
                           NamedSharding(mesh, spec)) for k, (spec, shape) in zip(keys, specs_shapes)]


def _assert_same(got, want, dtype=jnp.float32):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jax.typeof(g) == jax.typeof(w), (jax.typeof(g), jax.typeof(w))
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.abs(w).max() > 0
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]}"


def _ops(report):
    return [r.op for r in report.sites]


# --------------------------------------------------------------------------------------------
# The programs, written on global arrays
# --------------------------------------------------------------------------------------------
def megatron_mlp(x, w_up, w_down):
    """Sequence-parallel Megatron MLP: gather the sequence, column- then row-parallel matmul."""
    g = reshard(x, P("dp", None, None))
    h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", g, w_up))
    return jnp.einsum("bsf,fd->bsd", h, w_down, out_sharding=SEQ_PARALLEL)


def _mlp_args(mesh, dtype=jnp.float32):
    return _random(mesh, [(SEQ_PARALLEL, (B, S, D)), (P(None, "tp"), (D, F)), (P("tp", None), (F, D))], dtype)


def attention_projections(x, wq, wk, wv, wo):
    """QKV projections of the gathered sequence (heads over tp), attention, O projection scattered."""
    g = reshard(x, P("dp", None, None))
    q, k, v = (jnp.einsum("bsd,dhk->bshk", g, w) for w in (wq, wk, wv))
    scores = jnp.einsum("bshk,bthk->bhst", q, k) * DH ** -0.5
    o = jnp.einsum("bhst,bthk->bshk", jax.nn.softmax(scores, axis=-1), v)
    return jnp.einsum("bshk,hkd->bsd", o, wo, out_sharding=SEQ_PARALLEL)


def _attention_args(mesh, dtype=jnp.float32):
    head_spec = P(None, "tp", None)
    return _random(mesh, [(SEQ_PARALLEL, (B, S, D)), (head_spec, (D, H, DH)), (head_spec, (D, H, DH)),
                          (head_spec, (D, H, DH)), (P("tp", None, None), (H, DH, D))], dtype, seed=1)


def _loss(block):
    return lambda *args: jnp.mean(block(*args).astype(jnp.float32) ** 2)


# --------------------------------------------------------------------------------------------
# Sites found and rewritten: values, gradients and types as written
# --------------------------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("block, make_args", [(megatron_mlp, _mlp_args), (attention_projections, _attention_args)],
                         ids=["mlp", "attention"])
def test_block_forward_and_gradients_equal(mesh, block, make_args, schedule, dtype):
    args = make_args(mesh, dtype)
    fused = overlap(block, schedule=schedule)
    report = explain(fused, *args)
    # One op per gather: the attention's Q, K and V projections are one op of three weights.
    assert _ops(report) == ["ag_matmul", "matmul_rs"] and not report.near_misses, str(report)
    assert (block is megatron_mlp) != ("3 weights" in report.sites[0].shapes), str(report)
    assert all(runs_given(r, schedule) and r.axis_name == "tp" for r in report.sites), str(report)
    _assert_same(jax.jit(fused)(*args), jax.jit(block)(*args), dtype)
    grad = lambda f: jax.jit(jax.grad(_loss(f), argnums=tuple(range(len(args)))))  # noqa: E731
    _assert_same(grad(fused)(*args), grad(block)(*args), dtype)


def mixed_precision_mlp(x, w_up, w_down):
    """megatron_mlp with bf16 values and f32 accumulation (preferred_element_type)."""
    g = reshard(x, P("dp", None, None))
    h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", g, w_up, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
    return jnp.einsum("bsf,fd->bsd", h, w_down, out_sharding=SEQ_PARALLEL, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mixed_precision_backward_sites_as_the_partitioner_computes_them(mesh, schedule):
    """overlap(value_and_grad(loss)) of a bf16 block with f32 accumulation: the backward's f32 x
    bf16 gather site and its scatter site, whose f32 sum the program casts to bf16, become ops
    (the scatter sums f32 partials and casts after, as the partitioner does); the gradients are
    JAX's bit for bit but where a sum runs in another order, as are those of
    value_and_grad(overlap(loss))."""
    args = _mlp_args(mesh, jnp.bfloat16)
    loss = lambda *a: jnp.sum(mixed_precision_mlp(*a) ** 2)  # noqa: E731
    plain = jax.value_and_grad(loss, argnums=(0, 1, 2))
    fused = overlap(plain, schedule=schedule)
    report = explain(fused, *args)
    # The weight gradient's sum over the data-parallel axis, read by the loss's caller here, is an
    # all-reduce site of its own (f32 x bf16, the bf16 operand widened).
    assert _ops(report) == ["ag_matmul", "matmul_rs", "ag_matmul", "matmul_psum", "matmul_rs"], str(report)
    assert "x float32" in report.sites[2].shapes and "w bfloat16" in report.sites[2].shapes, str(report)
    assert report.sites[3].axis_name == "dp", str(report)
    assert report.sites[4].shapes.endswith("-> bfloat16[4@dp,16@tp,32]"), str(report)
    assert not report.near_misses, str(report)
    value_ref, grads_ref = jax.jit(plain)(*args)
    # overlap inside the gradient: the ops' backward sums, then casts, as the partitioner does.
    for fn in (fused, jax.value_and_grad(overlap(loss, schedule=schedule), argnums=(0, 1, 2))):
        value, grads = jax.jit(fn)(*args)
        assert abs(float(value) - float(value_ref)) <= 1e-5 * abs(float(value_ref))
        for g, r in zip(grads, grads_ref, strict=True):
            assert jax.typeof(g) == jax.typeof(r), (jax.typeof(g), jax.typeof(r))
            same = np.mean(np.asarray(g, np.float32) == np.asarray(r, np.float32))
            assert same > 0.99, same


def test_sites_report_the_global_and_the_local_shapes(mesh):
    report = explain(overlap(megatron_mlp, schedule=XLA), *_mlp_args(mesh))
    gather, scatter = report.sites
    assert gather.shapes.startswith(f"x float32[{B}@dp,{S}@tp,{D}] gathered dim 1"), gather.shapes
    assert gather.matmul_2d == f"[{B // 2 * S // 4},{D}]·[{D},{F // 4}]"  # local rows (s, b), local columns
    assert scatter.matmul_2d == f"[{B // 2 * S},{F // 4}]·[{F // 4},{D}]"
    assert "test_global_view.py" in gather.source


def test_dp_tp_training_step_equal(mesh):
    """A 2-D (dp, tp) SGD step on the MLP: the rewritten step updates the parameters alike."""
    x, w_up, w_down = _mlp_args(mesh)

    def step(params, x):
        loss, grads = jax.value_and_grad(lambda p: _loss(megatron_mlp)(x, *p))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    fused = overlap(step, schedule=XLA)
    # forward: gather (also returning the gathered rows, read by a weight gradient) and scatter;
    # backward: the hidden gradient's gather (x is not differentiated: no scatter behind it), and
    # w_down's gradient all-reduced over dp, read by the update
    report = explain(fused, (w_up, w_down), x)
    assert sorted(_ops(report)) == ["ag_matmul", "ag_matmul", "matmul_psum", "matmul_rs"], str(report)
    assert [r.axis_name for r in report.sites if r.op == "matmul_psum"] == ["dp"], str(report)
    assert "also used by" in report.sites[0].shapes, str(report)
    _assert_same(jax.jit(fused)((w_up, w_down), x), jax.jit(step)((w_up, w_down), x))


def test_overlap_of_the_gradient_rewrites_backward_sites(mesh):
    args = _mlp_args(mesh)
    grad = jax.grad(_loss(megatron_mlp), argnums=(0, 1, 2))
    report = explain(overlap(grad, schedule=XLA), *args)
    # w_down's data-parallel gradient is all-reduced over dp and read on (transposed): matmul_psum
    assert sorted(_ops(report)) == ["ag_matmul", "ag_matmul", "matmul_psum", "matmul_rs", "matmul_rs"], str(report)
    assert [r.axis_name for r in report.sites if r.op == "matmul_psum"] == ["dp"], str(report)
    assert all("all-reduce" in r.reason and r.axis_name == "dp" for r in report.near_misses), str(report)
    _assert_same(jax.jit(overlap(grad, schedule=XLA))(*args), jax.jit(grad)(*args))


def tensor_parallel_mlp(x, w_up, w_down):
    """Megatron's MLP without sequence parallelism: x replicated over tp, column- then row-parallel
    matmul whose product is all-reduced (a result replicated over tp) and added to x."""
    h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, w_up))
    return x + jnp.einsum("bsf,fd->bsd", h, w_down, out_sharding=P("dp", None, None))


def _tp_mlp_args(mesh, dtype=jnp.float32):
    return _random(mesh, [(P("dp", None, None), (B, S, D)), (P(None, "tp"), (D, F)), (P("tp", None), (F, D))], dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_all_reduced_matmul_forward_and_gradients_equal(mesh, schedule, dtype):
    args = _tp_mlp_args(mesh, dtype)
    fused = overlap(tensor_parallel_mlp, schedule=schedule)
    report = explain(fused, *args)
    assert _ops(report) == ["matmul_psum"] and not report.near_misses, str(report)
    site = report.sites[0]
    assert site.axis_name == "tp" and runs_given(site, schedule)
    assert site.matmul_2d == f"[{B // 2 * S},{F // 4}]·[{F // 4},{D}]"  # local rows (b, s), local contraction
    _assert_same(jax.jit(fused)(*args), jax.jit(tensor_parallel_mlp)(*args), dtype)
    grad = lambda f: jax.jit(jax.grad(_loss(f), argnums=(0, 1, 2)))  # noqa: E731
    _assert_same(grad(fused)(*args), grad(tensor_parallel_mlp)(*args), dtype)


def test_all_reduced_matmul_auto_keeps_the_plain_path_on_cpu(mesh):
    args = _tp_mlp_args(mesh)
    site, = explain(overlap(tensor_parallel_mlp), *args).sites
    assert site.op == "matmul_psum" and site.schedule == "none (auto)" and "plain path: CPU" in site.note
    np.testing.assert_array_equal(np.asarray(jax.jit(overlap(tensor_parallel_mlp))(*args)),
                                  np.asarray(jax.jit(tensor_parallel_mlp)(*args)))


def test_gate_and_up_are_one_op_that_returns_the_gathered_tensor(mesh):
    x, w_up, w_down = _mlp_args(mesh)

    def swiglu(x, w_gate, w_up, w_down):
        g = reshard(x, P("dp", None, None))
        h = jax.nn.silu(jnp.einsum("bsd,df->bsf", g, w_gate)) * jnp.einsum("bsd,df->bsf", g, w_up)
        return jnp.einsum("bsf,fd->bsd", h, w_down, out_sharding=SEQ_PARALLEL), g

    args = (x, w_up, w_up * 0.5 - 0.1, w_down)
    report = explain(overlap(swiglu, schedule=XLA), *args)
    assert _ops(report) == ["ag_matmul", "matmul_rs"], str(report)
    assert "2 weights" in report.sites[0].shapes and "also used by 1 more" in report.sites[0].shapes, str(report)
    _assert_same(jax.jit(overlap(swiglu, schedule=XLA))(*args), jax.jit(swiglu)(*args))


def test_dot_that_gathers_its_operand_and_reshard_after_the_product(mesh):
    """No reshard before the matmul (out_sharding drops the sequence axis), and the reduce-scatter
    as a replicated product resharded onto the sequence."""
    x, w_up, w_down = _mlp_args(mesh)

    def mlp(x, w_up, w_down):
        h = jnp.einsum("bsd,df->bsf", x, w_up, out_sharding=P("dp", None, "tp"))
        y = jnp.einsum("bsf,fd->bsd", jnp.tanh(h), w_down, out_sharding=P("dp", None, None))
        return reshard(y, SEQ_PARALLEL)

    report = explain(overlap(mlp, schedule=XLA), x, w_up, w_down)
    assert _ops(report) == ["ag_matmul", "matmul_rs"] and not report.near_misses, str(report)
    _assert_same(jax.jit(overlap(mlp, schedule=XLA))(x, w_up, w_down), jax.jit(mlp)(x, w_up, w_down))


def test_sites_inside_scan_and_remat(mesh):
    x, w_up, w_down = _mlp_args(mesh)
    layers = [jnp.stack([w, w * 0.5]) for w in (w_up, w_down)]  # [2 layers, ...], sharded as the weights

    def stack(x, layers):
        layer = jax.checkpoint(lambda h, p: (h + megatron_mlp(h, *p), None))
        return jax.lax.scan(layer, x, layers)[0]

    report = explain(overlap(stack, schedule=XLA), x, layers)
    assert _ops(report) == ["ag_matmul", "matmul_rs"] and all("scan@" in r.where for r in report.sites), str(report)
    _assert_same(jax.jit(overlap(stack, schedule=XLA))(x, layers), jax.jit(stack)(x, layers))
    grad = lambda f: jax.jit(jax.grad(lambda x, p: jnp.mean(f(x, p) ** 2), argnums=(0, 1)))  # noqa: E731
    _assert_same(grad(overlap(stack, schedule=XLA))(x, layers), grad(stack)(x, layers))


# --------------------------------------------------------------------------------------------
# FP8 as the recipes write it: the FP8 ops, with the two scales
# --------------------------------------------------------------------------------------------
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_SCALES = (jnp.float32(0.37), jnp.float32(1.7))
# The second matmul reads the first one's result requantized to FP8: where the bf16 rounding of
# that result differs, an FP8 step may differ too.
REQUANTIZED_TOLERANCE = 0.05


def fp8_mlp(x8, w_up, w_down, sx, sw):
    """The gathered FP8 sequence dequantized in bf16 before the column-parallel matmul; the
    row-parallel matmul's operands dequantized from FP8 in f32, its product scattered."""
    g = reshard(x8, P("dp", None, None))
    h = jnp.einsum("bsd,df->bsf", g.astype(jnp.bfloat16) * sx.astype(jnp.bfloat16),
                   w_up.astype(jnp.bfloat16) * sw.astype(jnp.bfloat16))
    h8 = jax.nn.relu(h).astype(E4M3)
    y = jnp.einsum("bsf,fd->bsd", h8.astype(jnp.float32) * sx, w_down.astype(jnp.float32) * sw,
                   out_sharding=SEQ_PARALLEL)
    return h, y


def _fp8_args(mesh, dtype=E4M3):
    x8, w_up, w_down = (v * 3 for v in _mlp_args(mesh))
    return (x8.astype(dtype), w_up.astype(dtype), w_down.astype(dtype), *FP8_SCALES)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fp8_sites_become_the_scaled_ops(mesh, schedule):
    args = _fp8_args(mesh)
    fused = overlap(fp8_mlp, schedule=schedule)
    report = explain(fused, *args)
    assert _ops(report) == ["ag_matmul", "matmul_rs"] and not report.near_misses, str(report)
    assert all("(FP8, scaled)" in r.shapes and runs_given(r, schedule) for r in report.sites), str(report)
    assert report.sites[0].shapes.startswith(f"x float8_e4m3fn[{B}@dp,{S}@tp,{D}] gathered dim 1"), str(report)
    (h, y), (h_ref, y_ref) = jax.jit(fused)(*args), jax.jit(fp8_mlp)(*args)
    _assert_same(h, h_ref, jnp.bfloat16)
    assert jax.typeof(y) == jax.typeof(y_ref)
    err = np.linalg.norm(np.asarray(y, np.float64) - np.asarray(y_ref)) / np.linalg.norm(np.asarray(y_ref))
    assert err < REQUANTIZED_TOLERANCE, err
    lowered = jax.jit(fused).lower(*args).as_text()
    if schedule.startswith("dma/"):
        assert lowered.count("ficco_ag_matmul_scaled") == 1 and lowered.count("ficco_matmul_rs_scaled") == 1
    else:  # the ring gathers FP8 blocks
        assert "collective-permute" in _compiled(fused, args) and "all-gather" not in _compiled(fused, args)


def test_fp8_scale_gradients(mesh):
    """The first matmul's result h is linear in each scale, so d mean(h²)/d s = 2·mean(h²)/s,
    computed here in f64 from the FP8 values."""
    args = _fp8_args(mesh)
    x8, w_up, _, sx, sw = (np.asarray(v, np.float64) for v in args)
    h = np.einsum("bsd,df->bsf", x8, w_up) * sx * sw
    want = [2 * np.mean(h ** 2) / s for s in (sx, sw)]
    loss = lambda *a: jnp.mean(overlap(fp8_mlp, schedule=XLA)(*a)[0].astype(jnp.float32) ** 2)  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(3, 4)))(*args)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=TOLERANCE[jnp.bfloat16])


def test_fp8_site_reads_the_fp8_tensors_and_scales(mesh):
    """The gather's op reads x8, w8 and both scales, and replaces the gathered side's dequantization."""
    closed = jax.make_jaxpr(fp8_mlp)(*_fp8_args(mesh))
    x8, w_up, w_down, sx, sw = closed.jaxpr.invars
    (gather, scatter), _ = find_sites(closed.jaxpr, None, "", ALL_OPS)
    assert gather.reads == (x8, sx, w_up, sw) and (gather.fp8_weight, gather.scales) == (w_up, (sx, sw))
    skipped = [closed.jaxpr.eqns[k].primitive.name for k in gather.skip]
    assert skipped == ["reshard", "convert_element_type", "mul", "dot_general"], skipped
    assert scatter.reads[2:] == (w_down, sw) and scatter.scales == (sx, sw) and scatter.fp8_weight is w_down


def test_fp8_near_misses_say_why(mesh):
    x8, w_up, w_down, sx, sw = _fp8_args(mesh)

    def per_channel_scale(x8, w_up, sx_d, sw):
        g = reshard(x8, P("dp", None, None)).astype(jnp.bfloat16) * sx_d.astype(jnp.bfloat16)
        return jnp.einsum("bsd,df->bsf", g, w_up.astype(jnp.bfloat16) * sw.astype(jnp.bfloat16))

    sx_d = jax.random.uniform(jax.random.key(3), (D,), jnp.float32, 0.5, 1.5)
    _check_fp8_miss(per_channel_scale, (x8, w_up, sx_d, sw), "scale is not one scalar")

    def dequantized_read_twice(x8, w_up, sx, sw):
        g = reshard(x8, P("dp", None, None)).astype(jnp.bfloat16) * sx.astype(jnp.bfloat16)
        return jnp.einsum("bsd,df->bsf", g, w_up.astype(jnp.bfloat16) * sw.astype(jnp.bfloat16)), g

    _check_fp8_miss(dequantized_read_twice, (x8, w_up, sx, sw), "dequantized gathered tensor has other users")

    def bf16_weight(x8, w_up, sx):
        g = reshard(x8, P("dp", None, None)).astype(jnp.bfloat16) * sx.astype(jnp.bfloat16)
        return jnp.einsum("bsd,df->bsf", g, w_up)

    _check_fp8_miss(bf16_weight, (x8, (w_up.astype(jnp.float32) * 0.5).astype(jnp.bfloat16), sx),
                    "other operand is not an FP8 tensor")

    def fp8_product_scattered(h8, w8):  # no dequantization: the FP8 ops have no scale to take
        return jnp.einsum("bsf,fd->bsd", h8, w8, out_sharding=SEQ_PARALLEL)

    (h,) = _random(mesh, [(P("dp", None, "tp"), (B, S, F))], seed=4)
    report = explain(overlap(fp8_product_scattered, schedule=XLA), (h * 3).astype(E4M3), w_down)
    assert not report.sites and [r.op for r in report.near_misses] == ["matmul_rs"], str(report)
    assert "multiplies FP8 tensors as they are" in report.near_misses[0].reason, str(report)


def test_fp8_e5m2_pair_gather_is_a_near_miss(mesh):
    """e5m2 x e5m2 has no FP8 matmul: the gather stays as written, with the reason; the second
    matmul (e4m3 activation x e5m2 weight) is still the FP8 matmul_rs."""
    args = _fp8_args(mesh, E5M2)
    fused = overlap(fp8_mlp, schedule=XLA)
    report = explain(fused, *args)
    assert _ops(report) == ["matmul_rs"] and "(FP8, scaled)" in report.sites[0].shapes, str(report)
    assert [r.op for r in report.near_misses] == ["ag_matmul"], str(report)
    assert report.near_misses[0].reason.endswith(": float8_e5m2 x float8_e5m2 matmuls are not supported"), str(report)
    (h, y), (h_ref, y_ref) = jax.jit(fused)(*args), jax.jit(fp8_mlp)(*args)
    _assert_same(h, h_ref, jnp.bfloat16)
    err = np.linalg.norm(np.asarray(y, np.float64) - np.asarray(y_ref)) / np.linalg.norm(np.asarray(y_ref))
    assert jax.typeof(y) == jax.typeof(y_ref) and 0 < err < REQUANTIZED_TOLERANCE, err


def _check_fp8_miss(fn, args, reason):
    report = explain(overlap(fn, schedule=XLA), *args)
    assert not report.sites and [r.op for r in report.near_misses] == ["ag_matmul"], str(report)
    assert reason in report.near_misses[0].reason and report.near_misses[0].axis_name == "tp", str(report)
    _assert_same(jax.jit(overlap(fn, schedule=XLA))(*args), jax.jit(fn)(*args), jnp.bfloat16)


# --------------------------------------------------------------------------------------------
# What the compiler is handed
# --------------------------------------------------------------------------------------------
def _compiled(fn, args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.skipif(not extension.available(), reason="the ficco_jax extension is not built")
def test_dma_sites_lower_to_the_custom_calls_and_gather_nothing(mesh):
    args = _mlp_args(mesh)
    fused = overlap(megatron_mlp, schedule=DMA)
    lowered = jax.jit(fused).lower(*args).as_text()
    assert "ficco_ag_matmul" in lowered and "ficco_matmul_rs" in lowered
    assert "all-gather" in _compiled(megatron_mlp, args)  # what the written program does
    compiled = _compiled(fused, args)
    assert "all-gather" not in compiled and "reduce-scatter" not in compiled


def test_xla_schedule_gathers_in_chunks(mesh):
    args = _mlp_args(mesh)
    compiled = _compiled(overlap(megatron_mlp, schedule=XLA), args)
    assert "collective-permute" in compiled and "all-gather" not in compiled


# --------------------------------------------------------------------------------------------
# Left as written
# --------------------------------------------------------------------------------------------
def test_gspmd_program_dots_are_partitioned_dots():
    """On an Auto mesh the matmuls become ficco_jax.dot_general (rewrite/match_gspmd.py; the
    partitioner picks each one's op, tests/test_overlap_gspmd.py)."""
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        _check_gspmd_mlp(mesh)


def _check_gspmd_mlp(mesh):
    x, w_up, w_down = _random(mesh, [(P("tp", None), (S * 2, D)), (P(None, "tp"), (D, F)), (P("tp", None), (F, D))])

    def mlp(x, w_up, w_down):
        g = jax.lax.with_sharding_constraint(x, P())
        return jax.lax.with_sharding_constraint(jnp.tanh(g @ w_up) @ w_down, P("tp", None))

    fused = overlap(mlp, schedule=XLA)
    report = explain(fused, x, w_up, w_down)
    assert not report.near_misses and [r.op for r in report.sites] == ["dot_general"] * 2, str(report)
    assert all(r.axis_name == "tp" for r in report.sites)
    _assert_same(jax.jit(fused)(x, w_up, w_down), jax.jit(mlp)(x, w_up, w_down))


def test_program_without_site_runs_unchanged(mesh):
    x, w = _random(mesh, [(P("dp", None), (B, D)), (P(), (D, F))])

    def data_parallel(x, w):  # no tensor-parallel axis anywhere: no collective beside a matmul
        return jnp.tanh(x @ w)

    assert len(explain(data_parallel, x, w)) == 0
    _assert_same(overlap(data_parallel, schedule=XLA)(x, w), data_parallel(x, w))


def test_one_device_mesh_keeps_the_plain_path():
    mesh = jax.make_mesh((1, 1), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        args = _mlp_args(mesh)
        report = explain(overlap(megatron_mlp), *args)
        assert _ops(report) == ["ag_matmul", "matmul_rs"] and all("plain path" in r.note for r in report.sites)
        for schedule in ("auto", XLA):
            _assert_same(jax.jit(overlap(megatron_mlp, schedule=schedule))(*args), jax.jit(megatron_mlp)(*args))


def test_near_misses_say_why(mesh):
    x, w_up, w_down = _mlp_args(mesh)

    def all_reduced(x, w_up, w_down):  # row-parallel matmul with a replicated result, only returned
        h = jnp.einsum("bsd,df->bsf", reshard(x, P("dp", None, None)), w_up)
        return jnp.einsum("bsf,fd->bsd", h, w_down, out_sharding=P("dp", None, None))

    report = explain(overlap(all_reduced, schedule=XLA), x, w_up, w_down)
    assert _ops(report) == ["ag_matmul"] and len(report.near_misses) == 1, str(report)
    assert report.near_misses[0].op == "matmul_psum" and "all-reduce" in report.near_misses[0].reason
    assert "only returns" in report.near_misses[0].reason
    report = explain(overlap(megatron_mlp, ops=("matmul_rs",)), x, w_up, w_down)
    assert "ag_matmul is not in ops=" in report.near_misses[0].reason, str(report)

    def gathered_then_normalised(x, w_up):  # a reshard whose reader is not the matmul
        g = reshard(x, P("dp", None, None))
        return jnp.einsum("bsd,df->bsf", g / jnp.linalg.norm(g, axis=-1, keepdims=True), w_up)

    report = explain(overlap(gathered_then_normalised, schedule=XLA), x, w_up)
    assert not report.sites and len(report.near_misses) == 1, str(report)
    assert "feeds no matmul directly" in report.near_misses[0].reason and report.near_misses[0].axis_name == "tp"


def _tp_mesh():
    return jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))


@pytest.mark.parametrize("make_mesh", [_tp_mesh, _dp_tp_mesh], ids=["tp8", "dp2xtp4"])
def test_rows_gathered_then_split_again_by_out_sharding(make_mesh):
    """A replicated operand whose product is split on rows again: each device computes its own rows
    with nothing communicated after the reshard, so no op gathers; explain says why."""
    mesh = make_mesh()
    with jax.set_mesh(mesh):
        x, w = _random(mesh, [(P("tp", None), (S * 4, D)), (P(None, None), (D, F))])

        def regathered(x, w):
            g = reshard(x, P(None, None))
            return jnp.dot(g, w, out_sharding=P("tp", None))

        report = explain(overlap(regathered, schedule=XLA), x, w)
        assert isinstance(report, Report) and not report.sites, str(report)
        assert [r.op for r in report.near_misses] == ["ag_matmul"], str(report)
        assert ("the result is sharded P('tp', None), not as its operands' free dimensions are (P(None, None))"
                in report.near_misses[0].reason), str(report)
        _assert_same(jax.jit(overlap(regathered, schedule=XLA))(x, w), jax.jit(regathered)(x, w))
        assert isinstance(explain(regathered, x, w), Report)


def test_spec_of_axes_writes_each_dimension_as_a_partition_spec_does():
    assert spec_of_axes(((), ("tp",), ("dp", "tp"))) == P(None, "tp", ("dp", "tp"))
    assert spec_of_axes(()) == P()


def _gathered_by_reshard(x, w):
    return jnp.dot(reshard(x, P()), w)


def _gathered_by_the_matmul(x, w):
    return jnp.dot(x, w, out_sharding=P())


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("program", [_gathered_by_reshard, _gathered_by_the_matmul], ids=["reshard", "matmul"])
def test_gathered_rows_times_a_replicated_weight(mesh, program, schedule):
    """The product of gathered rows and a replicated weight is replicated although the gathered
    rows' type varies over tp: the op's shard_map states that replication instead of inferring it."""
    x, w = _random(mesh, [(P("tp", None), (S * 2, D)), (P(), (D, F))])
    fused = overlap(program, schedule=schedule)
    report = explain(fused, x, w)
    assert _ops(report) == ["ag_matmul"] and not report.near_misses, str(report)
    _assert_same(jax.jit(fused)(x, w), jax.jit(program)(x, w))
    grad = lambda f: jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))  # noqa: E731
    _assert_same(grad(fused)(x, w), grad(program)(x, w))


@pytest.mark.parametrize("x_spec, out_spec, product", [
    (P(None, "dp"), P(None, "dp"), "P(None, 'tp')"),  # tp leaves the columns, dp comes
    (P("tp", "dp"), P("tp", "dp"), "P('tp', 'tp')"),  # tp on the rows and, from w, on the columns
], ids=["columns-tp-to-dp", "tp-on-rows-and-columns"])
def test_scatter_onto_a_dimension_the_operands_already_split_is_a_near_miss(mesh, x_spec, out_spec, product):
    """The contraction is split over dp and dp goes onto the columns, which w splits over tp: more
    than a reduce-scatter of an unsplit dimension, so the matmul stays as written."""
    x, w = _random(mesh, [(x_spec, (S, D)), (P("dp", "tp"), (D, F))])

    def scattered_onto_split_columns(x, w):
        return jnp.dot(x, w, out_sharding=out_spec)

    report = explain(overlap(scattered_onto_split_columns, schedule=XLA), x, w)
    assert not report.sites and [r.op for r in report.near_misses] == ["matmul_rs"], str(report)
    assert f"sharded {product} by its operands, becomes {out_spec}" in report.near_misses[0].reason, str(report)
    _assert_same(jax.jit(overlap(scattered_onto_split_columns, schedule=XLA))(x, w),
                 jax.jit(scattered_onto_split_columns)(x, w))


def test_expert_all_to_all_in_global_view_is_a_near_miss():
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Explicit,))
    tokens, w = _random(mesh, [(P("ep"), (8, 8, 4, D)), (P("ep"), (8, D, F))])

    def experts(tokens, w):  # tokens [group@ep, expert, capacity, d] -> experts over ep
        routed = reshard(tokens, NamedSharding(mesh, P(None, "ep")))
        return jnp.einsum("gecd,edf->gecf", routed, w)

    report = explain(overlap(experts, schedule=XLA), tokens, w)
    assert not report.sites and [r.op for r in report.near_misses] == ["a2a_matmul"], str(report)
    assert "all-to-all" in report.near_misses[0].reason and "shard_map" in report.near_misses[0].reason
    _assert_same(overlap(experts, schedule=XLA)(tokens, w), experts(tokens, w))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_without_a_context_mesh_the_arguments_mesh_is_used(schedule):
    """Shardings given as NamedShardings, no jax.set_mesh: the sites run over the arguments' mesh."""
    mesh = _dp_tp_mesh()
    args = _mlp_args(mesh)

    def mlp(x, w_up, w_down):
        g = reshard(x, NamedSharding(mesh, P("dp", None, None)))
        h = jnp.tanh(jnp.einsum("bsd,df->bsf", g, w_up))
        return jnp.einsum("bsf,fd->bsd", h, w_down, out_sharding=NamedSharding(mesh, SEQ_PARALLEL))

    fused = overlap(mlp, schedule=schedule)
    assert _ops(explain(fused, *args)) == ["ag_matmul", "matmul_rs"]
    _assert_same(jax.jit(fused)(*args), jax.jit(mlp)(*args))


@pytest.mark.parametrize("schedule", ["xla/ring/c2"] + (["dma/direct/c2"] if extension.available() else []))
def test_arrays_on_another_mesh_of_the_same_shape_are_traced_for_it(schedule):
    """No jax.set_mesh: the shard_maps of global-view sites run over the arguments' mesh, so a call
    with arrays on the same axes over another order of the devices is rewritten for that mesh."""
    devices = np.array(jax.devices()[:8])
    meshes = [jax.sharding.Mesh(devices[order].reshape(2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
              for order in (list(range(8)), [5, 2, 7, 0, 3, 6, 1, 4])]

    def f(x, w):
        return reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, P(None, None))) @ w

    rng = np.random.default_rng(6)
    x_host, w_host = rng.standard_normal((16, 8), np.float32), rng.standard_normal((8, 16), np.float32)
    fused = overlap(f, schedule=schedule)
    for mesh in meshes:
        x = jax.device_put(x_host, NamedSharding(mesh, P("tp", None)))
        w = jax.device_put(w_host, NamedSharding(mesh, P(None, "tp")))
        assert len(explain(fused, x, w).sites) == 1
        got, want = fused(x, w), jax.jit(f)(x, w)
        assert got.sharding == want.sharding
        _assert_same(got, want)
