"""``ce-bench tied``: a tied head passed as the table costs what an untied head costs (compile only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ce_bench import cli


def _records(tmp_path: Path, *args: str) -> list[dict]:
    path = tmp_path / "tied.json"
    assert cli.main(["tied", "--json", str(path), *args]) == 0
    return json.loads(path.read_text())


def test_tied_head_on_the_host_needs_no_copy_of_the_table(tmp_path: Path) -> None:
    records = {r["way"]: r for r in _records(tmp_path, "--shapes", "256x128x1000")}
    assert set(records) == {"vh", "transposed", "untied"}
    assert records["vh"]["head_copies"] == 0 and records["untied"]["head_copies"] == 0
    assert records["transposed"]["head_copies"] > 0  # the check sees the copy a transposed table costs
    assert records["vh"]["temp_bytes"] <= records["transposed"]["temp_bytes"]


@pytest.mark.slow
def test_tied_head_for_a_tpu_costs_what_an_untied_one_does(tmp_path: Path) -> None:
    """The command compiled for v5e: issue 23's bound (within 5%, or 8 MiB, of untied, and no copy) at a head whose
    transposed copy (32 MB) the check must see. The bound at model heads on every generation is
    ce_pallas_tpu's test_pallas_tied_memory's (a Qwen-like head here took 138 s of the slow tier until 2026-11-29)."""
    records = {r["way"]: r for r in _records(tmp_path, "--target", "v5e", "--shapes", "1024x512x32000",
                                             "--implementation", "pallas_tpu")}
    untied, tied = records["untied"]["temp_bytes"], records["vh"]["temp_bytes"]
    assert abs(tied - untied) <= max(0.05 * untied, 8 * 2**20)
    assert records["vh"]["head_copies"] == 0
    # What w_layout="vh" saves: the transposed table's copy (the default may keep logits on both, so the
    # ratio of the recompute-only figures, over 10x, is no longer the measure).
    assert records["transposed"]["head_copies"] > 0 and records["transposed"]["temp_bytes"] > untied
