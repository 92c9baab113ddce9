"""Shared fixtures for the cross-package tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import ce_core

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise ``backend_name`` over every backend available on this platform.

    pallas_tpu joins on CPU only with ``CE_PALLAS_TPU_INTERPRET=1``; its own package tests set that.
    A module that sets ``EIGHT_DEVICE_MESHES = True`` runs its ``backend_name`` tests on 8 simulated
    devices, where Pallas' race-checked TPU interpreter deadlocks in its cross-device barrier (and the
    generic interpreter is refused inside shard_map): there interpreted pallas_tpu is left
    out of ``backend_name``, and the module covers it with its own 4-device tests instead.
    """
    if "backend_name" in metafunc.fixturenames:
        names = ce_core.available_backends()
        if getattr(metafunc.module, "EIGHT_DEVICE_MESHES", False) and os.environ.get("CE_PALLAS_TPU_INTERPRET"):
            names = [name for name in names if name != "pallas_tpu"]
        metafunc.parametrize("backend_name", names)


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
