"""Presets, dtype parsing, the interleaved timer and the table renderer (no compilation)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from ce_bench import presets, report, timing
from ce_bench.records import Record, classify, short_reason


def test_presets_reduce_n_on_cpu_and_say_so() -> None:
    (llama,) = presets.parse_shapes("llama3-8b", reduced_for_cpu=True)
    assert (llama.h, llama.v) == (4096, 128256)
    cpu_n = presets.PRESETS["llama3-8b"].cpu_n
    assert cpu_n is not None and llama.n == cpu_n < presets.PRESETS["llama3-8b"].n
    assert "reduced" in llama.note and "8192" in llama.note
    (full,) = presets.parse_shapes("llama3-8b", reduced_for_cpu=False)
    assert full.n == 8192 and not full.note


def test_explicit_shapes_and_defaults() -> None:
    shapes = presets.parse_shapes("12x34x56, small", reduced_for_cpu=True)
    assert [(s.n, s.h, s.v) for s in shapes] == [(12, 34, 56), (1024, 512, 16384)]
    assert [s.name for s in presets.parse_shapes(None, reduced_for_cpu=True)] == list(presets.DEFAULT_RUN_SHAPES)
    assert presets.parse_shapes("qwen3", reduced_for_cpu=True, tokens=64)[0].n == 64
    assert presets.PRESETS["qwen3"].v == 151936 and presets.PRESETS["gemma3"].v == 262144


def test_models_group_is_every_head_at_both_token_counts() -> None:
    shapes = presets.parse_shapes("models,tiny", reduced_for_cpu=True)
    assert len(shapes) == 2 * len(presets.MODEL_HEADS) + 1
    by_name = {s.name: (s.n, s.h, s.v) for s in shapes}
    assert by_name["llama3-70b@16k"] == (16384, 8192, 128256)
    assert by_name["qwen2.5-0.5b@4k"] == (4096, 896, 151936)
    assert by_name["gemma2-2b@4k"] == (4096, 2304, 256000)
    assert {h for _, _, h, _ in presets.SHAPE_GROUPS["models"]} >= {896, 1024, 1536, 2304, 3584, 4096, 8192}
    halves = presets.parse_shapes("models@4k,models@16k", reduced_for_cpu=True)
    assert sorted(s.name for s in halves) == sorted(by_name.keys() - {"tiny"})
    assert {s.n for s in presets.parse_shapes("models@16k", reduced_for_cpu=False)} == {16384}


@pytest.mark.parametrize("bad", ["nope", "0x4x4", "3x4"])
def test_bad_shapes_are_value_errors(bad: str) -> None:
    with pytest.raises(ValueError, match="shape"):
        presets.parse_shapes(bad, reduced_for_cpu=True)


def test_dtypes() -> None:
    assert presets.parse_dtypes("bf16,float32") == [jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)]
    with pytest.raises(ValueError, match="unknown dtype"):
        presets.parse_dtypes("int8")


def test_interleaved_is_round_robin_with_rotation_and_survives_a_failure() -> None:
    calls: list[str] = []

    def make(name: str, fail_on: int | None = None):
        def fn() -> None:
            calls.append(name)
            if fail_on is not None and calls.count(name) == fail_on:
                raise RuntimeError(f"{name} broke")
        return fn

    results = timing.interleaved({"a": make("a"), "b": make("b"), "c": make("c", fail_on=2)}, repeats=3, warmup=1)
    # Round r starts at position r mod 3; c fails on its second call (round 1) and is dropped after.
    assert calls == ["a", "b", "c", "b", "c", "a", "a", "b", "a", "b"]
    assert len(results["a"].seconds) == 3 and len(results["b"].seconds) == 3
    assert results["c"].error and "c broke" in results["c"].error and results["c"].median_ms is None
    assert results["a"].median_ms is not None and results["a"].median_ms >= 0


def test_reasons_and_classification() -> None:
    from ce_core import UnsupportedError

    assert classify(UnsupportedError("no")) == "unsupported"
    assert classify(ExceptionGroup("all", [UnsupportedError("x"), NotImplementedError("y")])) == "unsupported"
    assert classify(RuntimeError("boom")) == "failed"
    assert short_reason(RuntimeError("line one\n\nline two\nline three")) == "RuntimeError: line one line two"


def test_tables_put_long_reasons_in_notes() -> None:
    records = [
        Record("reference", "tiny 1x2x3", 1, 2, 3, "float32", "mean", fwd_ms=1.0, fwd_bwd_ms=2.5,
               tokens_per_s=400.0, floor_ratio=1.25, temp_bytes=2048, max_rel_err=1e-6),
        Record("other", "tiny 1x2x3", 1, 2, 3, "float32", "mean", status="failed", reason="RuntimeError: boom"),
    ]
    text = report.run_table(records)
    assert "reference" in text and "1.25x" in text and "failed[1]" in text and "[1] RuntimeError: boom" in text
    markdown = report.run_table(records, "markdown")
    assert markdown.startswith("| backend |") and "| failed[1] |" in markdown
    compiled = report.compile_table([Record("reference", "s", 1, 2, 3, "bfloat16", "mean", status="compiled",
                                            temp_bytes=3 * 2**20, target="v5e")])
    assert "v5e" in compiled and "3.0 MiB" in compiled


def test_block_sizes_are_formatted_from_block_sizes_and_tile_reports() -> None:
    import ce_core
    from ce_bench.contenders import format_block_sizes

    report = ce_core.TileReport(
        passes=(ce_core.PassTiles("forward", ce_core.BlockSizes(512, None, 1024), (2, 16, 63, 1)),
                ce_core.PassTiles("backward", ce_core.BlockSizes(256, 512, 2048))),
        source="table:v5p/llama3", details={"precision": "default"})
    assert format_block_sizes(ce_core.BlockSizes(512, None, 1024)) == "b=512 h=- v=1024"
    assert format_block_sizes(report) == (
        "forward b=512 h=- v=1024 grid=2x16x63x1; backward b=256 h=512 v=2048; source=table:v5p/llama3; "
        "precision=default")
    assert format_block_sizes(None) is None
