"""``benchmarks/gpu_xla_tiles.py``, the script that chose the GPU budgets, still runs (on CPU, small shapes)."""

from __future__ import annotations

import pytest

from ce_xla import target


def _cells(rows: list[str]) -> list[list[str]]:
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


@pytest.mark.slow  # 15 s: every variant compiled; the forward mode below keeps the script in the fast tier
def test_every_variant_is_timed_with_its_own_plan_and_the_budgets_are_restored(load_benchmark_script):
    script = load_benchmark_script("gpu_xla_tiles.py")
    # The table compares today's budgets.
    assert ("GPU's (x4, 512 MiB statistics from 512 rows)", (target.GPU, "vocab_outer")) in script.VARIANTS.items()
    rows = script.measure_shape("narrow", 256, 512, 65536, repeats=1, platform="cpu")
    assert len(rows) == len(script.VARIANTS) + 1 and "matmul floor" in rows[-1]
    cells = _cells(rows)
    plans = {row[2]: row[3] for row in cells[:-1]}
    assert plans["TPU's (64/32/8 MiB)"] == "256x65536; 256x16384; vocab_outer"
    assert plans["GPU's (x4, 512 MiB statistics from 512 rows)"] == "256x65536; 256x65536; vocab_outer"
    assert plans["tokens outer, 512 MiB rows"].endswith("tokens_outer")
    for row in cells:
        assert float(row[4]) > 0 and row[5].endswith("x") and float(row[5][:-1]) > 0, row
    assert target.BUDGETS["cpu"] is target.CPU


@pytest.mark.slow  # it times every budget (8 s): the slow tier since 2026-12-03
def test_the_forward_mode_times_each_statistics_budget_beside_the_reference(load_benchmark_script):
    script = load_benchmark_script("gpu_xla_tiles.py")
    assert script.FORWARD_VARIANTS["GPU's (512 MiB, full rows from 512)"] == {}
    rows = script.measure_forward("narrow", 256, 512, 65536, repeats=1, platform="cpu")
    cells = _cells(rows)
    assert [row[2] for row in cells] == [*script.FORWARD_VARIANTS, "reference", "one matmul"]
    tiles = {row[2]: row[3] for row in cells}
    # CPU's other budgets kept: 256 rows fill each statistics tile; the vocabulary is one chunk from 64 MiB up.
    assert tiles["GPU's (512 MiB, full rows from 512)"] == "256x65536"
    for row in cells:
        assert float(row[4]) > 0 and float(row[5][:-1]) > 0, row
    assert target.BUDGETS["cpu"] is target.CPU


def test_only_runs_the_variants_named(load_benchmark_script):
    script = load_benchmark_script("gpu_xla_tiles.py")
    rows = script.measure_shape("tiny", 256, 128, 4096, repeats=1, platform="cpu", only="GPU's")
    assert [row[2] for row in _cells(rows)] == [name for name in script.VARIANTS if "GPU's" in name] + ["matmul floor"]
    forward = script.measure_forward("tiny", 256, 128, 4096, repeats=1, platform="cpu", only="1 GiB,2 GiB")
    assert [row[2] for row in _cells(forward)] == ["1 GiB", "2 GiB", "reference", "one matmul"]
