"""The layout's rules, checked on the source: no import circles, the scheduling core imports no
I/O, and the two services share nothing but contracts (protos).

Imports are read with `ast`: every `import` and `from ... import`, including ones inside
functions (a deferred import that hides a circle is still a circle) and those under
`if TYPE_CHECKING:`: an annotation naming the class that calls you is a dependency on it (the
module reads that class's attributes or calls back into it), and hiding the import only hides
the circle. A package's `__init__` is a module of its own, with its own imports: anything that
imports a module inside the package runs it, and `from pkg import name` reads the package's
namespace, so it depends on `pkg/__init__.py` even from inside `pkg` (name a sibling by its own
module, `from pkg.sibling import ...`, to depend on that sibling alone). Only the implicit run of
one's own enclosing packages is not an edge: every module has it, and the package cannot import
anything that does not exist yet.

Also checked here, on the engine (scheduler_svc/engine): `engine.py` stays a short coordinator,
no function of the package (subpackages included) grows past one screen, and its floors (the
fleet, the request state, the fault handling, the request front) import only downwards.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler_svc", "executor_svc", "frontend_svc", "client")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of this repository that `name` imports (resolved to known module names)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
            # `from base import x` reads base's namespace: an edge to base's own module (its
            # __init__ when a package), an enclosing package of this module included.
            if base in known and base != name:
                out.add(base)
        for target in targets:
            # The deepest known module the target names, plus every package on the way
            # (importing pkg.mod runs pkg/__init__.py first) except this module's own
            # enclosing packages, which are running already.
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if (
                    candidate in known
                    and candidate != name
                    and not name.startswith(candidate + ".")
                ):
                    out.add(candidate)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = all_modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


GRAPH = import_graph()


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package: str) -> None:
    inside = {m: {d for d in deps if d.split(".")[0] == package} for m, deps in GRAPH.items()}
    cycles = [c for c in find_cycles(inside) if c[0].split(".")[0] == package]
    assert not cycles, f"import circles in {package}: {cycles}"


SERVICES = {"scheduler_svc", "executor_svc", "frontend_svc"}


def test_the_services_import_nothing_of_each_other() -> None:
    """The services share contracts (protos, the registry layout), never code; the frontend is a
    client of the public API (`client`, `protos`) like any other."""
    crossing = [
        (m, d)
        for m, deps in GRAPH.items()
        for d in deps
        if m.split(".")[0] in SERVICES
        and d.split(".")[0] in SERVICES
        and m.split(".")[0] != d.split(".")[0]
    ]
    assert not crossing, f"imports between services: {crossing}"


# The one module of protos the core may import: the sampling model shared with the client
# (issue 43), a plain dataclass whose import loads no wire types (checked below).
CORE_MAY_IMPORT = {"protos.sampling"}


def test_scheduling_core_imports_no_io() -> None:
    forbidden = {"grpc", "redis", "asyncio", "torch", "protos"}
    found = []
    for path in sorted((ROOT / "scheduler_svc" / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for n in names:
                if n.split(".")[0] in forbidden and n not in CORE_MAY_IMPORT:
                    found.append(f"{path.relative_to(ROOT)}: {n}")
                if n.startswith("scheduler_svc.") and not n.startswith("scheduler_svc.core"):
                    found.append(f"{path.relative_to(ROOT)}: {n} (outside the core)")
    assert not found, found


def test_what_the_core_may_import_of_protos_loads_no_wire_types() -> None:
    """Importing the scheduler's SamplingParams (the shared model) runs no protobuf: its
    conversions import the generated module only when they are called."""
    code = (
        "import sys, scheduler_svc.core.sampling_params, scheduler_svc.core.request\n"
        "print(sorted(m for m in sys.modules if m.startswith(('google', 'grpc')) or "
        "m.endswith('_pb2')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_checker_sees_a_circle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # The engine's request front builds the core's requests (engine.py did before issue 25).
    assert GRAPH["scheduler_svc.engine.requests"] >= {"scheduler_svc.core.request"}


def test_the_checker_counts_a_package_init_as_a_module(tmp_path: Path) -> None:
    """`from pkg import sibling` inside pkg reads pkg/__init__.py: with an __init__ that imports
    the module, that is a circle; `from pkg.sibling import x` is not."""
    init = tmp_path / "__init__.py"
    init.write_text("from pkg.mod import f\n")
    via_package = tmp_path / "mod.py"
    via_package.write_text("from pkg import other\n")
    known = {"pkg", "pkg.mod", "pkg.other"}
    graph = {
        "pkg": imports_of("pkg", init, known),
        "pkg.mod": imports_of("pkg.mod", via_package, known),
    }
    assert graph == {"pkg": {"pkg.mod"}, "pkg.mod": {"pkg", "pkg.other"}}
    assert find_cycles(graph) == [["pkg", "pkg.mod"]]
    via_package.write_text("from pkg.other import g\nimport pkg.other\n")
    assert imports_of("pkg.mod", via_package, known) == {"pkg.other"}
    # A deferred import inside the package's own __init__ counts too.
    init.write_text("def load():\n    from pkg import mod\n")
    assert imports_of("pkg", init, known) == {"pkg.mod"}


def test_the_checker_counts_imports_for_type_checking(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.other\n")
    assert imports_of("pkg.mod", module, {"pkg.mod", "pkg.other"}) == {"pkg.other"}


ENGINE = ROOT / "scheduler_svc" / "engine"
MAX_ENGINE_LINES = 250
MAX_FUNCTION_LINES = 40


def test_the_engine_class_stays_a_coordinator() -> None:
    num_lines = len((ENGINE / "engine.py").read_text().splitlines())
    assert num_lines <= MAX_ENGINE_LINES, f"engine/engine.py has {num_lines} lines"


def test_no_engine_function_is_longer_than_a_screen() -> None:
    """Decorators and the signature count; a nested function counts inside its parent too."""
    long = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                num_lines = (node.end_lineno or node.lineno) - first + 1
                if num_lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({num_lines})")
    assert not long, long


# The engine's floors, lowest first; a module imports engine modules of its own floor or lower
# ones only. The fleet knows nothing of requests; the fault handling acts on the fleet and on the
# request state it is handed, and the request front (every module not named here) calls it.
ENGINE_FLOORS = (
    ("config", ("scheduler_svc.engine.config",)),
    ("fleet", ("scheduler_svc.engine.fleet",)),
    (
        "request state",
        tuple(
            f"scheduler_svc.engine.{m}"
            for m in ("streams", "request_table", "key_usage", "metrics", "model")
        ),
    ),
    ("faults", ("scheduler_svc.engine.faults",)),
)


def engine_floor(module: str) -> int | None:
    """The floor's index (the request front is the last), None outside the engine."""
    if module != "scheduler_svc.engine" and not module.startswith("scheduler_svc.engine."):
        return None
    for i, (_, prefixes) in enumerate(ENGINE_FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(ENGINE_FLOORS)


def test_the_engine_floors_import_only_downwards() -> None:
    upward = []
    for m, deps in GRAPH.items():
        floor = engine_floor(m)
        if floor is None:
            continue
        upward += [(m, d) for d in deps if (engine_floor(d) or 0) > floor]
    assert not upward, f"engine modules importing a floor above their own: {upward}"
    # The rule bites: the fault handling really does sit on the request state and the fleet.
    assert engine_floor("scheduler_svc.engine.faults.recovery") == 3
    assert GRAPH["scheduler_svc.engine.faults.recovery"] >= {
        "scheduler_svc.engine.request_table",
        "scheduler_svc.engine.fleet.executors",
    }
