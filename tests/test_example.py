"""examples/tp_transformer.py: the tiny preset trains the same with and without overlap; the
llama70b-layer preset builds its shapes without allocating."""
import dataclasses
import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tp_transformer.py"
sys.path.insert(0, str(_PATH.parent))  # as running the script does: it imports its model, llama_block
import llama_block  # noqa: E402
from helpers import weight_writers  # noqa: E402

_spec = importlib.util.spec_from_file_location("tp_transformer", _PATH)
tp_transformer = importlib.util.module_from_spec(_spec)
sys.modules["tp_transformer"] = tp_transformer  # dataclasses look their module up there
_spec.loader.exec_module(tp_transformer)

# A chunked schedule on the extension's executor: with "auto", the cost model picks comm=none for
# the tiny shapes and both runs would execute the same collectives and matmuls.
OVERLAP_SCHEDULE = "dma/direct/c2"


@pytest.fixture(scope="module")
def tiny_runs():
    cfg = dataclasses.replace(tp_transformer.PRESETS["tiny"], steps=3, dtype="float32",
                              schedule=OVERLAP_SCHEDULE)
    mesh = tp_transformer.make_mesh(cfg)
    quiet = lambda *_: None  # noqa: E731
    return {mode: tp_transformer.train(dataclasses.replace(cfg, overlap=mode), mesh, log=quiet)
            for mode in (False, True)}


def test_tiny_losses_agree_with_and_without_overlap(tiny_runs):
    plain, over = tiny_runs[False]["losses"], tiny_runs[True]["losses"]
    assert len(plain) == len(over) == 3
    assert np.all(np.isfinite(plain)) and np.all(np.isfinite(over))
    assert len(set(plain)) == 3, f"the loss does not change between steps: {plain}"
    np.testing.assert_allclose(over, plain, rtol=1e-4, err_msg="losses with overlap differ from those without")


def test_tiny_overlap_rewrites_forward_and_backward_sites(tiny_runs):
    report = tiny_runs[True]["report"]
    assert tiny_runs[False]["report"] is None
    # per block, forward: QKV and gate/up (ag_matmul), O and down (matmul_rs); backward: the transposes;
    # and the LM head's gather and matmul, forward (ag_matmul) and backward (matmul_rs)
    assert [r.op for r in report.sites].count("ag_matmul") == 5, str(report)
    assert [r.op for r in report.sites].count("matmul_rs") == 5, str(report)
    assert all(r.schedule == OVERLAP_SCHEDULE for r in report.sites), str(report)


def test_tiny_step_times_reported(tiny_runs):
    for run in tiny_runs.values():
        assert len(run["step_s"]) == 3 and all(t > 0 for t in run["step_s"])
        assert run["tokens_per_step"] == 2 * 2 * 64  # batch per replica x dp x seq


def test_vocab_parallel_head_loss_is_the_dense_cross_entropy():
    """The LM head in the shard_map (each device the logits of its vocabulary slice, the softmax
    combined over tp) gives the dense cross-entropy and its gradients, targets in every slice."""
    cfg = dataclasses.replace(tp_transformer.PRESETS["tiny"], dtype="float32")
    mesh = tp_transformer.make_mesh(cfg)
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    b, s, d, v = cfg.batch * mesh.shape["dp"], cfg.seq, cfg.hidden, cfg.vocab
    x = jax.random.normal(keys[0], (b, s, d))
    norm = 1 + 0.1 * jax.random.normal(keys[1], (d,))
    head = jax.random.normal(keys[2], (d, v)) / np.sqrt(d)
    targets = jax.random.randint(keys[3], (b, s), 0, v)
    assert len(set(np.asarray(targets).ravel() // (v // cfg.tp))) == cfg.tp  # every device holds some targets
    P = tp_transformer.P
    sharded = jax.shard_map(lambda *a: llama_block.lm_head_loss(cfg, *a), mesh=mesh, out_specs=P(),
                            in_specs=(llama_block.ACT_SPEC, P(), P(None, "tp"), P("dp", None)))

    def dense(x, norm, head, targets):
        logits = jnp.einsum("bsd,dv->bsv", llama_block.rms_norm(x, norm), head)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    ours = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(x, norm, head, targets)
    ref = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2)))(x, norm, head, targets)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
    for got, want in zip(ours[1], ref[1]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(np.max(np.abs(want))))


