"""Every threshold, limit and environment variable of ficco_jax, named and documented in one place.

Environment variables are read once, at import; change them before importing ficco_jax, or set the
module attributes directly (tests do).
"""
from __future__ import annotations

import os

import numpy as np


#: The longest wait a limit may name, seconds (the executor counts its deadlines in 64-bit nanoseconds),
#: and the shortest rendezvous timeout (the executor takes whole milliseconds).
MAX_LIMIT_S, MIN_RENDEZVOUS_TIMEOUT_S = 1e6, 1e-3


def _env_float(name: str, default: float, *, unit: str = "seconds", low: float = 0.0,
               high: float = MAX_LIMIT_S, whole: bool = False) -> float:
    """The number in environment variable `name` (`default` where unset or ""), within [low, high],
    and a whole number where `whole`."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high or (whole and value != int(value)):  # (NaN: refused too)
        kind = f"a whole number of {unit}" if whole else unit
        raise ValueError(f"{name}={raw!r}: expected {kind} from {low:g} to {high:g}; unset it for the default "
                         f"({default:g}), e.g. {name}={default:g}")
    return value


def _env_flag(name: str, default: bool) -> bool:
    """Environment variable `name` as a switch: 1/true/yes/on or 0/false/no/off (any case); unset or
    "" gives `default`."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off); unset it for the default "
                     f"({int(default)})")


#: Seconds a device waits in a host rendezvous for the other devices of its group before the call
#: fails with an error that names the op, the group and the missing ranks. The rendezvous happens
#: when the handlers enqueue work, not when the GPU runs it, so peers arrive within microseconds
#: of each other in a healthy program; 5 s only guards against a missing peer.
RENDEZVOUS_TIMEOUT_S: float = _env_float("FICCO_RENDEZVOUS_TIMEOUT_S", 5.0, low=MIN_RENDEZVOUS_TIMEOUT_S)

#: Seconds a copy-engine call's device work may take once it has started before the watchdog
#: (xla_ffi/runtime/watchdog.h) reports what the call waits for on stderr — the op, where it was
#: written, its schedule, device and rank, and each peer event not yet complete — and ends the
#: process, as NCCL's watchdog ends a PyTorch process: a device waiting for an event that never
#: completes cannot be recovered in-process, and the thread that would raise is blocked in XLA.
#: 0 turns the report off (the call then waits as long as it takes, e.g. under a debugger). Read
#: when an op is traced, like the rendezvous timeout.
WATCHDOG_S: float = _env_float("FICCO_WATCHDOG_S", 60.0)

#: Copy engines across the processes of one host (CUDA IPC through staging buffers, ipc.py,
#: docs/multiprocess.md) are opt-in: "1" enables them. Correct on 2 and 4 x H200; on 2 GPUs within
#: 5 % of one process; on 4 GPUs the best schedule of six timed cases -2 % to +7.5 % against one
#: process (2026-11-22, 2 and 4 x H200, BENCHMARKS.md).
#: Off: such groups use XLA's collectives (comm="xla") and an explicit comm="dma" there is a ValueError.
CROSS_PROCESS_DMA: bool = _env_flag("FICCO_CROSS_PROCESS_DMA", False)

#: Seconds the first meeting of each device's group across processes waits for its peers, at least
#: (later meetings wait RENDEZVOUS_TIMEOUT_S). Processes reach their first call as far apart as their
#: compile and start-up times differ — seconds to minutes — and a rank that gives up leaves its group
#: out of step for the rest of the job, so the first wait is long; later calls of one program meet
#: within microseconds.
CROSS_PROCESS_FIRST_MEETING_S: float = _env_float("FICCO_CROSS_PROCESS_FIRST_MEETING_S", 300.0)

#: Chunk counts (sub-shard decomposition factors) the design space enumerates.
CHUNK_CHOICES: tuple[int, ...] = (1, 2, 4, 8)

#: Copy-stream counts the design space enumerates for `comm="dma"` direct schedules.
COPY_STREAM_CHOICES: tuple[int, ...] = (1, 2, 4)

#: Transfer directions the design space enumerates for `comm="dma"` (Schedule.transfer): "pull"
#: only — on 2 x H200 pushes timed level with pulls (36 op/schedule pairs, median 1.3 % slower,
#: 2026-11-22; tp = 4 not measured); "push" and "symmetric" are always accepted where they are named
#: ("dma/direct/c2/push", "dma/direct/c1/symmetric").
TRANSFER_CHOICES: tuple[str, ...] = ("pull",)

#: The smallest block one peer sends (bytes) for which `ficco_jax.dma.*(..., schedule="auto")` uses
#: copy engines; below it, XLA's own collective (NCCL on GPUs). On 2 x H200 (2026-11-22) the
#: copy-engine all_gather took 2.06x and reduce_scatter 1.59x NCCL's time at 1 MiB per peer, about
#: 1.1x at 4 MiB and 0.8x at 16 MiB: copy engines pay from about 8 MiB.
DMA_COLLECTIVE_MIN_BYTES: int = 8 << 20

