"""The package graph is one-way: no import (lazy ones included) goes up a layer, no cycle.

Layers, lowest first (docs/architecture.md draws them)::

    core -> measure -> strategies -> validation -> planning -> simulate -> compare
         -> report -> jax -> cli | integrations

where the lowest layer, ``CORE``, is the ``remat.core`` package (what the PyTorch and JAX
backends share: budget, peak model, solver, result records) and the torch-free top-level
modules beside it (``errors``, ``units``, ...).

jax (the JAX backend) sits below the CLI, which runs it for ``--framework jax``
(importing it lazily); nothing below the CLI imports it.

compiled (torch.compile: measured, simulated, installed, planned) is one package that is a
vertical slice: ``remat.profile`` (measure) measures compiled models, ``remat.apply``
(strategies) compiles a plan's blocks and ``remat.plan`` (planning) plans compiled steps,
so each of its modules sits in the layer of what it builds on (``SLICES``). distributed
(parallel training per rank: schedules, FSDP arithmetic, tensor-parallel and pipeline rank
steps, stage plans) is the other slice. Inside a slice the modules import each other one
way, type-only imports included (a slice spread over layers is read module by module).

A module may import its own layer's modules and any lower layer's; the test parses
every ``import`` under src/remat, function bodies included, so a lazy import cannot
hide an upward edge.

Module size: a module over 600 lines draws a warning (the test passes), one over 800
fails. Split by role, not by length.
"""

from __future__ import annotations

import ast
import functools
import warnings
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "remat"

CORE = ("core", "errors", "units", "devices", "device_memory", "card_fit", "blocks", "recompute",
        "models",
        "native", "progress")
LAYERS: tuple[tuple[str, ...], ...] = (
    ("remat",),  # the package's own __init__: lazy names only, imports nothing eagerly
    CORE,
    ("measure",),
    ("strategies",),
    ("validation",),
    ("planning",),
    ("simulate",),
    ("compare",),
    ("report",),
    ("jax",),
    ("cli", "integrations"),
)

