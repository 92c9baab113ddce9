"""Gradients with the vocabulary as the outer loop: no ``[H, V]`` float32 accumulator.

For each slice of ``grad_chunk`` vocab entries, every token chunk is streamed: its logits tile is
recomputed, its ``delta`` formed from the known statistics, ``dx`` rows gain ``delta @ w_slice.T`` in a
float32 ``[N, H]`` accumulator, and the slice's float32 ``dw`` gains ``x_chunk.T @ delta``. The
slice is then written once, in ``w``'s dtype and layout (``[H, c]``, or ``[c, H]`` for a ``[V, H]``
head: :mod:`ce_xla.head`). Temporaries: ``4NH`` bytes of ``dx`` (none when ``x`` is float32: the
accumulator is the gradient) plus one ``dw`` slice and one tile, whatever ``V``.
Flops: 6NHV here, after a 2NHV statistics pass.

The overlapping last token chunk masks ``delta`` on rows an earlier chunk owns (they would add to
``dx`` twice); the overlapping last vocab slice masks columns the previous slice owns, and keeps
that slice's values of ``dw`` there when it writes its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ce_core import RowStats, StatsSpec
from ce_core.extend import vary_like
from ce_xla import head, tile_stats
from ce_xla.loops import TokenRows, chunk_start, loop
from ce_xla.tiling import ChunkPlan


def row_stats_grads(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    stats: RowStats,
    cotangent: RowStats,
    spec: StatsSpec,
    plan: ChunkPlan,
    row_scale: jax.Array | None = None,
    token_rows: TokenRows | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``dx`` (dtype of ``x``) and ``dw`` (dtype and layout of ``w``) for cotangents of the row statistics
    (with ``token_rows`` marking live rows, token chunks of dead rows only are skipped: their ``dx`` rows stay 0)."""
    stats, cotangent = tile_stats.differentiable(stats), tile_stats.differentiable(cotangent)
    layout = spec.w_layout
    n, (h, v) = x.shape[0], head.dims(w, layout)
    rows, width = plan.grad_token_chunk, plan.grad_chunk
    token_rows = token_rows or TokenRows(n)
    token_chunks = token_rows.chunks(rows)
    dtype = jnp.promote_types(x.dtype, w.dtype)
    product_dtype = tile_stats.grad_dtype(dtype)
    cap = spec.logit_soft_cap

    def vocab_slice(j, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        dx, dw = carry
        start, first_new = chunk_start(j, width, v)
        cols = tile_stats.column_ids(start, width)
        cols_owned = tile_stats.column_mask(cols, first_new)
        w_slice = head.vocab_slice(w, start, width, layout)
        w_product = w_slice.astype(product_dtype)

        def token_chunk(i, inner: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            dx, dw_slice = inner
            row_start, first_row = chunk_start(i, rows, n)
            piece = lambda a: token_rows.take(a, row_start, rows)  # noqa: E731
            x_chunk = token_rows.take_rows(x, row_start, rows)
            scale = None if row_scale is None else piece(row_scale)
            z = tile_stats.logits(x_chunk, w_slice, cap, dtype, layout, scale)
            owned = _owned(cols_owned, row_start, first_row, rows)
            delta = tile_stats.logit_cotangent(z, jax.tree.map(piece, stats), jax.tree.map(piece, cotangent),
                                               piece(labels), cols, owned, cap, scale).astype(product_dtype)
            dx_rows = piece(dx) + head.dx_product(delta, w_product, layout)
            dw_slice = dw_slice + head.dw_product(x_chunk.astype(product_dtype), delta, layout)
            return token_rows.put(dx, dx_rows, row_start), dw_slice

        dw_slice = vary_like(head.zeros_tile(h, width, layout), x, w_slice, dx, row_scale)
        dx, dw_slice = loop(token_chunks, token_chunk, (dx, dw_slice))
        dw_slice = dw_slice.astype(w.dtype)
        if width == v:
            return dx, dw_slice
        if cols_owned is not None:  # columns the previous slice owns keep its values
            dw_slice = jnp.where(head.column_mask_for(cols_owned, layout), dw_slice,
                                 head.vocab_slice(dw, start, width, layout))
        return dx, head.update_slice(dw, dw_slice, start, layout)

    initial = vary_like((jnp.zeros(x.shape, jnp.float32), jnp.zeros(w.shape, w.dtype)), x, w, labels, stats, cotangent,
                        row_scale, token_rows.order)
    dx, dw = loop(plan.grad_chunks, vocab_slice, initial)
    return dx.astype(x.dtype), dw


def _owned(cols_owned: jax.Array | None, row_start: jax.Array | int, first_row: jax.Array | int | None,
           rows: int) -> jax.Array | None:
    """Mask of the tile entries no earlier tile covered (``None``: all of them, statically)."""
    if first_row is None:
        return cols_owned
    rows_owned = (jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) + row_start) >= first_row
    return rows_owned if cols_owned is None else rows_owned & cols_owned