#: Off (0) by default. Otherwise the largest partials (bytes) a `matmul_rs` or `matmul_a2a` call of
#: an in-process group computes for its peers for which the call runs on its group's channel
#: (xla_ffi/runtime/channel.h): the partials are written into a region of device memory exchanged
#: once, and the copies are ordered by counters in pinned host memory that the devices set and wait
#: for, instead of a meeting of the group's handlers on the host at every call. Larger calls, pushes,
#: groups across processes and the other ops meet. Each group holds one region per device of at most
#: this size. Off because it has not been measured faster: on 2 x H100 (2026-11-27, a loop of
#: matmul_rs [1024, 1024] @ [1024, 1024] on dma/direct/c2) it took 107.8 against 153.2 us per call in
#: one run and 116.0 against 106.8 in another (docs/design.md, "Group channels"). Read when an op
#: is traced.
CHANNEL_BYTES: int = int(_env_float("FICCO_CHANNEL_BYTES", 0, unit="bytes", high=float(1 << 40), whole=True))

#: dtypes the DMA executor handles; others take the XLA path (`comm="xla"`).
DMA_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

#: FP8 operand dtypes of the scaled ops (`ag_matmul` / `matmul_rs` with `x_scale`, `w_scale`).
FP8_DTYPES: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")


def is_fp8(dtype) -> bool:
    """Whether `dtype` (a dtype, its name, or a scalar type) is one of FP8_DTYPES."""
    return np.dtype(dtype).name in FP8_DTYPES


def dma_results(operand_dtype) -> tuple[str, ...]:
    """The result dtypes the DMA executor's matmuls compute from operands of `operand_dtype`: FP8
    into any of DMA_DTYPES; bf16 / f16 into themselves or f32 (mixed precision); f32 into f32. A
    result narrower than its operands (f32 products rounded to bf16, JAX's backward of a
    mixed-precision matmul) is computed by `comm="xla"` / `"none"` only."""
    name = np.dtype(operand_dtype).name
    if is_fp8(name):
        return DMA_DTYPES
    return tuple(dict.fromkeys((name, "float32"))) if name in DMA_DTYPES else ()

#: This process's host id in a multi-process run (topology.py): processes with equal ids share a
#: host. Default (""): socket.gethostname(). Set it where host names do not identify machines
#: (containers with generated names on one machine, or one name reused across machines).
HOST_ID: str = os.environ.get("FICCO_HOST_ID", "")

#: Seconds a process waits for another process's host id in the jax.distributed key-value store
#: (read once, when an op site first spans processes). A process missing after that counts as
#: another host; the schedule is the same (comm="xla"), only the log line is less precise.
HOST_EXCHANGE_TIMEOUT_S: float = _env_float("FICCO_HOST_EXCHANGE_TIMEOUT_S", 30.0)

#: The commit stamped on benchmark results (report.git_commit) where no .git travels with the tree
#: (device runs: benchmarks/run.py sets it from the `.commit` file beside the carried tree).
#: Default (""): `git rev-parse` of the checkout.
COMMIT: str = os.environ.get("FICCO_COMMIT", "")

#: Where `schedule="autotune"` keeps its measured winners.
AUTOTUNE_CACHE_DIR: str = os.environ.get(
    "FICCO_AUTOTUNE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ficco_jax")
)

#: Seconds a process waits for another's lock on the autotune cache file before it gives up caching
#: its pick (with a warning; the pick is still used).
CACHE_LOCK_TIMEOUT_S: float = 30.0

#: GPUs that no shipped profile describes exactly (another GPU, another group size) get a cost
#: profile measured on first use — matmul rate, NCCL and copy-engine transfers, a copy-engine
#: call's fixed costs; tens of seconds, announced on stderr — cached per device kind and group size
#: in FICCO_PROFILE_CACHE (default: AUTOTUNE_CACHE_DIR/profiles). "0" skips the measurement: the
#: same GPU's profile of the nearest group size, else the conservative default.
PROFILE_MEASURE: bool = _env_flag("FICCO_PROFILE_MEASURE", True)
PROFILE_CACHE_DIR: str = os.environ.get("FICCO_PROFILE_CACHE", os.path.join(AUTOTUNE_CACHE_DIR, "profiles"))

#: Where the benchmark tools (`bench`, `accuracy`) keep JAX's persistent compilation cache, and in it
#: XLA's per-fusion autotuning results, so that a GEMM's autotuning (25-60 s for one FP8 dot on an
#: H100) is paid once per machine rather than once per run. "none" turns it off; `--xla-cache`
#: overrides it. A cache the user configured in JAX (`jax_compilation_cache_dir`) is kept.
XLA_CACHE_DIR: str = os.environ.get("FICCO_XLA_CACHE", os.path.join(AUTOTUNE_CACHE_DIR, "xla"))

#: Environment variables the compiled extension (xla_ffi/) reads itself, once, when first needed:
#: diagnostics, not settings. Python never reads them; they are listed here so that every variable
#: of ficco_jax is named in one place (a test checks the sources against this table). "Set" means
#: set to anything but "" or "0" unless stated.
NATIVE_ENVIRONMENT: dict[str, str] = {
    "FICCO_GEMM_LOG": "\"1\": one stderr line per new cuBLASLt plan of the executor (shape, candidates, the "
                      "chosen algorithm and its time), xla_ffi/device/gemm.cc",
    "FICCO_SEGV_TRACE": "set: on SIGSEGV/SIGABRT print the native stack before dying (xla_ffi/module.cc)",
}
