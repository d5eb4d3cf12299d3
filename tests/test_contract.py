"""The contract between the lowering and the extension's handlers, checked from both sides: the
attributes Python writes are exactly the ones the C++ structs decode (xla_ffi/ffi/attrs.h lists them
once), the codes of the schedule's fields come from the extension, and the contract's version is the
one both sides name. A change on one side alone fails here, not at a user's first call."""
import re

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import ficco_jax
from ficco_jax import schedule
from ficco_jax.lowering.dma import probe
from ficco_jax.runtime import extension


def _attribute_names(mlir_text: str, target: str) -> list[str]:
    """The attribute names of the first custom call of `target` in lowered StableHLO text."""
    line = next(line for line in mlir_text.splitlines() if f'@{target}(' in line or f'"{target}"' in line)
    config = re.search(r"mhlo.backend_config = \{(.*?)\}", line).group(1)
    return re.findall(r"(\w+) = ", config)


def _lowered(fn, *args, mesh):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    return f.lower(*args).as_text()


def test_every_target_is_lowered_with_exactly_the_attributes_its_handler_decodes():
    contract = extension.contract()
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    x = np.zeros((16, 8), np.float32)
    text = _lowered(lambda a: ficco_jax.dma.all_gather(a, "tp", schedule="dma/direct/c2"), x, mesh=mesh)
    assert sorted(_attribute_names(text, "ficco_all_gather")) == sorted(contract["attributes"])
    text = _lowered(lambda a: probe.matmuls_beside_pulls(a, np.ones((8, 8), np.float32), a, "tp", repeats=1,
                                                         pull=True), x, mesh=mesh)
    assert sorted(_attribute_names(text, "ficco_contention_probe")) == sorted(contract["probe_attributes"])


def test_the_codes_of_the_schedule_fields_cover_the_design_space():
    contract = extension.contract()
    assert set(contract["gemm"]) == set(schedule.GEMMS)
    assert set(contract["transfer"]) == set(schedule.TRANSFERS)
    dma_orders = {s.order for op in schedule.OPS for s in schedule.Schedule.enumerate(op, 4, ("dma",))}
    assert dma_orders <= set(contract["order"])
    assert len(set(contract["order"].values())) == len(contract["order"])  # distinct codes


def test_both_sides_name_one_contract_version():
    assert extension.contract()["version"] == extension.CONTRACT_VERSION == extension.build_info()["contract"]
