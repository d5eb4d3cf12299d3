"""benchmarks/suites/step_timeline.py and its analysis: the interval arithmetic against a brute-force
count of points, the classes of CUPTI's event names, exposed and hidden communication of small
made-up steps (a copy half under a GEMM), and a whole made-up GPU trace (the format CUPTI's
collector gives JAX's profiler: one process per GPU, one thread per stream) through the analysis
to the tables."""
import gzip
import importlib.util
import json
import pathlib
import random
import re
import sys

import pytest

SUITES = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "suites"
sys.path.insert(0, str(SUITES))
import timeline_analysis as ta  # noqa: E402
import timeline_report  # noqa: E402

COMPUTE_STREAM = "Stream #7(Compute,MemcpyD2D)"
COPY_STREAM = "Stream #21(MemcpyP2P,MemcpyD2D)"
NCCL_STREAM = "Stream #15(Compute)"
GEMM = "nvjet_tst_192x192_64x4_2x1_v_bz_TNT"
STEP_MARK = re.compile(r"^step_timeline step (\d+)$")


def act(start, end, name, lane=COMPUTE_STREAM, label=""):
    return ta.Activity(float(start), float(end), name, lane, label)


def points(intervals):
    """The integer points t with t + 0.5 inside some interval: a brute-force measure."""
    return {t for s, e in intervals for t in range(int(s), int(e)) if s <= t + 0.5 < e}


def random_intervals(rng, n):
    return [(s, s + rng.randint(0, 12)) for s in (rng.randint(0, 80) for _ in range(n))]


# ------------------------------------------------------------------------------------------------
# Interval arithmetic
# ------------------------------------------------------------------------------------------------
def test_union_merges_overlapping_and_touching_intervals_and_drops_empty_ones():
    assert ta.union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6), (9, 8)]) == [(0, 4), (5, 7)]
    assert ta.total([(0, 10), (5, 15), (20, 21)]) == 16


@pytest.mark.parametrize("seed", range(20))
def test_intersect_subtract_and_union_agree_with_counting_points(seed):
    rng = random.Random(seed)
    a, b = random_intervals(rng, rng.randint(0, 8)), random_intervals(rng, rng.randint(0, 8))
    assert points(ta.union(a)) == points(a)
    assert points(ta.intersect(a, b)) == points(a) & points(b)
    assert points(ta.subtract(a, b)) == points(a) - points(b)
    assert ta.total(ta.intersect(a, b)) + ta.total(ta.subtract(a, b)) == ta.total(a)
    for parts in (ta.union(a), ta.intersect(a, b), ta.subtract(a, b)):  # sorted and disjoint
        assert all(e1 < s2 for (_, e1), (s2, _) in zip(parts, parts[1:])), parts


def test_gaps_are_the_holes_longer_than_the_threshold():
    assert ta.gaps([(0, 10), (50, 60), (65, 100)], 0, 100, 20) == [(10, 50)]
    assert ta.gaps([(10, 20)], 0, 60, 5) == [(0, 10), (20, 60)]


def test_clip_keeps_every_interval_that_reaches_into_the_window():
    disjoint = [(0, 10), (20, 30), (40, 50), (60, 70)]
    kept = ta.clip(disjoint, 25, 45)
    assert (20, 30) in kept and (40, 50) in kept and (0, 10) not in kept
    assert ta.intersect([(25, 45)], kept) == ta.intersect([(25, 45)], disjoint)


# ------------------------------------------------------------------------------------------------
# Classes
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, cls", [
    (GEMM, "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)", "gemm"),
    ("triton_gemm_dot_17", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "compute"),
    ("loop_multiply_fusion_3", "compute"), ("small_reduce_fusion", "compute"),
    ("void xla::gpu::AllReduceKernel<__nv_bfloat16, 2>(AllReduceKernelParams)", "nccl"),
    ("ReduceSumVectorKernel", "compute"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "nccl"),
    ("MemcpyP2P", "copy"), ("MemcpyD2D", "copy"), ("MemcpyOther", "copy"), ("Memcpy PtoP (Device -> Device)", "copy"),
    ("MemcpyH2D", "other"), ("MemcpyD2H", "other"), ("Memcpy HtoD (Pinned -> Device)", "other"), ("Memset", "other"),
])
def test_event_names_map_to_classes(name, cls):
    assert ta.classify(name) == cls


def test_a_device_copy_on_a_kernel_stream_is_not_communication():
    events = ta.classify_lanes([act(0, 5, GEMM), act(5, 6, "MemcpyD2D"),               # XLA's stream
                                act(0, 3, "MemcpyP2P", COPY_STREAM), act(3, 4, "MemcpyD2D", COPY_STREAM)])
    assert [e.cls for e in events] == ["gemm", "other", "copy", "copy"]


