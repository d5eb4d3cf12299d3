"""A device timeline of training steps of examples/tp_transformer.py, every collective attributed.

Usage: python benchmarks/suites/step_timeline.py --out DIR [--warmup-steps 2] [--traced-steps 2]
           [--comm-free-ms MS] [-- EXAMPLE OPTIONS]

EXAMPLE OPTIONS are the example's (e.g. `--preset llama70b-layer --attention cudnn`, `--global-view`;
`--comm-free-bound` adds a third, traced mode: the step with its sequence collectives replaced by
local ops). For each mode, no overlap then `ficco_jax.overlap`, in this process: compile the step,
run the warm-up steps, then trace the next steps with JAX's profiler (CUPTI on GPUs: every kernel and
copy of every stream), each step under a host annotation; the trace is kept in DIR/trace_<mode>/.
Each device's stream events are classed (timeline_analysis.py: GEMM and other compute kernels,
NCCL kernels, copy-engine copies, other) and, per step: the device span, compute busy time,
communication time, exposed communication (communication while no compute runs), idle gaps of
compute longer than 20 us, and one row per NCCL kernel and per group of copies with how much of it
compute hides. DIR/step_timeline.json holds everything, DIR/step_timeline.md the tables,
DIR/step_timeline.png one step per mode (one lane per stream, exposed communication in red; needs
matplotlib), and a short table is printed last. The overlap share,
(no-overlap step - overlap step) / (no-overlap step - communication-free step), is given where a
communication-free step is known (--comm-free-ms, or the traced mode). Without a GPU (CPU runs) the
trace has no device lane: the files say so and give the host's step times.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import sys
import time
import traceback

#: While a profiler records, XLA runs its command buffers (CUDA graphs) thunk by thunk unless this
#: flag says otherwise: keep them, so that traced steps launch their work as untraced ones do.
#: An XLA_FLAGS that names the flag wins.
KEEP_COMMAND_BUFFERS = "--xla_enable_command_buffers_during_profiling=true"
if "xla_enable_command_buffers_during_profiling" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + KEEP_COMMAND_BUFFERS).strip()

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples")
sys.path.insert(0, HERE)
sys.path.insert(0, EXAMPLES)  # as running the example does: it imports its model, llama_block

import jax  # noqa: E402
from ficco_jax.tools.report import git_commit  # noqa: E402

import perfetto_timeline  # noqa: E402
import timeline_analysis as ta  # noqa: E402
import timeline_report  # noqa: E402
from timeline_report import fmt  # noqa: E402

STEP_MARK = "step_timeline step {}"
STEP_MARK_RE = re.compile(r"^step_timeline step (\d+)$")
MODES = ("no-overlap", "overlap")
#: Host sleep before each traced step: the device idles between steps, so that steps stay apart
#: even where host and device clocks disagree by up to half of it.
STEP_SEPARATION_S = 0.01


def load_example():
    spec = importlib.util.spec_from_file_location("tp_transformer", os.path.join(EXAMPLES, "tp_transformer.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["tp_transformer"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def mode_config(tp, cfg, mode: str):
    """The example's Config of a mode, and the mesh it runs on."""
    if mode == "comm-free":  # as the example's --comm-free-bound: the shard_map view without collectives
        cfg = dataclasses.replace(cfg, overlap=False, comm_free=True, global_view=False)
    else:
        cfg = dataclasses.replace(cfg, overlap=mode == "overlap")
    return cfg, tp.make_mesh(cfg)


def trace_mode(tp, cfg, mode: str, out: str, warmup: int, traced: int) -> dict:
    """Compile `mode`'s step, run `warmup` steps, then `traced` steps under JAX's profiler, each in a
    host annotation; the host's wall time of each step and the trace's folder."""
    cfg, mesh = mode_config(tp, cfg, mode)
    trace_dir = os.path.join(out, f"trace_{mode}")
    with tp.mesh_context(cfg, mesh):
        start = time.perf_counter()
        trainer = tp.build_trainer(cfg, mesh)
        compile_s = time.perf_counter() - start
        params, opt_state = tp.init_state(trainer)
        # Batches made and placed before the traced steps, so that the steps hold only the step.
        batches = [[jax.device_put(a, trainer.shardings["batch"]) for a in tp.synthetic_batch(cfg, mesh.shape["dp"], s)]
                   for s in range(warmup + traced)]
        wall_ms, losses = [], []
        tracing = False
        try:
            for step, batch in enumerate(batches):
                if step >= warmup:
                    if not tracing:
                        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
                        tracing = True
                    time.sleep(STEP_SEPARATION_S)
                marked = jax.profiler.TraceAnnotation(STEP_MARK.format(step)) if tracing else contextlib.nullcontext()
                with marked:
                    t0 = time.perf_counter()
                    params, opt_state, loss = trainer.step_fn(params, opt_state, *batch)
                    losses.append(float(jax.block_until_ready(loss)))
                    wall_ms.append((time.perf_counter() - t0) * 1e3)
        finally:
            if tracing:  # also after a failed step: the next mode starts a trace of its own
                jax.profiler.stop_trace()
    print(f"[{mode}] compiled in {compile_s:.1f} s; step wall ms {', '.join(f'{t:.2f}' for t in wall_ms)} "
          f"(the last {traced} traced); losses {', '.join(f'{x:.4f}' for x in losses)}", flush=True)
    return {"compile_s": compile_s, "wall_ms": wall_ms[warmup:], "untraced_wall_ms": wall_ms[warmup - 1],
            "losses": losses, "trace_dir": trace_dir}


