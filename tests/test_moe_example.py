"""examples/moe_layer.py: the MoE layer runs with and without overlap, and both agree."""
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from ficco_jax import dma

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "moe_layer.py"


@pytest.fixture(scope="module")
def moe():
    spec = importlib.util.spec_from_file_location("moe_layer_example", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_runs_without_overlap(moe):
    result = moe.main(["--no-overlap", "--steps", "2"])
    assert result["report"] is None
    assert len(result["losses"]) == 2 and result["losses"][1] < result["losses"][0]


@pytest.mark.parametrize("schedule,dtype", [
    ("xla/ring/c2", "float32"),
    pytest.param("dma/direct/c2/s2", "float32",
                 marks=pytest.mark.skipif(not dma.available(), reason="the ficco_jax extension is not built")),
    ("xla/direct/c4/grouped", "bfloat16"),
])
def test_overlap_agrees_with_plain(moe, schedule, dtype):
    result = moe.main(["--compare", "--schedule", schedule, "--steps", "2", "--dtype", dtype])
    report = result["overlap"]["report"]
    # Forward dispatch and combine, and the backward's dispatch of the output gradient.
    assert [(r.op, r.schedule) for r in report.sites] == [
        ("a2a_matmul", schedule), ("matmul_a2a", schedule), ("a2a_matmul", schedule)], str(report)
    assert result["ok"], (result["loss_rel_diff"], result["grad_rel_diff"])
    plain, fused = result["plain"], result["overlap"]
    assert fused["losses"][1] < fused["losses"][0]
    for name, grad in fused["grads"].items():
        assert np.all(np.isfinite(np.asarray(grad, np.float32))), name
        assert np.any(np.asarray(plain["grads"][name], np.float32) != 0), name


def test_compare_on_one_device(moe):
    import os
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    done = subprocess.run([sys.executable, str(_PATH), "--compare", "--steps", "2"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "over ep=1" in done.stdout and "no all_to_all to overlap" in done.stdout
    assert ": OK" in done.stdout, done.stdout
