"""The package layers: imports point downward only, and the library holds no tooling.

coordinator_cli → bench → local_fleet → proxy_node → coordinator. A module may use
its own layer and the ones below it. "Use" covers `import` statements and module
names written as strings: `importlib.import_module("x")`, tables of module names,
and `python -m x` command lines for child processes. Only coordinator_cli, the top,
may name every layer; nothing may name it except itself.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("coordinator", "proxy_node", "local_fleet", "bench", "coordinator_cli")
RANK = {name: i for i, name in enumerate(LAYERS)}
# A whole string that is a dotted module name of one of the packages.
MODULE_NAME = re.compile(rf"({'|'.join(LAYERS)})(\.[A-Za-z_]\w*)*")
# `-m pkg.mod` inside a longer command line string.
DASH_M = re.compile(rf"(?:^|\s)-m\s+((?:{'|'.join(LAYERS)})(?:\.[A-Za-z_]\w*)*)")
# The library must not hold benchmark, simulator, mock-engine or launcher code.
TOOLING_FILE = re.compile(r"sim|bench|mock|cluster|demo|embedded|launch|soak|fleet|replay")


@dataclass(frozen=True)
class Use:
    """One reference from a module to another package: where, what, and how."""

    path: Path
    line: int
    target: str  # dotted module name
    how: str  # "import" or "string"

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.how} {self.target}"


def modules(package: str) -> list[Path]:
    """Every Python file of a package."""
    return sorted((ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    """Dotted name of a module file (a package's __init__ names the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def uses(path: Path) -> Iterator[Use]:
    """Every import and every module name written as a string in one file."""
    return parse_uses(path.read_text(), module_name(path), path.name == "__init__.py", path)


def parse_uses(source: str, module: str, is_package: bool, path: Path) -> Iterator[Use]:
    """The uses in `source`, read as the module `module` (for relative imports)."""
    tree = ast.parse(source, filename=str(path))
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Use(path, node.lineno, alias.name, "import")
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            yield Use(path, node.lineno, target, "import")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if MODULE_NAME.fullmatch(node.value.strip()):
                yield Use(path, node.lineno, node.value.strip(), "string")
            for match in DASH_M.finditer(node.value):
                yield Use(path, node.lineno, match.group(1), "string")


def layer_of(dotted: str) -> str | None:
    """The package a dotted module name belongs to, if it is one of ours."""
    top = dotted.split(".", 1)[0]
    return top if top in RANK else None


def upward_uses(package: str) -> list[Use]:
    """References from `package` to a package above it."""
    out = []
    for path in modules(package):
        for use in uses(path):
            target = layer_of(use.target)
            if target is not None and RANK[target] > RANK[package]:
                out.append(use)
    return out


@pytest.mark.parametrize("package", LAYERS)
def test_no_module_uses_a_higher_layer(package: str) -> None:
    assert modules(package), f"{package}/ has no modules: is the layout list stale?"
    assert [str(u) for u in upward_uses(package)] == []


@pytest.mark.parametrize("package", LAYERS)
def test_no_package_module_uses_the_tests(package: str) -> None:
    """tests/ is not installed: a package that imports it breaks outside a checkout."""
    used = [
        str(u)
        for path in modules(package)
        for u in uses(path)
        if u.how == "import" and u.target.split(".")[0] == "tests"
    ]
    assert used == []


def test_the_scan_sees_imports_strings_and_command_lines() -> None:
    """The checker itself: each form of an upward reference is caught, prose is not."""
    source = (
        "import importlib\n"
        "from bench.sim import run\n"
        "import local_fleet.cluster as c\n"
        "TABLE = {'x': ('proxy_node.serve', 'help')}\n"
        "importlib.import_module('coordinator_cli.main')\n"
        "ARGS = ['python', '-m', 'local_fleet.mock_engine']\n"
        "CMD = 'python -m bench.live --limit 3'\n"
        "HELP = 'see coordinator bench sim, or the bench folder'\n"
        "from . import keys\n"
    )
    path = ROOT / "coordinator" / "probe.py"
    found = {u.target: u.line for u in parse_uses(source, "coordinator.probe", False, path)}
    upward = {t for t in found if RANK.get(layer_of(t) or "coordinator", 0) > 0}
    assert upward == {
        "bench.sim",
        "local_fleet.cluster",
        "proxy_node.serve",
        "coordinator_cli.main",
        "local_fleet.mock_engine",
        "bench.live",
    }
    assert found["coordinator"] == 9  # `from . import keys` stays in the library
    relative = parse_uses("from ..live import x\n", "bench.sim.cli", False, path)
    assert [u.target for u in relative] == ["bench.live"]


def test_only_the_cli_names_every_layer() -> None:
    """The CLI's dispatch tables do name the homes above the library (sanity of the scan)."""
    named = {
        layer_of(u.target)
        for path in modules("coordinator_cli")
        for u in uses(path)
        if u.how == "string"
    }
    assert {"proxy_node", "local_fleet", "bench"} <= named


def test_the_library_holds_no_tooling() -> None:
    library = modules("coordinator")
    tooling = [
        str(p.relative_to(ROOT))
        for p in library
        if TOOLING_FILE.search(str(p.relative_to(ROOT / "coordinator")))
    ]
    assert tooling == []
    # No library module touches anything but the library (or names it in a string).
    foreign = [
        str(u) for p in library for u in uses(p) if layer_of(u.target) not in (None, "coordinator")
    ]
    assert foreign == []
    # Its only non-Python files are the Lua scripts and the typing marker.
    others = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "coordinator").rglob("*")
        if p.is_file() and p.suffix not in (".py", ".lua", ".pyc") and p.name != "py.typed"
    )
    assert others == []
