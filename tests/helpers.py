"""Shared test helpers: shard_map wrappers for the ops on 1-D and 2-D meshes, error metrics, and what
a compiled program holds (executor calls, what writes a copy-engine matmul's weight)."""
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings
from jax.sharding import NamedSharding, PartitionSpec as P

#: Tolerances by dtype: relative Frobenius error against a float32 reference of the same inputs.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}


def ffi_position(axis_name: str = "tp"):
    """The position operand a raw copy-engine FFI call takes first (xla_ffi/runtime/placement.h):
    the device's partition id, which on a one-axis mesh is its index along that axis."""
    return jax.lax.axis_index(axis_name).astype(jnp.uint32)


def examples(count: int) -> int:
    """A Hypothesis test's example count: `count` in the full tier, at most conftest.FAST_EXAMPLES in
    the fast one (the max_examples of the settings profile the tier loaded). Every Hypothesis test
    names its count through this, so the fast tier's cap is set in one place."""
    return min(count, settings().max_examples)


def runs_given(site, schedule: str) -> bool:
    """Whether an `explain` site runs the schedule given to overlap: as given, or with as many row
    chunks at a gather site where the schedule cuts a reduce-scatter's columns (Schedule.for_op)."""
    from ficco_jax import Schedule
    taken = Schedule.parse(schedule).for_op(site.op)
    return site.schedule == schedule if str(taken) == schedule else site.schedule.startswith(f"{taken} (given {schedule};")


def batch_axes(mesh):
    return tuple(a for a in mesh.axis_names if a != "tp")


def rows_spec(mesh):
    """Rows split over every mesh axis, tp fastest: the per-device row block of x / of the RS output."""
    return P((*batch_axes(mesh), "tp"), None)


def ag_specs(mesh):
    b = batch_axes(mesh) or None
    return (rows_spec(mesh), P(None, "tp")), P(b, "tp")


def rs_specs(mesh):
    b = batch_axes(mesh) or None
    return (P(b, "tp"), P("tp", None)), rows_spec(mesh)


def psum_specs(mesh):
    """matmul_psum: y and w as matmul_rs takes them; the sum replicated over tp (rows split over dp)."""
    b = batch_axes(mesh) or None
    return (P(b, "tp"), P("tp", None)), P(b, None)


def _jitted(mesh, body, specs, args):
    """(jit of shard_map(body), args placed by their in_specs)."""
    in_specs, out_specs = specs
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return f, [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]


def run_sharded(mesh, body, specs, *args):
    f, placed = _jitted(mesh, body, specs, args)
    return f(*placed)


@functools.cache
def operands_and_reference(mesh, reference, specs, shapes, dtype: str):
    """(inputs, reference result) shared by every case of a sweep that compares schedules: random
    inputs of the global `shapes` in `dtype` (the same for each (mesh, shapes, dtype)), and
    `reference` (the plain-JAX meaning, a function of the inputs alone) run by shard_map with `specs`
    (in_specs, out_specs) on those inputs in float32, so a bf16 result is compared with the exact
    product of its rounded inputs. Computed, and the reference compiled, once per distinct arguments:
    each case then compiles only its own program. `reference` must be the same object from case to
    case (a module-level function, not a lambda made per case)."""
    rng = np.random.default_rng(zlib.crc32(repr((mesh.shape, mesh.axis_names, shapes, dtype)).encode()))
    args = tuple(random(rng, shape, dtype) for shape in shapes)
    want = run_sharded(mesh, reference, specs, *[a.astype(jnp.float32) for a in args])
    return args, want


def mixed_precision_mlp(mesh):
    """shard_map of a bf16 MLP with f32 accumulation over the mesh's "tp" axis, as users write mixed
    precision: all_gather -> dot(preferred_element_type=f32) -> gelu -> bf16 -> dot -> psum_scatter."""
    def mlp(x, w1, w2):
        h = jnp.dot(jax.lax.all_gather(x, "tp", tiled=True), w1, preferred_element_type=jnp.float32)
        y = jnp.dot(jax.nn.gelu(h).astype(jnp.bfloat16), w2, preferred_element_type=jnp.float32)
        return jax.lax.psum_scatter(y, "tp", tiled=True)

    return jax.shard_map(mlp, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))