def test_llama70b_layer_preset_shapes_without_allocating():
    cfg, _ = tp_transformer.parse_config(["--preset", "llama70b-layer"])
    cfg.validate(cfg.tp)
    assert (cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.seq, cfg.tp) == (8192, 28672, 64, 8, 8192, 4)
    assert 4 <= cfg.layers <= 8
    params = jax.eval_shape(lambda k: tp_transformer.init_params(cfg, k), jax.random.PRNGKey(0))
    layers = params["layers"]
    assert layers["wqkv"].shape == (cfg.layers, 8192, 8, 10, 128)  # 8 q heads + k + v per kv head
    assert layers["wo"].shape == (cfg.layers, 64, 128, 8192)
    assert layers["w_gate_up"].shape == (cfg.layers, 8192, 2, 28672)
    assert layers["w_down"].shape == (cfg.layers, 28672, 8192)
    per_layer = sum(math.prod(a.shape[1:]) for a in jax.tree.leaves(layers))
    assert per_layer == pytest.approx(856e6, rel=0.01)  # one Llama-70B decoder layer


def test_llama8b_layer_preset_shapes_without_allocating():
    cfg, _ = tp_transformer.parse_config(["--preset", "llama8b-layer"])
    cfg.validate(cfg.tp)
    assert (cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.seq, cfg.tp) == (4096, 14336, 32, 8, 8192, 2)
    params = jax.eval_shape(lambda k: tp_transformer.init_params(cfg, k), jax.random.PRNGKey(0))
    layers = params["layers"]
    assert layers["wqkv"].shape == (cfg.layers, 4096, 8, 6, 128)  # 4 q heads + k + v per kv head
    assert layers["w_gate_up"].shape == (cfg.layers, 4096, 2, 14336)
    per_layer = sum(math.prod(a.shape[1:]) for a in jax.tree.leaves(layers))
    assert per_layer == pytest.approx(218e6, rel=0.01)  # one Llama-3-8B decoder layer


def test_command_line_overrides():
    cfg, args = tp_transformer.parse_config(["--layers", "3", "--no-overlap", "--remat", "--compare"])
    assert (cfg.layers, cfg.overlap, cfg.remat, args.compare) == (3, False, True, True)
    with pytest.raises(ValueError, match="kv_heads=3 must divide by tp=4"):
        dataclasses.replace(cfg, kv_heads=3, heads=6, hidden=48).validate(4)


