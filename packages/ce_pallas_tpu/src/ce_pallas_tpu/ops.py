"""Row statistics with a custom VJP: the forward kernel, then the backward kernel.

This is the wrapper around the kernels: it chooses the tiles and the target, merges the per-core
partial statistics of the forward, and sums the per-core ``dx`` partials of the backward. Nothing
is padded in HBM: ragged last token and vocab blocks, and a hidden size that is not a multiple of
128 (blocks then span its round-up), are masked inside the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TypedDict

import jax
import jax.numpy as jnp

from ce_core import PassTiles, RowStats, StatsSpec, TileReport
from ce_pallas_tpu import tile_cache, tiling
from ce_pallas_tpu.backward import BackwardConfig, backward_call
from ce_pallas_tpu.common import LiveBlocks, mxu_dtype, resolve_precision
from ce_pallas_tpu.cost_model import Shape
from ce_pallas_tpu.forward import ForwardConfig, forward_call, label_logits, merge_argmax, merge_cores, merge_expected
from ce_pallas_tpu.layout import LANES, cdiv, round_up
from ce_pallas_tpu.target import Target, active_cores, current_target, interpret_params


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one row-statistics call (hashable: a custom_vjp static argument).

    ``n``, ``h``, ``v``: the problem's sizes; each kernel's tiles are in its config (``block_b``,
    ``block_h``, ``block_v``); ``source``: where the tiles came from (``cache:<gen>``, ``table:<gen>/<bucket>``,
    ``inferred``, ``explicit``).
    """

    n: int
    h: int
    v: int
    forward: ForwardConfig
    backward: BackwardConfig
    source: str

    @property
    def hp(self) -> int:
        return self.forward.hp

    def report(self) -> TileReport:
        """The tiles and grids of both kernels, for ``Backend.block_sizes_for``."""
        f, b = self.forward, self.backward
        return TileReport(
            passes=(
                PassTiles("forward", f.block_sizes, (f.num_cores, f.nb, f.nv_per_core, f.nh)),
                PassTiles("backward", b.block_sizes, (b.num_cores, b.nv_per_core, b.nb)),
            ),
            source=self.source,
            details={"backward_w_buffers": str(b.w_buffers), "precision": f.precision},
        )


class _SharedConfig(TypedDict):
    """The fields both kernels' configs take from the problem and the target."""

    n: int
    hidden: int
    hp: int
    v: int
    logit_soft_cap: float | None
    with_sum: bool
    with_expected: bool
    w_layout: str
    with_row_scale: bool
    interpret: object
    vmem_limit_bytes: int | None
    precision: str
    mxu_side: int


def padded_hidden(h: int) -> int:
    return round_up(h, LANES)


def problem_shape(n: int, h: int, v: int, x_dtype, w_dtype, spec: StatsSpec) -> Shape:
    precision = resolve_precision(x_dtype, w_dtype, spec.precision)
    return Shape(
        n=n,
        hp=padded_hidden(h),
        v=v,
        x_bytes=jnp.dtype(x_dtype).itemsize,
        w_bytes=jnp.dtype(w_dtype).itemsize,
        with_sum=spec.with_sum,
        capped=spec.logit_soft_cap is not None,
        mxu_bytes=mxu_dtype(precision).itemsize,
        with_expected=spec.with_expected,
        with_argmax=spec.with_argmax,
        with_row_scale=spec.with_row_scale,
    )


def make_plan(
    n: int, h: int, v: int, x_dtype, w_dtype, spec: StatsSpec, target: Target | None = None
) -> Plan:
    """Tiles and kernel configurations for a problem on ``target`` (default: the current one, read now).

    Made once per problem and target: a call asks for it several times (the backend's check, the
    forward, the backward), and every argument is hashable, so the plans are cached (the user's tile
    cache, :mod:`ce_pallas_tpu.tile_cache`, is read when a problem is first planned in a process).
    """
    target = current_target() if target is None else target
    return _cached_plan(n, h, v, jnp.dtype(x_dtype), jnp.dtype(w_dtype), spec, target)


