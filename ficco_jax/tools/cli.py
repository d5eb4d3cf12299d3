"""`python -m ficco_jax {demo,bench,rank,characterize,calibrate,accuracy}`: the command line of ficco_jax.
The overlap sites of a function are reported by `ficco_jax.explain(fn, *args)` in Python: `explain` is
no command."""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

from .. import config
from ..schedule import Schedule, local_shapes
from ..tuning import cost_model, fitting, select
from . import accuracy, bench, characterize, demo
from .harness import DTYPES, at_least, listed_schedules, positive_seconds, use_xla_cache

# Without GPUs, run on 8 virtual CPU devices. The flag only affects JAX's CPU platform, so it is
# harmless on a GPU host; it must be set before JAX's backend starts (the first device query).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _positive_ints(text: str, count: int, flag: str, expected: str) -> tuple[int, ...]:
    """`count` comma-separated integers > 0, else a clear error naming `flag` and what it expects."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count or min(values) < 1:
        raise SystemExit(f"{flag} {text!r}: expected {expected}")
    return values


def _shapes(args_shapes, default):
    """--shape values: M,K,N, a named shape (e.g. llama70b_qkv_M8k) or a set (anchors, llama405b)."""
    if not args_shapes:
        return default
    named = {k: v for group in bench.SHAPE_SETS.values() for k, v in group.items()}
    shapes = {}
    for text in args_shapes:
        if text in bench.SHAPE_SETS:
            shapes.update(bench.SHAPE_SETS[text])
            continue
        if text in named:
            shapes[text] = named[text]
            continue
        M, K, N = _positive_ints(text, 3, "--shape", "M,K,N (three integers > 0, e.g. 8192,8192,28672), a shape "
                                 f"name ({', '.join(sorted(named))}) or a set ({', '.join(sorted(bench.SHAPE_SETS))})")
        shapes[f"M{M}_K{K}_N{N}"] = (M, K, N)
    return shapes


def _load_profile(name: str | None, flag: str):
    """The profile `--profile` names (a name or a JSON path), None when not given; one that is
    missing, unreadable or not a profile is a clear error naming the option (the same checks as
    select_schedule's `profile=`: cost_model.resolve_profile)."""
    try:
        return cost_model.resolve_profile(name, flag)
    except (ValueError, OSError) as exc:
        raise SystemExit(str(exc))


def _add_bench(sub):
    p = sub.add_parser("bench", help="ficco_jax vs JAX sequential, ring, windowed einsum and the ideal bound")
    p.add_argument("--op", choices=["ag_matmul", "matmul_rs", "matmul_psum", "all", "a2a_matmul", "matmul_a2a", "moe"],
                   default="all", help="all = ag_matmul + matmul_rs; moe = a2a_matmul + matmul_a2a; matmul_psum: the "
                                       "row-parallel matmul's all-reduce against JAX's matmul + psum")
    p.add_argument("--shape", action="append", help="M,K,N, a shape name or a set: anchors, llama405b (repeatable); default: the anchor shapes (GPU) or a tiny one (CPU)")
    p.add_argument("--moe-shape", action="append",
                   help="T,d,f,E,k for the moe ops (repeatable); default: Mixtral-8x7B-like on GPU, tiny on CPU")
    p.add_argument("--dtype", default="bf16",
                   help=f"operand dtype, one of {', '.join(sorted(DTYPES))} (default bf16). fp8: e4m3 operands with "
                        f"per-tensor scales and bf16 results (ag_matmul / matmul_rs only), JAX's FP8 path "
                        f"(the collective, then XLA's FP8 dot) as JAX seq, JAX's ring only if listed "
                        f"(xla/ring/c1), and every shape again in bf16 beside it")
    p.add_argument("--schedules", default="auto", help="auto | all | dma | xla | comma-separated list like dma/direct/c4/s2,xla/ring/c1")
    p.add_argument("--out", default="out/bench", help="folder for bench.json and bench.md (default out/bench)")
    p.add_argument("--plot", action="store_true", help="write speedup PNGs (needs matplotlib)")
    p.add_argument("--no-windowed", action="store_true", help="skip XLA's windowed einsum child process")
    p.add_argument("--budget-s", type=positive_seconds,
                   help="start no new case (op, shape) after this many seconds; the cases left are listed, and "
                        "--resume adds them later")
    p.add_argument("--resume", metavar="JSON", help="keep the cases of this earlier bench.json (same machine, devices, "
                                                    "--dtype and --rounds) and measure only those it lacks")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="time every variant and bound of a case this many times, interleaved (one timing of each in "
                        "turn per round), and report the median: drift over a case's minutes then hits them alike "
                        "(default 1)")
    _add_xla_cache(p)
    p.set_defaults(fn=_cmd_bench)


