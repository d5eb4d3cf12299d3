"""Train a Llama-style decoder with tensor + sequence parallelism, with and without `ficco_jax.overlap`.

Usage:
    python examples/tp_transformer.py                        # tiny preset, 8 virtual CPU devices, overlap on
    python examples/tp_transformer.py --compare --steps 5    # both modes, same init and data, side by side
    python examples/tp_transformer.py --preset llama70b-layer --layers 6 --compare   # 4 x H200
    python examples/tp_transformer.py --preset llama8b-layer --attention cudnn --compare --comm-free-bound  # 2 GPUs
    python examples/tp_transformer.py --compare --comm-free-bound   # + the step with no communication at all
    python examples/tp_transformer.py --global-view --compare       # the model in global view, no shard_map

The model, in examples/llama_block.py, is written as a user would write it, with no ficco_jax call
inside: decoder blocks (RMSNorm, causal attention with RoPE and grouped-query heads, SwiGLU MLP)
run in one `jax.shard_map` over a (dp, tp) mesh, as a `lax.scan` over stacked layer parameters
(`--remat`: `jax.checkpoint` per layer). Between blocks, activations are sequence-parallel:
[batch/dp, seq/tp, hidden]. Each block gathers the sequence in front of its column-parallel
matmuls and reduce-scatters it behind its row-parallel ones:

    attention: all_gather(norm(x)) -> QKV matmul -> RoPE, causal attention on local heads -> O matmul -> psum_scatter
    MLP:       all_gather(norm(x)) -> gate/up matmul -> silu(gate) * up -> down matmul -> psum_scatter

Q, K and V share one weight [hidden, kv_heads, q_per_kv + 2, head_dim], sharded over kv heads
(and the MLP's gate and up one weight [hidden, 2, ffn]): one matmul per gather, so in the
backward pass the input gradient is one matmul before its reduce-scatter, a site `overlap` can
rewrite (with separate Q/K/V weights it is a sum of three matmuls, left as written).

The LM head is vocab-parallel (Megatron's) and runs in the same shard_map after the blocks: the
final norm's output has its sequence gathered in front of the head matmul, each device computes the
logits of its slice of the vocabulary, and the cross-entropy combines the softmax's max, normaliser
and target logit over tp (three all-reduces of one number per token). The embedding runs outside
the shard_map, partitioned by XLA from the shardings given to `jit`.

`--overlap` trains with `jit(ficco_jax.overlap(value_and_grad(loss)))`: the rewrite sees the
forward and the backward shard_map bodies, so both passes' all_gather->matmul and
matmul->psum_scatter sites, the LM head's among them, become `ag_matmul` / `matmul_rs`.

`--global-view` trains the same model written on global arrays with explicit shardings and no
shard_map (the mesh's axes are `AxisType.Explicit`; the step runs under `jax.set_mesh`): each
block's `reshard(x, P("dp", None, None))` is the sequence all-gather and its row-parallel
matmul's `out_sharding=P("dp", "tp", None)` the reduce-scatter. `overlap` finds the same sites
there and runs each op in a shard_map over the mesh; the step's types are unchanged. On one
device there is nothing to gather and the plain path is kept.

Precision: on GPU, bf16 parameters and activations, f32 Adam moments and f32 update arithmetic
(no f32 master copy); on CPU, f32 throughout (`--dtype` overrides). Optimizer: AdamW in plain JAX.
Data: synthetic token sequences that mostly follow a fixed affine recurrence, so the loss falls.
Timing: wall time of each training step, one `block_until_ready` per step (a training loop's
real time, dispatch included); the step function is compiled before the first step.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # CPU: 8 virtual devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402
from ficco_jax.tuning import timing  # noqa: E402
from llama_block import PRESETS, Config, init_params, make_loss, param_specs  # noqa: E402


# ------------------------------------------------------------------------------------------------
# Optimizer: AdamW, f32 moments
# ------------------------------------------------------------------------------------------------
def adamw_init(params):
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
    return {"m": jax.tree.map(zeros, params), "v": jax.tree.map(zeros, params), "count": jnp.zeros((), jnp.int32)}


def adamw_update(params, grads, state, lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1):
    count = state["count"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(jnp.float32), state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)), state["v"], grads)
    c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)

    def step(path, p, m, v):
        decay = 0.0 if "norm" in jax.tree_util.keystr(path) else weight_decay  # none on norm weights
        p32 = p.astype(jnp.float32)
        return (p32 - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + decay * p32)).astype(p.dtype)

    return jax.tree_util.tree_map_with_path(step, params, m, v), {"m": m, "v": v, "count": count}


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
def synthetic_batch(cfg: Config, dp: int, step: int):
    """[global batch, seq + 1] tokens: next = (5 * token + 3) mod vocab, with 10% random tokens."""
    rng = np.random.default_rng([cfg.seed, step])
    n = cfg.batch * dp
    tokens = np.empty((n, cfg.seq + 1), np.int64)
    tokens[:, 0] = rng.integers(0, cfg.vocab, n)
    noise = rng.random((n, cfg.seq + 1)) < 0.1
    random_tokens = rng.integers(0, cfg.vocab, (n, cfg.seq + 1))
    for t in range(1, cfg.seq + 1):
        tokens[:, t] = np.where(noise[:, t], random_tokens[:, t], (5 * tokens[:, t - 1] + 3) % cfg.vocab)
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def fit_tp(cfg: Config, n_devices: int) -> int:
    """The tp to use when --tp is not given: the largest value up to the preset's that divides the
    device count and the model's sizes (1 always does: one device runs the plain model)."""
    def fits(tp):
        try:
            cfg.validate(tp)
        except ValueError:
            return False
        return n_devices % tp == 0
    return max(tp for tp in range(1, cfg.tp + 1) if fits(tp))


