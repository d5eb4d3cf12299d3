"""PyTorch peers of ag_matmul and matmul_rs: sequential NCCL + cuBLAS, and async-TP.

    python3 -m torch.distributed.run --nproc-per-node=N benchmarks/peers/torch_tp.py [--shape S] [--out DIR]
        [--dtype bf16|fp8]

One process per GPU. Per shape (M, K, N), bf16, every rank:
  ag_seq        all_gather_into_tensor(x[M/n, K]) then full[M, K] @ w[K, N/n]
  ag_async_tp   torch.ops.symm_mem.fused_all_gather_matmul (symmetric memory; copy engines move
                the shards while the matmul runs, one shard at a time)
  rs_seq        y[M, N/n] @ w[N/n, K] then reduce_scatter_tensor
  rs_async_tp   torch.ops.symm_mem.fused_matmul_reduce_scatter
  gemm_only     the full [M, K] @ [K, N/n] alone (the bound of AG+GEMM when the gather hides)
  ag_only / rs_only   the NCCL collective alone
With --dtype fp8 the operands are e4m3 with per-tensor scales and the results bf16 (FP8 recipes' form):
the matmuls are torch._scaled_mm (fast accumulation), the gathers move the FP8 shard, the reduce-scatters
the bf16 partials, and async-TP is torch.ops.symm_mem.fused_all_gather_scaled_matmul and
fused_scaled_matmul_reduce_scatter (called by their schema's argument names, which differ between torch
versions); rank 0 writes torch_tp_fp8.{json,md}.
Each async-TP result is compared with its sequential twin (relative Frobenius error) before it
is timed. Times: CUDA events around `--iters` back-to-back calls after `--warmup` calls, median of
`--rounds` such rounds, the slowest rank's (all_reduce MAX). Rank 0 writes DIR/torch_tp.json and
torch_tp.md and prints the table last. Without torch, CUDA, or as many GPUs as processes, it
says why and exits 0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402

# NVLink multicast stays off (as benchmarks/run.py sets for every suite), also when this script is
# started on its own: on GPUs that others share, a program using it can put them out of service.
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

NAME = "torch_tp"
METHOD = ("CUDA events around ITERS back-to-back calls after WARMUP calls; median of ROUNDS rounds; "
          "the slowest rank's time (all_reduce MAX)")
COLUMNS = ["gemm_only", "ag_only", "ag_seq", "ag_async_tp", "rs_only", "rs_seq", "rs_async_tp"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="M,K,N, a shape name, or a set: anchors, llama405b, tiny")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "out/peers"))
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    args = parser.parse_args(argv)
    if min(args.iters, args.rounds) < 1 or args.warmup < 0:
        parser.error(f"--iters {args.iters}, --rounds {args.rounds}, --warmup {args.warmup}: time at least one "
                     f"iteration in at least one round (--iters, --rounds >= 1; --warmup >= 0)")
    return args


def why_not(torch) -> str | None:
    """None where this process can run, else the reason it cannot."""
    if "WORLD_SIZE" not in os.environ:
        return "not launched by torch.distributed.run (python3 -m torch.distributed.run --nproc-per-node=N ...)"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        return f"{torch.cuda.device_count()} GPUs for {world} processes"
    if world < 2:
        return "one process: a tensor-parallel layer needs 2 or more GPUs"
    return None


class Peer:
    """One rank's view: the process group, its symmetric-memory group, and a timer."""

    def __init__(self, torch, dist):
        self.torch, self.dist = torch, dist
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank)))
        dist.init_process_group("nccl")
        self.group = dist.group.WORLD.group_name
        self.symm_error = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            symm_mem.enable_symm_mem_for_group(self.group)
        except Exception as exc:  # noqa: BLE001 - async-TP is reported as unavailable, the rest runs
            self.symm_error = f"{type(exc).__name__}: {str(exc)[:200]}"

    def time_ms(self, fn, args) -> float:
        torch = self.torch
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        self.dist.barrier()
        rounds = []
        for _ in range(args.rounds):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                fn()
            stop.record()
            stop.synchronize()
            rounds.append(start.elapsed_time(stop) / args.iters)
        t = torch.tensor([statistics.median(rounds)], device="cuda")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def rel_err(self, got, want) -> float:
        got, want = got.float(), want.float()
        return float((got - want).norm() / want.norm().clamp_min(1e-30))


