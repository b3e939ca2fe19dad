"""The import graph of kernels/, runtime/, services/ and devtools/: no cycle, and imports point one
way (kernels <- runtime <- services <- devtools; devtools is development tooling the wheel does not
ship, so no product module may import it).

Every module is parsed with `ast`; every import counts, wherever it is written: at module level,
inside a function (the usual way to hide a cycle), or under `if TYPE_CHECKING:`. `import a.b` and
`from a import b` (when `a.b` is a module) are edges to `a.b`; `from a.b import name` is an edge to
`a.b`. Only edges between modules of the three packages are kept.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "runtime", "services", "devtools")
# layer -> the layers it must not import
FORBIDDEN = {
    "kernels": ("runtime", "services", "devtools"),
    "runtime": ("services", "devtools"),
    "services": ("devtools",),
}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({module_path(self.src)}:{self.line})"


@cache
def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def module_path(name: str) -> str:
    return str(modules()[name].relative_to(REPO))


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _resolve_from(src: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = src.split(".")
    if not _is_package(src):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _targets(src: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    known = modules()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                yield alias.name
        return
    base = _resolve_from(src, node)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            yield sub
        elif base in known:
            yield base


@cache
def edges() -> tuple[Edge, ...]:
    found: list[Edge] = []
    for src, path in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for dst in _targets(src, node):
                    if dst != src:
                        found.append(Edge(src, dst, node.lineno))
    return tuple(found)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_every_package_is_walked() -> None:
    names = modules()
    for pkg in PACKAGES:
        assert pkg in names and sum(n.startswith(pkg + ".") for n in names) > 3, pkg
    assert "services.worker.celery_app" in names and "services.settings" in names
    assert any(e.src == "services.worker.app" and e.dst == "services.worker.reconcile" for e in edges())


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for e in edges():
        graph[e.src].add(e.dst)
    cycles = _cycles(graph)
    detail = []
    for component in cycles:
        members = set(component)
        detail.append(
            " / ".join(component)
            + ":\n    "
            + "\n    ".join(str(e) for e in edges() if e.src in members and e.dst in members)
        )
    assert not cycles, "import cycles:\n  " + "\n  ".join(detail)


def test_imports_point_one_way() -> None:
    """kernels imports neither runtime nor services; runtime does not import services; no product
    package imports devtools."""
    bad = [
        str(e)
        for e in edges()
        if any(e.dst.split(".")[0] == layer for layer in FORBIDDEN.get(e.src.split(".")[0], ()))
    ]
    direction = "kernels <- runtime <- services <- devtools"
    assert not bad, f"imports against the {direction} direction:\n  " + "\n  ".join(bad)


def test_worker_celery_app_is_a_leaf() -> None:
    src = "services.worker.celery_app"
    own = [e for e in edges() if e.src == src and e.dst.startswith("services.worker")]
    assert not own, [str(e) for e in own]


PLUGIN = "runtime.vllm_plugin"


def _is_vllm_import(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "vllm" for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return not node.level and (node.module or "").split(".")[0] == "vllm"
    return False


def _imports_vllm(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree) if _is_vllm_import(node)]  # type: ignore[attr-defined]


def test_vllm_is_imported_only_by_the_plugin_and_the_plugin_by_nothing_else() -> None:
    """vLLM is an optional dependency: only runtime/vllm_plugin imports it, and no other module imports
    the plugin (vLLM loads it through its entry point)."""
    outside = [
        f"{module_path(name)}:{line}"
        for name, path in modules().items()
        if not name.startswith(PLUGIN)
        for line in _imports_vllm(path)
    ]
    assert not outside, f"modules outside {PLUGIN} import vllm: {outside}"
    into = [str(e) for e in edges() if e.dst.startswith(PLUGIN) and not e.src.startswith(PLUGIN)]
    assert not into, into
    assert any(_imports_vllm(modules()[f"{PLUGIN}.model_loader"]))


UNITS = "services.convert.units"


def test_unit_kinds_are_known_only_to_their_registration() -> None:
    """The plan, the pipeline, the artifact writer and the manifest see units through the protocol
    (units.base) and the registration (units.UNIT_KINDS) only, so a new unit kind is its module plus
    one line there."""
    kinds = {name for name in modules() if name.startswith(UNITS + ".") and name != f"{UNITS}.base"}
    assert {f"{UNITS}.linear", f"{UNITS}.experts"} <= kinds
    outside = [str(e) for e in edges() if e.dst in kinds and e.src != UNITS]
    assert not outside, "modules that name a unit kind instead of the protocol:\n  " + "\n  ".join(outside)