def random(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def max_rel_err(got, want):
    """max |got - want| / max |want|, in f32 (rel_err is the norm-wise one)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def global_shapes(op, mesh, m, k, n_cols):
    """Global (input, weight) shapes giving per-device x [m, K], w [K, N] (ag) or y [M=n*m, N], w [N, K]
    (rs, psum)."""
    tp = mesh.shape["tp"]
    dp = int(np.prod([mesh.shape[a] for a in batch_axes(mesh)])) if batch_axes(mesh) else 1
    if op == "ag_matmul":
        return (dp * tp * m, k), (k, tp * n_cols)
    return (dp * tp * m, tp * n_cols), (tp * n_cols, k)


def prefer_copy_engines(monkeypatch):
    """'auto' decides as on a GPU (over the comms that can run), with a stand-in for the cost model
    that takes copy engines wherever they are allowed (dma/direct/c1, else xla/ring/c1): on CPU the
    real model picks comm='none' for test-sized shapes, and the path under test would never run.
    Returns the list of (op, comms) the stand-in was asked about."""
    from ficco_jax.tuning import policy, select
    from ficco_jax.schedule import Schedule

    asked = []

    def select_schedule(op, shapes, dtype, axis_size, profile=None, comms=None, out_dtype=None):
        comms = tuple(comms or select.available_comms())
        asked.append((op, comms))
        return Schedule.parse("dma/direct/c1" if "dma" in comms else "xla/ring/c1")

    monkeypatch.setattr(policy, "MODEL_ON_CPU", True)
    monkeypatch.setattr(policy, "select_schedule", select_schedule)
    return asked


def lowered_text(mesh, body, specs, *args) -> str:
    """The StableHLO text run_sharded would compile (to check which custom calls a program holds)."""
    f, placed = _jitted(mesh, body, specs, args)
    return f.lower(*placed).as_text()


def ffi_calls(compiled_hlo: str) -> int:
    """The executor calls one run of a compiled program makes: its ficco custom calls, each counted
    once per iteration of every while loop around it (XLA's known trip count), so that a loop of
    one call per batch element counts as many calls as elements (every branch of a conditional
    counted)."""
    bodies, name, entry = {}, None, None
    for line in compiled_hlo.splitlines():
        head = re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name, bodies[head.group(2)] = head.group(2), []
            entry = name if head.group(1) else entry
        elif name is not None:
            bodies[name].append(line)

    def calls(computation: str) -> int:
        total = 0
        for line in bodies[computation]:
            total += 'custom_call_target="ficco_' in line
            trips = 1
            if " while(" in line:
                found = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                assert found, f"a while loop without a known trip count: {line[:200]}"
                trips = int(found.group(1))
            callees = re.findall(r"(?:body|calls|to_apply)=%([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                callees += re.findall(r"%([\w.\-]+)", group)
            total += trips * sum(calls(c) for c in callees)
        return total

    return calls(entry)


# ------------------------------------------------------------------------------------------------
# A compiled module's text: what writes each copy-engine matmul's w
# ------------------------------------------------------------------------------------------------
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<type>.+?) (?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)")


def _computations(hlo: str) -> dict:
    """computation name -> {instruction name: (match, line)} of an HLO module's text."""
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            current = comps.setdefault(head.group(1), {})
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current[m["name"]] = (m, line)
    return comps


def _layout(type_text: str) -> list[int]:
    return [int(d) for d in re.search(r"\{([\d,]*)\}", type_text).group(1).split(",") if d]


def _moves_bytes(m, line, comp) -> bool:
    """A copy, or a transpose whose result is not its operand's bytes in another order of dimensions."""
    if m["op"] == "copy":
        return True
    if m["op"] != "transpose":
        return False
    perm = [int(d) for d in re.search(r"dimensions=\{([\d,]*)\}", line).group(1).split(",")]
    source = comp[re.match(r"%([\w.\-]+)", m["args"]).group(1)][0]
    return [perm[d] for d in _layout(m["type"])] != _layout(source["type"])


def weight_writers(hlo: str) -> dict:
    """{(call, w_col_major): the lines that move bytes to write its w} for every copy-engine matmul
    call of a compiled module: its w operand followed back through bitcasts; a fusion that produces
    it contributes its copies and byte-moving transposes. [] where w is an argument (or a bitcast of
    one), as XLA's own dots read it."""
    comps = _computations(hlo)
    found = {}
    for comp in comps.values():
        for name, (m, line) in comp.items():
            target = re.search(r'custom_call_target="(ficco_\w*matmul\w*)"', line)
            if m["op"] != "custom-call" or not target:
                continue
            col_major = re.search(r"w_col_major = (\d)", line)
            col_major = int(col_major.group(1)) if col_major else 0
            # Operand 0 is the call's position (xla_ffi/runtime/placement.h), 1 the activation, 2 w.
            w = re.findall(r"%([\w.\-]+)", m["args"])[2]
            while comp[w][0]["op"] == "bitcast":
                w = re.match(r"%([\w.\-]+)", comp[w][0]["args"]).group(1)
            wm, wline = comp[w]
            if wm["op"] == "fusion":
                body = comps[re.search(r"calls=%([\w.\-]+)", wline).group(1)]
                moves = [ln.strip() for fm, ln in body.values() if _moves_bytes(fm, ln, body)]
            else:
                moves = [wline.strip()] if _moves_bytes(wm, wline, comp) else []
            found[(f"{target.group(1)} {name}", col_major)] = moves
    return found
