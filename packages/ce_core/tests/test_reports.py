"""The report types backends and tools share: TileReport (Backend.block_sizes_for) and CompileResult."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import ce_core
from ce_core.testing import CompileResult, compile_program


def _report() -> ce_core.TileReport:
    return ce_core.TileReport(
        passes=(ce_core.PassTiles("forward", ce_core.BlockSizes(256, None, 512), (1, 4, 8)),
                ce_core.PassTiles("backward", ce_core.BlockSizes(128, 512, 1024))),
        source="inferred", details={"order": "tokens_outer"})


def test_a_tile_report_finds_its_passes_by_name_and_says_which_exist():
    report = _report()
    assert report["backward"].block_sizes.h_block_size == 512
    with pytest.raises(KeyError, match=r"no pass 'gradients'.*\['forward', 'backward'\]"):
        report["gradients"]


def test_a_tile_report_refuses_two_passes_of_one_name():
    tiles = ce_core.PassTiles("forward", ce_core.BlockSizes(8, None, 128))
    with pytest.raises(ValueError, match="distinct names"):
        ce_core.TileReport(passes=(tiles, tiles), source="explicit")


def test_a_tile_report_is_frozen_and_describes_itself_on_one_line():
    report = _report()
    with pytest.raises(TypeError):
        report.details["order"] = "vocab_outer"  # type: ignore[index]
    assert report.describe() == ("forward b=256 h=- v=512 grid=1x4x8; backward b=128 h=512 v=1024; "
                                 "source=inferred; order=tokens_outer")


def test_the_base_backend_reports_no_tiles_and_the_reference_none_either():
    problem = ce_core.Problem(4, 8, 16, jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), ce_core.StatsSpec())
    assert ce_core.get_backend("reference").block_sizes_for(problem) is None


def test_a_compile_result_has_the_sizes_of_the_program():
    n, h, v = 64, 32, 256

    def logits_sum(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(jnp.exp(x @ w), axis=1)

    args = (jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32))
    compiled, result = compile_program(lambda: jax.jit(logits_sum).lower(*args).compile())
    assert compiled is not None and result.ok and result.error is None and result.seconds > 0
    assert result.argument_bytes == 4 * (n * h + h * v) and result.output_bytes == 4 * n
    assert result.temp_bytes is not None and result.temp_bytes >= 0
    assert result.total_bytes == result.temp_bytes + result.argument_bytes + result.output_bytes - (
        result.alias_bytes or 0)
    assert CompileResult.of(compiled).temp_bytes == result.temp_bytes


def test_a_failed_compile_is_a_result_or_raises():
    def broken() -> object:
        raise ValueError("first line\nsecond line")

    compiled, result = compile_program(broken, raise_errors=False)
    assert compiled is None and not result.ok and result.error == "ValueError: first line"
    assert result.temp_bytes is None and result.total_bytes is None
    with pytest.raises(ValueError, match="first line"):
        compile_program(broken)
