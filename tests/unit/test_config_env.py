"""Configuration has one home per service: no module reads the environment except its service's
config module, and no code writes it (one documented exception, a library that can only be
configured through a variable). Checked on the source with `ast`, as test_import_graph.py
checks the layering.

The others take their settings from the configuration object (or the config module's helpers);
processes a service starts get theirs handed over (tensor-parallel workers: a serialized
`RuntimeFlags`), never through variables written into `os.environ`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The one module of each service that touches os.environ.
CONFIG_MODULES = {
    "scheduler_svc": "scheduler_svc.envs",
    "executor_svc": "executor_svc.config.envs",
    "frontend_svc": "frontend_svc.config",
    "client": "client.envs",
}
# (module, function) allowed to write the environment, each with its reason in its docstring.
ALLOWED_WRITES = {
    # gloo takes its network interface from GLOO_SOCKET_IFNAME only.
    ("executor_svc.config.envs", "use_loopback_for_gloo"),
}
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
WRITE_METHODS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _is_env(node: ast.AST) -> bool:
    """`os.environ`, `os.getenv`, ... (or the bare name when imported from os)."""
    if isinstance(node, ast.Attribute):
        return node.attr in ENV_NAMES and isinstance(node.value, ast.Name) and node.value.id == "os"
    return False


def env_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Every place the module reads or writes the environment: (line, what)."""
    found = []
    for node in ast.walk(tree):
        if _is_env(node):
            found.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ENV_NAMES:
                    found.append((node.lineno, f"from os import {alias.name}"))
    return found


def env_writes(tree: ast.AST) -> list[tuple[int, str | None]]:
    """Every write to the environment: (line, the enclosing function's name or None)."""
    writes: list[tuple[int, str | None]] = []

    def visit(node: ast.AST, func: str | None) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            if _is_env(node.value):
                writes.append((node.lineno, func))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func
            mutates = target.attr in WRITE_METHODS and _is_env(target.value)
            if mutates or (_is_env(target) and target.attr in ("putenv", "unsetenv")):
                writes.append((node.lineno, func))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, None)
    return writes


def _module_trees() -> dict[str, ast.AST]:
    trees = {}
    for package in CONFIG_MODULES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            trees[".".join(parts)] = ast.parse(path.read_text())
    return trees


TREES = _module_trees()


def test_only_each_services_config_module_reads_the_environment() -> None:
    outside = [
        f"{name}:{line} {what}"
        for name, tree in TREES.items()
        for line, what in env_uses(tree)
        if name != CONFIG_MODULES[name.split(".")[0]]
    ]
    assert not outside, f"read the environment outside the config module: {outside}"


def test_nothing_writes_the_environment_but_the_documented_exception() -> None:
    writes = [
        f"{name}:{line} in {func}"
        for name, tree in TREES.items()
        for line, func in env_writes(tree)
        if (name, func) not in ALLOWED_WRITES
    ]
    assert not writes, f"writes to os.environ: {writes}"
    for module, func in ALLOWED_WRITES:
        node = next(
            n for n in ast.walk(TREES[module]) if isinstance(n, ast.FunctionDef) and n.name == func
        )
        assert ast.get_docstring(node), f"{module}.{func} must say why it writes the environment"


def test_the_checker_sees_reads_and_writes() -> None:
    source = (
        "import os\nfrom os import getenv\n"
        "def f():\n    os.environ['A'] = '1'\n    del os.environ['B']\n"
        "    os.environ.setdefault('C', '2')\n    return os.getenv('D')\n"
        "x = os.environ.get('E')\n"
    )
    tree = ast.parse(source)
    assert {line for line, _ in env_uses(tree)} == {2, 4, 5, 6, 7, 8}
    assert env_writes(tree) == [(4, "f"), (5, "f"), (6, "f")]
    # A parameter called environ (WSGI's) is not the process environment.
    assert env_uses(ast.parse("def app(environ, start):\n    environ.pop('X')\n")) == []


def test_the_config_modules_exist() -> None:
    for module in CONFIG_MODULES.values():
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module
