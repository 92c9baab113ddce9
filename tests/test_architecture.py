"""The shape of the code: what each package may import, and no import cycles (read from the sources).

- A backend package and ce-bench import ``ce_core`` and ``ce_core.extend`` only: the rest of ce_core
  is private (docs/architecture.md).
- Inside ce_core, each room imports only the rooms below it: ``contract`` nothing but itself,
  ``sharded`` the contract, ``api`` both; only the public modules import ``api``.
- No module imports itself back through others, at import time or in a deferred import.
- Running a backend never loads the offline tooling (``tune``, ``schedule``, ``aot``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
#: ce_core's declared surface: the API, the backend authors' ``extend``, and ``policy`` (the RL token functions the
#: README imports from it; the schedule tool's RL baseline feeds its ``PolicyLoss`` too).
PUBLIC_CE_CORE = {"ce_core", "ce_core.extend", "ce_core.policy"}


def modules(package: str) -> dict[str, Path]:
    """Dotted module name -> source file, for one workspace package's ``src`` tree."""
    root = PACKAGES / package / "src"
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(path: Path, module: str) -> set[str]:
    """The modules ``path`` imports, wherever the import stands (relative imports resolved).

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``.
    """
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in ALL_MODULES else base)
    return names


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGES).with_suffix("").parts
    parts = parts[2:] if parts[1] == "src" else parts[1:]  # <package>/src/<module path>, or <package>/tests/...
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ALL_MODULES = {name: path for package in sorted(p.name for p in PACKAGES.iterdir() if p.is_dir())
               for name, path in modules(package).items()}


@pytest.mark.parametrize("package", ["ce_reference", "ce_xla", "ce_pallas_tpu", "ce_bench"])
def test_packages_import_only_ce_cores_declared_surface(package):
    sources = list((PACKAGES / package).rglob("*.py"))
    assert sources
    private = [f"{path.relative_to(PACKAGES)}: {name}" for path in sources
               for name in sorted(imported(path, module_name(path)))
               if name.split(".")[0] == "ce_core" and name not in PUBLIC_CE_CORE]
    assert private == [], "import from ce_core or ce_core.extend instead:\n" + "\n".join(private)


#: ce_core's rooms and the rooms each may import (besides itself).
CE_CORE_ROOMS = {"contract": set(), "sharded": {"contract"}, "api": {"contract", "sharded"}}


def test_ce_core_rooms_import_only_the_rooms_below_them():
    wrong = []
    for name, path in ALL_MODULES.items():
        parts = name.split(".")
        if parts[0] != "ce_core" or len(parts) < 3:
            continue  # the public modules (ce_core, ce_core.extend, ce_core.testing) may import any room
        room = parts[1]
        for target in sorted(imported(path, name)):
            target_parts = target.split(".")
            if target_parts[0] != "ce_core":
                continue
            target_room = target_parts[1] if len(target_parts) > 2 else "public"
            if target_room != room and target_room not in CE_CORE_ROOMS[room]:
                wrong.append(f"{name} -> {target}")
    assert wrong == [], "imports against the rooms' order:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = {name: sorted(n for n in imported(path, name) if n in ALL_MODULES and n != name)
             for name, path in ALL_MODULES.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in graph[name]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
    real = cycles
    assert real == [], "import cycles:\n" + "\n".join(real)


def test_running_a_backend_loads_no_offline_tooling():
    script = (
        "import sys; from ce_core import get_backend\n"
        "for name in ('pallas_tpu', 'xla', 'reference'): get_backend(name)\n"
        "import ce_pallas_tpu.ops, ce_pallas_tpu.backend\n"
        "tooling = ('ce_pallas_tpu.tooling', 'ce_pallas_tpu.aot', 'ce_bench', 'ce_core.testing')\n"
        "loaded = sorted(m for m in sys.modules if m in tooling or m.startswith(tuple(t + '.' for t in tooling)))\n"
        "print(loaded); sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


#: Roles both backends have, under one file name each (docs/architecture.md).
SHARED_ROLES = {
    "backend.py": "the Backend subclass and its entry point",
    "ops.py": "the differentiable row statistics (custom VJP) around the kernels or loops",
    "tiling.py": "tile and chunk sizes for a problem",
    "target.py": "facts about the hardware compiled for",
    "tile_stats.py": "the statistics of one tile of logits",
}


@pytest.mark.parametrize("package", ["ce_xla", "ce_pallas_tpu"])
def test_backends_name_the_same_roles_alike(package):
    files = {path.name for path in (PACKAGES / package / "src" / package).glob("*.py")}
    assert set(SHARED_ROLES) <= files, sorted(set(SHARED_ROLES) - files)
