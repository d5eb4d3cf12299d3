"""Copy engines across the processes of one host: CUDA IPC (xla_ffi/runtime/ipc.h, docs/multiprocess.md).

A tensor-parallel group whose devices live in several processes of one host (one process per
GPU under ``jax.distributed``) runs ``comm="dma"`` through CUDA IPC. XLA's own allocations
cannot be exported (cuMemCreate ranges, not legacy-IPC capable), so each device copies what its
peers read into a staging buffer the extension allocates (cudaMalloc) and exports once per size;
the devices meet per call in a POSIX shared-memory mailbox on the host, and the peers' copy
engines pull from the staging buffers into their own XLA buffers. Opt-in
(`config.CROSS_PROCESS_DMA`); the multiprocess suite checks it on GPUs (docs/multiprocess.md).
This module is the Python side of it:

  * `supported()`: whether this build and platform have the IPC path (CUDA build, GPU backend);
  * `job_id()`: the id of this ``jax.distributed`` job and the random token that names its host
    mailbox (``/dev/shm/ficco_jax_<token>``, the same in every process), agreed once through its
    key-value store;
  * `close()`, `stats()`, `staging_info()`, `describe_pointer()`: teardown and diagnostics.

The CPU backend cannot share memory between processes this way: there, sites whose groups span
processes stay on XLA's collectives.
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading

import jax

from .. import config, jax_compat
from . import extension as _ext

log = logging.getLogger("ficco_jax")

_KV_KEY = "ficco_jax/ipc/job"
_lock = threading.Lock()
_job: int | None = None


def supported(platform: str | None = None) -> bool:
    """True if copy engines may reach other processes of this host: the CUDA build on GPUs, and
    the opt-in `config.CROSS_PROCESS_DMA` (FICCO_CROSS_PROCESS_DMA=1; docs/multiprocess.md)."""
    platform = platform or jax.default_backend()
    if not config.CROSS_PROCESS_DMA or platform != "gpu" or not _ext.cuda_built():
        return False
    return bool(_ext.build_info().get("ipc"))


def _propose() -> str:
    """A proposal for the job: "<job id>:<token>", a random positive 62-bit id (compiled programs
    carry it) and 128 random bits from the OS that name the host mailbox. The token is never
    derived from the id: the id is in every compiled program, so a name made from it could be
    guessed and created first by another user of the host."""
    return f"{secrets.randbits(62) | 1}:{os.urandom(16).hex()}"


def register(agreed: str) -> int:
    """Registers the host mailbox of the agreed proposal ("<job id>:<token>") in this process and
    returns the job id. Raises ValueError naming what is malformed."""
    from .. import _ffi

    job_text, _, token = agreed.partition(":")
    if not job_text.isdigit() or not token:
        raise ValueError(f"ficco_jax: the job's host-mailbox proposal {agreed!r} in the key-value store is not "
                         f"'<job id>:<token>'; another program wrote {_KV_KEY!r}")
    job = int(job_text)
    _ffi.ipc_register_mailbox(job, token, float(config.CROSS_PROCESS_FIRST_MEETING_S))
    return job


def job_id() -> int:
    """This job's id (a positive 62-bit int), equal in every process of the ``jax.distributed`` job.

    The first process to ask proposes an id and a random mailbox token through the key-value store;
    the store keeps the first proposal (set without overwrite), and every process reads that one
    back and registers the mailbox's name with the extension. Called at lowering time of the first
    copy-engine op whose group spans processes.
    """
    global _job
    with _lock:
        if _job is not None:
            return _job
        client = jax_compat.distributed_client()
        if client is None:
            raise RuntimeError(
                "ficco_jax: comm='dma' across processes needs jax.distributed.initialize(...) (its key-value "
                "store agrees on the host mailbox's name); found no distributed client")
        try:
            client.key_value_set(_KV_KEY, _propose())
        except Exception:  # noqa: BLE001 - another process proposed first (ALREADY_EXISTS): use theirs
            pass
        agreed = client.blocking_key_value_get(_KV_KEY, int(config.HOST_EXCHANGE_TIMEOUT_S * 1000))
        _job = register(agreed)
        from .. import _ffi

        atexit.register(_ffi.ipc_unlink)
        log.info("ficco_jax: copy engines across processes of this host; host mailbox /dev/shm%s",
                 _ffi.mailbox_name(_job))
        return _job


def close() -> int:
    """Tear down the IPC state of this process: wait for its devices, close every peer mapping and
    event it opened, free the staging buffers, unmap and unlink the host mailbox. Call after the last copy-engine op of
    every process has finished (e.g. after a barrier); later cross-process ops fail. Calls still
    running on other threads are waited for (60 s at most; if they do not end, nothing is unmapped
    and -1 is returned). Returns the number of mappings closed. Without it, process exit releases everything and an atexit hook
    removes the mailbox's name."""
    from .. import _ffi

    return int(_ffi.ipc_close())


def stats() -> list[dict]:
    """Per local device: staging buffers (``exported_allocations``: generations exported) and
    events exported / opened, mailbox exchanges so far, and the staging buffer's size
    (``staging_bytes``), generations and retired bytes (kept until `close`)."""
    from .. import _ffi

    return [dict(d) for d in _ffi.ipc_stats()]


def staging_info(device=None, nbytes: int = 0) -> dict:
    """The staging buffer of `device` (default: this process's first local device), grown to at
    least `nbytes`: ``base``, ``bytes``, ``buffer_id``, ``ipc_capable`` (legacy CUDA IPC can
    export it), ``generation``, ``retired_bytes`` and ``export_error`` ("" if
    ``cudaIpcGetMemHandle`` accepts it). Allocates it if needed, so call it between ops (the first
    step of the multiprocess suite, benchmarks/suites/multiprocess.py, does). Raises RuntimeError with the CUDA error otherwise."""
    from .. import _ffi

    device = device if device is not None else jax.local_devices()[0]
    return dict(_ffi.ipc_describe_staging(int(device.local_hardware_id), int(nbytes)))


def describe_pointer(array) -> dict:
    """How the allocation under a single-device jax.Array looks to CUDA IPC: base, size, offset,
    driver buffer id, and whether legacy CUDA IPC can export it. Diagnostics only: the IPC path
    never exports XLA's buffers (on the first GPU run none was exportable), it stages them."""
    from .. import _ffi

    return dict(_ffi.ipc_describe_pointer(int(array.unsafe_buffer_pointer())))
