"""The named layer shapes live in one file, ficco_jax/tools/anchor_shapes.json: every reader (bench
and its CLI, the peers' scripts, the multiprocess suite) gives the same names and values, and no
Python file of the package or the benchmarks types an anchor shape again."""
import json
import pathlib
import re
import sys

from ficco_jax.tools import bench, cli

REPO = pathlib.Path(__file__).resolve().parents[1]
FILE = REPO / "ficco_jax" / "tools" / "anchor_shapes.json"


def _file_sets() -> dict:
    sets = json.loads(FILE.read_text())["sets"]
    return {name: {shape: tuple(dims) for shape, dims in group["shapes"].items()} for name, group in sets.items()}


def _import(folder: str, module: str):
    sys.path.insert(0, str(REPO / folder))
    try:
        return __import__(module)
    finally:
        sys.path.remove(str(REPO / folder))


def test_the_file_names_the_anchor_shapes_of_the_benchmarks():
    sets = _file_sets()
    assert list(sets) == ["anchors", "llama405b"]
    assert sets["anchors"]["llama70b_qkv_M8k"] == (8192, 8192, 10240)
    assert sets["anchors"]["gpt3_175b_mlp_M4k"] == (4096, 12288, 49152)
    assert len(sets["anchors"]) == 5 and len(sets["llama405b"]) == 2
    for group in sets.values():
        for dims in group.values():
            assert len(dims) == 3 and all(isinstance(d, int) and d > 0 for d in dims), dims


def test_bench_and_its_command_line_read_the_file():
    sets = _file_sets()
    assert bench.SHAPE_SETS == sets
    assert list(bench.ANCHOR_SHAPES.items()) == list(sets["anchors"].items())  # the order too
    assert bench.LLAMA405B_SHAPES == sets["llama405b"]
    assert cli._shapes(["anchors"], None) == sets["anchors"]
    assert cli._shapes(["llama405b_qkv_M8k"], None) == {"llama405b_qkv_M8k": (8192, 16384, 18432)}


def test_the_peers_read_the_file():
    shapes = _import("benchmarks/peers", "shapes")
    sets = _file_sets()
    assert pathlib.Path(shapes.SHAPES_FILE) == FILE
    assert list(shapes.ANCHORS.items()) == list(sets["anchors"].items())
    assert {k: v for k, v in shapes.SETS.items() if k != "tiny"} == sets
    assert shapes.parse(None) == sets["anchors"]
    assert shapes.parse(["llama405b"]) == sets["llama405b"]
    assert shapes.parse(["llama70b_mlp_up_M2k", "64,32,64"]) == {"llama70b_mlp_up_M2k": (2048, 8192, 28672),
                                                                  "M64_K32_N64": (64, 32, 64)}


def test_the_multiprocess_suite_reads_the_file():
    steps = _import("benchmarks/suites", "multiprocess_steps")
    anchors = _file_sets()["anchors"]
    assert steps.GPU_TIMED and all(anchors[name] == dims for name, dims in steps.GPU_TIMED.items())
    assert steps.GPU_CHECKED["llama70b_qkv_M8k"] == anchors["llama70b_qkv_M8k"]


def test_no_python_file_types_an_anchor_shape_again():
    patterns = [re.compile(r"\(\s*%d\s*,\s*%d\s*,\s*%d\s*\)" % dims)
                for group in _file_sets().values() for dims in group.values()]
    found = []
    for folder in ("ficco_jax", "benchmarks", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            found += [f"{path.relative_to(REPO)}: {p.pattern}" for p in patterns if p.search(text)]
    assert not found, "anchor shapes typed outside ficco_jax/tools/anchor_shapes.json: " + "; ".join(found)