#: Modules of a vertical-slice package, each in a layer of its own (the package's own
#: ``__init__`` imports nothing). Keys drop the leading ``remat.``.
SLICES: dict[str, str] = {
    "compiled": "measure",
    "compiled.graphs": "measure",
    "compiled.measure": "measure",
    "compiled.capture": "measure",
    "compiled.replay": "measure",
    "compiled.simulate": "measure",
    "compiled.install": "strategies",
    "compiled.candidates": "planning",
    "compiled.plan": "planning",
    # parallel training per rank: schedules and FSDP arithmetic need only core; DTensor
    # measurement and StageLoss serve measure's step; the simulated rank steps build on
    # simulate; stage and rank plans call the planner.
    "distributed": "core",
    "distributed.schedule": "core",
    "distributed.pipeline_fsdp": "core",
    "distributed.sharding": "core",
    "distributed.sharded": "measure",
    "distributed.stage_loss": "measure",
    "distributed.tp_fused": "simulate",
    "distributed.tp_roles": "simulate",
    "distributed.tp_layout": "simulate",
    "distributed.tp_step": "simulate",
    "distributed.tensor_parallel": "simulate",
    "distributed.pipeline_record": "simulate",
    "distributed.pipeline": "simulate",
    "distributed.stage": "planning",
    "distributed.pipeline_rank": "planning",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The parsed source of ``path``, parsed once for the whole module's tests."""
    return ast.parse(path.read_text(), filename=str(path))


def _imports(path: Path) -> set[str]:
    tree = _tree(path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("remat"):
                # ``from pkg import submodule`` names the submodule; other names, the module
                found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("remat"))
    return found


def _in_type_checking_only(path: Path) -> set[str]:
    """Imports under ``if TYPE_CHECKING:`` (never executed)."""
    tree = _tree(path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.module:
                    out.update(f"{sub.module}.{a.name}" for a in sub.names)
    return out


def _graph(*, type_only: bool = False) -> dict[str, set[str]]:
    """Each module's imports; ``type_only=True`` keeps those under ``TYPE_CHECKING`` too."""
    graph: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        graph[_module_name(path)] = _imports(path) if type_only \
            else _imports(path) - _in_type_checking_only(path)
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "remat"


def _layer_part(module: str) -> str:
    """The ``LAYERS`` entry ``module`` (or the module an import names) belongs to."""
    parts = module.split(".")[1:]
    for end in range(len(parts), 0, -1):
        placed = SLICES.get(".".join(parts[:end]))
        if placed is not None:
            return placed
    return _part(module)


def _layer(module: str) -> int:
    part = _layer_part(module)
    for index, members in enumerate(LAYERS):
        if part in members:
            return index
    raise AssertionError(f"{module}: package part {part!r} is in no layer; add it to LAYERS "
                         "here and to docs/architecture.md")


def test_every_module_is_in_a_layer() -> None:
    for module in _graph():
        _layer(module)


def test_no_import_goes_up_a_layer() -> None:
    upward = sorted(
        f"{src} -> {dst} ({LAYERS[_layer(src)]} imports {LAYERS[_layer(dst)]})"
        for src, targets in _graph().items() for dst in targets
        if _layer(dst) > _layer(src)
    )
    assert upward == [], "upward imports:\n" + "\n".join(upward)


def test_peers_in_the_top_layer_do_not_import_each_other() -> None:
    top = LAYERS[-1]
    crossing = sorted(f"{s} -> {d}" for s, ts in _graph().items() for d in ts
                      if _part(s) in top and _part(d) in top and _part(s) != _part(d))
    assert crossing == []


def _resolve(name: str, graph: dict[str, set[str]]) -> str | None:
    """The module an import names: ``remat.x.y`` when that is a module, else ``remat.x``."""
    while name and name not in graph:
        name = name.rpartition(".")[0]
    return name or None


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycle() -> None:
    graph = _graph()
    edges = {m: {r for t in ts if (r := _resolve(t, graph)) and r != m} for m, ts in graph.items()}
    # a package's __init__ importing its own submodules is how packages work: a submodule
    # importing its own package's __init__ back is the cycle to catch.
    cycles = _cycles(edges)
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_a_slice_imports_its_own_modules_one_way() -> None:
    # A slice's modules sit in several layers, so the layer test cannot order them; a
    # circle inside one, even through a type-only import, means neither module can be
    # read first (a pipeline schedule's Action imported back by the FSDP replay of it).
    graph = _graph(type_only=True)
    cycles: list[list[str]] = []
    for top in sorted({s.split(".")[0] for s in SLICES}):
        inside = {m for m in graph if m.startswith(f"remat.{top}.")}
        edges = {m: {r for t in graph[m] if (r := _resolve(t, graph)) in inside and r != m}
                 for m in inside}
        cycles += _cycles(edges)
    assert cycles == [], "import cycles in a slice:\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def _package(module: str) -> str:
    """``remat.x`` for a module ``remat.x`` or ``remat.x.y`` (``remat`` for the root)."""
    return ".".join(module.split(".")[:2])


def test_no_two_packages_import_each_other() -> None:
    # Modules may be acyclic while their packages are not (remat.errors importing
    # remat.core.cost while every remat.core module imports remat.errors): a reader then
    # cannot learn one package without the other. The vertical slices (SLICES) are spread
    # over several layers on purpose and are left out.
    graph = _graph()
    edges: dict[str, set[str]] = {}
    for src, targets in graph.items():
        for target in targets:
            dst = _resolve(target, graph)
            a, b = _package(src), _package(dst or "remat")
            if a != b and "remat" not in (a, b) and not {a, b} & {f"remat.{s}" for s in SLICES}:
                edges.setdefault(a, set()).add(b)
    both = sorted(f"{a} <-> {b}" for a in edges for b in edges[a]
                  if a < b and a in edges.get(b, set()))
    assert both == [], "packages importing each other:\n" + "\n".join(both)


#: Lines past which a module is worth a second look (a warning), and past which it fails.
#: A module is split by role, never by length: staying under a limit is no reason to cut.
WARN_LINES, MAX_LINES = 600, 800


def _module_lines() -> dict[str, int]:
    return {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}


def test_no_module_is_a_big_room() -> None:
    lines = _module_lines()
    long = sorted(f"{m}: {n} lines" for m, n in lines.items() if WARN_LINES < n <= MAX_LINES)
    if long:
        warnings.warn(f"modules over {WARN_LINES} lines (fine if they are one role):\n"
                      + "\n".join(long), stacklevel=1)
    big = sorted(f"{m}: {n} lines" for m, n in lines.items() if n > MAX_LINES)
    assert big == [], f"modules over {MAX_LINES} lines:\n" + "\n".join(big)


#: Modules users import from by name: every package's ``__init__`` and these leaves. Only
#: they declare ``__all__``; every other module is the implementation behind them.
PUBLIC_LEAVES = ("remat.errors", "remat.units", "remat.devices", "remat.device_memory",
                 "remat.card_fit",
                 "remat.blocks", "remat.recompute", "remat.progress", "remat.strategies.regions",
                 "remat.integrations.hf", "remat.integrations.fsdp2",
                 "remat.integrations.compile", "remat.integrations.lightning",
                 "remat.integrations.tp", "remat.distributed.stage",
                 "remat.distributed.pipeline_rank")


def _declares_all(path: Path) -> bool:
    tree = _tree(path)
    return any(isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == "__all__"
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
        for node in tree.body)


def _exports_something(path: Path) -> bool:
    """Anything but a docstring and ``from __future__`` (a package whose ``__init__`` loads
    no submodule, such as ``remat.core``, exports nothing)."""
    body = _tree(path).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
               and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
               for n in body)


def test_only_public_modules_declare_all() -> None:
    public = {p for p in SRC.rglob("*.py")
              if p.name == "__init__.py" or _module_name(p) in PUBLIC_LEAVES}
    private_with_all = sorted(_module_name(p) for p in SRC.rglob("*.py")
                              if p not in public and _declares_all(p))
    public_without = sorted(_module_name(p) for p in public if not _declares_all(p)
                            and _exports_something(p))
    assert private_with_all == [], "private modules declaring __all__:\n" + \
        "\n".join(private_with_all)
    assert public_without == [], "public modules without __all__:\n" + "\n".join(public_without)


def test_no_private_name_is_imported_from_another_package() -> None:
    # Privacy is one convention: a name starting with ``_`` is its package's own. Another
    # package that needs it needs a public name (and a docstring saying what it promises).
    crossing: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        importer = _module_name(path)
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("remat")):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and \
                        _package(node.module) != _package(importer):
                    crossing.append(f"{importer} imports {node.module}.{alias.name}")
    assert crossing == [], "private names used across packages:\n" + "\n".join(crossing)


def test_no_module_name_starts_with_an_underscore() -> None:
    # A module is private by not being public (PUBLIC_LEAVES, package __init__ files); a
    # second convention (underscore modules in some packages) would make readers ask which
    # one holds where.
    marked = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("_*.py")
                    if p.name not in ("__init__.py", "__main__.py"))
    assert marked == []
