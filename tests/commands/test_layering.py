"""The layering rule of the `miles_k3` packages, checked on the source (nothing is imported).

Units: the packages of `miles_k3` (`miles_k3.model`, `miles_k3.kernels`, ...: pyproject's `[tool.setuptools]
package-dir` maps the top-level folders into them, e.g. `kernels/` is `miles_k3.kernels`) and the root
modules directly in `miles_k3/` (`miles_k3.train`, `miles_k3.config`, ...; `miles_k3` itself is its
`__init__.py`). `LAYERS` orders them, highest first. The rule:

* a unit imports only units of its own layer or of lower layers (never upward);
* no units import each other, directly or round a longer loop (a cycle, whatever the layers);
* the kernels are the lowest layer, so they import no other unit;
* every unit has a place in `LAYERS`: a new package or root module fails this test until it is added.

Every import statement counts, inside functions too (a lazy import is still a dependency), except those under
`if TYPE_CHECKING:` (never executed). The graph covers every .py file git knows in the working tree (tracked,
or untracked and not ignored) outside tests/ and benchmarks/.
"""
from __future__ import annotations

import ast
import subprocess
from collections import defaultdict, deque
from collections.abc import Iterator
from pathlib import Path

import pytest
from repo_helpers import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT_PACKAGE = "miles_k3"
EXCLUDED_DIRS = ("tests", "benchmarks")  # not part of the package

ENTRY_POINTS = tuple(f"miles_k3.{name}" for name in (
    "train", "eval", "sft", "grade", "model_info", "init_checkpoint", "launch", "config", "config_checks",
    "quantize", "__main__", "serve", "config_reference", "agent", "cli", "ray_config", "ray_launch", "sft_config",
    "sft_examples"))

# Highest first. Units of one layer may import each other (but not both ways).
LAYERS: tuple[tuple[str, ...], ...] = (
    ENTRY_POINTS,  # the commands and their configuration
    ("miles_k3.trainer",),
    ("miles_k3.envs",),  # environments and tools of multi-turn episodes: the trainer's rollouts run them
    ("miles_k3.weight_sync",),
    ("miles_k3.rollout",),
    ("miles_k3.evals",),
    ("miles_k3.model",),
    ("miles_k3.parallel",),
    # Pure utilities (`utils`: atomic writes, device and logging setup, metrics tracking), which every layer but
    # the kernels may use; the package root (`__version__`) and the Hydra recipes (data) import nothing either.
    ("miles_k3", "miles_k3.utils", "miles_k3.recipes"),
    ("miles_k3.kernels",),  # Triton kernels beside their torch references: the bottom, importing no unit
)

Graph = dict[tuple[str, str], list[str]]  # (importing unit, imported unit) -> sites "path:line"


