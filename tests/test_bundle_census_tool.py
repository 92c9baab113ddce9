"""tools/bundle_census.py reads what a real compile does: the calibration matmul's MXU results, one pop per pass.

The finding its notes rest on (docs/notes/2026-12-04-rl-objective-matrix.md, "Where the step's bundles go"):
Mosaic pops every MXU pass's partial products and adds them on the vector unit, one pop per float32 output
register and 128-deep (v5e, v5p) or 256-deep (v6e) pass; v6e does four times v5e's MXU work a cycle, so its
pops and adds come four times as often per MXU cycle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Compiles for deviceless TPU topologies: the slow tier (about 10 s).
pytestmark = pytest.mark.slow

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bundle_census.py"


def _census(*args: str) -> dict:
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    done = subprocess.run([sys.executable, str(TOOL), "--json", *args], env=env, capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("generation", "mxu_side"), [("v6e", 256), ("v5e", 128)])
def test_a_plain_matmul_pops_each_output_register_once_a_pass(generation, mxu_side):
    for depth in (1024, 2048):
        result = _census("matmul", "--generation", generation, "--shape", f"512,{depth},512")
        per_register = result["per_output_register"]
        assert result["tile"] == [512, 512] and result["kernel"] == "census_matmul"
        assert per_register["mxu_pops"] == depth / mxu_side
        assert per_register["valu_ops"] >= depth / mxu_side - 1  # the passes' adds
        critical = result["critical_path"]
        assert 0 < critical["instructions"] <= result["bundles"] and 0 <= critical["store_share"] < 1
