"""The layer order of ``lightning_pipe``, stated once and checked on the source (no import runs).

Layers, top to bottom (an arrow may only point down, and only along the table below)::

    lightning_pipe/__init__, cli, export,     the package's entry points: anything
      profiling/cli, profiling/__main__
    callbacks/     Lightning callbacks         -> strategies (the package's public names), profiling, planning, schedules
    strategies/    Lightning glue              -> profiling, runtime, model, planning, schedules
    profiling/     measuring a module          -> runtime, model, planning, schedules
    runtime/       running one rank's step     -> model, schedules
    model/         understanding the module    -> (nothing of the project)
    planning/      pure computation            -> schedules
    schedules/     pure Python, no torch       -> (nothing of the project)

Besides the table: ``schedules/`` imports no torch at all, ``planning/`` neither torch nor Lightning;
only ``strategies/``, ``callbacks/`` and the entry points import Lightning; only ``runtime/`` uses
``torch.distributed``; no two modules import each other, directly or around a circle (imports under
``if TYPE_CHECKING:`` do not run and do not count).

The graph is read with :mod:`ast`, so an import inside a function counts as much as one at the top.
Two further tests import the pure layers in a fresh interpreter and look at ``sys.modules``, which
also catches what the AST cannot see (an import made by a dependency).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_pipe"

# layer -> the project layers it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "schedules": frozenset(),
    "planning": frozenset({"schedules"}),
    "model": frozenset(),
    "runtime": frozenset({"model", "schedules"}),
    "profiling": frozenset({"runtime", "model", "planning", "schedules"}),
    "strategies": frozenset({"profiling", "runtime", "model", "planning", "schedules"}),
    "callbacks": frozenset({"strategies", "profiling", "planning", "schedules"}),
}
ENTRY_POINTS = "<entry>"  # lightning_pipe/__init__.py, cli.py, export.py, __main__.py: may import anything
# command lines inside a layer's folder that build the module and data through LightningCLI
ENTRY_POINT_MODULES = frozenset({"lightning_pipe.profiling.cli", "lightning_pipe.profiling.__main__"})
LIGHTNING_LAYERS = frozenset({"strategies", "callbacks", ENTRY_POINTS})
TORCH_DISTRIBUTED_LAYERS = frozenset({"runtime"})
THIRD_PARTY_LIGHTNING = ("lightning", "pytorch_lightning")


@dataclass(frozen=True)
class Import:
    """One import statement's target, as written and as resolved to a project module."""

    source: str  # importing module, dotted
    target: str  # imported name, dotted (``torch.distributed``, ``lightning_pipe.model.units``)
    module: str | None  # the project module it loads, None for third-party names
    line: int
    type_checking: bool


@cache
def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages by their ``__init__``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if path.name == "__init__.py" else parts)] = path
    return modules


def layer_of(module: str) -> str:
    """The layer a project module belongs to: its subpackage, or the entry points for top-level files
    and the command lines that build a Trainer."""
    if module in ENTRY_POINT_MODULES:
        return ENTRY_POINTS
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else ENTRY_POINTS


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _project_module(name: str) -> str | None:
    modules = project_modules()
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """Every import in ``module``'s source, at any depth, with relative imports resolved."""
    path = project_modules()[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            guarded.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from pkg import name``: the submodule ``pkg.name`` if there is one, else ``pkg`` itself
            targets = [f"{origin}.{alias.name}" for alias in node.names]
        for target in targets:
            resolved = _project_module(target)
            if resolved == module:
                continue
            found.append(Import(module, target, resolved, node.lineno, id(node) in guarded))
    return tuple(found)


def _where(imp: Import) -> str:
    return f"{project_modules()[imp.source].relative_to(REPO)}:{imp.line} imports {imp.module or imp.target}"


def test_the_table_names_every_subpackage():
    """A new subpackage must be placed in the order before it can be used."""
    subpackages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(ALLOWED), f"place {sorted(subpackages ^ set(ALLOWED))} in ALLOWED (tests/test_layers.py)"


def test_imports_point_down_the_layers():
    wrong = []
    for module in project_modules():
        source_layer = layer_of(module)
        if source_layer == ENTRY_POINTS:
            continue
        for imp in imports_of(module):
            if imp.module is None or imp.type_checking:
                continue
            target_layer = layer_of(imp.module)
            if target_layer == source_layer:
                continue
            if target_layer not in ALLOWED[source_layer]:
                wrong.append(f"{_where(imp)} ({source_layer} -> {target_layer})")
            elif target_layer == "strategies" and imp.module != "lightning_pipe.strategies":
                wrong.append(f"{_where(imp)} (callbacks use the strategy's public names only)")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(set(wrong)))


