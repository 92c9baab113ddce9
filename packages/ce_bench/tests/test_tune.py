"""``ce-bench tune``: pallas_tpu's tiles chosen from libtpu's static schedules (compile only, no TPU).

Runs the real search on one bucket at a small shape with one candidate per kernel so that it cannot
rot; asserts what the records must satisfy by construction, never how fast anything is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ce_bench import cli
from ce_pallas_tpu.tooling import tune
from ce_pallas_tpu.tooling.schedule import mxu_cycles

#: The slow tier: libtpu static schedules (uv run pytest -m slow).
pytestmark = pytest.mark.slow

#: Every candidate block divides it (no ragged blocks: libtpu 0.0.52's profiler rejects some ragged backward
#: tiles at small shapes, such as 256/256/1536 at V=2048).
N, H, V = 1024, 256, 6144


def test_tune_measures_todays_entry_first_and_keeps_a_measured_candidate(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "tune.json"
    code = cli.main(["tune", "--target", "v5e", "--buckets", "llama3", "--candidates", "1", "--shape",
                     f"{N}x{H}x{V}", "--json", str(json_path), "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ratio" in printed and "HBM us/step" in printed and "kept" in printed
    rows = json.loads(json_path.read_text())
    assert [row["kernel"] for row in rows] == ["forward", "backward"]
    problem = tune.Problem(N, H, V)
    for row in rows:
        assert row["error"] is None, row
        assert (row["generation"], row["bucket"], row["n"], row["h"], row["v"]) == ("v5e", "llama3", N, H, V)
        # One candidate: today's entry (fitted to the small shape), and it is kept.
        incumbent = tune.incumbent_tiles("v5e", "llama3", row["kernel"], problem)
        assert incumbent is not None
        b, h, vb = row["tiles"]
        assert (b, vb) == (incumbent.block_b, incumbent.block_v)
        assert row["incumbent"] and row["chosen"]
        assert row["mxu_cycles_per_step"] == mxu_cycles("v5e", row["kernel"], b, h if row["kernel"] == "forward"
                                                        else H, vb)
        assert row["ratio"] == pytest.approx(row["cycles_per_step"] / row["mxu_cycles_per_step"])
        assert row["estimated_us"] >= row["kernel_us"]
    assert rows[1]["w_buffers"] in (1, 2)


def test_tune_exits_1_when_no_bucket_could_be_measured(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def nothing_compiles(generation: str, bucket: str, kernel: str, **_: object) -> tune.KernelChoice:
        raise tune.TuneError(f"no {kernel} candidate compiles for {generation}/{bucket}")

    monkeypatch.setattr(tune, "tune_kernel", nothing_compiles)
    assert cli.main(["tune", "--target", "v6e", "--buckets", "small,wide", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "nothing could be measured for small, wide" in captured.err
    assert "0 candidates measured" in captured.out


def test_tune_shapes_writes_the_users_cache_and_the_backend_then_plans_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--shapes`` with the RL objective: today's tiles measured first, the winner written to the cache
    file with its versions, and a plan of that very problem (and only that one) then takes it."""
    import jax.numpy as jnp

    from ce_core import StatsSpec
    from ce_pallas_tpu import ops, tile_cache
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    cache = tmp_path / "tiles.json"
    json_path = tmp_path / "tune.json"
    code = cli.main(["tune", "--target", "v5e", "--shapes", f"{N}x{H}x{V}", "--objective", "rl", "--candidates",
                     "1", "--cache", str(cache), "--json", str(json_path), "--quiet"])
    assert code == 0
    assert f"tile cache written: {cache}" in capsys.readouterr().out
    rows = json.loads(json_path.read_text())
    assert {row["kernel"] for row in rows} == {"forward", "backward"}
    assert all(row["error"] is None and row["variant"] == "rl" for row in rows), rows
    (cached,) = tile_cache.read_entries(cache)
    assert cached.key == tile_cache.CacheKey("v5e", N, H, V, "bfloat16", "bfloat16", "rl")
    assert cached.stale_because(tile_cache.installed_versions()) is None
    for kernel in ("forward", "backward"):
        kept = [row for row in rows if row["kernel"] == kernel and row["chosen"]]
        assert len(kept) == 1
        tiles = getattr(cached.entry, kernel)
        assert (tiles.block_b, tiles.block_v) == (kept[0]["tiles"][0], kept[0]["tiles"][2])
        assert getattr(cached.entry, f"{kernel}_ratio") == pytest.approx(kept[0]["ratio"], abs=5e-4)
        assert any(row["incumbent"] for row in rows if row["kernel"] == kernel)  # today's tiles were measured

    monkeypatch.setenv(tile_cache.CACHE_ENV, str(cache))
    ops._cached_plan.cache_clear()
    target = Target("v5e", CHIP_FACTS["v5e"].num_cores, None)
    rl = ops.make_plan(N, H, V, jnp.bfloat16, jnp.bfloat16, StatsSpec(with_expected=True), target)
    plain = ops.make_plan(N, H, V, jnp.bfloat16, jnp.bfloat16, StatsSpec(), target)
    ops._cached_plan.cache_clear()
    assert rl.source == "cache:v5e" and plain.source != "cache:v5e"
    assert (rl.backward.block_b, rl.backward.block_v) == (cached.entry.backward.block_b,
                                                          cached.entry.backward.block_v)