def _add_xla_cache(p):
    p.add_argument("--xla-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache, with XLA's autotuning results, so that autotuning "
                        "(FP8 dots: 25-60 s each) is paid once per machine (default: $FICCO_XLA_CACHE or "
                        "~/.cache/ficco_jax/xla; 'none': off; a cache set in JAX's own config is kept)")


def _cmd_bench(args):
    dtype = DTYPES.get(args.dtype)
    if dtype is None:
        raise SystemExit(f"--dtype {args.dtype!r}: use one of {sorted(DTYPES)}")
    default = bench.CPU_SHAPES if jax.default_backend() == "cpu" else bench.ANCHOR_SHAPES
    ops = {"all": ["ag_matmul", "matmul_rs"], "moe": ["a2a_matmul", "matmul_a2a"]}.get(args.op, [args.op])
    if config.is_fp8(dtype) and args.op not in ("all", "ag_matmul", "matmul_rs"):
        raise SystemExit(f"bench --dtype {args.dtype} --op {args.op}: FP8 runs ag_matmul and matmul_rs only "
                         f"(--op all, ag_matmul or matmul_rs)")
    listed_schedules(ops[0], args.schedules, 1, ("none", "xla", "dma"))  # parse before any compile
    resume = _read_json(args.resume, "bench --resume") if args.resume else None
    use_xla_cache(args.xla_cache)
    bench.run(ops, _shapes(args.shape, default), dtype, args.schedules, args.out, plot=args.plot,
              windowed=not args.no_windowed, moe_shapes=_moe_shapes(args.moe_shape), budget_s=args.budget_s,
              resume=resume, rounds=args.rounds)


def _moe_shapes(texts):
    if not texts:
        return None  # bench_moe's defaults: a Mixtral-8x7B-like layer on GPUs, a tiny one on CPU
    shapes = {}
    for text in texts:
        T, d, f, E, k = _positive_ints(text, 5, "--moe-shape", "T,d,f,E,k (integers > 0: tokens per device, model "
                                       "dim, expert hidden dim, experts, experts per token), e.g. 8192,4096,14336,8,2")
        shapes[f"T{T}_d{d}_f{f}_E{E}_k{k}"] = (T, d, f, E, k)
    return shapes


def _add_demo(sub):
    p = sub.add_parser("demo", help="check every schedule on all local devices and print a timing table "
                                    "(one device: what auto does there)")
    p.add_argument("--out", default="out/demo", help="folder for the result files (default out/demo)")
    p.set_defaults(fn=lambda args: demo.run(args.out))


RANK_HELP = ("the cost model's predicted time of every candidate schedule of one op and shape, best first "
             "(for the overlap sites of a function, see ficco_jax.explain(fn, *args) in Python)")

#: What `python -m ficco_jax explain ...` says: the name is the Python API's, whose report is of a function.
NO_EXPLAIN_COMMAND = (
    "python -m ficco_jax explain: no such command. For the schedules of one op and shape, ranked by the cost "
    "model, run `python -m ficco_jax rank --op ag_matmul --shape M,K,N`; for the "
    "overlap sites of a function and the schedule of each, call `ficco_jax.explain(fn, *args)` in Python "
    "(print(ficco_jax.explain(step, params, batch)))")


def _add_rank(sub):
    p = sub.add_parser("rank", help=RANK_HELP, description=RANK_HELP)
    p.add_argument("--op", choices=["ag_matmul", "matmul_rs", "matmul_psum"], required=True,
                   help="the op to rank schedules for")
    p.add_argument("--shape", required=True, help="M,K,N of the whole layer, or a shape name")
    p.add_argument("--axis-size", type=at_least(1), default=4, help="devices in the group (default 4)")
    p.add_argument("--dtype", default="bf16", help=f"operand dtype, one of {', '.join(sorted(DTYPES))} (default bf16)")
    p.add_argument("--profile", default=None, help="profile name or JSON path (default: this machine's)")
    p.add_argument("--top", type=at_least(1), default=15, help="how many schedules to list (default 15)")
    p.set_defaults(fn=_cmd_rank)


