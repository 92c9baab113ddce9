"""The math of one tile of logits ``z = cap(x_chunk @ w_tile)``: statistics and logit cotangent.

Everything here works on a ``[rows, cols]`` float32 tile whose columns are the global vocab ids
``start + [0, cols)``; with a row scale ``s`` (``StatsSpec.with_row_scale``) the tile is
``s_i cap(x_i . w_j)``. A label is never used as an unchecked index: the one-hot term of the logit
cotangent compares an iota of column ids with the label (no one-hot array), and the label logit
is a clamped ``[rows]`` gather that is then masked, so a label outside the tile, or outside
``[0, V)`` altogether (one owned by another vocab shard), contributes exactly 0. Columns a tile
shares with the previous tile (the last tile starts early rather than padding ``w``) are masked
and count for nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ce_core import RowStats
from ce_xla import head


def logits(x_chunk: jax.Array, w_tile: jax.Array, cap: float | None, dtype: jnp.dtype, layout: str = "hv",
           scale: jax.Array | None = None) -> jax.Array:
    """``s cap(x_chunk . w_tile)`` in float32, the product taken in ``dtype`` with float32 accumulation.

    ``w_tile`` is in ``layout`` (:mod:`ce_xla.head`); ``scale`` is the rows' ``s`` (``None``: 1).
    """
    raw = head.logits_product(x_chunk.astype(dtype), w_tile.astype(dtype), layout)
    z = raw if cap is None else cap * jnp.tanh(raw / cap)
    return z if scale is None else z * scale[:, None]


def grad_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """Operand dtype of the ``dx`` and ``dw`` products for inputs of ``dtype``.

    ``delta`` is a probability times a per-token coefficient (``1/N`` for a mean), often far below
    float16's smallest subnormal (6e-8), so float16 problems take their gradient products in
    float32; bfloat16 has float32's exponent range and keeps its fast products.
    """
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def column_ids(start: jax.Array | int, width: int) -> jax.Array:
    """Global vocab ids ``start + [0, width)`` as a ``[1, width]`` int32 row."""
    return jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) + jnp.asarray(start, jnp.int32)


def column_mask(cols: jax.Array, first_new: jax.Array | int | None) -> jax.Array | None:
    """Columns not already covered by the previous tile (``None``: all of them, statically)."""
    return None if first_new is None else cols >= first_new


class TileStats(NamedTuple):
    """Online-logsumexp state of a row chunk over the tiles seen so far (float32 ``[rows]``)."""

    max: jax.Array
    sumexp: jax.Array
    label: jax.Array
    total: jax.Array | None
    weighted: jax.Array | None  # sum_j exp(z_ij - max_i) z_ij: the expected logit times sumexp
    argmax: jax.Array | None = None  # int32: the lowest vocab id achieving ``max``


def tile_stats(
    z: jax.Array, labels: jax.Array, start: jax.Array | int, first_new: jax.Array | int | None, with_sum: bool,
    with_expected: bool = False, with_argmax: bool = False,
) -> TileStats:
    """Max, sum of ``exp(z - max)``, label logit and (optionally) logit sum, ``exp``-weighted logit sum
    and argmax of one tile.

    ``start`` is the vocab id of the tile's first column; columns below ``first_new`` belong to the
    previous tile and are masked (``None``: no overlap), so they never win the argmax either.
    """
    valid = column_mask(column_ids(start, z.shape[1]), first_new)
    masked = z if valid is None else jnp.where(valid, z, -jnp.inf)
    peak = jnp.max(masked, axis=1)
    exps = jnp.exp(masked - peak[:, None])
    label = label_logit(z, labels, start, first_new)
    owned_z = z if valid is None else jnp.where(valid, z, 0.0)  # columns the previous tile owns count for nothing
    total = jnp.sum(owned_z, axis=1) if with_sum else None
    if with_expected:  # one two-output reduction: exps is read once, never written out as a tile
        sumexp, weighted = jax.lax.reduce((exps, exps * owned_z), (jnp.float32(0), jnp.float32(0)), _add_pairs, (1,))
    else:
        sumexp, weighted = jnp.sum(exps, axis=1), None
    argmax = None
    if with_argmax:  # first column equal to the peak: the lowest index, as jnp.argmax
        argmax = jnp.argmax(masked, axis=1).astype(jnp.int32) + jnp.asarray(start, jnp.int32)
    return TileStats(peak, sumexp, label, total, weighted, argmax)


def _add_pairs(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return a[0] + b[0], a[1] + b[1]


def label_logit(
    z: jax.Array, labels: jax.Array, start: jax.Array | int, first_owned: jax.Array | int | None
) -> jax.Array:
    """``z[i, labels_i - start]`` where that column is in the tile (and owned by it), else 0.

    The label's column is picked with a clamped ``[rows]`` gather and then masked: O(rows) work
    instead of a compare-and-select pass over the whole tile. A label outside ``[0, V)`` (or in
    another tile) gives exactly 0; the clamped index is never used unmasked.
    """
    width = z.shape[1]
    local = labels - start
    inside = (local >= 0) & (local < width)
    if first_owned is not None:
        inside = inside & (labels >= first_owned)
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, width - 1)[:, None], axis=1)[:, 0]
    return jnp.where(inside, picked, 0.0)


def empty_stats(rows: int, with_sum: bool, with_expected: bool = False, with_argmax: bool = False) -> TileStats:
    """The state before any tile: max ``-inf``, sums 0 (argmax 0, replaced by the first tile's)."""
    zeros = jnp.zeros((rows,), jnp.float32)
    return TileStats(jnp.full((rows,), -jnp.inf, jnp.float32), zeros, zeros, zeros if with_sum else None,
                     zeros if with_expected else None, jnp.zeros((rows,), jnp.int32) if with_argmax else None)


def merge(a: TileStats, b: TileStats) -> TileStats:
    """The state over the tiles of ``a`` and then ``b``: the sums of exponentials rescaled to one max.

    ``a`` holds the lower vocab ids: on a tie of the maxima its argmax is kept (the lowest index).
    """
    peak = jnp.maximum(a.max, b.max)
    # a.max is -inf before the first tile; exp(-inf - finite) is 0, as it should be.
    scale_a, scale_b = jnp.exp(a.max - peak), jnp.exp(b.max - peak)
    sumexp = a.sumexp * scale_a + b.sumexp * scale_b
    total = None if a.total is None or b.total is None else a.total + b.total
    weighted = None if a.weighted is None or b.weighted is None else a.weighted * scale_a + b.weighted * scale_b
    argmax = None if a.argmax is None or b.argmax is None else jnp.where(b.max > a.max, b.argmax, a.argmax)
    return TileStats(peak, sumexp, a.label + b.label, total, weighted, argmax)


def finish(state: TileStats) -> RowStats:
    """Row statistics from the online state (the expected logit is the weighted sum over ``sumexp``)."""
    expected = None if state.weighted is None else state.weighted / state.sumexp
    top = None if state.argmax is None else state.max
    return RowStats(state.max + jnp.log(state.sumexp), state.label, state.total, expected, top, state.argmax)


def differentiable(stats: RowStats) -> RowStats:
    """``stats`` without ``max`` and ``argmax``: not differentiated, and never sliced as a cotangent
    (an integer output's cotangent is a ``float0`` array)."""
    return stats._replace(max=None, argmax=None)


def logit_cotangent(
    z: jax.Array,
    stats: RowStats,
    cotangent: RowStats,
    labels: jax.Array,
    cols: jax.Array,
    valid: jax.Array | None,
    cap: float | None,
    scale: jax.Array | None = None,
) -> jax.Array:
    """``delta`` of one tile, float32: the contract's logit cotangent times ``s cap'``.

    ``g_lse p + g_label [col == label] + g_sum + g_expected p (1 + z - expected)``, with ``p`` the
    softmax against the rows' ``stats.lse`` (which may cover a larger vocabulary than this tile's
    ``w``). ``cap'`` is written in terms of the capped logit: ``1 - tanh^2 = 1 - (z / (s c))^2``.
    With the expected logit the softmax terms are one expression ``p (a + b z)``, its per-row
    coefficients ``a = g_lse + g_expected (1 - expected)`` and ``b = g_expected`` formed on ``[rows]``
    first, so a tile costs two multiplies and an add per entry beyond ``p``, not five.
    """
    p = jnp.exp(z - stats.lse[:, None])
    if cotangent.expected is None:
        delta = cotangent.lse[:, None] * p
    else:
        if stats.expected is None:
            raise ValueError("a cotangent of the expected logit needs the rows' expected logit")
        a = cotangent.lse + cotangent.expected * (1.0 - stats.expected)
        delta = p * (a[:, None] + cotangent.expected[:, None] * z)
    delta = delta + jnp.where(cols == labels[:, None], cotangent.label[:, None], 0.0)
    if cotangent.sum is not None:
        delta = delta + cotangent.sum[:, None]
    if cap is not None:
        inverse = (1.0 / cap) if scale is None else (1.0 / cap) / scale[:, None]
        delta = delta * (1.0 - jnp.square(z * inverse))
    if scale is not None:
        delta = delta * scale[:, None]
    if valid is not None:
        delta = jnp.where(valid, delta, 0.0)
    return delta