# ---- building the graph ------------------------------------------------------------------------------------
def package_dirs(pyproject: Path) -> dict[str, str]:
    """pyproject's `[tool.setuptools] package-dir`: {import name: folder relative to the repository root}."""
    with pyproject.open("rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def module_name(path: str, dirs: dict[str, str]) -> str | None:
    """The dotted module name of the repository file `path` (a folder's `__init__.py` is the package), through
    the longest matching folder of `dirs`; None for a file outside every mapped folder."""
    parts = path.removesuffix(".py").split("/")
    for name, folder in sorted(dirs.items(), key=lambda item: -len(item[1])):
        prefix = folder.split("/")
        if parts[:len(prefix)] == prefix:
            rest = parts[len(prefix):]
            if rest[-1:] == ["__init__"]:
                rest = rest[:-1]
            return ".".join([name, *rest])
    return None


def unit_of(module: str) -> str:
    """The layering unit of a module: `miles_k3` itself, or the package or root module below it."""
    return ".".join(module.split(".")[:2])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth, in source order, except in the body of an
    `if TYPE_CHECKING:` (its `else:` counts)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        skip_body = isinstance(node, ast.If) and _is_type_checking(node.test)
        todo.extend(reversed(node.orelse if skip_body else list(ast.iter_child_nodes(node))))


def imported_modules(source: str, module: str, is_package: bool, modules: set[str]
                     ) -> Iterator[tuple[str, int]]:
    """(imported module, line) for each import in `source` (the code of `module`). `from X import y` names the
    module X.y when that is one of `modules` (so `from miles_k3 import config` is the root module), else X.
    Relative imports are resolved against `module`."""
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
            continue
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            yield (sub if sub in modules else base), node.lineno


def build_graph(sources: dict[str, str], dirs: dict[str, str]) -> tuple[Graph, set[str]]:
    """The unit graph of `sources` ({repository path: code}) and the units that own a file."""
    names = {path: module_name(path, dirs) for path in sources}
    names = {path: name for path, name in names.items() if name is not None}
    modules = set(names.values())
    graph: Graph = defaultdict(list)
    for path, module in names.items():
        src = unit_of(module)
        for target, line in imported_modules(sources[path], module, path.endswith("__init__.py"), modules):
            if target != ROOT_PACKAGE and not target.startswith(ROOT_PACKAGE + "."):
                continue
            dst = unit_of(target)
            if dst != src:
                graph[src, dst].append(f"{path}:{line}")
    # one site per line (`from miles_k3.x import a, b` is one import)
    return {edge: list(dict.fromkeys(sites)) for edge, sites in graph.items()}, {unit_of(m) for m in modules}


def repository_sources() -> dict[str, str]:
    """{path: code} of the .py files git knows in the working tree (tracked or untracked-not-ignored, still
    present), outside `EXCLUDED_DIRS`."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              "*.py"], cwd=REPO, capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e})")
    paths = sorted({p for p in out.split("\0") if p and p.split("/")[0] not in EXCLUDED_DIRS})
    return {p: (REPO / p).read_text() for p in paths if (REPO / p).is_file()}


# ---- checking it -------------------------------------------------------------------------------------------
def _sites(sites: list[str], limit: int = 4) -> str:
    more = f" (+{len(sites) - limit} more)" if len(sites) > limit else ""
    return ", ".join(sites[:limit]) + more


def unknown_units(units: set[str], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    placed = {u for layer in layers for u in layer}
    return [f"{u} has no layer: add it to LAYERS in tests/commands/test_layering.py (read what it imports and what "
            "imports it)" for u in sorted(units - placed)]


def upward_edges(graph: Graph, layers: tuple[tuple[str, ...], ...]) -> list[tuple[str, str]]:
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    return [(src, dst) for src, dst in sorted(graph) if src in rank and dst in rank and rank[dst] < rank[src]]


def upward_imports(graph: Graph, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    return [f"upward import: {src} (layer {rank[src]}) imports {dst} (layer {rank[dst]}, higher) at "
            f"{_sites(graph[src, dst])}" for src, dst in upward_edges(graph, layers)]


def _shortest_path(adj: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """Nodes from `start` to `goal` along `adj` (breadth first, ties by name), or None."""
    prev: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        if node == goal:
            path = [node]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])
            return path[::-1]
        for nxt in sorted(adj[node] - prev.keys()):
            prev[nxt] = node
            todo.append(nxt)
    return None


def cycles(graph: Graph, upward: set[tuple[str, str]] = frozenset()) -> list[str]:
    """Each pair of units importing each other, then each longer loop (the shortest one closing an edge that
    is on no such pair) that takes none of the `upward` edges: those have their own message, and removing
    them breaks the loop. Every step is named by its first import site."""
    adj: dict[str, set[str]] = defaultdict(set)
    for src, dst in graph:
        adj[src].add(dst)
    found: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for src, dst in sorted(graph):
        if (dst, src) in graph:
            if src < dst:
                found.append(f"cycle {src} <-> {dst}: {graph[src, dst][0]} imports {dst}; "
                             f"{graph[dst, src][0]} imports {src}")
            continue
        back = _shortest_path(adj, dst, src)
        if back is None:
            continue
        loop = [src, *back[:-1]]
        i = loop.index(min(loop))
        key = tuple(loop[i:] + loop[:i])
        steps = list(zip(key, key[1:] + key[:1], strict=True))
        if key not in seen and not set(steps) & upward:
            seen.add(key)
            sites = "; ".join(graph[step][0] for step in steps)
            found.append(f"cycle {' -> '.join([*key, key[0]])}: {sites}")
    return found


def layering_problems(graph: Graph, units: set[str], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every violation of the module docstring's rule, one message each."""
    every = units | {u for edge in graph for u in edge}
    upward = set(upward_edges(graph, layers))
    return unknown_units(every, layers) + upward_imports(graph, layers) + cycles(graph, upward)


# ---- tests -------------------------------------------------------------------------------------------------
def test_packages_are_layered():
    assert all(unit_of(u) == u for layer in LAYERS for u in layer), "LAYERS names packages and root modules"
    graph, units = build_graph(repository_sources(), package_dirs(REPO / "pyproject.toml"))
    assert "miles_k3.kernels" in units and "miles_k3.model" in units  # the mapping was applied
    problems = layering_problems(graph, units, LAYERS)
    assert not problems, "the layering rule (this file's docstring) is broken:\n" + "\n".join(problems)


def test_checker_reports_cycles_upward_imports_and_unknown_units():
    layers = (("top",), ("mid", "mid2", "mid3"), ("low",))
    graph = {("top", "mid"): ["top.py:1"], ("mid", "low"): ["mid.py:2"], ("low", "mid"): ["low.py:3"],
             ("low", "top"): ["low.py:4", "low.py:9"], ("mid", "new"): ["mid.py:5"],
             ("mid", "mid2"): ["mid.py:6"], ("mid2", "mid3"): ["mid2.py:7"], ("mid3", "mid"): ["mid3.py:8"]}
    problems = layering_problems(graph, {"top", "mid", "mid2", "mid3", "low"}, layers)
    unknown = "new has no layer: add it to LAYERS in tests/commands/test_layering.py (read what it imports and what " \
              "imports it)"
    assert problems == [
        unknown,
        "upward import: low (layer 2) imports mid (layer 1, higher) at low.py:3",
        "upward import: low (layer 2) imports top (layer 0, higher) at low.py:4, low.py:9",
        "cycle low <-> mid: low.py:3 imports mid; mid.py:2 imports low",
        # a loop within one layer; low -> top -> mid -> low is left to the upward import low -> top
        "cycle mid -> mid2 -> mid3 -> mid: mid.py:6; mid2.py:7; mid3.py:8",
    ]
    assert layering_problems({("top", "low"): ["top.py:1"], ("mid", "mid2"): ["mid.py:1"]},
                             {"top", "mid", "mid2", "low"}, layers) == []


def test_graph_applies_the_mapping_and_skips_type_checking_imports():
    dirs = {"miles_k3": "miles_k3", "miles_k3.kernels": "kernels", "miles_k3.rollout": "rollout"}
    sources = {
        "kernels/noise.py": "import torch\n",
        "kernels/__init__.py": "from . import noise\n",
        "miles_k3/codec.py": "from miles_k3.kernels.noise import x\n",
        "rollout/sample.py": ("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from miles_k3 import train\n"
                              "else:\n    from miles_k3 import codec\n"
                              "def f():\n    import miles_k3.kernels\n    from .. import __version__\n"),
        "miles_k3/train.py": "from miles_k3 import __version__\n",
        "scripts/tool.py": "import miles_k3.train\n",  # outside every mapped folder: not a unit
    }
    graph, units = build_graph(sources, dirs)
    assert units == {"miles_k3.kernels", "miles_k3.codec", "miles_k3.rollout", "miles_k3.train"}
    assert graph == {("miles_k3.codec", "miles_k3.kernels"): ["miles_k3/codec.py:1"],
                     ("miles_k3.rollout", "miles_k3.codec"): ["rollout/sample.py:5"],
                     ("miles_k3.rollout", "miles_k3.kernels"): ["rollout/sample.py:7"],
                     ("miles_k3.rollout", "miles_k3"): ["rollout/sample.py:8"],
                     ("miles_k3.train", "miles_k3"): ["miles_k3/train.py:1"]}
