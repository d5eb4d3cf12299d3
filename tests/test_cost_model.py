"""Cost model and selection on a synthetic profile; the autotune cache."""
import json

import jax
import pytest

from ficco_jax import config
from ficco_jax.tuning import autotune, cost_model, select
from ficco_jax.schedule import Schedule

PROFILE = cost_model.default_profile()  # synthetic: fixed numbers, independent of this machine


def shapes(op, M, K, N, n=4):
    return ((M // n, K), (K, N // n)) if op == "ag_matmul" else ((M, N // n), (N // n, K))


def predict(op, sched, M=8192, K=8192, N=28672, n=4, profile=PROFILE):
    return cost_model.predict(op, sched, shapes(op, M, K, N, n), "bfloat16", n, profile)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_psum"])
def test_tiny_operations_choose_no_overlap(op):
    chosen = select.select_schedule(op, shapes(op, 512, 1024, 1024), "bfloat16", 4, profile=PROFILE,
                                        comms=("none", "xla", "dma"))
    assert chosen == Schedule(comm="none")


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_large_operations_choose_copy_engine_overlap(op):
    chosen = select.select_schedule(op, shapes(op, 8192, 8192, 28672), "bfloat16", 4, profile=PROFILE,
                                        comms=("none", "xla", "dma"))
    assert chosen.comm == "dma"
    assert predict(op, chosen) < predict(op, Schedule(comm="none"))


@pytest.mark.parametrize("profile", ["h200x2", "h200x4"])
def test_large_all_reduced_matmuls_choose_copy_engine_overlap(profile):
    profile = cost_model.load_profile(profile)
    n = profile["axis_size"]
    chosen = select.select_schedule("matmul_psum", shapes("matmul_psum", 8192, 8192, 28672, n), "bfloat16", n,
                                    profile=profile, comms=("none", "xla", "dma"))
    assert chosen.comm == "dma"
    assert predict("matmul_psum", chosen, n=n, profile=profile) < predict("matmul_psum", Schedule(comm="none"), n=n,
                                                                          profile=profile)


@pytest.mark.parametrize("sched", ["dma/direct/c4/s2", "xla/ring/c2", "xla/bidirectional/c8/grouped"])
def test_an_all_reduced_matmul_costs_its_reduce_scatter_plus_the_all_gather(sched):
    """matmul_psum runs its schedule's matmul_rs, then gathers the reduced rows on the same comm."""
    sched = Schedule.parse(sched)
    M, N, K, n = 8192, 28672, 8192, 4
    gather = cost_model.all_gather_time(M * K * 2 / n, n, sched.comm, PROFILE)
    assert gather > 0
    assert predict("matmul_psum", sched) == pytest.approx(predict("matmul_rs", sched) + gather)
    # The plain path all-reduces: twice the reduce-scatter's traffic after the same matmul.
    none = Schedule(comm="none")
    traffic = predict("matmul_rs", none) - cost_model.gemm_time(M, N // n, K, "bfloat16", PROFILE)
    extra = predict("matmul_psum", none) - predict("matmul_rs", none)
    assert extra == pytest.approx(traffic - PROFILE["collective_latency_us"] * 1e-6)


def test_orderings_that_must_hold():
    none = Schedule(comm="none")
    # Overlap can never beat the larger of its two parts, and no schedule beats the GEMM alone.
    gemm = cost_model.gemm_time(8192, 8192, 28672 // 4, "bfloat16", PROFILE)
    for s in Schedule.enumerate("ag_matmul", 4):
        assert predict("ag_matmul", s) >= gemm * 0.999
    # More copy-engine contention or a larger call overhead never makes a schedule faster.
    s = Schedule(comm="dma", order="direct", chunks=2, copy_streams=2)
    worse = {**PROFILE, "contention_dma": 0.2, "dma_call_us": 100.0}
    assert predict("ag_matmul", s, profile=worse) > predict("ag_matmul", s)
    # Decomposition loss: with thin matmuls expensive, more chunks cost more.
    lossy = {**PROFILE, "rows_half": 4096.0}
    c1, c8 = (Schedule(comm="dma", order="direct", chunks=c) for c in (1, 8))
    assert predict("ag_matmul", c8, profile=lossy) > predict("ag_matmul", c1, profile=lossy)
    # Faster links help every overlapped schedule and leave the GEMM alone.
    fast = {**PROFILE, "dma_ingress_gbps": 1000.0, "dma_stream_gbps": 1000.0}
    assert predict("ag_matmul", c1, profile=fast) <= predict("ag_matmul", c1)
    assert predict("ag_matmul", none, profile=fast) == predict("ag_matmul", none)


@pytest.mark.parametrize("n", [2, 4])
def test_a_per_chunk_reduce_scatter_pays_no_sum_after_its_matmuls_on_two_devices(n):
    """The executor adds the received partial in the own block's matmuls for per-chunk schedules of
    more than one chunk (exec/scatter.cc, SumInMatmuls): on 2 devices no sum is left, so slower memory
    does not change their price; on more devices a sum of the other partials remains, and the
    schedules that sum after the matmul (c1, gemm=grouped) pay for it everywhere."""
    # Large enough that every matmul stays compute-bound at a quarter of the memory bandwidth: only
    # the sums feel it.
    slow_memory = {**PROFILE, "hbm_gbps": PROFILE["hbm_gbps"] / 4}
    for text in ("dma/direct/c2", "dma/direct/c4", "dma/direct/c1", "dma/direct/c4/grouped"):
        s = Schedule.parse(text)
        fast, slow = (predict("matmul_rs", s, 16384, 16384, 16384, n=n, profile=p) for p in (PROFILE, slow_memory))
        sums_in_matmuls = s.gemm == "per_chunk" and s.chunks > 1
        if sums_in_matmuls and n == 2:
            assert slow == pytest.approx(fast), text
        else:
            assert slow > fast * 1.001, text


def test_the_executors_grouped_reduce_scatter_pays_the_whole_blocks_sum_and_xlas_one_chunks():
    """The executor sums the whole received block after its own block's matmul (gemm=grouped); XLA
    adds each chunk as it lands, so only the last chunk's sum is left after the transfers."""
    def sum_cost(text, hbm_gbps):
        s = Schedule.parse(text)
        slow = {**PROFILE, "hbm_gbps": hbm_gbps, "xla_overlaps": True}
        return predict("matmul_rs", s, 16384, 16384, 16384, n=2, profile=slow)
    rows, cols = 16384 // 2, 16384  # the reduced block: M / n rows of the product's K columns
    whole_sum_bytes = 2 * rows * cols * 2  # 2 blocks read, bf16
    for text, summed_rows in (("dma/direct/c4/grouped", rows), ("dma/direct/c1", rows),
                              ("xla/direct/c4/grouped", rows // 4)):
        extra = sum_cost(text, 1500.0) - sum_cost(text, 3000.0)  # what halving the memory bandwidth adds
        assert extra == pytest.approx(whole_sum_bytes * summed_rows / rows / 3000e9, rel=1e-6), text


def test_the_executors_decomposition_loss_is_its_own():
    """`executor_rows_half` prices the executor's chunk matmuls; XLA's matmuls keep `rows_half`, and a
    profile without it gives both the same loss."""
    lossless = {**PROFILE, "rows_half": 512.0, "executor_rows_half": 0.0}
    same = {**PROFILE, "rows_half": 512.0}
    none, c4 = Schedule(comm="none"), Schedule.parse("dma/direct/c4")
    assert predict("matmul_rs", none, profile=lossless) == predict("matmul_rs", none, profile=same)
    assert predict("matmul_rs", c4, profile=lossless) < predict("matmul_rs", c4, profile=same)
    assert cost_model.gemm_time(1024, 8192, 8192, "bfloat16", same, executor=True) == \
        cost_model.gemm_time(1024, 8192, 8192, "bfloat16", same)
    assert cost_model.gemm_time(1024, 8192, 8192, "bfloat16", lossless, executor=True) < \
        cost_model.gemm_time(1024, 8192, 8192, "bfloat16", lossless)


def test_column_chunks_read_a_share_of_the_weight_each():
    """gemm=columns prices a chunk's matmul as all of a block's rows and a c-th of its columns. Where a thin
    row chunk reads the whole weight and is memory-bound, column chunks cost less; where the matmuls are
    compute-bound the two are alike."""
    prof = {**PROFILE, "rows_half": 0.0, "executor_rows_half": 0.0, "hbm_gbps": 1000.0}
    rows, cols = Schedule.parse("dma/direct/c4"), Schedule.parse("dma/direct/c4/columns")
    # 2 devices, 256-row blocks; a 64-row chunk reads all of w [8192, 16384] (256 MiB).
    thin = {s: predict("matmul_rs", s, M=512, K=16384, N=16384, n=2, profile=prof) for s in (rows, cols)}
    assert thin[cols] < 0.5 * thin[rows]
    wide = {s: predict("matmul_rs", s, M=32768, K=8192, N=8192, n=2, profile=prof) for s in (rows, cols)}
    assert wide[cols] == pytest.approx(wide[rows], rel=0.02)


def test_auto_picks_column_chunks_where_its_profile_was_fitted_to_them_and_row_chunks_for_fp8():
    """The shipped 2 x H100 profile, fitted to op times of both splits, picks column chunks for the bf16
    reduce-scatter anchors; FP8 operands, outside that fit, keep row chunks, in auto's and in autotune's
    candidates alike."""
    local = shapes("matmul_rs", 8192, 8192, 10240, 2)
    prof = cost_model.load_profile("h100x2")
    comms = ("none", "xla", "dma")
    assert select.select_schedule("matmul_rs", local, "bfloat16", 2, profile=prof, comms=comms).gemm == "columns"
    fp8 = select.select_schedule("matmul_rs", local, "float8_e4m3fn", 2, profile=prof, comms=comms)
    assert fp8.comm == "dma" and fp8.gemm != "columns", fp8
    assert any(s.gemm == "columns" for s in select.candidates("matmul_rs", 2, comms, "bfloat16"))
    assert not any(s.gemm == "columns" for s in select.candidates("matmul_rs", 2, comms, jax.numpy.float8_e4m3fn))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_where_xla_serializes_its_collectives_an_xla_schedule_costs_its_parts_in_sequence(op):
    """With `xla_overlaps` off (what every characterized machine showed), an xla schedule's time is
    its matmuls plus its transfers, so it never ranks above the plain path it decomposes; with it
    on, the simulation overlaps them."""
    serial = {**PROFILE, "xla_overlaps": False}
    overlapping = {**PROFILE, "xla_overlaps": True}
    for M, K, N in ((1024, 4096, 4096), (8192, 8192, 28672)):
        xla = [s for s in Schedule.enumerate(op, 4, ("none", "xla")) if s.comm == "xla"]
        for s in xla:
            assert predict(op, s, M, K, N, profile=serial) >= predict(op, Schedule(comm="none"), M, K, N,
                                                                      profile=serial), s
    big = [s for s in Schedule.enumerate(op, 4, ("none", "xla")) if s.comm == "xla"]
    assert min(predict(op, s, profile=overlapping) for s in big) < min(predict(op, s, profile=serial) for s in big)
    small = shapes(op, 1024, 4096, 4096, 2)
    assert select.select_schedule(op, small, "bfloat16", 2, profile=serial, comms=("none", "xla")) == \
        Schedule(comm="none")


def test_predict_rejects_invalid_schedules():
    with pytest.raises(ValueError, match="valid chunk counts"):
        cost_model.predict("ag_matmul", Schedule(comm="xla", chunks=8), ((12, 16), (16, 16)), "float32", 4)


def test_load_profile_names_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match="shipped profiles"):
        cost_model.load_profile("no_such_machine")


def test_select_schedule_takes_a_profile_as_rank_profile_does(tmp_path):
    """select_schedule(profile=...) takes what `rank --profile` takes (a shipped name, a JSON path) and
    a dict, and refuses what it refuses with the same message: one check serves both."""
    args = ("ag_matmul", shapes("ag_matmul", 8192, 8192, 28672), "bfloat16", 4)
    comms = ("none", "xla", "dma")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(cost_model.load_profile("h200x4")))
    picks = {select.select_schedule(*args, profile=p, comms=comms)
             for p in ("h200x4", str(path), path, cost_model.load_profile("h200x4"))}
    assert len(picks) == 1, picks
    partial = {"peak_tflops": {"bfloat16": 400.0}}  # the entries it lacks are the default profile's, as in a file
    assert select.select_schedule(*args, profile=partial, comms=comms) == select.select_schedule(
        *args, profile={**cost_model.DEFAULT_PROFILE, **partial}, comms=comms)
    bad = {"peak_tflops": {"bfloat16": 0.0}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    (tmp_path / "text.txt").write_text("not json\n")
    for profile, error, says in ((bad, ValueError, "peak_tflops.bfloat16 = 0.0, expected a finite number > 0"),
                                 (str(tmp_path / "bad.json"), ValueError, "peak_tflops.bfloat16 = 0.0"),
                                 ({}, ValueError, "the profile is empty"),
                                 ("no_such_machine", FileNotFoundError, "shipped profiles"),
                                 (str(tmp_path / "text.txt"), ValueError, "not a JSON profile"),
                                 (4, TypeError, "expected a profile name, a JSON path, a dict or None, found int")):
        with pytest.raises(error, match="^select_schedule: profile") as raised:
            select.select_schedule(*args, profile=profile, comms=comms)
        assert says in str(raised.value), (profile, raised.value)
        if isinstance(profile, str):  # the command line says the same of the same file
            from ficco_jax.tools import cli
            with pytest.raises(SystemExit) as exit_:
                cli._load_profile(profile, "rank --profile")
            assert str(exit_.value.code).removeprefix("rank --profile") == \
                str(raised.value).removeprefix("select_schedule: profile")


def test_autotune_cache_round_trips_and_survives_corruption(tmp_path):
    cache = autotune.AutotuneCache(str(tmp_path))
    key = autotune.cache_key("ag_matmul", ((128, 64), (64, 32)), "bfloat16", 4, "NVIDIA H200")
    assert cache.get(key) is None
    sched = Schedule(comm="dma", order="direct", chunks=4, copy_streams=2)
    cache.put(key, sched, {"dma/direct/c4/s2": 0.5, "none": 0.7})
    assert autotune.AutotuneCache(str(tmp_path)).get(key) == sched
    assert json.loads((tmp_path / "autotune.json").read_text())[key]["times_ms"]["none"] == 0.7
    (tmp_path / "autotune.json").write_text("{ not json")
    assert cache.get(key) is None  # a corrupt file is a miss, with a warning, not a crash
    cache.put(key, sched, {})
    assert cache.get(key) == sched


def test_an_autotune_cache_that_cannot_be_written_leaves_the_pick_standing(tmp_path, monkeypatch, caplog):
    """A cache lock held elsewhere is waited for only so long, and an unwritable folder is no
    error of the op: the measured winner is returned either way, with a warning."""
    import fcntl

    monkeypatch.setattr(config, "CACHE_LOCK_TIMEOUT_S", 0.2)
    cache = autotune.AutotuneCache(str(tmp_path))
    with open(cache.path + ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's lock (flock locks are per open file)
        with pytest.raises(TimeoutError, match=r"autotune.json.lock stayed held by another process for 0.2 s"):
            cache.put("k", Schedule(comm="none"), {})
        args = ("matmul_rs", ((256, 64), (64, 32)), "float32", 4)
        timed = lambda op, s, shapes, dtype, n, out_dtype=None: 1.0 if s.comm == "none" else 2.0  # noqa: E731
        with caplog.at_level("WARNING", logger="ficco_jax"):
            assert autotune.autotune_schedule(*args, cache=cache, measure=timed) == Schedule(comm="none")
    assert "could not cache the pick" in caplog.text
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    unwritable = autotune.AutotuneCache(str(blocked / "cache"))
    assert autotune.autotune_schedule(*args, cache=unwritable, measure=timed) == Schedule(comm="none")


def test_autotune_passes_over_a_candidate_that_cannot_run(tmp_path, caplog):
    def timed(op, s, shapes, dtype, n, out_dtype=None):
        if s.comm == "none":
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return 1.0 + s.chunks

    def timed_nothing(op, s, shapes, dtype, n, out_dtype=None):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    cache = autotune.AutotuneCache(str(tmp_path))
    args = ("matmul_rs", ((256, 64), (64, 32)), "float32", 4)
    with caplog.at_level("WARNING", logger="ficco_jax"):
        got = autotune.autotune_schedule(*args, cache=cache, measure=timed)
    assert got.comm != "none" and "could not time {'none': 'RuntimeError: RESOURCE_EXHAUSTED" in caplog.text
    with pytest.raises(RuntimeError, match="no candidate could be timed"):
        autotune.autotune_schedule(*args[:3], 2, cache=cache, measure=timed_nothing)


def test_autotune_measures_once_then_uses_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_time(op, s, shapes, dtype, n, out_dtype=None):
        calls.append(s)
        return 1.0 if s.comm == "none" else 2.0 + s.chunks  # make "none" the measured winner

    cache = autotune.AutotuneCache(str(tmp_path))
    args = ("matmul_rs", ((256, 64), (64, 32)), "float32", 4)
    first = autotune.autotune_schedule(*args, cache=cache, measure=fake_time)
    measured = len(calls)
    assert first == Schedule(comm="none") and measured >= 2
    assert autotune.autotune_schedule(*args, cache=cache, measure=fake_time) == first
    assert len(calls) == measured  # the second call measured nothing


def test_autotune_of_a_group_larger_than_this_process_uses_the_model(tmp_path, monkeypatch, caplog):
    # A tp group that spans processes cannot be timed from one process: no measurement, no cache
    # entry, the model's pick, and a warning that says why.
    monkeypatch.setattr(autotune.jax, "local_devices", lambda: jax.devices()[:2])
    cache = autotune.AutotuneCache(str(tmp_path))
    args = ("ag_matmul", ((512, 1024), (1024, 256)), "bfloat16", 4)
    with caplog.at_level("WARNING", logger="ficco_jax"):
        got = autotune.autotune_schedule(*args, cache=cache, comms=("none", "xla", "dma"),
                                         measure=lambda *a: pytest.fail("autotune tried to time a group it does not hold"))
    assert got == select.select_schedule(*args, comms=("none", "xla", "dma"))
    assert "spans processes" in caplog.text
    assert cache.get(autotune.cache_key(*args, jax.devices()[0].device_kind)) is None


@pytest.mark.parametrize("kind,n,expected", [
    ("NVIDIA H200", 4, "h200x4"), ("NVIDIA H200", 8, "h200x8"),
    ("NVIDIA H200", 2, "h200x2"),
    ("NVIDIA H200", 3, "h200x4"),    # no 3-GPU profile: the nearest group size of the same GPU (4/3 < 3/2)
    ("NVIDIA H200", 16, "h200x8"),
    ("NVIDIA H200", 6, "h200x8"),    # 8/6 is nearer than 6/4
    ("NVIDIA H100 80GB HBM3", 2, "h100x2"), ("NVIDIA H100 80GB HBM3", 4, "h100x2"),
    ("NVIDIA H100 PCIe", 2, None), ("cpu", 8, None), ("NVIDIA H200", 0, None),
])
def test_profile_name_for_falls_back_to_the_same_gpu_then_to_none(kind, n, expected):
    assert select.profile_name_for(kind, n) == expected


def test_shipped_profiles_load_and_name_their_group_size():
    for name, size in (("h200x2", 2), ("h200x4", 4), ("h200x8", 8)):
        profile = cost_model.load_profile(name)
        assert profile["name"] == name and profile.get("axis_size", size) == size


@pytest.mark.parametrize("op,shapes", [
    ("ag_matmul", ((8192, 8192), (8192, 10240))), ("matmul_rs", ((8192, 10240), (10240, 8192))),
    ("matmul_psum", ((8192, 10240), (10240, 8192))),
    ("ag_matmul", ((256, 4096), (4096, 4096))), ("matmul_rs", ((256, 4096), (4096, 4096))),
])
def test_a_group_of_one_device_ranks_the_plain_path_first(op, shapes):
    # One device has nothing to communicate: a copy-engine call only adds its own cost.
    for name in ("h200x2", "h200x4", "h200x8", "default"):
        ranked = cost_model.rank(op, shapes, "bfloat16", 1, Schedule.enumerate(op, 1, ("none", "xla", "dma")),
                                 cost_model.load_profile(name))
        assert ranked[0][1] == Schedule(comm="none"), (name, ranked[:3])


@pytest.mark.parametrize("op", ["a2a_matmul", "matmul_a2a"])
def test_the_expert_ops_overlap_where_the_model_says_it_pays(op):
    """The expert ops are priced as the tensor-parallel op that moves and multiplies the same blocks.
    On 2 x H100 (2026-11-27) a Mixtral-like layer (8192 tokens per GPU, 8 experts) took 2.85 ms on
    dma/direct/c1 against JAX sequential's 3.32, and a small one (1024 tokens, hidden 2048, 16
    experts) 0.131 against 0.121: `auto` overlaps the first and keeps the plain path on the second."""
    from ficco_jax.tools.bench_moe import local_shapes

    profile = cost_model.load_profile("h100x2")
    comms = ("none", "xla", "dma")
    large = local_shapes(op, 8192, 4096, 14336, 8, 2, 2)
    small = local_shapes(op, 1024, 2048, 4096, 16, 2, 2)
    assert select.select_schedule(op, large, "bfloat16", 2, profile=profile, comms=comms) == \
        Schedule.parse("dma/direct/c1")
    assert select.select_schedule(op, small, "bfloat16", 2, profile=profile, comms=comms) == Schedule(comm="none")
    # Without copy engines, the expert ops still overlap over XLA's collectives.
    assert select.select_schedule(op, large, "bfloat16", 2, profile=profile, comms=("none", "xla")).comm == "xla"
    # The dispatch is priced as an all-gather then matmul of the same rows, the combine as a matmul then
    # reduce-scatter without the sum: the plain combine costs what the plain dispatch does here.
    none = Schedule(comm="none")
    assert cost_model.predict(op, none, large, "bfloat16", 2, profile) == pytest.approx(
        cost_model.predict("a2a_matmul", none, local_shapes("a2a_matmul", 8192, 4096, 14336, 8, 2, 2), "bfloat16", 2,
                           profile), rel=1e-9)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_psum", "a2a_matmul", "matmul_a2a"])
def test_auto_keeps_the_plain_path_on_a_group_of_one_device(monkeypatch, op):
    from ficco_jax.tuning import policy

    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)  # decide as on a GPU
    shapes = ((1, 2, 64, 32), (2, 32, 48)) if op in ("a2a_matmul", "matmul_a2a") else ((8192, 8192), (8192, 10240))
    assert policy.choose(op, shapes, "bfloat16", 1) == Schedule(comm="none")


def test_auto_keeps_the_plain_path_on_cpu():
    from ficco_jax.tuning import policy

    assert jax.default_backend() == "cpu"
    shapes = ((8192, 10240), (10240, 8192))
    assert policy.choose("matmul_psum", shapes, "bfloat16", 4) == Schedule(comm="none")


@pytest.mark.sweep(first=1)
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_psum"])
def test_rank_cli_chooses_none_for_one_device(op):
    import subprocess
    import sys

    for shape in ("8192,8192,10240", "256,4096,4096", "2048,8192,28672"):
        out = subprocess.run([sys.executable, "-m", "ficco_jax", "rank", "--op", op, "--shape", shape,
                              "--axis-size", "1", "--profile", "h200x4"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "choice: none", out.stdout


def test_autotune_measures_and_caches_each_result_dtype_apart(tmp_path):
    """bf16 operands into f32 results run other matmuls than into bf16: a winner measured for one
    must not serve the other, and the candidates are timed with the result dtype asked for."""
    seen = []

    def fake_time(op, s, shapes, dtype, n, out_dtype=None):
        seen.append(out_dtype)
        return 1.0 if s.comm == "none" else 2.0

    cache = autotune.AutotuneCache(str(tmp_path))
    args = ("matmul_rs", ((256, 64), (64, 32)), "bfloat16", 4)
    autotune.autotune_schedule(*args, cache=cache, measure=fake_time)
    assert seen and set(seen) == {None}
    seen.clear()
    autotune.autotune_schedule(*args, cache=cache, measure=fake_time, out_dtype="float32")
    assert seen and set(seen) == {"float32"}, "the f32-result call was served the bf16 winner"
    kind = jax.devices()[0].device_kind
    assert autotune.cache_key(*args, kind, "bfloat16") == autotune.cache_key(*args, kind)
    assert cache.get(autotune.cache_key(*args, kind, "float32")) is not None
