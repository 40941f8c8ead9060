"""fp4rl's layering, read from the source: every room of ``src/fp4rl`` (a sub-package or a
top-level module) sits on a floor, and imports only rooms on floors below its own; no
module imports itself back through others. docs/architecture.md draws the same floors.

Every import counts, a deferred one inside a function too: it is still a dependency, only
paid later. A new room, or a new import between rooms, is a decision: make it here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from _paths import ROOT

PACKAGE = ROOT / "src" / "fp4rl"

#: bottom up; a room imports only rooms of lower floors (siblings stay independent)
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "host_memory", "progress", "version"),
    ("hub", "presets", "paths", "registry", "rundir_lock", "precision", "settings"),
    ("data", "kernels"),
    ("formats",),
    ("models", "gemm", "env"),
    ("recovery",),
    ("nn",),
    ("rollout",),
    ("rl", "integrations"),
    ("experiments", "export", "analysis"),
    ("demo", "bench"),
    ("cli",),
    ("__main__",),
)
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
#: the package's face re-exports from every floor
FACE = "__init__"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The fp4rl modules ``path`` imports (``from pkg import name`` counts as ``pkg.name``
    where that is a module, else ``pkg``)."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = package[:len(package) - node.level + 1]
                base = ".".join([*stem, base] if base else stem)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
    return {m for m in found if m == "fp4rl" or m.startswith("fp4rl.")}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACE


def test_every_room_has_a_floor():
    rooms = {room(m) for m in modules()} - {FACE}
    assert not rooms - set(FLOOR), f"rooms without a floor here: {sorted(rooms - set(FLOOR))}"
    assert not set(FLOOR) - rooms, f"floors name rooms that are gone: {set(FLOOR) - rooms}"


def test_no_import_runs_up_or_across():
    known = modules()
    bad = sorted(f"{m} -> {t}" for m, p in known.items() for t in imports(p, known)
                 if room(m) != FACE and room(t) != room(m)
                 and (room(t) == FACE or FLOOR[room(t)] >= FLOOR[room(m)]))
    assert not bad, "imports that run up or across a floor:\n" + "\n".join(bad)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back():
    """Through any import, a deferred one or one for type checking too, inside rooms as
    well: a circle broken only by deferring an import is still a circle. A package's
    ``__init__`` re-exporting its own modules is its face, and no module imports its face
    back (:func:`test_no_module_imports_its_own_package`), so every edge counts here."""
    known = modules()
    graph = {m: {t for t in imports(p, known) if t != m} for m, p in known.items()}
    assert not circles(graph)


def arrows_back_up(known: dict[str, Path]) -> list[str]:
    """Each import by a module of a package that holds it (``fp4rl.kernels.dispatch`` ->
    ``fp4rl.kernels``): the package's face re-exports the module, so the import runs in a
    circle that only the order of execution breaks."""
    return sorted(f"{m} -> {t}" for m, p in known.items() for t in imports(p, known)
                  if p.name != "__init__.py" and m.startswith(f"{t}."))


def test_no_module_imports_its_own_package():
    """A module inside a package takes what it needs from the sibling module that holds
    it (``from fp4rl.kernels.base import KernelFormat``), never from the package's face."""
    back = arrows_back_up(modules())
    assert not back, f"{len(back)} arrows back up into a package's face:\n" + "\n".join(back)


def _face_statement(node: ast.stmt) -> bool:
    """Whether a top-level statement belongs on a face: the docstring, an import, or
    ``__all__`` (assigned or extended)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
    return bool(targets) and all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def not_a_face(path: Path) -> list[str]:
    """What a package's ``__init__`` holds beyond a face: functions, classes, constants,
    logic. A package with modules of its own keeps them there, so the face says what the
    package offers and each name has one home a reader (and a patch) can find."""
    return [f"line {n.lineno}: {type(n).__name__} "
            f"{getattr(n, 'name', '') or ast.unparse(n).splitlines()[0][:60]}"
            for n in ast.parse(path.read_text()).body if not _face_statement(n)]


def test_package_faces_are_faces():
    """Every ``__init__.py`` of a package with modules of its own only imports and
    re-exports (a package that is one module, such as ``presets`` beside its YAML files,
    is that module)."""
    bad = []
    for path in sorted(PACKAGE.rglob("__init__.py")):
        if any(p != path for p in path.parent.glob("*.py")):
            bad += [f"{path.relative_to(PACKAGE)} {what}" for what in not_a_face(path)]
    assert not bad, "package faces holding more than a face:\n" + "\n".join(bad)


def test_the_face_rules_catch_a_package_holding_its_dispatch(tmp_path, monkeypatch):
    """The shape these rules were written against: a package face holding dispatch code
    whose modules import shared types back from it."""
    package = tmp_path / "fp4rl" / "kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        '"""doc"""\nimport os\nOPS = ("rows",)\n\n'
        "def backend(op):\n    from fp4rl.kernels import triton_ops\n"
        '    return triton_ops\n__all__ = ["backend"]\n')
    (package / "triton_ops.py").write_text("from fp4rl.kernels import OPS\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "fp4rl")
    assert [w.split(":")[0] for w in not_a_face(package / "__init__.py")] == ["line 3", "line 5"]
    known = {"fp4rl.kernels": package / "__init__.py",
             "fp4rl.kernels.triton_ops": package / "triton_ops.py"}
    assert arrows_back_up(known) == ["fp4rl.kernels.triton_ops -> fp4rl.kernels"]


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(graph, expected):
    assert circles(graph) == expected


def test_no_private_name_is_imported_from_another_module():
    """A name with a leading underscore is its module's own: a second module that needs it
    gets a public name (or the code moves), so that a module's face says what others use."""
    taken = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp4rl"):
                taken += [f"{module} <- {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not taken, taken


def test_only_the_modules_vllm_loads_import_it_at_import_time():
    """fp4rl.rollout.vllm's package docstring names them; the rest of the package (and of
    fp4rl) imports vLLM inside functions, so a trainer without vLLM imports every module."""
    at_import = set()
    for module, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                at_import.add(module)
    assert at_import == {f"fp4rl.rollout.vllm.{m}" for m in ("quant_config", "method",
                                                             "sharding")}
