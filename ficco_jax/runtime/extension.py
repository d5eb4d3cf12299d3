"""Loads the compiled extension `ficco_jax._ffi` and registers its XLA FFI targets with jax.

The extension holds the DMA executor (xla_ffi/): one FFI target per op, each built for the
"cpu" platform and, when CUDA was found at build time, for "CUDA". Importing this module
registers every target once; `available()` says whether that worked.
"""
from __future__ import annotations

import jax

#: The extension version this Python package expects (CMakeLists.txt's project VERSION).
EXPECTED_VERSION = "0.1.0"
#: The version of the contract between the lowering and the extension's handlers: the operands (the
#: call's position first) and the attributes of every call (xla_ffi/ffi/contract.h, kContractVersion).
#: Every call carries it (attribute `ficco_abi`), so a program lowered by another version, e.g. a
#: `jax.export` artifact, is refused by name; raise both constants whenever a target's operands or
#: attributes change.
CONTRACT_VERSION = 2
#: Keys of `build_info()` that sources of this version report: one missing means a build from older
#: sources of the same version (e.g. without the `<target>_symmetric` forms of transfer="symmetric").
REQUIRED_CAPABILITIES = ("symmetric", "placement")

_REBUILD_HINT = (
    "rebuild it from the repository root with `pip install --no-build-isolation -e .` "
    "(or `pip install .`); set FICCO_CUDA=ON to insist on the CUDA backend"
)

_registered = False
_module = None  # ficco_jax._ffi, once loaded
_build_info: dict | None = None
_import_error: ImportError | None = None


def _register(name: str, platform: str, handler) -> None:
    """One target on one platform: a capsule (its execute stage), or a bundle of stages with the
    trait bits XLA applies to it (the `<target>_symmetric` forms on CUDA: command-buffer compatible,
    with an initialize stage that numbers the launches)."""
    if isinstance(handler, dict):
        stages = dict(handler)
        traits = int(stages.pop("traits", 0))
        jax.ffi.register_ffi_target(name, stages, platform=platform, traits=traits)
    else:
        jax.ffi.register_ffi_target(name, handler, platform=platform)


def _load() -> dict:
    """Import `_ffi`, check its version and register its targets (once)."""
    global _registered, _module, _build_info
    try:
        from .. import _ffi
    except ImportError as exc:
        raise ImportError(f"ficco_jax: the compiled extension ficco_jax._ffi is missing ({exc}); {_REBUILD_HINT}") from exc
    info = dict(_ffi.build_info())
    if info.get("version") != EXPECTED_VERSION:
        raise ImportError(
            f"ficco_jax: the compiled extension is stale: version {info.get('version')!r}, "
            f"expected {EXPECTED_VERSION!r}; {_REBUILD_HINT}"
        )
    missing = [key for key in REQUIRED_CAPABILITIES if key not in info]
    if missing:
        raise ImportError(f"ficco_jax: the compiled extension is stale: it lacks {', '.join(missing)} "
                          f"(built from older sources); {_REBUILD_HINT}")
    if info.get("contract") != CONTRACT_VERSION:
        raise ImportError(f"ficco_jax: the compiled extension follows call contract {info.get('contract')!r}, "
                          f"this package lowers calls of contract {CONTRACT_VERSION}; {_REBUILD_HINT}")
    if not _registered:
        for name, registration in _ffi.types().items():  # the targets' state: before the targets
            for platform in _ffi.registrations()["ficco_all_gather"]:
                jax.ffi.register_ffi_type(name, registration, platform=platform)
        for name, platforms in _ffi.registrations().items():
            for platform, handler in platforms.items():
                _register(name, platform, handler)
        _registered = True
    _module, _build_info = _ffi, info
    return info


def contract() -> dict:
    """The extension's side of the call contract (xla_ffi/ffi/attrs.h): {"version", "attributes" and
    "probe_attributes" (every target's attribute names, in order), "order", "gemm", "transfer" (name ->
    the code the attributes carry)}. The lowering writes the codes from here, never its own."""
    ensure_loaded()
    return _module.contract()


def target_names() -> list[str]:
    """The names of every FFI target the extension registers (each op's, and its `_symmetric` form)."""
    ensure_loaded()
    return sorted(_module.registrations())


def export_disabled_checks() -> list:
    """What `jax.export.export(..., disabled_checks=...)` needs to export a program that calls
    ficco_jax: one `DisabledSafetyCheck.custom_call` per target of the extension (jax.export refuses
    custom calls it does not know to be stable). The process that loads the artifact must import
    ficco_jax first, which registers the targets; each call carries the version of the contract it
    was lowered for (CONTRACT_VERSION), and an extension of another contract refuses it by name."""
    from jax.export import DisabledSafetyCheck

    return [DisabledSafetyCheck.custom_call(name) for name in target_names()]


def register_local_devices(job: int) -> None:
    """Tell the extension the global id of each of this process's devices (by the ordinal its calls
    see) and the jax.distributed job (runtime/ipc.job_id) it is in: the members of a group across
    processes post these ids to each other (xla_ffi/runtime/placement.h)."""
    ensure_loaded()
    _module.set_device_ids({int(d.local_hardware_id): int(d.id) for d in jax.local_devices()}, int(job))


def ensure_loaded() -> dict:
    """The extension's build info; raises ImportError (with the rebuild command) if unusable."""
    if _build_info is not None:
        return _build_info
    if _import_error is not None:
        raise _import_error
    return _load()


def available() -> bool:
    """True if the extension is built, current, and its targets are registered."""
    try:
        ensure_loaded()
    except ImportError:
        return False
    return True


def cuda_built() -> bool:
    """True if the extension was built with its CUDA backend."""
    return available() and bool(_build_info and _build_info.get("cuda"))


def build_info() -> dict:
    return dict(ensure_loaded())


def testing():
    """`ficco_jax._ffi.testing`, the extension's test-only entry points (the library never calls
    them): `inject_fault(spec)` arms a fault for every later copy-engine call of this process
    ("skip:<rank>", "fail:<rank>", "stall:<rank>"; "" disarms it: xla_ffi/testing/faults.h), and
    `mailbox_exchange(...)` runs the host mailbox's protocol with plain integers."""
    ensure_loaded()
    return _module.testing


try:
    _load()
except ImportError as _exc:  # remembered; raised again by ensure_loaded() when an op needs it
    _import_error = _exc


#: The first compute capability with FP8 tensor cores (Ada; Hopper is 9.0).
FP8_MIN_CAPABILITY = (8, 9)


def fp8_matmuls_supported(platform: str | None = None) -> bool:
    """Whether the executor's FP8 matmuls run here: always on CPU (reference loops); on GPUs, where
    every local device has FP8 tensor cores (compute capability 8.9 or newer, as cuBLASLt needs)."""
    platform = platform or jax.default_backend()
    if platform != "gpu":
        return platform == "cpu"
    for device in jax.local_devices():
        capability = getattr(device, "compute_capability", None)
        if capability is None or tuple(int(p) for p in str(capability).split(".")[:2]) < FP8_MIN_CAPABILITY:
            return False
    return True
