"""``benchmarks/tpu_vmem_model.py``, the script that fitted the VMEM model to libtpu's figure, still runs."""

from __future__ import annotations

import random

import pytest


def test_the_cases_are_distinct_seeded_and_within_reach_of_the_core(load_benchmark_script):
    script = load_benchmark_script("tpu_vmem_model.py")
    drawn = list(script.cases("v5p", 20, random.Random(7)))
    assert drawn == list(script.cases("v5p", 20, random.Random(7)))
    assert len({(kernel, n, h, v, tiles, name) for kernel, n, h, v, tiles, name, _ in drawn}) == 20
    for kernel, _, h, _, tiles, name, _ in drawn:
        assert (kernel, name) not in (("forward", "sum"), ("backward", "argmax"))
        assert (tiles.block_h is None) == (kernel == "forward") and (tiles.w_buffers is None) == (kernel == "forward")
        if kernel == "backward":
            assert (-(-h // 128) * 128) % tiles.block_h == 0  # a chunk that divides the padded hidden size


@pytest.mark.slow
def test_it_compiles_and_compares_a_few_kernels(load_benchmark_script, capsys):
    script = load_benchmark_script("tpu_vmem_model.py")
    script.main(["--targets", "v4", "--count", "1", "--seed", "3"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| v4 |")]
    assert len(rows) == 2  # one kernel, then the summary
    for row in rows[:1]:
        used, model, ratio = (float(cell) for cell in row.strip("|").split("|")[5:8])
        assert 0 < used <= model and ratio == pytest.approx(model / used, abs=0.01)
