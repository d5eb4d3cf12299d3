"""What every GPU test module shares: the visible CUDA GPUs, the marks that skip without them, and
what a compiled program runs on copy engines."""
import re

import jax
import pytest

from ficco_jax.runtime import extension as _ext


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpus()
#: pytestmark of a GPU test module: skips cleanly on machines without >= 2 GPUs or a CUDA build.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(GPUS) < 2, reason="needs >= 2 CUDA GPUs"),
    pytest.mark.skipif(not _ext.cuda_built(), reason="ficco_jax._ffi was built without CUDA"),
]
#: The same for a module that needs one GPU only (test_shared_gpu.py: two processes share it).
ONE_GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(GPUS) < 1, reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _ext.cuda_built(), reason="ficco_jax._ffi was built without CUDA"),
]


def copy_engine_targets(jitted, *args) -> set[str]:
    """The extension's FFI targets in the compiled program of `jitted` (a jax.jit) on `args`: a test
    of a copy-engine path asserts it is there, so that a silent fallback to XLA's path fails it."""
    return set(re.findall(r'custom_call_target="(ficco_\w+)"', jitted.lower(*args).compile().as_text()))