def _cmd_rank(args):
    named = _shapes([args.shape], None)
    if len(named) != 1:
        raise SystemExit(f"{args.cmd} --shape {args.shape!r}: {args.cmd} takes one shape, and {args.shape!r} names "
                         f"{len(named)} ({', '.join(named)}); give M,K,N or one of those shape names")
    (M, K, N), = named.values()
    n = args.axis_size
    shapes = local_shapes(args.op, M, K, N, n, caller=args.cmd)
    dtype = DTYPES.get(args.dtype)
    if dtype is None:
        raise SystemExit(f"{args.cmd} --dtype {args.dtype!r}: use one of {sorted(DTYPES)}")
    profile = _load_profile(args.profile, f"{args.cmd} --profile") or select.profile_for(n)
    comms = ("none", "xla", "dma")
    ranked = cost_model.rank(args.op, shapes, dtype, n, Schedule.enumerate(args.op, n, comms), profile)
    print(f"{args.op} M,K,N={M},{K},{N} on {n} devices, {dtype}, profile {profile.get('name')}: per-device {shapes}")
    print(f"{'predicted ms':>12}  schedule")
    for t, s in ranked[: args.top]:
        print(f"{t * 1e3:12.3f}  {s}")
    print(f"choice: {ranked[0][1]}")


def _add_characterize(sub):
    p = sub.add_parser("characterize", help="decomposition loss, contention, transfer cost and the FP8 matmul rate "
                                            "on this machine")
    p.add_argument("--out", default="out/characterize", help="folder for characterize.json (default out/characterize)")
    p.add_argument("--plot", action="store_true", help="write characterize.png (needs matplotlib)")
    p.add_argument("--parts", default="decomposition,transfers,contention,fp8",
                   help="comma-separated subset of decomposition, transfers, contention, fp8 (the executor's "
                        "FP8 matmul rate; calibrate fits peak_tflops['float8_e4m3fn'] to it)")
    p.set_defaults(fn=_cmd_characterize)


def _cmd_characterize(args):
    parts = tuple(p for p in args.parts.split(",") if p)
    try:
        characterize.check_parts(parts)
    except ValueError as exc:
        raise SystemExit(f"--parts {args.parts!r} (comma-separated): {exc}")
    characterize.run(args.out, plot=args.plot, parts=parts)


def _add_calibrate(sub):
    p = sub.add_parser("calibrate", help="characterize, then fit and write a machine profile for the cost model")
    p.add_argument("--out", default="out/calibrate/profile.json", help="the profile file to write "
                   "(default out/calibrate/profile.json)")
    p.add_argument("--characterization", help="fit an existing characterize.json instead of measuring")
    p.add_argument("--bench", action="append",
                   help="a bench.json whose verified op times refine the op-level costs (repeatable)")
    p.add_argument("--name", help="the profile's name (e.g. h200x8)")
    p.set_defaults(fn=_cmd_calibrate)


def _cmd_calibrate(args):
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.characterization:
        char = _read_json(args.characterization, "calibrate --characterization")
    else:
        char = characterize.run(os.path.dirname(os.path.abspath(args.out)), plot=False)
    profile = _fitted(fitting.fit_profile, char, f"calibrate: {args.characterization or 'the characterization'}",
                      "`python -m ficco_jax characterize` wrote")
    if args.name:
        profile["name"] = args.name
    if args.bench:  # one fit over the op times of every bench file given
        obs = []
        for path in args.bench:
            obs += _fitted(fitting.op_observations, _read_json(path, "calibrate --bench"), f"calibrate --bench {path}",
                           "`python -m ficco_jax bench` wrote")
        profile, err = fitting.fit_to_ops(profile, obs)
        profile["fitted_to_ops"]["source"] = ", ".join(os.path.basename(p) for p in args.bench)
        print(f"fitted to {len(obs)} op times: RMS log error {err:.3f}; {profile['fitted_to_ops']['parameters']}")
    with open(args.out, "w") as fh:
        json.dump(profile, fh, indent=1, sort_keys=True)
    print(f"profile written to {args.out}: " + json.dumps({k: profile[k] for k in ("peak_tflops", "rows_half", "dma_latency_us", "dma_ingress_gbps", "xla_latency_us", "xla_ingress_gbps", "contention_xla")}))


def _fitted(fit, data, what: str, writers: str):
    """`fit(data)`, or a clear error where `data` (read from a file) is not what `fit` reads:
    `writers` completes "give a file that ..." with the commands that write what it reads."""
    try:
        return fit(data)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, np.linalg.LinAlgError) as exc:
        raise SystemExit(f"{what}: cannot read it ({type(exc).__name__}: {exc}); give a file that {writers}")


