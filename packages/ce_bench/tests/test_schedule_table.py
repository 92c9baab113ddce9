"""``ce-bench schedule``'s table from records (no libtpu): the estimated time and its ratio to the roofline."""

from __future__ import annotations

import pytest

from ce_bench import schedule


def _record(**overrides: object) -> dict[str, object]:
    record: dict[str, object] = {
        "generation": "v6e", "shape": "4096x8192x128256", "x_dtype": "bfloat16", "w_dtype": "bfloat16",
        "kernel": "backward", "variant": "", "tiles": [128, 512, 1024], "w_buffers": 2, "grid": [1, 126, 32],
        "cycles_per_step": 20_000.0, "bundles_per_step": 9_000.0, "mxu_cycles_per_step": 16_384.0,
        "ratio": 1.25, "hbm_us_per_step": 7.0, "mxu_us_per_step": 9.36, "kernel_us": 47_000.0,
        "hbm_floor_us": 26_000.0, "roofline_us": 28_100.0, "error": None,
    }
    record.update(overrides)
    return record


def test_the_estimate_is_the_longer_of_the_static_cycles_and_the_hbm_floor() -> None:
    assert schedule.estimated_ms(_record()) == pytest.approx(47.0)
    assert schedule.estimated_ms(_record(hbm_floor_us=50_000.0)) == pytest.approx(50.0)


def test_the_table_shows_the_estimate_over_the_roofline() -> None:
    """A 128-row step on a 256-wide MXU: ratio 1.25 against its passes, 1.673 against the roofline."""
    record = _record()
    assert schedule.over_roofline(record) == pytest.approx(47.0 / 28.1)
    table = schedule.schedule_table([record], fmt="markdown")
    header, _, row = table.splitlines()[:3]
    assert header.rstrip(" |").endswith("est. / roofline")
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[-2:] == ["47.00", "1.673"]


def test_a_record_without_a_roofline_shows_a_dash() -> None:
    assert schedule.over_roofline(_record(roofline_us=None)) is None
    row = schedule.schedule_table([_record(roofline_us=None)], fmt="markdown").splitlines()[2]
    assert row.strip("| ").endswith("-")


def test_a_failed_record_fills_every_column() -> None:
    table = schedule.schedule_table([_record(error="out of VMEM")], fmt="markdown")
    header, _, row = table.splitlines()[:3]
    assert row.count("|") == header.count("|")
