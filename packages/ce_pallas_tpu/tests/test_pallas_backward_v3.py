"""The backward kernel at contract version 3: ``[V, H]`` heads and a per-row scale, in interpret mode.

``ops.row_stats_vjp`` (the backward kernel alone) is given the float64 oracle's statistics of the
whole rows and random cotangents of all four differentiable statistics, and its ``dx``/``dw`` are
compared with the oracle's, for both head layouts, row scale on and off, soft cap on and off. The
shapes are ragged in N, V and H (H not a multiple of 128, so every masking path meets the
interpreter's NaN garbage), with labels outside ``[0, V)``; v5e runs one core, v5p two (the vocab
split over them, the last core a block short where the block count is odd).
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call

import ce_pallas_tpu
from ce_core import BlockSizes, Problem, RowStats, StatsSpec
from ce_core.extend import TOLERANCES, max_rel_error, random_problem, stats_oracle
from ce_pallas_tpu import ops
from ce_pallas_tpu.target import Target

STATS = ("lse", "label", "sum", "expected")


def _races_found() -> bool:
    races = interpret_pallas_call.races
    assert races is not None, "race detection is off"
    return races.races_found


def _inputs(seed: int, n: int, h: int, v: int, layout: str, dtype: str, scaled: bool):
    """``x, w (in layout), labels, row_scale or None, cotangents``; x and w rounded to ``dtype``."""
    x, labels, w = random_problem(seed, (n,), h, v, ignore_fraction=0.0)
    labels = labels.copy()
    labels[:3] = [-1, v, v + 5]  # another shard's labels: no label term
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    if layout == "vh":
        w = jnp.asarray(np.ascontiguousarray(np.asarray(w, np.float32).T), dtype)
    rng = np.random.default_rng(seed + 1)
    scale = jnp.asarray(rng.uniform(0.3, 2.5, n), jnp.float32) if scaled else None
    cotangent = {name: rng.standard_normal(n).astype(np.float32) for name in STATS}
    return x, w, jnp.asarray(labels), scale, cotangent


def _check_against_oracle(target_setter, target: str, n: int, h: int, v: int, *, layout: str, scaled: bool,
                          cap: float | None, dtype: str = "float32", blocks: BlockSizes | None = None,
                          with_sum: bool = True, with_expected: bool = True, via_backend: bool = False) -> None:
    target_setter(target)
    x, w, labels, scale, cotangent = _inputs(n + h + v, n, h, v, layout, dtype, scaled)
    if not with_sum:
        cotangent["sum"] = np.zeros(n, np.float32)
    if not with_expected:
        cotangent["expected"] = np.zeros(n, np.float32)
    oracle = stats_oracle(np.asarray(x, np.float32), np.asarray(w, np.float32), np.asarray(labels),
                          w_layout=layout, logit_soft_cap=cap,
                          row_scale=None if scale is None else np.asarray(scale), cotangent=cotangent)
    spec = StatsSpec(logit_soft_cap=cap, with_sum=with_sum, with_expected=with_expected, block_sizes=blocks,
                     w_layout=layout, with_row_scale=scaled)
    stats = RowStats(*(jnp.asarray(oracle[name], jnp.float32) for name in STATS))
    cot = RowStats(*(jnp.asarray(cotangent[name]) for name in STATS))
    if via_backend:
        dx, dw = ce_pallas_tpu.make_backend().row_stats_vjp(x, w, labels, stats, cot, spec, row_scale=scale)
    else:
        dx, dw = ops.row_stats_vjp(x, w, labels, stats, cot, spec, row_scale=scale)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert dw.shape == w.shape and dw.dtype == w.dtype
    tolerance = TOLERANCES[dtype][1]
    assert max_rel_error(dx, oracle["dx"]) < tolerance
    assert max_rel_error(dw, oracle["dw"]) < tolerance
    assert not _races_found()


# Every switch flips at least once; both layouts on one and two cores, f32 and bf16. The fast tier runs
# three of them (both layouts, both dtypes, one and two cores, v6e's transposed dw); CI's interpreter
# tier (``pytest -m interpreter``) all of them.
FAST_CASES = [
    # target, layout, scaled, cap, dtype, (n, h, v), blocks
    ("v5p", "vh", True, 5.0, "float32", (77, 200, 333), BlockSizes(32, 128, 128)),
    ("v5e", "vh", False, None, "float32", (77, 200, 333), BlockSizes(32, 128, 128)),
    ("v5p", "hv", True, None, "float32", (77, 200, 333), BlockSizes(32, 128, 128)),
    ("v5e", "hv", True, 5.0, "bfloat16", (61, 136, 300), BlockSizes(32, 128, 128)),
    ("v5p", "vh", True, 30.0, "bfloat16", (61, 136, 300), BlockSizes(48, 128, 128)),
    # V a multiple of the vocab block, several blocks per core: dw's write-back with no ragged tail.
    ("v5e", "hv", False, None, "float32", (70, 200, 512), BlockSizes(32, 128, 128)),
    ("v5p", "vh", False, None, "bfloat16", (70, 200, 768), BlockSizes(32, 128, 128)),
    # v6e's 256-wide MXU and H = 384 (1.5 of its width): a [V, H] head's dw accumulated as [Hp, block_v]
    # and transposed on its way out (BackwardConfig.dw_transposed), the last vocab block ragged.
    ("v6e", "vh", True, 5.0, "float32", (77, 384, 700), BlockSizes(32, 128, 256)),
    ("v6e", "vh", False, None, "bfloat16", (70, 384, 512), BlockSizes(32, 384, 256)),
]


@pytest.mark.parametrize("target,layout,scaled,cap,dtype,shape,blocks",
                         [row if k in (0, 3, 7) else pytest.param(*row, marks=pytest.mark.interpreter)
                          for k, row in enumerate(FAST_CASES)],
                         ids=lambda value: str(value) if not isinstance(value, (tuple, BlockSizes)) else "")
def test_backward_matches_the_oracle(interpret, target, layout, scaled, cap, dtype, shape, blocks):
    _check_against_oracle(interpret, target, *shape, layout=layout, scaled=scaled, cap=cap, dtype=dtype,
                          blocks=blocks)


@pytest.mark.parametrize("generation,layout,h,block_v,transposed", [
    ("v6e", "vh", 896, 4096, True),  # Qwen2.5-0.5B: 3.5 MXU widths
    ("v6e", "vh", 384, 256, True),
    ("tpu7x", "vh", 896, 2048, True),
    ("v6e", "vh", 1024, 4096, False),  # whole MXU widths
    ("v6e", "vh", 900, 4096, False),  # H padded to Hp: the staged tile is not Hp wide
    ("v6e", "vh", 896, 128, False),  # a vocab block narrower than the MXU would waste it instead
    ("v6e", "hv", 896, 4096, False),  # an [H, V] head accumulates x.T @ delta already
    ("v5e", "vh", 896, 4096, False),  # 128-wide MXUs: 896 is 7 of them
])
def test_a_vh_dw_is_accumulated_transposed_where_its_hidden_size_half_fills_the_mxu(generation, layout, h,
                                                                                     block_v, transposed):
    """``delta.T @ x`` puts ``Hp`` on the MXU's output columns: at 3.5 of v6e's 256-wide passes an eighth
    of that product is wasted (Qwen2.5-0.5B's RL backward 1.168 of the MXU minimum against the ``[H, V]``
    head's 1.128, docs/notes/2026-11-27-tied-heads-backwards.md); ``x.T @ delta`` puts ``block_v`` there."""
    spec = StatsSpec(w_layout=layout, block_sizes=BlockSizes(256, None, block_v))
    plan = ops.make_plan(4096, h, 151936, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16), spec,
                         Target(generation, 1, None))
    assert plan.backward.block_v == block_v
    assert plan.backward.dw_transposed is transposed


