"""``--memory-shapes``: shapes compiled at full size next to the timed run (the default run's Llama-3
head), their table, and the reference-over-backend temporaries ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ce_bench import cli, presets, report
from ce_bench.commands import run
from ce_bench.records import Record


def _memory_shapes(argv: list[str]) -> list[presets.Shape]:
    parser = run.run_parser()
    return run.memory_shapes(parser, parser.parse_args(argv))


def test_the_default_run_compiles_the_llama3_head_at_full_size_and_explicit_shapes_do_not() -> None:
    (shape,) = _memory_shapes([])
    assert (shape.name, shape.n, shape.h, shape.v) == ("llama3-8b", 8192, 4096, 128256) and not shape.note
    assert _memory_shapes(["--shapes", "tiny"]) == []
    assert _memory_shapes(["--memory-shapes", "none"]) == []
    assert [s.label for s in _memory_shapes(["--shapes", "tiny", "--memory-shapes", "qwen3,64x8x128"])] == [
        "qwen3 8192x4096x151936", "64x8x128"]
    assert [s.n for s in _memory_shapes(["--tokens", "512"])] == [512]  # --tokens: every preset


def test_a_malformed_memory_shape_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--memory-shapes", "12x3"])
    assert exit_info.value.code == 2
    assert "--memory-shapes: malformed shape '12x3'" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.slow
def test_memory_shapes_are_compiled_not_run_and_compared_with_the_reference(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "run.json"
    # 2048 x 16384 float32 logits: 128 MiB the reference holds (twice, with their gradient); xla does not.
    assert cli.main(["--shapes", "32x16x256", "--memory-shapes", "2048x64x16384", "--backends", "reference,xla",
                     "--repeats", "1", "--no-floor", "--json", str(json_path), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    records = {(r["n"], r["backend"]): r for r in json.loads(json_path.read_text())}
    for name in ("reference", "xla"):
        assert records[32, name]["status"] == "ok" and records[32, name]["repeats"] == 1
        compiled = records[2048, name]
        assert compiled["status"] == "compiled" and compiled["repeats"] is None and compiled["fwd_bwd_ms"] is None
    reference, xla = records[2048, "reference"]["temp_bytes"], records[2048, "xla"]["temp_bytes"]
    assert reference >= 2 * 2048 * 16384 * 4 > xla
    header, tables = printed.split("\n\n", 1)
    assert header.endswith("compiled only, for their memory at full size: 2048x64x16384")
    timed_table, compiled_table = tables.split("Compiled only, not run")
    assert "fwd+bwd ms" in timed_table and "2048x64x16384" not in timed_table
    assert "fwd+bwd temp" in compiled_table
    ratio_line = next(line for line in printed.splitlines() if line.strip().startswith("2048x64x16384 float32:"))
    assert f"({reference / xla:.2f}x)" in ratio_line and ratio_line.strip().startswith(
        "2048x64x16384 float32: reference 256.0 MiB; xla")

    assert cli.main(["report", str(json_path)]) == 0  # the saved JSON gives the same tables
    again = capsys.readouterr().out
    assert "Compiled only, not run" in again and ratio_line in again


def _record(backend: str, temp: int | None, shape: str = "s", repeats: int | None = 1) -> Record:
    return Record(backend=backend, shape=shape, n=1, h=1, v=1, dtype="float32", reduction="mean", temp_bytes=temp,
                  repeats=repeats)


def test_memory_ratios_need_a_reference_and_keep_compiled_rows_apart() -> None:
    assert report.memory_ratios([_record("xla", 10), _record("tokamax:xla", 20)]) == ""
    assert report.memory_ratios([_record("reference", 10)]) == ""
    text = report.memory_ratios([
        _record("reference", 4 << 30), _record("xla", 40 << 20), _record("tokamax:xla", None),
        _record("reference", 1 << 20, repeats=None), _record("xla", 2 << 20, repeats=None)])
    head, timed, compiled = text.splitlines()
    assert "reference's over each backend's" in head
    assert timed == "  s float32: reference 4.0 GiB; xla 40.0 MiB (102x)"
    assert compiled == "  s float32: reference 1.0 MiB; xla 2.0 MiB (0.5x)"
    assert report.memory_ratios([_record("reference", 100), _record("xla", 10)], "markdown").endswith(
        "\n\n- s float32: reference 100 B; xla 10 B (10.0x)")
