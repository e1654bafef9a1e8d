"""The package's layering, enforced: every module's imports against the layer table.

The table is README.md's package map (a test below checks the two agree). Each module of
``kvci_plugin`` belongs to one layer; it may import kvci modules of its own layer's package and
of lower layers only, never of a higher layer nor of another package on its own level. Only
``connector/`` and ``lmcache/`` import vLLM (and the entry points, inside a function: see
``ENTRY``), only ``lmcache/`` imports LMCache, and the rest need torch at most: a machine with
torch alone (the GPU machine) imports and tests everything else.

Imports are read from the source (``ast``), so an import inside a function counts as much as
one at the top of a module. An import under ``if TYPE_CHECKING:`` never runs: it is no import
for the layering (a process never loads it), but it does count when looking for import circles.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvci_plugin"


@dataclass(frozen=True)
class Layer:
    rank: int
    name: str
    members: tuple[str, ...]  # subpackages ("tiering") or root modules ("plugin") of kvci_plugin
    vllm: bool = False  # may import vllm
    lmcache: bool = False  # may import lmcache
    torch: bool = False  # may import torch
    vllm_lazily: bool = False  # may import vllm, but only inside a function


BASE = Layer(0, "base", ("__init__", "build_info", "logs"))
ENTRY = Layer(6, "entry", ("plugin", "cli", "cli_render", "demo", "doctor", "tinymodel"),
              torch=True, vllm_lazily=True)
"""The entry points: what vLLM (``plugin``: the ``vllm.general_plugins`` entry point, which must
register kvci's connectors with vLLM's factory), a shell (``cli`` and its ``cli_render``,
``demo``, ``doctor``) or
``make`` (``tinymodel``) starts. They sit above every layer, and may import vLLM only inside the
function that needs it — registering, starting the demo's engines, diagnosing an install — so that
``kvci stats`` or ``kvci explain`` start without vLLM, and ``kvci doctor`` can report a vLLM that
does not import."""

LAYERS: tuple[Layer, ...] = (
    BASE,
    Layer(1, "worthiness", ("worthiness",)),
    Layer(1, "governance", ("governance",)),
    Layer(1, "ops", ("ops", "_C"), torch=True),
    Layer(2, "policy", ("policy",)),
    Layer(2, "request", ("request",)),
    Layer(3, "tiering", ("tiering",), torch=True),
    Layer(4, "api", ("api",)),
    Layer(5, "connector", ("connector",), vllm=True, torch=True),
    Layer(5, "lmcache", ("lmcache",), vllm=True, lmcache=True, torch=True),
    ENTRY,
)
"""Lowest first. ``_C`` is the native extension (``csrc/``), which ``ops`` loads."""


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (for ``from a import b``: ``a.b`` when that is a module)
    line: int
    lazy: bool  # inside a function
    typing_only: bool  # under ``if TYPE_CHECKING:``


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def kvci_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = kvci_modules()
KNOWN = set(MODULES) | {"kvci_plugin._C"}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _resolve(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path | None = None) -> list[Import]:
    """Every import statement of ``module``: at the top, in functions, in classes, in try and
    if blocks."""
    path = path or MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def walk(node: ast.AST, lazy: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(module, alias.name, child.lineno, lazy, typing_only)
                             for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child, package)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append(Import(module, sub if sub in KNOWN else base, child.lineno,
                                        lazy, typing_only))
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:
                    walk(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
                for stmt in child.orelse:
                    walk(ast.Module(body=[stmt], type_ignores=[]), lazy, typing_only)
            else:
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                walk(child, inner, typing_only)

    walk(ast.parse(path.read_text(), str(path)), False, False)
    return found


def layer_of(module: str) -> Layer:
    parts = module.split(".")
    member = parts[1] if len(parts) > 1 else "__init__"
    for layer in LAYERS:
        if member in layer.members:
            return layer
    raise AssertionError(f"{module} is in no layer of the table: add it to LAYERS and README.md")


def runtime_imports() -> Iterator[Import]:
    for module in MODULES:
        yield from (imp for imp in imports_of(module) if not imp.typing_only)


def _top(name: str) -> str:
    return name.split(".")[0]


# --- the rule ------------------------------------------------------------------------------


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_point_down_only():
    wrong = []
    for imp in runtime_imports():
        if _top(imp.target) != "kvci_plugin" or imp.target not in KNOWN:
            continue
        source, target = layer_of(imp.source), layer_of(imp.target)
        same = source == target
        if not same and target.rank >= source.rank:
            wrong.append(f"{imp.source}:{imp.line} ({source.name}, layer {source.rank}) imports "
                         f"{imp.target} ({target.name}, layer {target.rank})")
    assert not wrong, "imports that do not point down:\n" + "\n".join(wrong)


@pytest.mark.parametrize("dependency", ["vllm", "lmcache", "torch"])
def test_heavy_dependencies_stay_in_their_layers(dependency):
    wrong = []
    for imp in runtime_imports():
        if _top(imp.target) != dependency:
            continue
        layer = layer_of(imp.source)
        lazily = dependency == "vllm" and layer.vllm_lazily and imp.lazy
        allowed = getattr(layer, dependency) or lazily
        if not allowed:
            how = " outside a function" if layer.vllm_lazily and dependency == "vllm" else ""
            wrong.append(f"{imp.source}:{imp.line} ({layer.name} layer) imports {imp.target}{how}")
    assert not wrong, f"{dependency} imported outside its layers:\n" + "\n".join(wrong)


def test_the_worker_side_imports_no_vllm_and_no_decision_layer():
    """vLLM's worker processes run ``connector.worker``: it and what it imports (at any depth)
    need torch, not vLLM, and none of the layers that decide (policy, worthiness, governance,
    request): the records it shares with the scheduler side (``tiering.types``) name the
    policy's figures only in annotations."""
    graph = _graph(typing_only=False)
    reached, todo = set(), ["kvci_plugin.connector.worker"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph.get(module, ()))
    deciders = {"policy", "worthiness", "governance", "request"}
    deciding = sorted(m for m in reached if layer_of(m).name in deciders)
    assert not deciding
    vllm = [f"{imp.source}:{imp.line}" for m in reached if m in MODULES
            for imp in imports_of(m) if not imp.typing_only and _top(imp.target) == "vllm"]
    assert not vllm


