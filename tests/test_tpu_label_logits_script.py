"""``benchmarks/tpu_label_logits.py``: the forward's work beside the kernel for a ``[V, H]`` head."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tpu_label_logits.py"


def test_shapes_are_three_positive_integers(load_benchmark_script):
    script = load_benchmark_script("tpu_label_logits.py")
    assert script.parse_shape("4096x1024x151936") == (4096, 1024, 151936)
    for text in ("4096x1024", "0x8x8", "ax8x8"):
        with pytest.raises(argparse.ArgumentTypeError, match="NxHxV"):
            script.parse_shape(text)


def test_profiles_are_read_by_op_name(load_benchmark_script, tmp_path):
    script = load_benchmark_script("tpu_label_logits.py")
    suffix = "_static_llo_profile.textproto"
    (tmp_path / f"ce_pallas_tpu_forward.1_TPU v6 lite{suffix}").write_text("estimated_cycles: 900\n")
    (tmp_path / f"gather_fusion_TPU v6 lite{suffix}").write_text("x: 1\nestimated_cycles: 12\n")
    (tmp_path / "unrelated.txt").write_text("estimated_cycles: 5\n")
    assert script.read_profiles(tmp_path) == {"ce_pallas_tpu_forward.1_TPU v6 lite": 900,
                                             "gather_fusion_TPU v6 lite": 12}


@pytest.mark.slow
def test_the_whole_forward_of_a_vh_head_is_profiled_beside_its_kernel():
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "512x256x4000", "--target", "v6e"], env=env,
                          check=True, capture_output=True, text=True, timeout=600)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ce_pallas_tpu_forward")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| 1.0000 |")
    assert "outside the kernel:" in done.stdout