@pytest.mark.slow
@pytest.mark.parametrize("target,layout,scaled,cap,dtype",
                         list(itertools.product(("v5e", "v5p"), ("hv", "vh"), (False, True), (None, 5.0),
                                                ("float32", "bfloat16"))))
def test_backward_matches_the_oracle_in_every_combination(interpret, target, layout, scaled, cap, dtype):
    """Every combination; a whole hidden chunk (block_h = Hp) and an odd vocab block count."""
    _check_against_oracle(interpret, target, 93, 328, 651, layout=layout, scaled=scaled, cap=cap, dtype=dtype,
                          blocks=BlockSizes(32, None if cap else 128, 128))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hv", "vh"])
@pytest.mark.parametrize("target", ["v5e", "v5p", "v6e"])
def test_backward_with_default_tiles_and_no_optional_statistics(interpret, target, layout):
    """Default tiles (the tables' small bucket) and only lse and the label logit asked for."""
    _check_against_oracle(interpret, target, 300, 256, 2000, layout=layout, scaled=True, cap=None,
                          dtype="bfloat16", with_sum=False, with_expected=False)


def test_backend_passes_the_row_scale_to_the_backward(interpret):
    _check_against_oracle(interpret, "v5p", 40, 128, 260, layout="vh", scaled=True, cap=2.0,
                          blocks=BlockSizes(16, 128, 128), via_backend=True)


def test_row_scale_is_given_exactly_when_the_spec_asks(interpret):
    interpret("v5e")
    x, w, labels, scale, cotangent = _inputs(3, 16, 128, 256, "vh", "float32", True)
    stats = RowStats(jnp.zeros(16), jnp.zeros(16))
    cot = RowStats(*(jnp.asarray(cotangent[name]) for name in ("lse", "label")))
    with pytest.raises(ValueError, match="row_scale"):
        ops.row_stats_vjp(x, w, labels, stats, cot, StatsSpec(w_layout="vh"), row_scale=scale)
    with pytest.raises(ValueError, match="row_scale"):
        ops.row_stats_vjp(x, w, labels, stats, cot, StatsSpec(w_layout="vh", with_row_scale=True))


def test_backend_takes_the_version_3_spec_fields(interpret):
    interpret("v5p")
    version = ce_pallas_tpu.make_backend().contract_version
    assert version is not None and version >= 3
    backend = ce_pallas_tpu.make_backend()
    f32 = jnp.dtype(jnp.float32)
    for layout, argmax, scaled in itertools.product(("hv", "vh"), (False, True), (False, True)):
        spec = StatsSpec(w_layout=layout, with_argmax=argmax, with_row_scale=scaled, logit_soft_cap=5.0)
        assert spec.needs_version <= version
        backend.check(Problem(100, 200, 300, f32, f32, spec))
