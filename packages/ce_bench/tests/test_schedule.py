"""``ce-bench schedule``: libtpu's static schedule of the pallas_tpu kernels (compile only, no TPU).

Runs the real measurement on one small shape so that it cannot rot; asserts what the numbers must
satisfy by construction, never how fast anything is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ce_bench import cli, schedule
from ce_pallas_tpu.tooling.schedule import SCHEDULE_CHIPS, mxu_cycles

#: The slow tier: libtpu static schedules (uv run pytest -m slow).
pytestmark = pytest.mark.slow

N, H, V = 512, 256, 2048


def test_schedule_reports_each_kernel_against_its_mxu_minimum(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "schedule.json"
    code = cli.main(["schedule", "--target", "v5e", "--shapes", f"{N}x{H}x{V}", "--json", str(json_path),
                     "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "cycles/step" in printed and "MXU min" in printed and "est. / roofline" in printed
    records = json.loads(json_path.read_text())
    assert [record["kernel"] for record in records] == ["forward", "backward"]
    chip = SCHEDULE_CHIPS["v5e"]
    for record in records:
        assert record["error"] is None, record
        assert (record["generation"], record["n"], record["h"], record["v"]) == ("v5e", N, H, V)
        b, h, vb = record["tiles"]
        hidden = h if record["kernel"] == "forward" else H
        assert record["mxu_cycles_per_step"] == mxu_cycles("v5e", record["kernel"], b, hidden, vb)
        assert record["ratio"] == pytest.approx(record["cycles_per_step"] / record["mxu_cycles_per_step"])
        # A step cannot beat its matmuls, and the kernel moves at least its operands' blocks.
        assert record["cycles_per_step"] > record["mxu_cycles_per_step"]
        assert record["bundles_per_step"] > 0
        assert record["hbm_bytes_per_step"] >= b * H * 2
        assert record["hbm_us_per_step"] == pytest.approx(record["hbm_bytes_per_step"] / chip.hbm_bytes_per_s * 1e6)
        # One vmatmul pushes 16 bf16 rows through a 128-wide MXU tile.
        assert record["vmatmuls_per_step"] == pytest.approx(record["mxu_cycles_per_step"] * 4 / 16, rel=1e-6)
        assert record["steps_per_core"] == record["grid"][1] * record["grid"][2] * (
            record["grid"][3] if record["kernel"] == "forward" else 1)
        # The estimate cannot beat the kernel's flops at the chip's peak.
        flops = (2 if record["kernel"] == "forward" else 6) * N * H * V
        assert record["roofline_us"] == pytest.approx(flops / chip.bf16_flops * 1e6)
        over = schedule.over_roofline(record)
        assert over is not None and over >= 1.0


def test_schedule_rejects_a_generation_libtpu_cannot_profile() -> None:
    with pytest.raises(SystemExit):
        cli.main(["schedule", "--target", "v4"])


def test_schedule_takes_a_tied_head_the_argmax_and_the_rl_objective(tmp_path: Path) -> None:
    """The variants issue 23 and 25 measure: each row says which it is, and each kernel schedules."""
    json_path = tmp_path / "schedule.json"
    code = cli.main(["schedule", "--target", "v5e", "--shapes", f"{N}x{H}x{V}", "--json", str(json_path),
                     "--quiet", "--w-layout", "vh", "--argmax", "--objective", "rl"])
    assert code == 0
    records = json.loads(json_path.read_text())
    assert [(r["kernel"], r["variant"]) for r in records] == [("forward", "vh+argmax+rl"), ("backward", "vh+rl")]
    for record in records:
        assert record["error"] is None, record
        assert record["cycles_per_step"] > record["mxu_cycles_per_step"]