def analyze_trace(trace_dir: str) -> tuple[dict, dict]:
    """Per device and step, the analysis of timeline_analysis.analyze_step; and device 0's classed
    events of each step (for the picture). A trace with no GPU process gives a verdict instead."""
    events = perfetto_timeline.load(trace_dir)
    windows = ta.step_windows(events, STEP_MARK_RE)
    host = [{"step": s, "wall_us": hi - lo} for s, lo, hi in windows]
    devices, notes = ta.device_activities(events)
    if not devices:
        why = ("a CPU run" if jax.default_backend() == "cpu" else
               f"the backend is {jax.default_backend()}, yet the profiler recorded no device activity: see its "
               "messages in the log")
        return {"verdict": f"no device events: the trace has no GPU stream ({why}); host step times only",
                "host_steps": host, "devices": {}}, {}
    result = {"verdict": "", "host_steps": host, "notes": notes, "devices": {}}
    steps_of_device0 = {}
    for device, activity in devices.items():
        per_step, how = ta.split_steps(activity, windows, slack_us=STEP_SEPARATION_S * 1e6 / 2)
        result["devices"][device] = {"steps": [ta.analyze_step(acts) for acts in per_step], "split_by": how,
                                     "unclassified": ta.unclassified(activity)[:40]}
        if not steps_of_device0:
            steps_of_device0 = dict(enumerate(per_step))
    first = result["devices"][min(devices)]
    result["verdict"] = f"{len(devices)} device(s), steps split by {first['split_by']}"
    return result, steps_of_device0


def mean_of(steps: list[dict], key: str):
    values = [s[key] for s in steps if s.get(key) is not None]
    return sum(values) / len(values) if values else None


def summarize(modes: dict, comm_free_ms: float | None) -> dict:
    """Per mode, device 0's step metrics averaged over the traced steps; and the overlap share."""
    keys = ("span_us", "compute_us", "gemm_us", "comm_us", "nccl_us", "copy_us", "exposed_us", "idle_gaps", "idle_us")
    rows = {}
    for mode, res in modes.items():
        if "error" in res:
            continue
        devices = res["analysis"]["devices"]
        steps = devices[min(devices)]["steps"] if devices else []
        row = {key: mean_of(steps, key) for key in keys}
        row["wall_ms"] = sum(res["wall_ms"]) / len(res["wall_ms"])
        row["untraced_wall_ms"] = res["untraced_wall_ms"]
        row["hidden_fraction"] = (1 - row["exposed_us"] / row["comm_us"]) if row["comm_us"] else None
        rows[mode] = row
    on_device = all(row["span_us"] for row in rows.values())
    summary = {"modes": rows, "comm_free_step_ms": comm_free_ms, "overlap_share": None,
               "step_time": "device span" if on_device else "host wall time (no device lane; CPU times mean nothing)"}
    step_ms = lambda mode: rows[mode]["span_us"] / 1e3 if on_device else rows[mode]["wall_ms"]  # noqa: E731
    if "comm-free" in rows:
        summary["comm_free_step_ms"] = step_ms("comm-free")
    free = summary["comm_free_step_ms"]
    if free is not None and {"no-overlap", "overlap"} <= rows.keys() and step_ms("no-overlap") > free:
        summary["overlap_share"] = (step_ms("no-overlap") - step_ms("overlap")) / (step_ms("no-overlap") - free)
    return summary


def verdict(summary: dict, modes: dict) -> str:
    done = {mode: res for mode, res in modes.items() if "error" not in res}
    failed = [f"{mode} failed ({res['error']})" for mode, res in modes.items() if "error" in res]
    if not any(res["analysis"]["devices"] for res in done.values()):
        parts = [next(iter(done.values()))["analysis"]["verdict"]] if done else []
    else:
        parts = [f"{mode} hides {fmt(r['hidden_fraction'], pct=True)} of {fmt(r['comm_us'], 1e3)} ms communication"
                 for mode, r in summary["modes"].items() if mode != "comm-free"]
        if summary["overlap_share"] is not None:
            parts.append(f"overlap share {summary['overlap_share']:.0%} of the hideable step time")
    return "step_timeline: " + "; ".join(parts + failed)


