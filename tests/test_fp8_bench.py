"""FP8 measurements on CPU devices: the GEMM-rate table (benchmarks/suites/fp8_gemm.py), `bench
--dtype fp8` and the FP8 part of `characterize` / `calibrate`. CPU times mean nothing; these tests
check that every variant runs, is verified before it is timed, and lands in well-formed results."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from ficco_jax.runtime import extension
from ficco_jax.tools import bench, characterize, cli, gemm_rates, harness
from ficco_jax.tuning import fitting

REPO = pathlib.Path(__file__).resolve().parents[1]
needs_ffi = pytest.mark.skipif(not extension.available(), reason="ficco_jax._ffi is not built")


@needs_ffi
def test_every_gemm_variant_is_verified_then_timed():
    shape = gemm_rates.measure_shape("t", 32, 64, 48)
    assert set(shape["variants"]) == set(gemm_rates.VARIANTS)
    for name, row in shape["variants"].items():
        assert row["verified"] is True and row["rel_err"] < gemm_rates.TOLERANCE, (name, row)
        assert row["ms"] is not None and row["ms"] >= 0 and row["note"] == "", (name, row)
    executor = shape["variants"]["executor_fp8"]
    assert set(executor["call_ms"]) == {str(r) for r in gemm_rates.REPEATS}
    assert set(shape["speedups"]) == {"executor_fp8_over_executor_bf16", "executor_fp8_over_jax_bf16",
                                      "jax_fp8_over_jax_bf16", "jax_dequant_dot_over_jax_bf16"}


@pytest.mark.parametrize("variant", [pytest.param("executor_fp8", marks=needs_ffi), "jax_dequant_dot"])
def test_a_wrong_gemm_is_reported_not_timed(monkeypatch, variant):
    real = gemm_rates._want
    # 2 % off: twice the check's threshold, so loosening the check fails this test
    monkeypatch.setattr(gemm_rates, "_want", lambda v, ops: real(v, ops) * (1 + 2 * gemm_rates.TOLERANCE))
    row = gemm_rates.measure_variant(variant, gemm_rates.operands(16, 32, 16))
    assert row["verified"] is False and row["ms"] is None and row["note"].startswith("WRONG RESULT"), row


@pytest.mark.parametrize("t1,t2", [(0.0077, 0.0033), (0.005, 0.005)])
def test_executor_matmuls_too_small_to_tell_apart_give_an_upper_bound(monkeypatch, t1, t2):
    """Two probe calls whose longer one is not the slower (on CPU, 8x8x8: 0.0077 and 0.0033 ms) give
    the longer call's time per matmul, marked an upper bound: never 0 ms, and the table prints it."""
    calls = iter([(t1, 0.0), (t2, 0.0)])
    monkeypatch.setattr(gemm_rates, "_device_ms", lambda make, args: next(calls))
    row = gemm_rates.executor_ms((), repeats=(1, 2))
    assert row["upper_bound"] is True and row["ms"] > 0 and row["ms"] == pytest.approx(t2 / 2)
    assert gemm_rates._cell(dict(row, tflops=None)) == f"≤ {t2 / 2:.3f}"


def test_dequant_dot_reference_carries_the_scales():
    ops = gemm_rates.operands(8, 32, 16)
    row = gemm_rates.measure_variant("jax_dequant_dot", ops)
    assert row["verified"] is True and row["rel_err"] < gemm_rates.TOLERANCE
    assert gemm_rates.SCALES[0] * gemm_rates.SCALES[1] != 1.0  # else the scales would go unchecked


@needs_ffi
def test_the_fp8_suite_script_writes_json_and_prints_its_table(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run([sys.executable, "benchmarks/suites/fp8_gemm.py", "--out", str(tmp_path), "--shape",
                           "32,64,48", "--shape", "16,32,64", "--repeats", "1,3", "--xla-cache", "none"],
                          cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "fp8_gemm.json").read_text())
    assert {"date", "device", "jax", "commit", "method", "repeats", "shapes"} <= set(result)
    assert result["repeats"] == [1, 3] and [s["shape"] for s in result["shapes"]] == ["M32_K64_N48", "M16_K32_N64"]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("ON CPU") and "before timing: 10/10 variants" in lines[-2]
    assert sum(line.startswith("| 32,64,48 |") or line.startswith("| 16,32,64 |") for line in lines) == 2
    sys.path.insert(0, str(REPO / "benchmarks"))
    import catalog  # noqa: PLC0415 - benchmarks/ is not a package

    assert catalog._fp8_result(str(tmp_path)).endswith("over 2 shapes; verified 10/10")