def test_comm_free_bound_has_the_shapes_and_no_collectives():
    # The bound replaces each sequence all-gather / reduce-scatter by a local op of the same shapes;
    # the step must keep every other piece of work and contain no collective in the blocks.
    cfg = dataclasses.replace(tp_transformer.PRESETS["tiny"], steps=2, dtype="float32")
    mesh = tp_transformer.make_mesh(cfg)
    free = dataclasses.replace(cfg, comm_free=True, overlap=False)
    x = jax.random.normal(jax.random.PRNGKey(0), (cfg.batch, cfg.seq // cfg.tp, cfg.hidden))
    y = jax.random.normal(jax.random.PRNGKey(1), (cfg.batch, cfg.seq, cfg.hidden))
    for c in (cfg, free):
        body = jax.shard_map(lambda x, y, c=c: (llama_block.gather_seq(c, x), llama_block.scatter_seq(c, y)),
                             mesh=mesh, in_specs=(tp_transformer.P(None, None, None),) * 2,
                             out_specs=(tp_transformer.P(None, None, None),) * 2, check_vma=False)
        g, r = body(x, y)
        assert g.shape == (cfg.batch, cfg.seq, cfg.hidden) and r.shape == (cfg.batch, cfg.seq // cfg.tp, cfg.hidden)
    # (r is the comm-free one here, the loop's last)
    np.testing.assert_allclose(r, y.reshape(cfg.batch, cfg.tp, cfg.seq // cfg.tp, cfg.hidden).sum(axis=1), rtol=1e-6)
    params = jax.eval_shape(lambda k: tp_transformer.init_params(cfg, k), jax.random.PRNGKey(0))
    inputs = jax.ShapeDtypeStruct((cfg.batch * mesh.shape["dp"], cfg.seq), np.int32)
    jaxprs = {c.comm_free: str(jax.make_jaxpr(jax.value_and_grad(tp_transformer.make_loss(c, mesh)))(params, inputs, inputs))
              for c in (cfg, free)}
    assert "all_gather" in jaxprs[False] and "reduce_scatter" in jaxprs[False]
    assert "all_gather" not in jaxprs[True] and "reduce_scatter" not in jaxprs[True]
    run = tp_transformer.train(free, mesh, log=lambda *_: None)
    assert len(run["step_s"]) == 2 and np.all(np.isfinite(run["losses"])) and run["report"] is None


def test_unrolled_layers_train_like_the_scan(tiny_runs):
    # --no-scan (the default with cuDNN attention, whose gradient in a scan crashes XLA's compiler on
    # GPUs) runs the same layers as a Python loop: same losses as the scanned run, overlap rewritten alike.
    cfg = dataclasses.replace(tp_transformer.PRESETS["tiny"], steps=3, dtype="float32", schedule=OVERLAP_SCHEDULE,
                              scan=False, overlap=True)
    assert not cfg.scans_layers
    run = tp_transformer.train(cfg, tp_transformer.make_mesh(cfg), log=lambda *_: None)
    np.testing.assert_allclose(run["losses"], tiny_runs[True]["losses"], rtol=1e-5)
    # the scan body holds one layer's 8 sites; unrolled, every layer has its own (and the LM head 2)
    assert len(tiny_runs[True]["report"].sites) == 8 + 2 and len(run["report"].sites) == 8 * cfg.layers + 2


def test_cudnn_attention_unrolls_layers_unless_told():
    cfg, _ = tp_transformer.parse_config(["--attention", "cudnn"])
    assert not cfg.scans_layers
    assert tp_transformer.parse_config(["--attention", "cudnn", "--scan"])[0].scans_layers
    assert tp_transformer.parse_config(["--attention", "cudnn", "--remat"])[0].scans_layers
    assert tp_transformer.parse_config([])[0].scans_layers


def test_default_tp_fits_the_device_count():
    tiny = tp_transformer.PRESETS["tiny"]  # tp=4
    assert [tp_transformer.fit_tp(tiny, n) for n in (1, 2, 3, 4, 6, 8)] == [1, 2, 1, 4, 2, 4]


@pytest.mark.slow
def test_global_view_trains_alike_with_and_without_overlap():
    """The same model on global arrays with explicit shardings: overlap finds each block's sequence
    gathers and scatters (forward and backward) in the layer scan, and the data-parallel sums of two
    weight gradients the scan reads on, and the losses are unchanged."""
    cfg = dataclasses.replace(tp_transformer.PRESETS["tiny"], steps=2, dtype="float32", schedule=OVERLAP_SCHEDULE,
                              global_view=True)
    mesh = tp_transformer.make_mesh(cfg)
    runs = {mode: tp_transformer.train(dataclasses.replace(cfg, overlap=mode), mesh, log=lambda *_: None)
            for mode in (False, True)}
    assert len(set(runs[False]["losses"])) == 2
    np.testing.assert_allclose(runs[True]["losses"], runs[False]["losses"], rtol=1e-5)
    in_layers = [r for r in runs[True]["report"].sites if "scan@" in r.where]
    assert sorted(r.op for r in in_layers) == ["ag_matmul"] * 4 + ["matmul_psum"] * 2 + ["matmul_rs"] * 4, \
        str(runs[True]["report"])
    assert {r.axis_name for r in in_layers if r.op == "matmul_psum"} == {"dp"}
    assert all(r.schedule == OVERLAP_SCHEDULE for r in in_layers)


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("view", [[], ["--global-view"]], ids=["shard_map", "global"])
def test_compare_on_one_device_runs_the_plain_model_both_ways(view):
    import os
    import re
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    done = subprocess.run([sys.executable, str(_PATH), "--compare", "--steps", "2", "--no-bound", *view],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp=1 x tp=1" in done.stdout and "no collective to overlap" in done.stdout
    steps = re.findall(r"^\s+\d+\s+(\d+\.\d+)\s+(\d+\.\d+)\s", done.stdout, re.MULTILINE)
    assert len(steps) == 2, done.stdout
    for plain, over in steps:
        assert float(plain) == pytest.approx(float(over), rel=1e-5)
    assert not re.search(r"\d+\.\d+x", done.stdout.split("step  loss")[-1]), done.stdout
    # the claim is checked, not assumed: the two modes' compiled steps are compared
    assert "same losses" not in done.stdout.split("step  loss")[0], done.stdout
    assert "overlap and no-overlap compiled to the same program (optimized HLO, source locations left out), and " \
           "gave the same losses" in done.stdout, done.stdout


def test_with_every_site_on_the_plain_path_the_overlap_step_is_the_plain_program():
    cfg = dataclasses.replace(tp_transformer.PRESETS["tiny"], tp=1, dtype="float32")
    mesh = tp_transformer.make_mesh(cfg)
    plain, over = (tp_transformer.step_program(tp_transformer.build_trainer(dataclasses.replace(cfg, overlap=m),
                                                                            mesh).step_fn) for m in (False, True))
    assert plain == over and "dot(" in plain


def test_step_program_leaves_out_source_locations_only():
    class Compiled:
        def __init__(self, text):
            self.text = text

        def as_text(self):
            return self.text

    here = ('HloModule m\nFileNames\n1 "a.py"\nStackFrames\n1 {file_location_id=1}\n\nENTRY e {\n'
            '  d = f32[2]{0} add(x, y), metadata={op_name="add" source_file="a.py" source_line=3}\n}')
    there = here.replace('"a.py"', '"/elsewhere/b.py"').replace("source_line=3", "source_line=9")
    program = tp_transformer.step_program
    assert program(Compiled(here)) == program(Compiled(there))
    assert program(Compiled(here)) != program(Compiled(here.replace("add(x, y)", "multiply(x, y)")))
    note = tp_transformer.same_program_note
    one, other = {"program": "a", "losses": [1.0, 2.0]}, {"program": "a", "losses": [1.0, 2.5]}
    assert note(one, dict(one), "gpu").endswith("compiled to the same program (optimized HLO, source locations left "
                                                "out), and gave the same losses")
    assert "same program" in note(one, other, "gpu") and "not bit-reproducible" in note(one, other, "gpu")
    assert "different programs" in note(one, dict(other, program="b"), "cpu")


@pytest.mark.slow
def test_global_view_reports_the_communication_free_bound():
    """The global view writes no collective to take out; its bound is the shard_map view's step
    without communication, reported beside both modes with tokens/s."""
    import os
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, str(_PATH), "--global-view", "--compare", "--comm-free-bound", "--steps", "2",
                           "--no-bound", "--schedule", OVERLAP_SCHEDULE], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global view (explicit shardings)" in done.stdout
    for name in ("no-overlap", "overlap", "comm-free bound"):
        assert f"\n{name}: " in done.stdout and "tokens/s" in done.stdout.split(f"\n{name}: ")[1].splitlines()[0], name
    assert "communication-free step" in done.stdout


@pytest.mark.slow
def test_per_site_kind_overlaps_each_kind_alone(capsys):
    """--per-site-kind trains with each site kind overlapped alone: that run rewrites only its kind."""
    cfg = dataclasses.replace(tp_transformer.PRESETS["tiny"], steps=2, dtype="float32", schedule=OVERLAP_SCHEDULE,
                              overlap_ops=("matmul_rs",))
    report = str(tp_transformer.train(cfg, log=lambda *_: None)["report"])
    rewritten = [line.split()[1] for line in report.splitlines() if line.startswith("ok ")]
    assert rewritten and set(rewritten) == {"matmul_rs"}, report
    tp_transformer.main(["--per-site-kind", "--steps", "2", "--no-bound", "--schedule", OVERLAP_SCHEDULE])
    out = capsys.readouterr().out
    for row in ("no overlap", "ag_matmul only", "matmul_rs only", "every site kind"):
        assert f"\n{row} " in out and "x" in out.split(f"\n{row} ")[1].splitlines()[0], row
    with pytest.raises(SystemExit, match="--per-site-kind"):
        tp_transformer.main(["--plot", "steps.png"])


@pytest.mark.parametrize("global_view", [False, True], ids=["shard_map", "global"])
def test_overlapped_step_writes_no_weight_transpose(global_view):
    """Every copy-engine matmul of the overlapped step reads its weight as the layer scan's slice
    of the stacked weights: the backward's input gradients take w^T column-major instead of XLA
    writing it out before the call (four per layer otherwise)."""
    cfg = dataclasses.replace(tp_transformer.PRESETS["tiny"], dtype="float32", schedule=OVERLAP_SCHEDULE, overlap=True,
                              global_view=global_view)
    mesh = tp_transformer.make_mesh(cfg)
    with tp_transformer.mesh_context(cfg, mesh):
        writers = weight_writers(tp_transformer.build_trainer(cfg, mesh).step_fn.as_text())
    assert [col for _, col in writers].count(1) >= 4, writers  # the backward's four input gradients per layer
    assert all(not moves for moves in writers.values()), writers