def buffer_shapes(M: int, K: int, N: int, n: int) -> dict[str, tuple[int, int]]:
    """Each rank's tensors for one layer (M, K, N) over n ranks:
      AG: gathered[M, K] = all_gather(x[M/n, K]);  gathered @ w[K, N/n]
      RS: partials[M, K] = y[M, N/n] @ w2[N/n, K]; scattered[M/n, K] = reduce_scatter(partials)
    rs_only reduce-scatters `partials`, the product's shape (NCCL's reduce_scatter_tensor needs an
    input n times its output: y [M, N/n] fits only where N/n = K)."""
    return {"x": (M // n, K), "w": (K, N // n), "gathered": (M, K),
            "y": (M, N // n), "w2": (N // n, K), "partials": (M, K), "scattered": (M // n, K)}


def variants(peer, M, K, N):
    """{name: zero-argument callable} for one shape, on fresh random bf16 inputs of this rank."""
    torch, dist, n = peer.torch, peer.dist, peer.world
    shapes = buffer_shapes(M, K, N, n)
    gen = torch.Generator(device="cuda").manual_seed(1000 + peer.rank)
    rand = lambda name, scale=1.0: torch.randn(*shapes[name], device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                               generator=gen) * scale
    empty = lambda name: torch.empty(*shapes[name], device="cuda", dtype=torch.bfloat16)  # noqa: E731
    x, w = rand("x"), rand("w", scale=K ** -0.5)
    y, w2 = rand("y"), rand("w2", scale=(N // n) ** -0.5)
    gathered, partials, scattered = empty("gathered"), y @ w2, empty("scattered")
    ops = torch.ops.symm_mem

    def ag_seq():
        dist.all_gather_into_tensor(gathered, x)
        return gathered @ w

    def rs_seq():
        dist.reduce_scatter_tensor(scattered, y @ w2)
        return scattered

    return {
        "gemm_only": lambda: gathered @ w,
        "ag_only": lambda: dist.all_gather_into_tensor(gathered, x),
        "ag_seq": ag_seq,
        "ag_async_tp": lambda: ops.fused_all_gather_matmul(x, [w], gather_dim=0, group_name=peer.group)[1][0],
        "rs_only": lambda: dist.reduce_scatter_tensor(scattered, partials),
        "rs_seq": rs_seq,
        "rs_async_tp": lambda: ops.fused_matmul_reduce_scatter(y, w2, "sum", scatter_dim=0, group_name=peer.group),
    }


def schema_call(op, **values):
    """Call the torch op `op` with the arguments its schema names, taken from `values`: torch versions
    name, order and default them differently (fused_scaled_matmul_reduce_scatter gained
    orig_scatter_dim and output_shape). A required argument `values` lacks is a TypeError naming it."""
    arguments = op.default._schema.arguments
    optional = lambda a: a.has_default_value() or "Optional" in str(a.type) or str(a.type).endswith("?")  # noqa: E731
    missing = [a.name for a in arguments if a.name not in values and not optional(a)]
    if missing:
        raise TypeError(f"{op}: this torch's schema needs {missing}, which this peer does not pass")
    return op(**{a.name: values[a.name] for a in arguments if a.name in values})


def fp8_variants(peer, M, K, N):
    """The variants of `variants` with e4m3 operands and per-tensor scales, bf16 results."""
    torch, dist, n = peer.torch, peer.dist, peer.world
    shapes = buffer_shapes(M, K, N, n)
    gen = torch.Generator(device="cuda").manual_seed(1000 + peer.rank)
    f8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    rand8 = lambda name: torch.randn(*shapes[name], device="cuda", dtype=bf16, generator=gen).to(f8)  # noqa: E731
    scale = lambda v: torch.tensor(v, device="cuda", dtype=torch.float32)  # noqa: E731
    x8, y8 = rand8("x"), rand8("y")
    w8, w2_8 = rand8("w").t().contiguous().t(), rand8("w2").t().contiguous().t()  # column-major, as _scaled_mm takes
    one, w_scale, w2_scale = scale(1.0), scale(K ** -0.5), scale((N // n) ** -0.5)
    gathered8 = torch.empty(*shapes["gathered"], device="cuda", dtype=f8)
    scattered = torch.empty(*shapes["scattered"], device="cuda", dtype=bf16)

    def mm(a, b, b_scale):
        return torch._scaled_mm(a, b, scale_a=one, scale_b=b_scale, out_dtype=bf16, use_fast_accum=True)

    partials = mm(y8, w2_8, w2_scale)
    gather = lambda: dist.all_gather_into_tensor(gathered8.view(torch.uint8), x8.view(torch.uint8))  # noqa: E731

    def ag_seq():
        gather()
        return mm(gathered8, w8, w_scale)

    def rs_seq():
        dist.reduce_scatter_tensor(scattered, mm(y8, w2_8, w2_scale))
        return scattered

    ops = torch.ops.symm_mem
    return {
        "gemm_only": lambda: mm(gathered8, w8, w_scale),
        "ag_only": gather,
        "ag_seq": ag_seq,
        "ag_async_tp": lambda: schema_call(
            ops.fused_all_gather_scaled_matmul, A=x8, A_shard=x8, Bs=[w8], A_scale=one, B_scales=[w_scale],
            gather_dim=0, group_name=peer.group, biases=[None], result_scales=[None], out_dtypes=[bf16],
            use_fast_accum=[True])[1][0],
        "rs_only": lambda: dist.reduce_scatter_tensor(scattered, partials),
        "rs_seq": rs_seq,
        "rs_async_tp": lambda: schema_call(
            ops.fused_scaled_matmul_reduce_scatter, A=y8, B=w2_8, A_scale=one, B_scale=w2_scale, reduce_op="sum",
            scatter_dim=0, orig_scatter_dim=0, scatter_dim_after_maybe_reshape=0, group_name=peer.group,
            output_shape=[M, K], out_dtype=bf16, use_fast_accum=True),
    }


def measure_shape(peer, name, dims, args) -> dict:
    row = {"shape": name, "M": dims[0], "K": dims[1], "N": dims[2], "n": peer.world}
    fns = (fp8_variants if args.dtype == "fp8" else variants)(peer, *dims)
    for fused, seq in (("ag_async_tp", "ag_seq"), ("rs_async_tp", "rs_seq")):
        if peer.symm_error:
            row[fused] = None
            row[f"{fused}_error"] = peer.symm_error
            continue
        try:
            want = fns[seq]().clone()
            row[f"{fused}_rel_err"] = peer.rel_err(fns[fused](), want)
        except Exception as exc:  # noqa: BLE001 - recorded; the sequential variants still run
            row[fused], row[f"{fused}_error"] = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    for key in COLUMNS:
        if f"{key}_error" not in row:
            row[key] = peer.time_ms(fns[key], args)
    if peer.rank == 0:
        print(f"[{NAME}] {name}: " + ", ".join(f"{k} {row[k]:.3f}" for k in COLUMNS if row.get(k) is not None),
              file=sys.stderr, flush=True)
    return row


def main() -> int:
    args = parse_args()
    name = NAME + ("_fp8" if args.dtype == "fp8" else "")
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return shapes.skipped(args.out, name, "torch is not installed")
    reason = why_not(torch)
    if reason:
        return shapes.skipped(args.out, name, reason) if int(os.environ.get("RANK", "0")) == 0 else 0
    peer = Peer(torch, dist)
    wanted = shapes.parse(args.shape)
    rows = [measure_shape(peer, name, dims, args) for name, dims in wanted.items()
            if shapes.divisible(dims, peer.world)]
    if peer.rank == 0:
        dtype = "float8_e4m3fn operands, per-tensor scales, bfloat16 results" if args.dtype == "fp8" else "bfloat16"
        result = {"peer": "pytorch", "torch": torch.__version__, "n": peer.world, "dtype": dtype,
                  "device": torch.cuda.get_device_name(), "method": METHOD.replace("ITERS", str(args.iters))
                  .replace("WARMUP", str(args.warmup)).replace("ROUNDS", str(args.rounds)),
                  "commit": os.environ.get("FICCO_COMMIT"), "async_tp_error": peer.symm_error, "rows": rows}
        table = shapes.markdown(rows, COLUMNS, f"PyTorch on {peer.world} x {result['device']}, {args.dtype}, ms ({name})")
        shapes.write(args.out, name, result, table)
        print(table, flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