# ------------------------------------------------------------------------------------------------
# One step
# ------------------------------------------------------------------------------------------------
def test_a_copy_half_covered_by_a_gemm_is_half_exposed():
    events = ta.classify_lanes([act(0, 100, GEMM, label="dot.1"),
                                act(50, 150, "MemcpyP2P", COPY_STREAM, label="custom-call.2")])
    step = ta.analyze_step(events)
    assert step["span_us"] == 150 and step["compute_us"] == 100 and step["gemm_us"] == 100
    assert step["comm_us"] == 100 and step["copy_us"] == 100 and step["nccl_us"] == 0
    assert step["exposed_us"] == 50 and step["hidden_fraction"] == 0.5
    assert step["exposed_intervals"] == [(100, 150)]
    row, = step["collectives"]
    assert (row["kind"], row["label"], row["events"]) == ("copy", "custom-call.2", 1)
    assert (row["start_us"], row["busy_us"], row["hidden_us"], row["hidden_fraction"]) == (50, 100, 50, 0.5)


def test_exposed_communication_is_the_union_not_the_sum():
    # Two copies overlap each other (30 us of communication, not 40) and a kernel covers 10 of it.
    events = ta.classify_lanes([act(0, 20, "MemcpyP2P", COPY_STREAM), act(10, 30, "MemcpyP2P", "Stream #22(MemcpyP2P)"),
                                act(25, 35, "loop_fusion")])
    step = ta.analyze_step(events)
    assert step["comm_us"] == 30 and step["exposed_us"] == 25 and step["compute_us"] == 10
    assert step["hidden_fraction"] == pytest.approx(1 - 25 / 30)


def test_copies_group_by_op_and_gap_and_each_nccl_kernel_is_a_row():
    events = ta.classify_lanes([
        act(0, 400, GEMM),
        act(10, 20, "MemcpyP2P", COPY_STREAM, "custom-call.1"), act(25, 35, "MemcpyP2P", COPY_STREAM, "custom-call.1"),
        act(36, 40, "MemcpyD2D", COPY_STREAM, "custom-call.1"),
        act(100, 110, "MemcpyP2P", COPY_STREAM, "custom-call.1"),       # a later call of the same op: a gap
        act(112, 120, "MemcpyP2P", COPY_STREAM, "custom-call.3"),       # another op right after
        act(350, 450, "ncclDevKernel_AllGather_RING_LL", NCCL_STREAM, "all-gather-start.4")])
    rows = ta.analyze_step(events)["collectives"]
    assert [(r["kind"], r["label"], r["events"]) for r in rows] == [
        ("copy", "custom-call.1", 3), ("copy", "custom-call.1", 1), ("copy", "custom-call.3", 1),
        ("nccl", "all-gather-start.4", 1)]
    assert rows[0]["span_us"] == 30 and rows[0]["busy_us"] == 24 and rows[0]["hidden_fraction"] == 1
    assert rows[3]["hidden_us"] == 50 and rows[3]["hidden_fraction"] == 0.5


def test_idle_gaps_of_compute_and_of_the_whole_device():
    events = ta.classify_lanes([act(0, 10, GEMM, label="dot.1"), act(60, 100, "loop_fusion", label="fusion.2"),
                                act(20, 40, "MemcpyP2P", COPY_STREAM)])
    step = ta.analyze_step(events)
    assert (step["idle_gaps"], step["idle_us"]) == (1, 50)          # compute idles 10..60
    assert (step["bare_gaps"], step["bare_us"]) == (0, 0)           # 10..20 and 40..60: not over 20 us
    gap, = step["longest_idle"]
    assert (gap["at_us"], gap["us"], gap["after"], gap["before"]) == (10, 50, "dot.1", "fusion.2")


def test_a_step_without_communication_has_no_hidden_fraction():
    step = ta.analyze_step(ta.classify_lanes([act(0, 10, GEMM)]))
    assert step["comm_us"] == 0 and step["hidden_fraction"] is None and step["collectives"] == []
    assert ta.analyze_step([]) == {"events": 0}


