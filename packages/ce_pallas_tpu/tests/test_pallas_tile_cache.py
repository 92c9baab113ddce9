"""The user's tile cache: an entry for exactly this problem steers the plan; anything else does not.

No compile here (plans only); ``ce_bench``'s ``test_tune.py`` writes entries through ``ce-bench tune
--shapes`` with libtpu's schedules and compiles with them.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import pytest

from ce_core import BlockSizes, StatsSpec
from ce_pallas_tpu import ops, tile_cache
from ce_pallas_tpu.target import CHIP_FACTS, Target
from ce_pallas_tpu.tile_types import KernelTiles, TunedEntry

N, H, V = 4096, 1536, 151936
#: Tiles no rule would pick at this problem (the table's v6e large_vocab entry differs in every size).
CACHED = TunedEntry(forward=KernelTiles(512, None, 768), backward=KernelTiles(384, 512, 1280, w_buffers=1),
                    forward_ratio=1.01, backward_ratio=1.02)


def v6e() -> Target:
    return Target("v6e", CHIP_FACTS["v6e"].num_cores, None)


@pytest.fixture
def cache_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "tiles.json"
    monkeypatch.setenv(tile_cache.CACHE_ENV, str(path))
    ops._cached_plan.cache_clear()
    yield path
    ops._cached_plan.cache_clear()


def plan(x_dtype=jnp.bfloat16, spec: StatsSpec | None = None, n: int = N) -> ops.Plan:
    return ops.make_plan(n, H, V, x_dtype, jnp.bfloat16, spec or StatsSpec(), v6e())


def planned_tiles(p: ops.Plan) -> tuple[tuple[int, int, int], tuple[int, int, int, int]]:
    f, b = p.forward, p.backward
    return (f.block_b, f.block_h, f.block_v), (b.block_b, b.block_h, b.block_v, b.w_buffers)


def key(**changes: object) -> tile_cache.CacheKey:
    fields: dict[str, object] = dict(generation="v6e", n=N, h=H, v=V, x_dtype="bfloat16", w_dtype="bfloat16",
                                     objective="loss")
    fields.update(changes)
    return tile_cache.CacheKey(**fields)  # pyright: ignore[reportArgumentType]


def write(path: Path, cache_key: tile_cache.CacheKey, entry: TunedEntry = CACHED,
          versions: dict[str, str] | None = None) -> None:
    cached = tile_cache.make_entry(cache_key, entry)
    if versions:
        cached = tile_cache.CachedEntry(cached.key, entry, versions.get("libtpu", cached.libtpu),
                                        versions.get("ce_pallas_tpu", cached.ce_pallas_tpu))
    tile_cache.write_entries([cached], path)


def test_an_entry_for_exactly_this_problem_is_used(cache_file: Path) -> None:
    before = plan()
    assert before.source.startswith("table:")
    write(cache_file, key())
    ops._cached_plan.cache_clear()
    after = plan()
    assert after.source == "cache:v6e"
    assert planned_tiles(after) == ((512, 1536, 768), (384, 512, 1280, 1))
    assert planned_tiles(after) != planned_tiles(before)


def test_the_rl_objective_and_other_dtypes_and_shapes_have_their_own_entries(cache_file: Path) -> None:
    write(cache_file, key())
    ops._cached_plan.cache_clear()
    assert plan(spec=StatsSpec(with_expected=True)).source.startswith("table:")  # objective rl: not this entry
    assert not plan(x_dtype=jnp.float32).source.startswith("cache:")
    assert plan(n=N + 8).source.startswith("table:")
    write(cache_file, key(objective="rl"))
    ops._cached_plan.cache_clear()
    assert plan(spec=StatsSpec(with_expected=True)).source == "cache:v6e"
    assert len(json.loads(cache_file.read_text())["entries"]) == 2


def test_writing_the_same_key_again_replaces_its_entry(cache_file: Path) -> None:
    write(cache_file, key())
    other = TunedEntry(forward=KernelTiles(1024, None, 1024), backward=KernelTiles(256, 512, 1024, w_buffers=2))
    write(cache_file, key(), other)
    entries = tile_cache.read_entries(cache_file)
    assert len(entries) == 1 and entries[0].entry == other
    ops._cached_plan.cache_clear()
    assert planned_tiles(plan()) == ((1024, 1536, 1024), (256, 512, 1024, 2))


def test_explicit_block_sizes_come_before_the_cache(cache_file: Path) -> None:
    write(cache_file, key())
    ops._cached_plan.cache_clear()
    explicit = plan(spec=StatsSpec(block_sizes=BlockSizes(256, 512, 512)))
    assert explicit.source == "explicit"
    assert (explicit.forward.block_b, explicit.forward.block_v) == (256, 512)


@pytest.mark.parametrize("stale", ["libtpu", "ce_pallas_tpu"])
def test_a_stale_entry_is_ignored_with_a_warning_that_says_how_to_renew_it(cache_file: Path, stale: str) -> None:
    write(cache_file, key(), versions={stale: "0.0.0-measured-elsewhere"})
    ops._cached_plan.cache_clear()
    tile_cache._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match=rf"stale \(measured with {stale} 0.0.0-measured-elsewhere.*ce-bench tune "
                                            rf"--target v6e --shapes {N}x{H}x{V}"):
        assert plan().source.startswith("table:")


def test_an_unreadable_cache_is_ignored_with_a_warning_naming_the_file(cache_file: Path) -> None:
    cache_file.write_text('{"format": 1, "entries": [{"generation": "v6e"}]}')
    tile_cache._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match=rf"tile cache is ignored: {cache_file}"):
        assert plan().source.startswith("table:")
    with pytest.raises(ValueError, match="KeyError"):
        write(cache_file, key())  # a malformed file is not overwritten behind the user's back


def test_an_entry_too_large_for_a_problem_with_more_columns_is_not_used(cache_file: Path) -> None:
    """The logit sum (label smoothing) adds a per-row column: a kernel's cached tiles, measured without
    it, that would need more VMEM with it than where they compiled, and more than the budget (by the
    model), give way to the inferred ones."""
    huge = TunedEntry(forward=KernelTiles(2048, None, 4096), backward=KernelTiles(2048, 512, 4096, w_buffers=2))
    write(cache_file, key(), huge)
    ops._cached_plan.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan().source == "cache:v6e"  # at the problem it was measured at, it stands
        summed = plan(spec=StatsSpec(with_sum=True))
        assert summed.source == "cache:v6e (backward inferred)"
        assert (summed.backward.block_b, summed.backward.block_v) != (2048, 4096)


@pytest.mark.parametrize("value", ["off", ""])
def test_the_cache_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, value: str, tmp_path: Path) -> None:
    monkeypatch.setenv(tile_cache.CACHE_ENV, value)
    assert tile_cache.cache_path() is None
    with pytest.raises(ValueError, match="turned off"):
        tile_cache.write_entries([tile_cache.make_entry(key(), CACHED)])


def test_the_default_file_is_in_the_users_cache_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(tile_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tile_cache.cache_path() == tmp_path / "ce_pallas_tpu" / "tiles.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tile_cache.cache_path() == Path.home() / ".cache" / "ce_pallas_tpu" / "tiles.json"


def test_a_key_refuses_an_unknown_objective() -> None:
    with pytest.raises(ValueError, match="objective must be one of"):
        key(objective="ppo")