@pytest.mark.slow
@needs_ffi
def test_the_fp8_suite_times_only_the_variants_asked_for(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run([sys.executable, "benchmarks/suites/fp8_gemm.py", "--out", str(tmp_path), "--shape",
                           "32,64,48", "--variants", "executor_bf16,jax_bf16", "--repeats", "1,3", "--xla-cache",
                           "none"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (shape,) = json.loads((tmp_path / "fp8_gemm.json").read_text())["shapes"]
    assert list(shape["variants"]) == ["executor_bf16", "jax_bf16"]
    assert all(r["verified"] and r["ms"] for r in shape["variants"].values())
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("| 32,64,48 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # M,K,N | executor FP8 | executor bf16 | JAX bf16 | JAX FP8 | JAX dequant->dot | ...: the columns stay put.
    assert cells[1] == "—" and cells[2] != "—" and cells[3] != "—" and cells[4] == cells[5] == "—"
    bad = subprocess.run([sys.executable, "benchmarks/suites/fp8_gemm.py", "--variants", "executor_bf16,nope"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--variants nope" in bad.stderr and "jax_bf16" in bad.stderr


@pytest.mark.slow
def test_the_fp8_suite_rejects_bad_repeats():
    done = subprocess.run([sys.executable, "benchmarks/suites/fp8_gemm.py", "--repeats", "6,2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "1 <= R1 < R2" in done.stderr


def test_cpu_gemm_shapes_follow_the_anchors():
    assert list(gemm_rates.CPU_GEMMS) == list(gemm_rates.ANCHOR_GEMMS)
    assert gemm_rates.ANCHOR_GEMMS["M8192_K8192_N7168"] == (8192, 8192, 7168)
    assert all(m * 64 == M for (m, _, _), (M, _, _) in zip(gemm_rates.CPU_GEMMS.values(), gemm_rates.ANCHOR_GEMMS.values()))


# ------------------------------------------------------------------------------------------------
# bench --dtype fp8
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_ffi
def test_bench_fp8_verifies_every_variant_beside_bf16(tmp_path):
    result = bench.run(["ag_matmul", "matmul_rs"], {"t": (64, 32, 64)}, "float8_e4m3fn", "xla/ring/c2,dma/direct/c2",
                       str(tmp_path), windowed=False)
    assert result["dtype"] == "float8_e4m3fn"
    timed = [r for r in result["rows"] if r["variant"].startswith(("ficco:", "jax_"))]
    for op in ("ag_matmul", "matmul_rs"):
        for shape, dtype in (("t", None), ("t/bf16", "bfloat16")):
            variants = {r["variant"] for r in timed if r["op"] == op and r["shape"] == shape}
            assert {"jax_seq", "ficco:xla/ring/c2", "ficco:dma/direct/c2"} <= variants, (op, shape, variants)
            # JAX's ring: always in bf16; in FP8 only when listed (its chunk dots autotune anew)
            assert ("jax_ring" in variants) == (dtype == "bfloat16"), (op, shape, variants)
            assert all(r["extra"].get("dtype") == dtype for r in result["rows"] if r["shape"] == shape)
    for r in timed:
        tol = harness.TOLERANCE["bfloat16" if r["shape"].endswith("/bf16") else "float8_e4m3fn"]
        assert r["verified"] is True and r["rel_err"] < tol and r["median_ms"] is not None and r["median_ms"] > 0, r
    table = (tmp_path / "bench.md").read_text()
    assert "| ag_matmul | t 64,32,64 |" in table and "| ag_matmul | t/bf16 64,32,64 |" in table
    assert "against bf16" in table and table.count("| matmul_rs | t 64,32,64 |") == 2  # both tables
    # calibrate reads each row's own dtype: the bf16 rows beside FP8 stay bf16
    dtypes = {(r["shape"], dt) for r, _, _, dt in fitting.recorded_op_rows(json.loads((tmp_path / "bench.json").read_text()))}
    assert dtypes == {("t", "float8_e4m3fn"), ("t/bf16", "bfloat16")}


def test_bench_fp8_catches_a_wrong_result(tmp_path, monkeypatch):
    real = bench.fp8_body

    def corrupt(op, schedule, scales):  # 2 %: twice the FP8 check's threshold
        body = real(op, schedule, scales)
        return body if schedule == "ref" else (lambda a, w: body(a, w) * 1.02)

    monkeypatch.setattr(bench, "fp8_body", corrupt)
    result = bench.run(["ag_matmul"], {"t": (64, 32, 64)}, "float8_e4m3fn", "xla/ring/c1", str(tmp_path), windowed=False)
    row = next(r for r in result["rows"] if r["variant"] == "ficco:xla/ring/c1" and r["shape"] == "t")
    assert row["verified"] is False and row["median_ms"] is None and row["note"].startswith("WRONG RESULT")


def test_cli_bench_fp8_refuses_the_expert_ops(capsys):
    with pytest.raises(SystemExit, match="FP8 runs ag_matmul and matmul_rs only"):
        cli.main(["bench", "--dtype", "fp8", "--op", "moe"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert "fp8: e4m3 operands" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------------------------------------
# characterize / calibrate: the FP8 peak
# ------------------------------------------------------------------------------------------------
@needs_ffi
def test_characterize_fp8_part_and_the_fitted_peak(tmp_path):
    char = characterize.run(str(tmp_path), parts=("fp8",))
    assert char["decomposition"] == [] and [r["rows"] for r in char["fp8"]] == characterize.CPU_FP8["rows"]
    for r in char["fp8"]:
        assert r["verified"] is True and r["rel_err"] < gemm_rates.TOLERANCE and r["ms"] is not None, r
    assert "FP8 executor matmul" in characterize.summary(char)


def test_fp8_peak_is_the_slope_of_time_in_rows():
    rows = [{"rows": r, "K": 1000, "N": 500, "ms": 0.1 + r * 1e-3, "verified": True} for r in (1000, 2000, 4000)]
    # 2 K N = 1e6 flops per row in 1 us: 1e12 flop/s, 1 TFLOP/s
    assert fitting.fp8_peak_tflops(rows) == pytest.approx(1.0)
    unverified = [dict(r, verified=False) for r in rows]
    assert fitting.fp8_peak_tflops(unverified) is None and fitting.fp8_peak_tflops(rows[:1]) is None
    char = json.loads(json.dumps({"device": "d", "n_devices": 8, "date": "x", "commit": "c", "dtype": "float32",
                                  "decomposition": [], "transfers": [], "contention": {}, "fp8": rows}))
    assert fitting.fit_profile(char)["peak_tflops"]["float8_e4m3fn"] == pytest.approx(1.0)



def _cuda_dots(fn, *args) -> list[str]:
    """The dot_general signatures ("(operand types) -> result type") of `fn` lowered for CUDA GPUs."""
    import jax

    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    return [line.split(" : ", 1)[1].split(" loc(")[0] for line in text.splitlines() if "stablehlo.dot_general" in line]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_fp8_jax_sequential_and_the_gemm_bound_hold_one_dot(mesh1d, monkeypatch, op):
    """On GPUs, JAX sequential's FP8 program (the op's plain path) and the bench's GEMM-alone bound hold
    the same FP8 dot, so XLA autotunes it once for both: same operand shapes, FP8 types, f32 accumulation.
    The bound is taken from `bench._bounds` as the bench builds it."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from ficco_jax.ops.measure import sharded
    from ficco_jax.schedule import local_shapes

    mesh = Mesh(mesh1d.devices[:2], ("tp",))
    M, K, N = 64, 32, 48
    shapes = local_shapes(op, M, K, N, 2)
    args, body_of = bench.fp8_inputs(op, shapes, "float8_e4m3fn", mesh)
    (seq,) = _cuda_dots(sharded(mesh, op, body_of(op, "ref")), *args)
    built = {}
    monkeypatch.setattr(bench, "bound_rows", lambda *a, **kw: built.update(kw) or [])
    bench._bounds(op, "t", M, K, N, "float8_e4m3fn", mesh, progress=lambda _: None)
    gemm = jax.shard_map(built["gemm"], mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp"))
    operands = [jax.device_put(jax.numpy.ones((2 * shape[0], *shape[1:]), "float8_e4m3fn"), NamedSharding(mesh, P("tp")))
                for shape in built["gemm_shapes"]]  # as harness.bound_rows places them: one block per device
    (alone,) = _cuda_dots(gemm, *operands)
    assert seq == alone, (seq, alone)
    assert seq.count("f8E4M3FN") == 2 and seq.endswith("xf32>"), seq