def make_mesh(cfg: Config) -> Mesh:
    devices = jax.devices()
    tp = cfg.tp
    if len(devices) % tp:
        raise ValueError(f"tp_transformer: tp={tp} must divide the device count {len(devices)}; pass --tp")
    # The global view states its shardings in the types: explicit axes. The shard_map view keeps
    # the Mesh default, as the user code it stands for was written against.
    axis_types = {"axis_types": (AxisType.Explicit,) * 2} if cfg.global_view else {}
    return Mesh(np.array(devices).reshape(len(devices) // tp, tp), ("dp", "tp"), **axis_types)


def mesh_context(cfg: Config, mesh: Mesh):
    """The global view's model names its shardings by PartitionSpec: it is traced under jax.set_mesh."""
    return jax.set_mesh(mesh) if cfg.global_view else contextlib.nullcontext()


@dataclasses.dataclass
class Trainer:
    """The compiled step and everything it is called with, for one mode (overlap on or off)."""
    cfg: Config
    mesh: Mesh
    step_fn: object  # compiled: (params, opt_state, inputs, targets) -> (params, opt_state, loss)
    grad_fn: object  # loss and gradients, overlapped or not
    shardings: dict


def build_trainer(cfg: Config, mesh: Mesh) -> Trainer:
    cfg.validate(mesh.shape["tp"])
    grad_fn = jax.value_and_grad(make_loss(cfg, mesh))
    if cfg.overlap and not cfg.comm_free:  # nothing to overlap without the collectives
        only = {} if cfg.overlap_ops is None else {"ops": cfg.overlap_ops}
        grad_fn = ficco_jax.overlap(grad_fn, schedule=cfg.schedule, **only)

    def train_step(params, opt_state, inputs, targets):
        loss, grads = grad_fn(params, inputs, targets)
        params, opt_state = adamw_update(params, grads, opt_state, cfg.lr)
        return params, opt_state, loss

    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    param_sh = jax.tree.map(named, param_specs(), is_leaf=lambda s: isinstance(s, P))
    opt_sh = {"m": param_sh, "v": param_sh, "count": named(P())}
    batch_sh = named(P("dp", "tp"))
    shardings = {"params": param_sh, "opt": opt_sh, "batch": batch_sh}
    params_abs = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.PRNGKey(0))
    opt_abs = jax.eval_shape(adamw_init, params_abs)
    with_sharding = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
    batch_abs = jax.ShapeDtypeStruct((cfg.batch * mesh.shape["dp"], cfg.seq), jnp.int32, sharding=batch_sh)
    abstract = (jax.tree.map(with_sharding, params_abs, param_sh), jax.tree.map(with_sharding, opt_abs, opt_sh),
                batch_abs, batch_abs)
    step_fn = jax.jit(train_step, in_shardings=(param_sh, opt_sh, batch_sh, batch_sh),
                      out_shardings=(param_sh, opt_sh, named(P())), donate_argnums=(0, 1))
    return Trainer(cfg, mesh, step_fn.lower(*abstract).compile(), grad_fn, shardings)


def init_state(trainer: Trainer):
    cfg, sh = trainer.cfg, trainer.shardings
    params = jax.jit(lambda k: init_params(cfg, k), out_shardings=sh["params"])(jax.random.PRNGKey(cfg.seed))
    return params, jax.jit(adamw_init, out_shardings=sh["opt"])(params)


def train(cfg: Config, mesh: Mesh | None = None, log=print) -> dict:
    """Train `cfg.steps` steps; returns {"losses", "step_s", "tokens_per_step", "report", "memory", "program"}
    (program: `step_program` of the compiled step)."""
    mesh = mesh or make_mesh(cfg)
    with mesh_context(cfg, mesh):
        return _train(cfg, mesh, log)


def _train(cfg: Config, mesh: Mesh, log) -> dict:
    trainer = build_trainer(cfg, mesh)
    mode = "comm-free bound" if cfg.comm_free else "overlap" if cfg.overlap else "no-overlap"
    params, opt_state = init_state(trainer)
    dp = mesh.shape["dp"]
    report = None
    if cfg.overlap and not cfg.comm_free:
        report = ficco_jax.explain(trainer.grad_fn, params, *synthetic_batch(cfg, dp, 0))
        log(f"[{mode}] ficco_jax.explain of the loss-and-gradient function:\n{report}")
    tokens_per_step = cfg.batch * dp * cfg.seq
    losses, times = [], []
    for step in range(cfg.steps):
        inputs, targets = (jax.device_put(a, trainer.shardings["batch"]) for a in synthetic_batch(cfg, dp, step))
        t0 = time.perf_counter()
        params, opt_state, loss = trainer.step_fn(params, opt_state, inputs, targets)
        loss = float(jax.block_until_ready(loss))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        log(f"[{mode}] step {step + 1}/{cfg.steps}  loss {loss:.6f}  {times[-1] * 1e3:9.2f} ms  "
            f"{tokens_per_step / times[-1]:12,.0f} tokens/s")
    return {"losses": losses, "step_s": times, "tokens_per_step": tokens_per_step, "report": report,
            "memory": trainer.step_fn.memory_analysis(), "program": step_program(trainer.step_fn)}


def step_program(compiled) -> str:
    """The compiled step's optimized HLO without what names only where the code was written (each
    instruction's metadata, the module's tables of source files, functions and stack frames): two
    modes that compile to the same text run the same program."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    source = re.compile(r"^\s*(FileNames|FunctionNames|FileLocations|StackFrames)\b|^\s*\d+ (\"|\{)")
    return "\n".join(line for line in text.splitlines() if not source.match(line))


# ------------------------------------------------------------------------------------------------
# Reporting: memory, matmul-only bound, comparison
# ------------------------------------------------------------------------------------------------
def steady_step_s(times) -> float:
    """Median step time, the first step left out when there are more (first-run allocation)."""
    return float(np.median(times[1:] if len(times) > 1 else times))


def matmul_flops_per_device(cfg: Config, tp: int) -> float:
    """Matmul FLOPs of one training step on one device: forward x 3 (x 4 for the layers with --remat)."""
    tokens, D, F, dh, S = cfg.batch * cfg.seq, cfg.hidden, cfg.ffn, cfg.head_dim, cfg.seq
    per_layer = 2 * tokens * D * (cfg.heads + 2 * cfg.kv_heads) * dh / tp  # QKV
    per_layer += 4 * cfg.batch * (cfg.heads / tp) * S * S * dh  # QK^T and PV, full square (the XLA path)
    per_layer += 2 * tokens * cfg.heads * dh * D / tp + 6 * tokens * D * F / tp  # O, gate/up, down
    head = 2 * tokens * D * cfg.vocab / tp
    return (3 + cfg.remat) * cfg.layers * per_layer + 3 * head


def gemm_rate(cfg: Config, tp: int) -> float:
    """FLOP/s of one device on the stack's largest matmul (gate/up), by ficco_jax.timing.device_time."""
    m, k, n = cfg.batch * cfg.seq, cfg.hidden, 2 * cfg.ffn // tp
    key_a, key_b = jax.random.split(jax.random.PRNGKey(1))
    dt = cfg.compute_dtype
    a, b = jax.random.normal(key_a, (m, k), dt), jax.random.normal(key_b, (k, n), dt)
    timed = timing.device_time(lambda r: jax.jit(timing.chain(jnp.matmul, r)), (a, b))
    return 2 * m * k * n / timed["median_s"]


def describe_memory(memory) -> str:
    if memory is None:
        return "XLA memory analysis: not available on this backend"
    gb = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"  # noqa: E731
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes
    return (f"XLA memory per device: arguments {gb(memory.argument_size_in_bytes)} (params + Adam + batch), "
            f"temporaries {gb(memory.temp_size_in_bytes)}, outputs not aliased to donated inputs "
            f"{gb(memory.output_size_in_bytes - memory.alias_size_in_bytes)}; total {gb(peak)}")


def print_comparison(plain: dict, over: dict, speedups: bool = True) -> None:
    """Losses and step times side by side; `speedups=False` (CPU, or tp=1 where there is nothing to
    overlap) prints n/a instead of a ratio of times that means nothing."""
    ratio = lambda t0, t1, digits: f"{t0 / t1:.{digits}f}x" if speedups else "n/a"  # noqa: E731
    print("\nstep  loss (no overlap)  loss (overlap)   rel diff   time no-overlap   time overlap   speedup")
    for i, (l0, l1, t0, t1) in enumerate(zip(plain["losses"], over["losses"], plain["step_s"], over["step_s"])):
        rel = abs(l1 - l0) / max(abs(l0), 1e-30)
        print(f"{i + 1:4d}  {l0:17.6f}  {l1:14.6f}  {rel:9.2e}  {t0 * 1e3:13.2f} ms  {t1 * 1e3:10.2f} ms  "
              f"{ratio(t0, t1, 2):>8}")
    t0, t1 = steady_step_s(plain["step_s"]), steady_step_s(over["step_s"])
    tokens = plain["tokens_per_step"]
    print(f"steady state (median, first step excluded): no-overlap {t0 * 1e3:.2f} ms ({tokens / t0:,.0f} tokens/s), "
          f"overlap {t1 * 1e3:.2f} ms ({tokens / t1:,.0f} tokens/s), speedup {ratio(t0, t1, 3)}")


def same_program_note(plain: dict, over: dict, platform: str) -> str:
    """Whether the two modes compiled to one program, and what a difference in their losses then means."""
    if plain["program"] != over["program"]:
        return ("overlap and no-overlap compiled to different programs (optimized HLO, source locations left out): "
                "their losses may differ by the rounding of those programs")
    note = "overlap and no-overlap compiled to the same program (optimized HLO, source locations left out)"
    if plain["losses"] == over["losses"]:
        return note + ", and gave the same losses"
    why = ("XLA's step on a GPU is not bit-reproducible: one compiled step run twice from the same start differs "
           "too (one H200, jax 0.11.2, 2026-12-03); XLA_FLAGS=--xla_gpu_deterministic_ops=true made the losses of "
           "both modes and of repeated runs identical there with --attention xla (with --attention cudnn that flag "
           "failed at run time)" if platform == "gpu" else f"the {platform} backend is not bit-reproducible here")
    return f"{note}; their losses differ in the last digits all the same: {why}"


def site_kinds(result: dict) -> list[str]:
    """The kinds of the sites an overlapped run rewrote (its explain report), each run alone by
    --per-site-kind."""
    return sorted({site.op for site in result["report"].sites})


def print_site_kinds(results: dict, plot: str | None, title: str) -> None:
    """Step time with no overlap, each site kind overlapped alone, every kind, and the comm-free bound
    where it was run; a bar chart in `plot` (PNG) if asked."""
    kinds = site_kinds(results[True])
    rows = [("no overlap", results[False])] + [(f"{kind} only", results[kind]) for kind in kinds] + \
        [("every site kind", results[True])] + ([("communication-free bound", results["comm-free"])]
                                                if "comm-free" in results else [])
    plain = steady_step_s(results[False]["step_s"])
    print("\noverlapped            ms/step   tokens/s   vs no overlap")
    for name, res in rows:
        t = steady_step_s(res["step_s"])
        print(f"{name:24s} {t * 1e3:8.2f} {res['tokens_per_step'] / t:10,.0f}   {plain / t:.3f}x")
    if jax.default_backend() == "cpu":
        print("(CPU times mean nothing)")
    if plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"--plot {plot}: matplotlib is not installed (pip install matplotlib); the table above has the "
                  "same numbers")
            return
        fig, ax = plt.subplots(figsize=(7, 3.2))
        names = [name for name, _ in rows]
        times = [steady_step_s(res["step_s"]) * 1e3 for _, res in rows]
        ax.barh(names[::-1], times[::-1], color="tab:blue")
        for y, t in enumerate(times[::-1]):
            ax.text(t, y, f" {t:.1f}", va="center", fontsize=8)
        ax.set_xlabel("ms per training step (median, first step excluded)")
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, max(times) * 1.15)
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
        print(f"plot written to {plot}")


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def parse_config(argv=None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                        help="rewrite the step with ficco_jax.overlap (default: on)")
    parser.add_argument("--compare", action="store_true", help="run without, then with overlap; print a table")
    parser.add_argument("--per-site-kind", action="store_true",
                        help="also run with each kind of site the overlapped run rewrote (e.g. all-gather -> "
                             "matmul, matmul -> reduce-scatter) overlapped alone and print step times per kind")
    parser.add_argument("--plot", metavar="PNG", help="with --per-site-kind: a bar chart of the step times "
                                                     "(needs matplotlib)")
    parser.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None, help="jax.checkpoint per layer")
    parser.add_argument("--bound", action=argparse.BooleanOptionalAction, default=True,
                        help="print the matmul-only bound (measures one GEMM)")
    parser.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                        help="layers as lax.scan (default) or a Python loop (default with --attention cudnn)")
    parser.add_argument("--global-view", action="store_true", default=None,
                        help="the model on global arrays with explicit shardings, no shard_map")
    parser.add_argument("--comm-free-bound", action="store_true",
                        help="also time the step with its sequence collectives replaced by local ops of the same "
                             "shapes: the fastest any overlap could make it (its losses are not the model's)")
    for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "seq", "batch", "steps", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    parser.add_argument("--tp", type=int, help="tensor-parallel group size (default: the preset's tp if it divides "
                                                "the device count, else the largest that does and fits the model)")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--schedule", help="schedule for every site: auto (default), autotune, or e.g. dma/direct/c4/s2")
    parser.add_argument("--attention", choices=("xla", "cudnn"),
                        help="jax.nn.dot_product_attention implementation (default xla). cudnn: flash attention; "
                             "its gradient inside a layer scan crashes XLA's compiler on 2+ GPUs (jax 0.11.2), so "
                             "the layers are unrolled unless --remat or --scan")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                 if getattr(args, f.name, None) is not None}
    return dataclasses.replace(PRESETS[args.preset], **overrides), args