# ------------------------------------------------------------------------------------------------
# A made-up GPU trace, as JAX's profiler writes it
# ------------------------------------------------------------------------------------------------
def gpu_trace(device_shift_us=0.0, nccl_start_us=200.0):
    """Two traced steps on two GPUs: per step a GEMM of 100 us with a copy half under it, and an NCCL
    kernel after it (at `nccl_start_us` into the step: earlier, the step is shorter), then an add;
    threads that are not streams (CUPTI overhead, XLA Ops) to leave out; the host annotations around
    the steps."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 5, "args": {"name": "python3"}}]
    events = []
    for step, t in ((2, 1000.0), (3, 20000.0)):
        events.append({"ph": "X", "pid": 1, "tid": 5, "ts": t, "dur": 400.0, "name": f"step_timeline step {step}"})
    for device in (0, 1):
        pid = 100 + device
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"/device:GPU:{device}"}})
        for tid, lane in ((7, COMPUTE_STREAM), (21, COPY_STREAM), (15, NCCL_STREAM), (99, "CUPTI overhead"),
                          (10000, "XLA Ops")):
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        for t in (1000.0 + device_shift_us, 20000.0 + device_shift_us):
            x = lambda tid, start, dur, name, op: {"ph": "X", "pid": pid, "tid": tid, "ts": t + start, "dur": dur,  # noqa: E731
                                                  "name": name, "args": {"hlo_op": op}}
            events += [x(7, 20, 100, GEMM, "dot.1"), x(21, 70, 100, "MemcpyP2P", "custom-call.2"),
                       x(15, nccl_start_us, 40, "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce-scatter.3"),
                       x(7, nccl_start_us + 40, 30, "loop_add_fusion", "fusion.4"), x(99, 10, 5, "overhead", ""),
                       x(10000, 20, 100, "dot.1", "")]  # a line derived from the streams: not counted twice
    return meta + events


def check_gpu_steps(devices):
    assert sorted(devices) == [0, 1]
    for device in devices.values():
        assert len(device) == 2 * 4  # the overhead thread left out
    step = ta.analyze_step(devices[0][:4])
    assert step["span_us"] == 250 and step["compute_us"] == 130 and step["comm_us"] == 140
    assert step["exposed_us"] == 50 + 40 and step["hidden_fraction"] == pytest.approx(50 / 140)


def test_device_activities_of_a_gpu_trace():
    devices, notes = ta.device_activities(gpu_trace())
    assert notes == ["left out 2 events on thread 'GPU:0 CUPTI overhead' (not a stream)",
                     "left out 2 events on thread 'GPU:0 XLA Ops' (not a stream)",
                     "left out 2 events on thread 'GPU:1 CUPTI overhead' (not a stream)",
                     "left out 2 events on thread 'GPU:1 XLA Ops' (not a stream)"]
    check_gpu_steps({d: sorted(acts, key=lambda e: e.start) for d, acts in devices.items()})
    windows = ta.step_windows(gpu_trace(), STEP_MARK)
    assert windows == [(2, 1000.0, 1400.0), (3, 20000.0, 20400.0)]
    per_step, how = ta.split_steps(devices[0], windows, slack_us=5000)
    assert [len(s) for s in per_step] == [4, 4] and how.startswith("host step annotations (0 events")


def test_steps_split_by_the_device_idle_gaps_when_clocks_disagree():
    devices, _ = ta.device_activities(gpu_trace(device_shift_us=-9000.0))
    windows = ta.step_windows(gpu_trace(), STEP_MARK)
    per_step, how = ta.split_steps(devices[0], windows, slack_us=100)
    assert [len(s) for s in per_step] == [4, 4] and how.startswith("the device's longest idle gaps")
    assert ta.analyze_step(per_step[1])["exposed_us"] == 90


def load_step_timeline():
    if "step_timeline" not in sys.modules:
        spec = importlib.util.spec_from_file_location("step_timeline", SUITES / "step_timeline.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["step_timeline"] = module
        spec.loader.exec_module(module)
    return sys.modules["step_timeline"]


def test_a_gpu_trace_through_the_analysis_to_the_tables(tmp_path):
    st = load_step_timeline()
    results = {}
    # Overlapped, the reduce-scatter starts under the copy: the step spans 180 us instead of 250.
    for mode, nccl_start_us in (("no-overlap", 200.0), ("overlap", 130.0)):
        folder = tmp_path / f"trace_{mode}" / "plugins" / "profile" / "2026_01_01_00_00_00"
        folder.mkdir(parents=True)
        with gzip.open(folder / "perfetto_trace.json.gz", "wt") as fh:
            json.dump({"traceEvents": gpu_trace(nccl_start_us=nccl_start_us), "displayTimeUnit": "ns"}, fh)
        analysis, first = st.analyze_trace(str(tmp_path / f"trace_{mode}"))
        results[mode] = {"wall_ms": [0.4, 0.4], "untraced_wall_ms": 0.3, "trace_dir": str(folder), "analysis": analysis}
        assert len(first[0]) == 4 and analysis["verdict"].startswith("2 device(s), steps split by host")
    result = st.write_results(str(tmp_path), ["--preset", "tiny"], results, comm_free_ms=0.15)
    row = result["summary"]["modes"]["no-overlap"]
    assert row["span_us"] == 250 and row["exposed_us"] == 90 and row["hidden_fraction"] == pytest.approx(50 / 140)
    assert result["summary"]["modes"]["overlap"]["span_us"] == 180
    # (250 - 180) us of the (250 - 150) us that communication adds to the step
    assert result["summary"]["overlap_share"] == pytest.approx(0.7)
    text = (tmp_path / "step_timeline.md").read_text()
    assert "| copy | `custom-call.2` | 1 |" in text and "| nccl | `reduce-scatter.3` | 1 |" in text
    assert "left out 2 events on thread 'GPU:0 CUPTI overhead'" in text
    assert "hides 36% of 0.14 ms communication" in result["verdict"]
    assert json.loads((tmp_path / "step_timeline.json").read_text())["summary"]["modes"]["no-overlap"]["comm_us"] == 140


def test_the_picture_or_a_clear_word_why_not(tmp_path):
    devices, _ = ta.device_activities(gpu_trace())
    said = timeline_report.plot({"overlap": devices[0][:4]}, {"overlap": [(150, 170)]}, str(tmp_path / "p.png"), "t")
    assert said == f"picture written to {tmp_path / 'p.png'}" and (tmp_path / "p.png").stat().st_size > 0 \
        or said.startswith("no picture: matplotlib is not installed")