@functools.lru_cache(maxsize=256)
def _cached_plan(n: int, h: int, v: int, x_dtype: jnp.dtype, w_dtype: jnp.dtype, spec: StatsSpec,
                 target: Target) -> Plan:
    shape = problem_shape(n, h, v, x_dtype, w_dtype, spec)
    key = tile_cache.CacheKey(target.generation, n, h, v, x_dtype.name, w_dtype.name,
                              "rl" if spec.with_expected else "loss")
    tiles = tiling.resolve_tiles(shape, target, spec.block_sizes, tile_cache.lookup(key))
    interpret = interpret_params(target)
    limit = None if interpret else tiling.vmem_limit(target)
    common = _SharedConfig(
        n=n,
        hidden=h,
        hp=shape.hp,
        v=v,
        logit_soft_cap=spec.logit_soft_cap,
        with_sum=spec.with_sum,
        with_expected=spec.with_expected,
        w_layout=spec.w_layout,
        with_row_scale=spec.with_row_scale,
        interpret=interpret,
        vmem_limit_bytes=limit,
        precision=resolve_precision(x_dtype, w_dtype, spec.precision),
        mxu_side=target.facts.mxu_side,
    )
    nv_forward = cdiv(v, tiles.forward.block_v)
    nv_backward = cdiv(v, tiles.backward.block_v)
    forward = ForwardConfig(
        block_b=tiles.forward.block_b,
        block_h=tiles.forward.block_h,
        block_v=tiles.forward.block_v,
        num_cores=active_cores(target.num_cores, nv_forward),
        with_argmax=spec.with_argmax,
        **common,
    )
    backward = BackwardConfig(
        block_b=tiles.backward.block_b,
        block_h=tiles.backward.block_h,
        block_v=tiles.backward.block_v,
        num_cores=active_cores(target.num_cores, nv_backward),
        w_buffers=tiling.backward_w_buffers(shape, tiles.backward, target),
        **common,
    )
    return Plan(n, h, v, forward, backward, tiles.source)


def vocab_size(w: jax.Array, spec: StatsSpec) -> int:
    """``V`` of a head in ``spec.w_layout``."""
    return w.shape[0] if spec.w_layout == "vh" else w.shape[1]


def row_stats(x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, *,
              row_scale: jax.Array | None = None, live: jax.Array | None = None) -> RowStats:
    """lse, label logit and (optionally) logit sum, expected logit, max logit and its index of
    ``s * cap(x @ w)`` from the kernels; ``w`` in ``spec.w_layout``, ``row_scale`` (float32 ``[N]``, not
    differentiated) exactly when ``spec.with_row_scale``. With ``live`` (bool ``[N]``) token blocks with
    no live row are skipped by both kernels (:class:`ce_pallas_tpu.common.LiveBlocks`); dead rows'
    statistics are 0, their ``dx`` rows 0, and they add nothing to ``dw``."""
    n, h = x.shape
    plan = make_plan(n, h, vocab_size(w, spec), x.dtype, w.dtype, spec)
    return _row_stats(x, w, (labels, _row_scale_column(row_scale, plan), _live(live)), plan)


