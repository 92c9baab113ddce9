"""Tile selection: the tuned table, the inference rule, explicit sizes, the target at call time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ce_core
import ce_pallas_tpu
from ce_core import BlockSizes, Problem, StatsSpec, UnsupportedError
from ce_core.extend import random_problem
from ce_pallas_tpu import cost_model, ops, tiling
from ce_pallas_tpu.ops import problem_shape
from ce_pallas_tpu.target import CHIP_FACTS, Target, active_cores, current_target
from ce_pallas_tpu.tile_types import KernelTiles, TunedEntry
from ce_pallas_tpu.tooling import tune

GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")


#: The default statistics: a plain loss (no logit sum, no expected logit).
PLAIN = StatsSpec()


def _target(generation: str) -> Target:
    return Target(generation, CHIP_FACTS[generation].num_cores, None)


def _shape(n, h, v, dtype=jnp.bfloat16, spec=PLAIN):
    return problem_shape(n, h, v, dtype, dtype, spec)


def test_table_covers_every_generation_and_bucket():
    buckets = {name for name, _ in tiling.BUCKET_RULES}
    assert buckets == set(tiling.BUCKET_EXAMPLES)
    for generation in GENERATIONS:
        for bucket in buckets:
            assert (generation, bucket) in tiling.tuned_table()
    assert tiling.tuned_table() is ce_pallas_tpu.TUNED


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("bucket", sorted(tiling.BUCKET_EXAMPLES))
def test_each_entry_is_used_at_its_bucket_and_fits_vmem(generation, bucket):
    n, h, v = tiling.BUCKET_EXAMPLES[bucket]
    assert tiling.shape_bucket(n, h, v) == bucket
    shape = _shape(n, h, v)
    tiles = tiling.tuned_tiles(shape, _target(generation))
    assert tiles.source == f"table:{generation}/{bucket}"
    # Within the budget, or a tuned entry the model over-estimates: libtpu compiled it at this shape
    # (test_pallas_aot), and the tuner's prefilter bounds what it may try.
    bound = tiling.vmem_budget(_target(generation))
    if generation in tune.GENERATIONS[1:]:
        bound = max(bound, tiling.vmem_limit(_target(generation)) * tune.VMEM_PREFILTER_SLACK)
    assert cost_model.forward_bytes(shape, *tiles.forward.sizes, chip=_target(generation).facts) <= bound
    assert cost_model.backward_bytes(shape, *tiles.backward.sizes) <= bound


@pytest.mark.parametrize("generation", [*GENERATIONS, "default"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n,h,v", [(100, 64, 50), (4096, 8192, 256000), (65536, 5120, 200000), (8192, 3072, 32000)])
def test_inference_respects_each_generations_vmem(generation, dtype, n, h, v):
    target = _target(generation)
    shape = _shape(n, h, v, dtype)
    budget = tiling.vmem_budget(target)
    try:
        tiles = tiling._infer(shape, target, budget)
    except UnsupportedError:
        # Only float32 with a hidden size too large for a 16 MiB VMEM may be refused.
        assert dtype == jnp.float32 and target.vmem_bytes <= 16 * 2**20 and h >= 5120
        assert cost_model.backward_bytes(shape, 8, 512, 128) > budget
        return
    f, b = tiles.forward, tiles.backward
    assert cost_model.forward_bytes(shape, f.block_b, f.block_h, f.block_v, chip=target.facts) <= budget
    assert cost_model.backward_bytes(shape, b.block_b, b.block_h, b.block_v) <= budget
    assert shape.hp % f.block_h == 0 and shape.hp % b.block_h == 0
    assert (f.block_b % 8 == 0 or f.block_b == n) and (f.block_v % 128 == 0 or f.block_v == v)


def test_a_table_entry_that_does_not_fit_falls_back_to_inference():
    # v4's llama3 entry was chosen for bf16; in float32 it no longer fits in 16 MiB of VMEM.
    shape = _shape(8192, 4096, 128256, jnp.float32)
    tiles = tiling.tuned_tiles(shape, _target("v4"))
    assert tiles.source == "inferred"
    budget = tiling.vmem_budget(_target("v4"))
    assert cost_model.backward_bytes(shape, *tiles.backward.sizes) <= budget


def test_an_entry_above_the_models_budget_is_used_where_it_needs_no_more_than_where_it_compiled(monkeypatch):
    """The VMEM model only prefilters the tuner's candidates; libtpu's compile at the bucket's example
    shape decides. Such an entry (and its w_buffers) is used wherever the model says it needs no more
    VMEM than at that shape, and not where it needs more (float32 here)."""
    target = _target("v5p")
    backward = KernelTiles(512, 512, 1024, w_buffers=1)
    example = tiling.bucket_example("llama3")
    assert cost_model.backward_bytes(example, 512, 512, 1024) > tiling.vmem_budget(target)
    monkeypatch.setitem(ce_pallas_tpu.TUNED, ("v5p", "llama3"), TunedEntry(KernelTiles(512, None, 512), backward))
    shape = _shape(8192, 4096, 128256)
    tiles = tiling.tuned_tiles(shape, target)
    assert tiles.source == "table:v5p/llama3"
    assert (tiles.backward.block_b, tiles.backward.block_v, tiles.backward.w_buffers) == (512, 1024, 1)
    assert tiling.backward_w_buffers(shape, tiles.backward, target) == 1
    assert tiling.tuned_tiles(_shape(4096, 4096, 100000), target).source == "table:v5p/llama3"
    assert tiling.tuned_tiles(_shape(8192, 4096, 128256, jnp.float32), target).source == "inferred"


def test_an_entry_with_two_w_buffers_falls_back_to_one_before_inference(monkeypatch):
    target = _target("v5e")
    entry = TunedEntry(KernelTiles(512, None, 512), KernelTiles(256, 512, 2304, w_buffers=2))
    monkeypatch.setitem(ce_pallas_tpu.TUNED, ("v5e", "llama3"), entry)
    assert tiling.tuned_tiles(_shape(8192, 4096, 128256), target).backward.w_buffers == 2
    # The logit sum's cotangent is one more column: no longer within the example's footprint with two
    # buffers, which is over the budget (libtpu compiled it there).
    summed = _shape(8192, 4096, 128256, spec=StatsSpec(with_sum=True))
    need = cost_model.backward_bytes(summed, 256, 512, 2304, single_w=False)
    assert need > max(tiling.vmem_budget(target),
                      cost_model.backward_bytes(tiling.bucket_example("llama3"), 256, 512, 2304, single_w=False))
    tiles = tiling.tuned_tiles(summed, target)
    assert tiles.source == "table:v5e/llama3" and tiles.backward.w_buffers == 1


def test_fitted_tiles_is_a_deprecated_name_of_kernel_tiles():
    with pytest.warns(DeprecationWarning, match="use KernelTiles"):
        assert ce_pallas_tpu.FittedTiles is KernelTiles
    with pytest.raises(AttributeError):
        _ = ce_pallas_tpu.NoSuchName


def test_small_dimensions_become_whole_dimension_blocks():
    tiles = tiling.tuned_tiles(_shape(37, 48, 203), _target("v5p"))
    assert tiles.forward.block_b == 37 and tiles.forward.block_v == 203 and tiles.forward.block_h == 128


@pytest.mark.parametrize("n,block_b,expected", [(269, 256, 144), (4100, 2048, 1376), (3000, 2048, 1504),
                                                 (8192, 2048, 2048), (100, 256, 100), (2049, 1024, 688)])
def test_token_blocks_are_balanced_over_n(n, block_b, expected):
    assert tiling.balanced_rows(n, block_b) == expected


def test_balanced_token_blocks_keep_the_block_count_and_pad_less_than_a_row_unit_per_block():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n, block_b = int(rng.integers(1, 50000)), 16 * int(rng.integers(1, 129))
        rows = tiling.balanced_rows(n, block_b)
        blocks = -(-n // block_b)
        assert rows <= block_b and -(-n // rows) == blocks, (n, block_b, rows)
        assert blocks == 1 or (rows % 16 == 0 and blocks * rows - n < 16 * blocks), (n, block_b, rows)


def test_tuned_tiles_balance_the_token_blocks_and_explicit_ones_stay():
    shape = _shape(4100, 4096, 128256)
    tiles = tiling.tuned_tiles(shape, _target("v6e"))
    assert tiles.source == "table:v6e/llama3" and tiles.forward.block_b == 1376  # 2048 rows in the table
    assert tiles.backward.block_b == 256  # 17 blocks of 256 rows: 4352 rows either way
    explicit = tiling.resolve_tiles(shape, _target("v6e"), BlockSizes(1024, 512, 512))
    assert explicit.forward.block_b == explicit.backward.block_b == 1024  # 5 blocks; balanced would be 832
    partial = tiling.resolve_tiles(shape, _target("v6e"), BlockSizes(v_block_size=1024))
    assert partial.forward.block_b == 1376


def test_explicit_block_sizes_override_both_kernels():
    tiles = tiling.resolve_tiles(_shape(8192, 4096, 128256), _target("v5p"), BlockSizes(256, 1024, 384))
    assert tiles.source == "explicit"
    assert (tiles.forward.block_b, tiles.forward.block_h, tiles.forward.block_v) == (256, 1024, 384)
    assert (tiles.backward.block_b, tiles.backward.block_h, tiles.backward.block_v) == (256, 1024, 384)
    partial = tiling.resolve_tiles(_shape(8192, 4096, 128256), _target("v5p"), BlockSizes(v_block_size=256))
    assert partial.forward.block_v == partial.backward.block_v == 256


def test_explicit_block_sizes_alone_never_work_out_the_tuned_tiles(monkeypatch):
    def fail(*_):
        raise AssertionError("the tuned tiles were worked out")

    monkeypatch.setattr(tiling, "tuned_tiles", fail)
    monkeypatch.setattr(tiling, "_infer", fail)
    tiles = tiling.resolve_tiles(_shape(8192, 4096, 128256), _target("v5p"), BlockSizes(256, 1024, 384))
    assert tiles.source == "explicit" and tiles.backward.sizes == (256, 1024, 384)
    # A hidden size no tiles fit is still unsupported (the fallback chain moves on), not a ValueError.
    with pytest.raises(UnsupportedError, match="even with the smallest tiles"):
        tiling.resolve_tiles(_shape(4096, 16384, 256000, jnp.float32), _target("v4"), BlockSizes(256, 1024, 384))


def test_a_call_makes_its_plan_once(interpret):
    """The recompute path (the kept one plans its chunk's kernels apart: ``kept_logits.plan_chunks``)."""
    interpret("v5p")
    x, labels, w = random_problem(3, (40,), 128, 300)
    ops._cached_plan.cache_clear()

    def loss(x_, w_):
        return ce_core.linear_cross_entropy(x_, labels, w_, implementation="pallas_tpu", keep_logits=False)

    jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    info = ops._cached_plan.cache_info()
    assert info.misses == 1 and info.hits >= 1, info  # the backend's check, then the kernels


@pytest.mark.parametrize(
    "blocks,message",
    [
        (BlockSizes(b_block_size=12), "multiple of 8"),
        (BlockSizes(v_block_size=200), "multiple of 128"),
        (BlockSizes(h_block_size=100), "multiple of 128 that divides"),
        (BlockSizes(h_block_size=384), "divides the hidden size"),
        (BlockSizes(2048, None, 2048), "MiB"),
    ],
)
def test_invalid_explicit_block_sizes_say_why(blocks, message):
    with pytest.raises(ValueError, match=message):
        tiling.resolve_tiles(_shape(8192, 4096, 128256), _target("v4"), blocks)


def test_target_is_read_at_call_time(monkeypatch):
    bf16 = jnp.dtype(jnp.bfloat16)
    problem = ce_core.Problem(8192, 4096, 128256, bf16, bf16, ce_core.StatsSpec())
    backend = ce_core.get_backend("pallas_tpu")
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v4")
    v4 = backend.block_sizes_for(problem)
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v6e")
    v6e = backend.block_sizes_for(problem)
    assert v4 is not None and v6e is not None
    assert v4.source == "table:v4/llama3" and v6e.source == "table:v6e/llama3"
    v4_grid, v6e_grid = v4["forward"].grid, v6e["forward"].grid
    assert v4_grid is not None and v6e_grid is not None
    assert v4_grid[0] == 2 and v6e_grid[0] == 1  # two cores on v4
    assert v4["forward"].block_sizes != v6e["forward"].block_sizes


def test_target_spellings_and_unknown_target(monkeypatch):
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "TPU v5 lite")
    assert current_target() == Target("v5e", 1, None)
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    assert current_target() == Target("v5p", 2, "tpu")
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "plain")
    assert current_target() == Target("v5p", 2, "plain")
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "yes please")
    with pytest.raises(ValueError, match=r"CE_PALLAS_TPU_INTERPRET='yes please': use 1 .*, plain, or 0"):
        current_target()
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v99")
    with pytest.raises(ValueError, match="not a known TPU generation"):
        current_target()