def provenance() -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
            "n_devices": jax.device_count(), "jax": jax.__version__, "commit": git_commit(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


METHOD = ("Device time from JAX's profiler (CUPTI): each stream's kernels and copies, classed by name; "
          "busy times are unions of intervals; exposed communication is communication time not covered by "
          "any compute kernel; steps are the host annotations around each traced step, which blocks until "
          "its results are ready; XLA keeps its command buffers while tracing. Wall times: host, per step, "
          "traced and (the last warm-up step) untraced.")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    options: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, options = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Options after -- go to examples/tp_transformer.py, e.g. "
                                            "-- --preset llama70b-layer --attention cudnn --global-view")
    parser.add_argument("--out", required=True, help="folder for the traces, step_timeline.json/.md/.png")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps run before tracing (default 2)")
    parser.add_argument("--traced-steps", type=int, default=2, help="steps traced per mode (default 2)")
    parser.add_argument("--comm-free-ms", type=float, help="a communication-free step time, for the overlap share")
    args = parser.parse_args(argv)
    if args.warmup_steps < 1 or args.traced_steps < 1:
        parser.error(f"--warmup-steps must be >= 1 (the first step allocates and sets up communication) and "
                     f"--traced-steps >= 1; found {args.warmup_steps} and {args.traced_steps}")
    return args, options


def main(argv=None) -> int:
    args, options = parse_args(sys.argv[1:] if argv is None else argv)
    tp = load_example()
    cfg, example_args = tp.parse_config(options)
    if example_args.tp is None:  # as the example: the preset's tp where it fits these devices
        cfg = dataclasses.replace(cfg, tp=tp.fit_tp(cfg, jax.device_count()))
    modes = MODES + (("comm-free",) if example_args.comm_free_bound else ())
    os.makedirs(args.out, exist_ok=True)
    print(f"step_timeline: examples/tp_transformer.py {' '.join(options)}: tp={cfg.tp} on {jax.device_count()} x "
          f"{jax.devices()[0].device_kind}; modes {', '.join(modes)}; {args.warmup_steps} warm-up + "
          f"{args.traced_steps} traced steps each", flush=True)
    results, first_steps = {}, {}
    for mode in modes:
        try:
            results[mode] = trace_mode(tp, cfg, mode, args.out, args.warmup_steps, args.traced_steps)
            results[mode]["analysis"], steps = analyze_trace(results[mode]["trace_dir"])
            first_steps[mode] = steps.get(0, [])
        except Exception as exc:  # the other modes still run, and the files say what failed
            traceback.print_exc()
            results[mode] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        result = write_results(args.out, options, results, args.comm_free_ms)  # after each mode: a cut run keeps some
    head = result["provenance"]
    title = (f"examples/tp_transformer.py {' '.join(options)}: {head['n_devices']} x {head['device']}, {head['date']}, "
             f"commit {head['commit']}; device time from JAX's profiler")
    print(timeline_report.plot(first_steps, exposed_of_first_steps(results), os.path.join(args.out, "step_timeline.png"),
                               title))
    print(f"files: {args.out}/step_timeline.json, step_timeline.md, trace_<mode>/")
    for heading, lines in (("events classed by default, by time (device 0; all in step_timeline.md):",
                            timeline_report.default_classed(result)),
                           ("most exposed collectives (device 0, first traced step):",
                            timeline_report.most_exposed(result))):
        if lines:
            print("\n".join(["", heading, *lines]))
    print("\n".join(["", result["verdict"], timeline_report.share_line(result["summary"]),
                     *timeline_report.summary_table(result["summary"])]))
    return 1 if any("error" in res for res in results.values()) else 0


def write_results(out: str, options: list[str], results: dict, comm_free_ms: float | None) -> dict:
    summary = summarize(results, comm_free_ms)
    result = {"provenance": provenance(), "example_options": options, "method": METHOD,
              "verdict": verdict(summary, results), "summary": summary, "modes": results}
    with open(os.path.join(out, "step_timeline.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    with open(os.path.join(out, "step_timeline.md"), "w") as fh:
        fh.write(timeline_report.markdown(result))
    return result


def exposed_of_first_steps(results: dict) -> dict:
    """Device 0's exposed communication in the first traced step of each mode, for the picture."""
    exposed = {}
    for mode, res in results.items():
        devices = res.get("analysis", {}).get("devices")
        if devices and devices[min(devices)]["steps"]:
            exposed[mode] = devices[min(devices)]["steps"][0].get("exposed_intervals", [])
    return exposed


if __name__ == "__main__":
    sys.exit(main())