# --- no import circle ----------------------------------------------------------------------


def _graph(typing_only: bool = True) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module in MODULES:
        for imp in imports_of(module):
            counted = typing_only or not imp.typing_only
            if imp.target in MODULES and imp.target != module and counted:
                graph[module].add(imp.target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle_between_kvci_modules():
    """Counting imports in function bodies and under TYPE_CHECKING: a circle closed by moving
    one import into a function is still a circle."""
    graph = _graph()
    circles = import_circles(graph)
    described = ["\n".join(f"  {a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle)
                 for circle in circles]
    assert not circles, "import circles:\n" + "\n\n".join(described)


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_lazy_and_typing_only_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n"
        "    from vllm.config import VllmConfig\n"
        "def f():\n"
        "    from vllm import LLM\n"
        "    try:\n"
        "        import lmcache.v1\n"
        "    except ImportError:\n"
        "        pass\n")
    found = {(imp.target, imp.lazy, imp.typing_only)
             for imp in imports_of("kvci_plugin.probe", source)}
    assert found == {("__future__", False, False), ("typing", False, False),
                     ("torch", False, False), ("vllm.config", False, True),
                     ("vllm", True, False), ("lmcache.v1", True, False)}


# --- the README's package map is this table ------------------------------------------------


def _readme_layers() -> dict[str, int]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- layers -->\n(.*?)<!-- /layers -->", text, re.S)
    assert block, "README.md lacks its <!-- layers --> package map"
    members: dict[str, int] = {}
    for row in block.group(1).splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            member = name.removeprefix("kvci_plugin/").strip("/").removesuffix(".py")
            members[member] = int(cells[0])
    return members


def test_the_readme_package_map_is_the_layer_table():
    expected = {member: layer.rank for layer in LAYERS for member in layer.members}
    assert _readme_layers() == expected