def row_stats_vjp(x: jax.Array, w: jax.Array, labels: jax.Array, stats: RowStats, cotangent: RowStats,
                  spec: StatsSpec, *, row_scale: jax.Array | None = None,
                  live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``dx, dw`` of the statistics from the backward kernel alone, given the rows' whole-vocab
    ``stats`` (their lse, and their expected logit when ``spec.with_expected``); ``row_scale``
    (float32 ``[N]``) exactly when ``spec.with_row_scale``; ``live`` as for :func:`row_stats`. ``dw`` has
    the layout of ``w``."""
    n, h = x.shape
    plan = make_plan(n, h, vocab_size(w, spec), x.dtype, w.dtype, spec)
    y = labels.astype(jnp.int32).reshape(-1, 1)
    scale = _row_scale_column(row_scale, plan)
    dx, dw = _row_stats_bwd(plan, (x, w, y, stats.lse, stats.expected, scale, _live(live)), cotangent)[:2]
    return dx, dw


def _live(live: jax.Array | None) -> jax.Array | None:
    return None if live is None else jax.lax.stop_gradient(live.reshape(-1).astype(bool))


def dead_rows_zeroed(stats: RowStats, live: jax.Array | None) -> RowStats:
    """``stats`` with dead rows' statistics 0: the kernels never write the rows of dead token blocks."""
    if live is None:
        return stats
    return jax.tree.map(lambda s: jnp.where(live, s, jnp.zeros((), s.dtype)), stats)


def inert_rows(lse: jax.Array, expected: jax.Array | None, cotangents: RowStats, live: jax.Array | None):
    """``(lse, expected, cotangents)`` with dead rows inert for the backward kernel: ``lse = +inf`` (so
    ``p = 0``), the rest 0, so a dead row in a live token block has ``delta = 0`` whatever its logits."""
    if live is None:
        return lse, expected, cotangents
    lse = jnp.where(live, lse, jnp.inf)
    expected = None if expected is None else jnp.where(live, expected, 0.0)
    def dead_zero(g: jax.Array | None) -> jax.Array | None:
        return None if g is None else jnp.where(live, g, jnp.zeros((), g.dtype))

    cotangents = cotangents._replace(lse=dead_zero(cotangents.lse), label=dead_zero(cotangents.label),
                                     sum=dead_zero(cotangents.sum), expected=dead_zero(cotangents.expected))
    return lse, expected, cotangents


def live_blocks(live: jax.Array | None, block_b: int) -> LiveBlocks | None:
    return None if live is None else LiveBlocks.of(live, block_b)


def merged_dx(dx_partials: jax.Array, n: int, h: int, live: jax.Array | None) -> jax.Array:
    """``dx [n, h]`` (float32) from the backward kernel's per-core partials ``[cores, Np, Hp]``, dead rows 0
    (a dead token block's rows were never written: garbage). The mask goes on every partial before the
    sum over cores, so XLA fuses it into the one reduction (masking the sum kept a second ``[N, H]``)."""
    rows = dx_partials[:, :n, :h]
    if live is not None:
        rows = jnp.where(live[None, :, None], rows, jnp.zeros((), rows.dtype))
    return jnp.sum(rows, axis=0) if rows.shape[0] > 1 else rows[0]


def _row_scale_column(row_scale: jax.Array | None, plan: Plan) -> jax.Array | None:
    """The row scale as the kernels take it (float32 ``[N, 1]``), checked against the plan."""
    if plan.backward.with_row_scale != (row_scale is not None):
        raise ValueError("pallas_tpu: row_scale must be given exactly when spec.with_row_scale")
    return None if row_scale is None else row_scale.astype(jnp.float32).reshape(-1, 1)


def _forward(x, w, inputs, plan: Plan):
    """The statistics, and the residuals ``(x, w, y, lse, expected, row scale column or None, live or None)``.

    ``inputs`` is ``(labels, row scale as a float32 [N, 1] column or None, live mask or None)``: one
    argument of the custom VJP, whose cotangent is None as a whole (none is differentiated).
    """
    labels, scale, live = inputs
    y = labels.astype(jnp.int32).reshape(-1, 1)
    partials = forward_call(x, w, y, plan.forward, scale, live_blocks=live_blocks(live, plan.forward.block_b))
    stats = dead_rows_zeroed(merge_partials(list(partials), x, w, y, plan.forward, scale), live)
    return stats, (x, w, y, stats.lse, stats.expected, scale, live)


def merge_partials(partials: list[jax.Array], x: jax.Array, w: jax.Array, y: jax.Array, cfg: ForwardConfig,
                   scale: jax.Array | None) -> RowStats:
    """The rows' statistics from the forward kernel's per-core partials (the label logit from
    :func:`label_logits` where the kernel does not pick it)."""
    lse_partials = partials.pop(0)
    lse = merge_cores(lse_partials, "logsumexp")
    label = merge_cores(partials.pop(0), "sum") if cfg.label_in_kernel else label_logits(x, w, y, cfg, scale)
    total = merge_cores(partials.pop(0), "sum") if cfg.with_sum else None
    expected = merge_expected(lse_partials, partials.pop(0), lse) if cfg.with_expected else None
    top, top_index = merge_argmax(partials.pop(0), partials.pop(0)) if cfg.with_argmax else (None, None)
    return RowStats(lse, label, total, expected, top, top_index)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _row_stats(x, w, inputs, plan: Plan) -> RowStats:
    return _forward(x, w, inputs, plan)[0]


def _row_stats_fwd(x, w, inputs, plan: Plan):
    return _forward(x, w, inputs, plan)


def _row_stats_bwd(plan: Plan, residuals, cotangents: RowStats):
    x, w, y, lse, expected, row_scale, live = residuals
    lse, expected, cotangents = inert_rows(lse, expected, cotangents, live)

    def column(g: jax.Array) -> jax.Array:
        return g.astype(jnp.float32).reshape(-1, 1)

    cfg = plan.backward
    g_sum = None if not cfg.with_sum or cotangents.sum is None else column(cotangents.sum)
    expected_column = g_expected = None
    if cfg.with_expected:
        if expected is None or cotangents.expected is None:
            raise ValueError("pallas_tpu: the expected logit's cotangent needs the rows' expected logit")
        expected_column, g_expected = column(expected), column(cotangents.expected)
    dx_partials, dw, _ = backward_call(x, w, y, column(lse), column(cotangents.lse), column(cotangents.label),
                                       g_sum, expected_column, g_expected, cfg, row_scale,
                                       live_blocks=live_blocks(live, cfg.block_b))
    return merged_dx(dx_partials, plan.n, plan.h, live).astype(x.dtype), dw, None


_row_stats.defvjp(_row_stats_fwd, _row_stats_bwd)
