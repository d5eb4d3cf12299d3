"""docs/design.md, "The layers": the import graph of ficco_jax/ (every import statement of every
module, function-level ones included) has no cycle, and nothing in the library imports tools/."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ficco_jax"
#: Compiled modules of the package (no .py file): imported, they import nothing of ficco_jax.
COMPILED = ("ficco_jax._ffi",)


def _modules() -> dict[str, pathlib.Path | None]:
    mods: dict[str, pathlib.Path | None] = dict.fromkeys(COMPILED)
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _targets(node, package: str, mods) -> list[str]:
    """The modules of ficco_jax an import statement imports (`from pkg import mod` imports mod;
    `from pkg import name` imports pkg)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    subs = [f"{target}.{a.name}" for a in node.names]
    return [s for s in subs if s in mods] if all(s in mods for s in subs) else [t for t in [target] if t in mods]


def import_graph() -> dict[str, set[str]]:
    mods, graph = _modules(), {}
    for name, path in mods.items():
        graph[name] = set()
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= set(_targets(node, package, mods)) - {name}
    return graph


def _cycle(graph) -> list[str] | None:
    """One cycle of `graph` as a path of module names, None if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert "ficco_jax.runtime.extension" in graph["ficco_jax.lowering.dma.registry"]
    assert "ficco_jax.tools.bench" in graph["ficco_jax.tools.cli"]  # `from . import bench`
    assert "ficco_jax.ops.api" in graph["ficco_jax.ops"]  # `from .api import ...`
    assert "ficco_jax._ffi" in graph["ficco_jax.runtime.extension"]  # inside a function


def test_the_import_graph_has_no_cycle():
    assert _cycle(import_graph()) is None, " -> ".join(_cycle(import_graph()))


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_nothing_in_the_library_imports_tools():
    graph = import_graph()
    outside = {name: sorted(t for t in targets if t.startswith("ficco_jax.tools"))
               for name, targets in graph.items()
               if not name.startswith("ficco_jax.tools")}
    assert not {k: v for k, v in outside.items() if v}