def test_interpret_mode_defaults_to_a_two_core_target(monkeypatch):
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    assert current_target() == Target("v5p", 2, "tpu")


@pytest.mark.parametrize("cores,blocks,expected", [(2, 1, 1), (2, 2, 2), (2, 3, 2), (2, 251, 2), (4, 5, 3), (1, 7, 1)])
def test_every_active_core_gets_a_vocab_block(cores, blocks, expected):
    assert active_cores(cores, blocks) == expected


def _problem(n=512, h=256, v=1000, dtype=jnp.float32, spec=PLAIN):
    return Problem(n, h, v, jnp.dtype(dtype), jnp.dtype(dtype), spec)


def test_unsupported_problems_say_why(monkeypatch):
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v4")
    backend = ce_pallas_tpu.make_backend()
    with pytest.raises(UnsupportedError, match="float16"):
        backend.check(_problem(dtype=jnp.float16))
    with pytest.raises(UnsupportedError, match="VMEM"):
        backend.check(_problem(h=262144, v=128256))
    with pytest.raises(ValueError, match="multiple of 128"):
        backend.check(_problem(spec=StatsSpec(block_sizes=BlockSizes(v_block_size=100))))
    backend.check(_problem())


def test_unsupported_without_tpu_target_or_interpret():
    with pytest.raises(UnsupportedError, match="needs a TPU"):
        ce_pallas_tpu.make_backend().check(_problem())


def test_an_entry_is_judged_with_its_tiles_fitted_to_its_own_example():
    """v5p's 'small' entry streams the whole hidden dimension: at its example (H=1024) that is small,
    at H=5276 it is 121 MiB of VMEM by the model (77.7 MiB in libtpu, past v5p's 64). Judging the
    example with the problem's H let it through and the compile ran out of VMEM (a random-shapes
    seed found it); its forward must be refused and inferred within the budget."""
    target = _target("v5p")
    shape = _shape(2978, 5276, 12968)
    tiles = tiling.tuned_tiles(shape, target)
    assert tiles.source == "table:v5p/small (forward inferred)"  # the backward's entry still fits
    f = tiles.forward
    need = cost_model.forward_bytes(shape, f.block_b, f.block_h, f.block_v, chip=target.facts)
    assert need <= tiling.vmem_budget(target)
