"""``benchmarks/tpu_forward_layouts.py``, the probe that found the forward's unoverlapped label gap, still runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tpu_forward_layouts.py"


def test_tiles_that_are_not_whole_registers_are_refused_by_name(load_benchmark_script, capsys):
    script = load_benchmark_script("tpu_forward_layouts.py")
    for argv, name in ((["--tokens", "1000"], "--tokens"), (["--vocab", "100"], "--vocab"),
                       (["--tokens", "1024", "--row-chunk", "384"], "--row-chunk"),
                       (["--variants", "kernel,rows"], "--variants")):
        with pytest.raises(SystemExit):
            script.parse_args(argv)
        assert f"error: {name}" in capsys.readouterr().err


def test_an_interior_step_is_the_difference_of_two_grids_per_token_block(load_benchmark_script):
    script = load_benchmark_script("tpu_forward_layouts.py")
    assert script.per_step({2: 1000.0, 3: 1600.0}, 2) == 300.0


def _probe_rows(argv: list[str]) -> dict[str, list[str]]:
    """The probe's table at 256/all/512, H=256, RL: each variant's cells after its name."""
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "256", "--vocab", "512", "--hidden", "256",
                           "--objective", "rl", *argv], env=env, check=True, capture_output=True, text=True,
                          timeout=600)
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): cells[1:] for cells in rows[1:]}


@pytest.fixture(scope="module")
def default_rows() -> dict[str, list[str]]:
    """The probe's default table (every variant, the label pick in the kernel), run once for the module."""
    return _probe_rows([])


@pytest.mark.slow
def test_each_variant_compiles_for_v6e_and_reads_back_its_schedule(default_rows):
    for variant in ("kernel", "lanes", "tokens-on-lanes"):
        cells = default_rows[variant]
        cycles, mxu, ratio = float(cells[0]), float(cells[1]), float(cells[2])
        assert cycles > mxu == 128  # 256 rows through one 256x256 weight tile per 256 columns, 2 MXUs x 2 rows
        assert ratio == pytest.approx(cycles / mxu, abs=1e-3)
        assert float(cells[3]) > 0  # vector loads per logit register


@pytest.mark.slow
def test_a_vh_kernel_and_lanes_without_the_label_pick_load_less(default_rows):
    """The streamed kernel with a ``[V, H]`` head leaves the label pick to the wrapper: it loads less per
    logit register than with ``[H, V]``, as the stripped-down step does without its pick."""
    without = {variant: float(cells[3]) for variant, cells in
               _probe_rows(["--variants", "kernel,lanes", "--w-layout", "vh", "--without-label"]).items()}
    for variant in ("kernel", "lanes"):
        with_pick = float(default_rows[variant][3])
        assert without[variant] < with_pick - 0.5, (variant, with_pick, without)