def test_runtime_imports_neither_planning_nor_profiling():
    wrong = [
        _where(imp)
        for module in project_modules()
        if layer_of(module) == "runtime"
        for imp in imports_of(module)
        if imp.module is not None and layer_of(imp.module) in ("planning", "profiling")
    ]
    assert not wrong, "runtime/ runs steps; measuring and planning live above it:\n" + "\n".join(sorted(set(wrong)))


def _third_party(module: str, roots: tuple[str, ...]) -> list[str]:
    return [
        _where(imp)
        for imp in imports_of(module)
        if imp.module is None and not imp.type_checking and imp.target.split(".")[0] in roots
    ]


@pytest.mark.parametrize("layer, roots", [("schedules", ("torch",) + THIRD_PARTY_LIGHTNING), ("planning", ("torch",) + THIRD_PARTY_LIGHTNING)])
def test_pure_layers_import_neither_torch_nor_lightning(layer, roots):
    wrong = [hit for module in project_modules() if layer_of(module) == layer for hit in _third_party(module, roots)]
    assert not wrong, f"{layer}/ is pure Python:\n" + "\n".join(sorted(set(wrong)))


def test_only_strategies_callbacks_and_entry_points_import_lightning():
    wrong = [
        hit
        for module in project_modules()
        if layer_of(module) not in LIGHTNING_LAYERS
        for hit in _third_party(module, THIRD_PARTY_LIGHTNING)
    ]
    assert not wrong, "Lightning belongs to strategies/ and callbacks/:\n" + "\n".join(sorted(set(wrong)))


def _torch_distributed_uses(module: str) -> list[str]:
    """Imports of ``torch.distributed`` and attribute chains ``torch.distributed.<...>`` (annotations
    excepted: naming a type is not a call)."""
    path = project_modules()[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    annotations: set[int] = set()
    for node in ast.walk(tree):
        for annotation in _annotations(node):
            annotations.update(id(inner) for inner in ast.walk(annotation))
    hits = [_where(imp) for imp in imports_of(module) if imp.target.startswith("torch.distributed") and not imp.type_checking]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and id(node) not in annotations
        ):
            hits.append(f"{path.relative_to(REPO)}:{node.lineno} uses torch.distributed")
    return hits


