"""The executor's layout (docs/internals.md, "executor_svc"): folders by role, each a floor that
imports only floors below it; no import circle between its modules even counting imports under
`if TYPE_CHECKING:`; the package root holds its entry points only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "executor_svc"
ENTRY_POINTS = {"__init__.py", "__main__.py", "cli.py"}
# Package -> floor; a module may import packages on lower floors only (and its own package).
FLOORS = {
    "config": 0,
    "kernels": 1,
    "attention": 2,
    "parallel": 2,
    # KV transfer between executors (issue 47): reads and writes the cache's tensors, which it
    # is handed; imports nothing of the executor, so the runner (a host tier) may use it too.
    "kv_transfer": 2,
    "models": 3,
    # Optional features, a folder each (LoRA, speculation, structured outputs, pooling, prompt
    # logprobs, GGUF), on hooks the runner and api call (features/base.py); no runner imports.
    "features": 4,
    "runner": 5,
    "api": 6,
    "demo": 1,  # the demo builder: imports config only; api and cli import it lazily
    "cli": 7,
    "__main__": 8,
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Executor modules `name` imports, TYPE_CHECKING and function-level imports included."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in MODULES and candidate != name:
                    out.add(candidate)
    return {m for m in out if not name.startswith(m + ".")}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _floor(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return parts[1], FLOORS[parts[1]]


def _circled(graph: dict[str, set[str]]) -> list[str]:
    """Modules on an import circle or importing one: what is left after removing, again and
    again, every module that imports none of the modules left (empty: no circle)."""
    left = {m: set(deps) for m, deps in graph.items()}
    changed = True
    while changed:
        changed = False
        for m in [m for m, deps in left.items() if not deps & left.keys()]:
            del left[m]
            changed = True
    return sorted(left)


def test_the_root_holds_entry_points_only():
    assert {p.name for p in PKG.glob("*.py")} == ENTRY_POINTS


def test_every_package_has_a_floor():
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {k for k in FLOORS if k not in ("cli", "__main__")}


def test_no_import_circle_even_under_type_checking():
    assert _circled(GRAPH) == []


def test_each_floor_imports_only_floors_below():
    wrong = []
    for module, deps in GRAPH.items():
        src = _floor(module)
        for dep in deps:
            dst = _floor(dep)
            if src is None or dst is None or src[0] == dst[0]:
                continue
            if dst[1] >= src[1]:
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_the_checker_sees_a_circle():
    assert _circled({"a": {"b"}, "b": {"a"}, "c": {"a"}, "d": set()}) == ["a", "b", "c"]
    assert _circled({"a": {"b"}, "b": set()}) == []
    assert _floor("executor_svc.kernels.gemm") == ("kernels", 1)
    assert GRAPH["executor_svc.runner.model_runner"] >= {"executor_svc.runner.loader"}
