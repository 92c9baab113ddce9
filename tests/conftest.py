"""Shared fixtures for the cross-package tests."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _load_script(path: Path) -> ModuleType:
    """Import a script that is not part of a package, as a module named after its folder and file."""
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_example() -> Callable[[str], ModuleType]:
    """Import a script of ``examples/`` by file name (the examples are not a package)."""
    return lambda filename: _load_script(EXAMPLES / filename)


@pytest.fixture(scope="session")
def load_benchmark_script() -> Callable[[str], ModuleType]:
    """Import a script of ``benchmarks/`` by file name (the GPU scripts, run by hand on a GPU)."""
    return lambda filename: _load_script(ROOT / "benchmarks" / filename)
