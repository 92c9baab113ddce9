"""``ce-bench aot``: compile for a TPU generation on a machine without one (needs libtpu)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ce_bench import cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="ahead-of-time TPU compilation needs libtpu (dev dependency group)")


@pytest.mark.slow
def test_aot_v5e_compiles_the_reference_backend_on_a_tiny_shape(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    json_path, png_path = tmp_path / "aot.json", tmp_path / "aot.png"
    code = cli.main(["aot", "--target", "v5e", "--shapes", "256x128x1024", "--backends", "reference",
                     "--json", str(json_path), "--plot", str(png_path), "--no-progress"])
    assert code == 0
    (record,) = json.loads(json_path.read_text())
    assert record["status"] == "compiled", record
    assert record["target"] == "v5e" and record["backend"] == "reference" and record["dtype"] == "bfloat16"
    assert record["temp_bytes"] > 0 and record["fwd_temp_bytes"] is not None
    # x, labels and w in bfloat16: 256*128*2 + 256*4 + 128*1024*2 bytes.
    assert record["argument_bytes"] >= 256 * 128 * 2 + 256 * 4 + 128 * 1024 * 2
    assert record["hbm_bytes"] > 10**10  # one v5e chip: 16 GiB class
    assert "TPU v5" in record["device"]
    assert png_path.read_bytes().startswith(b"\x89PNG")
    assert "compiled" in capsys.readouterr().out


def test_aot_unknown_target_is_an_argument_error() -> None:
    with pytest.raises(SystemExit):
        cli.main(["aot", "--target", "v9x"])


def test_aot_honours_tokamax_supported_on(tmp_path: Path) -> None:
    pytest.importorskip("tokamax")
    json_path = tmp_path / "aot-v4.json"
    code = cli.main(["aot", "--target", "v4", "--shapes", "256x128x1024", "--backends", "tokamax:mosaic_tpu",
                     "--json", str(json_path), "--no-progress", "--no-files"])
    assert code == 1  # its only row is unsupported: nothing was compiled
    (record,) = json.loads(json_path.read_text())
    assert record["status"] == "unsupported" and "supported_on" in record["reason"], record
