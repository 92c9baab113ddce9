"""``benchmarks/gpu_xla_tiles.py``, the script that chose the GPU budgets, still runs (on CPU, small shapes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ce_xla import target

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_xla_tiles.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_xla_tiles", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_variant_is_timed_with_its_own_plan_and_the_budgets_are_restored():
    script = _load_script()
    assert ("GPU's (256/128/64)", (target.GPU, None)) in script.VARIANTS.items()  # the table compares today's budgets
    rows = script.measure_shape("narrow", 256, 512, 65536, repeats=1, platform="cpu")
    assert len(rows) == len(script.VARIANTS) + 1 and "matmul floor" in rows[-1]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    plans = {row[2]: row[3] for row in cells[:-1]}
    assert plans["TPU's (64/32/8 MiB)"] == "256x65536; 256x16384; vocab_outer"
    assert plans["GPU's (256/128/64)"] == "256x65536; 256x65536; vocab_outer"
    assert plans["tokens outer, 512 MiB rows"].endswith("tokens_outer")
    for row in cells:
        assert float(row[4]) > 0 and row[5].endswith("x") and float(row[5][:-1]) > 0, row
    assert target.BUDGETS["cpu"] is target.CPU
