"""What `schedule="auto"` and `"autotune"` resolve to at trace time: the candidates that can run
this call (copy engines only where they reach every peer and handle the dtype), then the cost
model's pick or the measured one."""
from __future__ import annotations

import logging
from typing import Callable

import jax
import numpy as np

from .. import config
from ..runtime import extension
from ..schedule import A2A_OPS, Schedule
from .autotune import autotune_schedule
from .select import available_comms, dma_reaches, select_schedule

log = logging.getLogger("ficco_jax")


#: On CPU "auto" means no overlap (host collectives are memcpys). Tests set this to run the GPU
#: decision (cost model over every comm kind that can run) on CPU devices.
MODEL_ON_CPU = False


def plain_path_reason(axis_size: int) -> str:
    """Why "auto" keeps the plain path before any model is asked, or "" where it asks one."""
    if axis_size == 1:
        # Any overlap schedule only adds work to a group with nothing to communicate.
        return "group of one device, nothing to communicate"
    if jax.default_backend() == "cpu" and not MODEL_ON_CPU:
        # Host "collectives" are memcpys that block the host thread: nothing to overlap.
        return ("CPU — auto keeps the plain path on CPU (host collectives are memcpys); "
                "pass schedule=... to force one")
    return ""


def choose(op: str, shapes, dtype, axis_size: int, *, autotune: bool = False, topology=None,
           measure: Callable | None = None, out_dtype=None) -> Schedule:
    """What `schedule="auto"` / `"autotune"` resolve to at trace time.

    The candidates are only schedules that can run this call: `comm="dma"` is left out where the
    peers are not all in this process (`topology`) or the executor lacks the dtype, with a log
    line saying why, so the pick never needs correcting afterwards.
    """
    if plain_path_reason(axis_size):
        return Schedule(comm="none")
    comms, why_not_dma = allowed_comms(dtype, topology, out_dtype)
    if autotune and op in A2A_OPS:
        log.info("%s: schedule='autotune' is not implemented for the expert-parallel ops; using 'auto'", op)
        autotune = False
    chosen = (autotune_schedule(op, shapes, dtype, axis_size, comms=comms, measure=measure, out_dtype=out_dtype)
              if autotune
              else select_schedule(op, shapes, dtype, axis_size, comms=comms, out_dtype=out_dtype))
    if why_not_dma:
        log.info("ficco_jax %s %s over axis %r: %s, so %s (XLA's collectives)", op, shapes,
                 getattr(topology, "axis_name", None), why_not_dma, chosen)
    return chosen


def allowed_comms(dtype, topology=None, out_dtype=None) -> tuple[tuple[str, ...], str]:
    """(comm kinds that can run a call of `dtype` operands with `out_dtype` results (None: `dtype`)
    whose peers are `topology`, why dma is not among them or "" when it is, or when the extension
    is simply not built)."""
    comms = available_comms(topology=topology)
    if not dma_reaches(topology):
        return comms, f"{topology.why_not_in_process()}; comm='dma' cannot reach every peer from here"
    name = np.dtype(dtype).name
    handled = config.DMA_DTYPES + config.FP8_DTYPES  # FP8: the scaled TP ops
    if "dma" in comms and name not in handled:
        return tuple(c for c in comms if c != "dma"), f"comm='dma' handles dtypes {handled}, not {name}"
    if "dma" in comms and config.is_fp8(name) and not extension.fp8_matmuls_supported():
        return tuple(c for c in comms if c != "dma"), "these GPUs have no FP8 tensor cores for the executor's matmuls"
    out = np.dtype(out_dtype or dtype).name
    if "dma" in comms and out not in config.dma_results(name):
        return (tuple(c for c in comms if c != "dma"),
                f"comm='dma' computes {name} operands into {config.dma_results(name)}, not {out}")
    if "dma" in comms and name == "float32" and jax.default_backend() == "gpu" and not _f32_dots_in_f32():
        return (tuple(c for c in comms if c != "dma"),
                "under jax's default matmul precision XLA computes float32 dots with TF32 tensor cores, the "
                "copy-engine executor in full float32 (several times slower); "
                "jax.config.update('jax_default_matmul_precision', 'float32') lets auto use copy engines here")
    return comms, ""


def _f32_dots_in_f32() -> bool:
    """Whether XLA computes this program's float32 dots in full float32, as the executor's matmuls do
    (jax_default_matmul_precision 'highest' / 'float32'); by default it uses TF32 on GPUs."""
    precision = str(jax.config.jax_default_matmul_precision or "").lower()
    return precision in ("highest", "float32", "f32_f32_f32", "precision.highest")