def _read_json(path: str, flag: str):
    """The JSON file an option names, or a clear error naming the option and the file."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{flag} {path}: cannot read it as JSON ({exc})")


def _add_accuracy(sub):
    p = sub.add_parser("accuracy", help="held-out check of schedule='auto': pick vs best measured vs JAX sequential")
    p.add_argument("--axis-size", type=at_least(2), help="devices in the tp group (default: all local devices)")
    p.add_argument("--top", type=at_least(0), default=3, help="the model's next candidates measured besides its pick")
    p.add_argument("--shape", action="append", help="M,K,N or a shape name (default: the 20 held-out shapes)")
    p.add_argument("--op", choices=[*accuracy.OPS, "both"], default="both",
                   help="the op(s) to measure (default both); e.g. matmul_rs alone after a change to its executor")
    p.add_argument("--profile", default=None, help="profile name or JSON path (default: this machine's)")
    p.add_argument("--budget-s", type=positive_seconds, help="stop starting new cases after this many seconds")
    p.add_argument("--out", default="out/accuracy", help="folder for accuracy.json (default out/accuracy)")
    p.add_argument("--confirm-rounds", type=at_least(0), default=None,
                   help="re-timings of the pick, the best and JAX seq when a case first looks like a miss (default 2; 0: none)")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="time every candidate of a case this many times, interleaved (one timing of each in turn per "
                        "round), and judge the medians; then no miss is re-timed (default 1)")
    p.add_argument("--plot", action="store_true", help="write accuracy.png (needs matplotlib)")
    p.add_argument("--resume", metavar="JSON", help="keep the cases of this earlier accuracy.json (same machine, "
                   "group size, profile and --rounds) and measure only the ones it lacks")
    p.add_argument("--replay", action="append", metavar="JSON",
                   help="no measuring: re-score the times of a bench.json or accuracy.json (repeatable) with "
                        "--profile, or with the profile auto would use for that run")
    _add_xla_cache(p)
    p.set_defaults(fn=_cmd_accuracy)


def _cmd_accuracy(args):
    if args.replay:  # offline: re-score recorded times, no device needed
        results = [_read_json(path, "accuracy --replay") for path in args.replay]
        profile = _load_profile(args.profile, "accuracy --replay")
        summary = _fitted(lambda r: accuracy.replay(r, profile), results, "accuracy --replay",
                          "`python -m ficco_jax bench` (bench.json) or `accuracy` (accuracy.json) wrote")
        print(accuracy.replay_markdown(summary), end="")
        return
    shapes = None
    if args.shape:
        named = dict(accuracy.HELDOUT_SHAPES)
        shapes = {t: named[t] for t in args.shape if t in named}
        shapes.update(_shapes([t for t in args.shape if t not in named], {}))
    profile = _load_profile(args.profile, "accuracy --profile")
    resume = _read_json(args.resume, "accuracy --resume") if args.resume else None
    rounds = accuracy.CONFIRM_ROUNDS if args.confirm_rounds is None else args.confirm_rounds
    use_xla_cache(args.xla_cache)
    accuracy.run(args.out, axis_size=args.axis_size, shapes=shapes, top=args.top, profile=profile,
                 budget_s=args.budget_s, plot=args.plot, confirm_rounds=rounds, resume=resume,
                 ops=accuracy.OPS if args.op == "both" else (args.op,), rounds=args.rounds)


def _windowed(argv):
    """`_windowed OP M K N DTYPE`: the windowed-einsum child process of `bench` (not for users, so
    it is parsed apart and `--help` does not list it); prints the child's timing as JSON."""
    p = argparse.ArgumentParser(prog="python -m ficco_jax _windowed")
    p.add_argument("op"); p.add_argument("M", type=at_least(1)); p.add_argument("K", type=at_least(1))
    p.add_argument("N", type=at_least(1)); p.add_argument("dtype")
    args = p.parse_args(argv)
    print(json.dumps(bench.windowed_einsum_child(args.op, args.M, args.K, args.N, args.dtype)))


#: The subcommands, in the order `--help` lists them: each adds its parser, options and handler.
SUBCOMMANDS = (_add_demo, _add_bench, _add_rank, _add_characterize, _add_calibrate, _add_accuracy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ficco_jax", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True, title="commands")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_windowed"]:
        _windowed(argv[1:])
        return 0
    if argv[:1] == ["explain"]:
        raise SystemExit(NO_EXPLAIN_COMMAND)
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, OSError) as exc:  # bad input found past parsing: a file, a schedule list, a shape or a
        # device count the run cannot take, an earlier run to resume that is not comparable
        raise SystemExit(f"python -m ficco_jax {args.cmd}: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