def main(argv=None) -> None:
    cfg, args = parse_config(argv)
    if args.tp is None:  # the preset's tp where it fits these devices, else the largest that does
        cfg = dataclasses.replace(cfg, tp=fit_tp(cfg, jax.device_count()))
        if cfg.tp != PRESETS[args.preset].tp:
            print(f"tp={cfg.tp}: the preset's tp={PRESETS[args.preset].tp} does not fit {jax.device_count()} "
                  f"device(s) (--tp sets it)")
    mesh = make_mesh(cfg)
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    if tp == 1:
        print("tp=1: a group of one device has no collective to overlap; with overlap every site keeps the plain "
              "path, so the overlap mode runs the plain step" + (" (the two compiled programs are compared below)"
                                                                 if args.compare else ""))
    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(jax.eval_shape(lambda k: init_params(cfg, k),
                                                                               jax.random.PRNGKey(0))))
    print(f"tp_transformer ({args.preset}): {cfg.layers} layers, hidden {cfg.hidden}, ffn {cfg.ffn}, heads "
          f"{cfg.heads}/{cfg.kv_heads} kv, seq {cfg.seq}, batch {cfg.batch} x dp {dp}, {n_params / 1e6:,.1f}M params, "
          f"{cfg.compute_dtype.name}, remat {cfg.remat}, layers {'scanned' if cfg.scans_layers else 'unrolled'}, "
          f"{'global view (explicit shardings)' if cfg.global_view else 'shard_map view'}; "
          f"mesh dp={dp} x tp={tp} on "
          f"{jax.device_count()} x {jax.devices()[0].device_kind}")
    print("timing: wall time per training step, block_until_ready after each (dispatch included)")
    if args.plot and not args.per_site_kind:
        raise SystemExit("--plot draws the --per-site-kind step times: add --per-site-kind")
    modes = (False, True) if args.compare or args.per_site_kind else (cfg.overlap,)
    results = {mode: train(dataclasses.replace(cfg, overlap=mode), mesh) for mode in modes}
    if args.per_site_kind:
        for kind in site_kinds(results[True]):
            results[kind] = train(dataclasses.replace(cfg, overlap=True, overlap_ops=(kind,)), mesh)
    if args.comm_free_bound:
        # The global view writes no collective to remove: its bound is the shard_map view's step with
        # the communication taken out, the same matmuls, attention and optimizer.
        free = dataclasses.replace(cfg, overlap=False, comm_free=True, global_view=False)
        results["comm-free"] = train(free, make_mesh(free) if cfg.global_view else mesh)
    for mode, res in results.items():
        t = steady_step_s(res["step_s"])
        name = {True: "overlap", False: "no-overlap", "comm-free": "comm-free bound"}.get(mode, f"overlap {mode} only")
        print(f"{name}: {t * 1e3:.2f} ms/step, {res['tokens_per_step'] / t:,.0f} tokens/s "
              f"(median step, first step excluded); {describe_memory(res['memory'])}")
    if "comm-free" in results and False in results:
        free, plain = steady_step_s(results["comm-free"]["step_s"]), steady_step_s(results[False]["step_s"])
        print(f"communication-free step {free * 1e3:.2f} ms: {plain / free:.3f}x faster than without overlap, "
              f"about what hiding every sequence all-gather and reduce-scatter could gain (its local stand-ins "
              f"run on the SMs, so an overlap on copy engines can beat it)"
              + ("; CPU times mean nothing" if jax.default_backend() == "cpu" else ""))
        if True in results and plain > free:
            over = steady_step_s(results[True]["step_s"])
            print(f"overlap hides {(plain - over) / (plain - free):.0%} of the communication time that could be "
                  f"hidden: (no-overlap - overlap) / (no-overlap - communication-free)")
    if args.bound:
        flops = matmul_flops_per_device(cfg, tp)
        rate = gemm_rate(cfg, tp)
        print(f"matmul-only bound: {flops / 1e9:,.2f} GFLOP per device per step / {rate / 1e12:.3f} TFLOP/s "
              f"(one device, gate/up GEMM) = {flops / rate * 1e3:.2f} ms/step"
              + ("; CPU times mean nothing" if jax.default_backend() == "cpu" else ""))
    if args.compare:
        print_comparison(results[False], results[True], speedups=jax.default_backend() != "cpu" and tp > 1)
        if tp == 1:
            print(same_program_note(results[False], results[True], jax.default_backend()))
    if args.per_site_kind:
        print_site_kinds(results, args.plot, title=f"{args.preset}, tp={tp}, {jax.device_count()} x "
                                                   f"{jax.devices()[0].device_kind}")


if __name__ == "__main__":
    sys.exit(main())