def _annotations(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        arguments += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
        return [a.annotation for a in arguments if a.annotation is not None] + ([node.returns] if node.returns else [])
    if isinstance(node, ast.AnnAssign):
        return [node.annotation]
    return []


def test_only_runtime_uses_torch_distributed():
    wrong = [
        hit
        for module in project_modules()
        if layer_of(module) not in TORCH_DISTRIBUTED_LAYERS
        for hit in _torch_distributed_uses(module)
    ]
    assert not wrong, (
        "torch.distributed is called from runtime/ only (add a function to runtime/collectives.py or "
        "runtime/groups.py):\n" + "\n".join(sorted(set(wrong)))
    )


COMPAT_FILES = ("_torch_compat.py", "_lightning_compat.py", "_torchmetrics_compat.py")
UPSTREAM = ("torch", "lightning", "pytorch_lightning", "torchmetrics")
# private attributes of upstream objects we know we use (a name on an arbitrary object cannot be told
# apart from our own ``obj._x`` by the AST alone)
KNOWN_PRIVATE_ATTRIBUTES = frozenset(
    {"_parameters", "_buffers", "_schema", "_base", "_per_optimizer_states", "_input_metadata", "_skip_backward", "_version"}
    | {"_update_count", "_copy_state_dict", "_forward_cache", "_to_sync", "_should_unsync", "_computed", "_reduce_states"}
)


def _private_uses(module: str) -> list[str]:
    """Private torch/Lightning names used by ``module``: ``from torch.x import _y``, ``torch.utils._pytree``,
    ``torch.ops.aten._op`` and the known private attributes of upstream objects."""
    path = project_modules()[module]
    where = path.relative_to(REPO)
    hits = []
    for imp in imports_of(module):
        parts = imp.target.split(".")
        if imp.module is None and parts[0] in UPSTREAM and any(p.startswith("_") and not p.startswith("__") for p in parts):
            hits.append(f"{where}:{imp.line} imports {imp.target}")
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        upstream_chain = isinstance(root, ast.Name) and root.id in UPSTREAM
        own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if upstream_chain or (node.attr in KNOWN_PRIVATE_ATTRIBUTES and not own):
            hits.append(f"{where}:{node.lineno} uses .{node.attr}")
    return hits


def test_private_upstream_names_live_in_compat_modules():
    wrong = [
        hit
        for module, path in project_modules().items()
        if path.name not in COMPAT_FILES
        for hit in _private_uses(module)
    ]
    assert not wrong, (
        "private torch/Lightning names belong in strategies/_lightning_compat.py, runtime/_torch_compat.py, "
        "model/_torch_compat.py or model/_torchmetrics_compat.py (each with a test):\n" + "\n".join(sorted(set(wrong)))
    )


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), TYPE_CHECKING imports left out."""
    edges = {
        module: sorted({imp.module for imp in imports_of(module) if imp.module and not imp.type_checking})
        for module in project_modules()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in edges[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return components


def test_no_import_cycles():
    cycles = _cycles()
    described = []
    for cycle in cycles:
        members = set(cycle)
        edges = {_where(imp) for module in cycle for imp in imports_of(module) if imp.module in members and not imp.type_checking}
        described.append("; ".join(sorted(edges)))
    assert not cycles, "modules importing each other (around a circle):\n" + "\n".join(described)


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """The graph reader sees a planted upward import, a torch.distributed call and a circle."""
    fake = tmp_path / "lightning_pipe"
    for layer in ALLOWED:
        (fake / layer).mkdir(parents=True)
        (fake / layer / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "runtime" / "a.py").write_text("from lightning_pipe.planning import b\n")
    (fake / "planning" / "b.py").write_text("import torch\nfrom ..runtime import a\n")
    (fake / "strategies" / "c.py").write_text("import torch\ndef f():\n    torch.distributed.barrier()\n")
    (fake / "model" / "d.py").write_text("from torch.utils._pytree import tree_map\ndef f(m):\n    return m._parameters\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    project_modules.cache_clear()
    imports_of.cache_clear()
    try:
        with pytest.raises(AssertionError, match=r"runtime/a.py:1 imports lightning_pipe.planning.b \(runtime -> planning\)"):
            test_imports_point_down_the_layers()
        with pytest.raises(AssertionError, match=r"planning/b.py:1 imports torch"):
            test_pure_layers_import_neither_torch_nor_lightning("planning", ("torch",))
        with pytest.raises(AssertionError, match=r"strategies/c.py:3 uses torch.distributed"):
            test_only_runtime_uses_torch_distributed()
        with pytest.raises(AssertionError, match=r"model/d.py:1 imports torch.utils._pytree.tree_map(.|\n)*d.py:3 uses ._parameters"):
            test_private_upstream_names_live_in_compat_modules()
        with pytest.raises(AssertionError, match="around a circle"):
            test_no_import_cycles()
    finally:
        project_modules.cache_clear()
        imports_of.cache_clear()


def _fresh_interpreter(statements: str) -> subprocess.CompletedProcess:
    """Run ``statements`` with the parent package stubbed (its ``__init__`` registers the strategy,
    which imports Lightning), then fail if torch or Lightning got imported."""
    code = f"""
import sys, types
parent = types.ModuleType("lightning_pipe")
parent.__path__ = [{str(PACKAGE)!r}]
sys.modules["lightning_pipe"] = parent
{statements}
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "pytorch_lightning"))
assert not bad, bad
print("ok")
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, check=False)


def test_planning_imports_neither_torch_nor_lightning():
    """A fresh interpreter imports ``lightning_pipe.planning`` and finds no torch or Lightning module."""
    done = _fresh_interpreter("import lightning_pipe.planning")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_schedules_and_their_command_line_run_without_torch_or_lightning():
    """``python -m lightning_pipe.schedules.cli`` semantics in a fresh interpreter: it prints a program
    and nothing imported torch or Lightning."""
    done = _fresh_interpreter(
        """
import runpy
sys.argv = ["lightning-pipe-schedule", "show", "1f1b", "--ranks", "2", "--microbatches", "2"]
try:
    runpy.run_module("lightning_pipe.schedules.cli", run_name="__main__")
except SystemExit as exit:
    assert exit.code == 0, exit.code
import lightning_pipe.schedules, lightning_pipe.schedules.auto, lightning_pipe.schedules.gallery
"""
    )
    assert done.returncode == 0, done.stderr
    assert "rank 1 |" in done.stdout and done.stdout.strip().endswith("ok")


def test_architecture_page_names_every_module():
    """docs/architecture.md describes the house as it is: every module of a layer is named there."""
    page = (REPO / "docs" / "architecture.md").read_text()
    missing = [
        str(path.relative_to(REPO))
        for layer in ALLOWED
        for path in sorted((PACKAGE / layer).glob("*.py"))
        if path.name not in ("__init__.py", "__main__.py") and path.name not in page
    ]
    assert not missing, f"describe these in docs/architecture.md: {missing}"
