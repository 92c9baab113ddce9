"""Gradients with the vocabulary as the outer loop: no ``[H, V]`` float32 accumulator.

For each slice of ``grad_chunk`` vocab columns, every token chunk is streamed: its logits tile is
recomputed, its ``delta`` formed from the known statistics, ``dx`` rows gain ``delta @ w_slice.T`` in a
float32 ``[N, H]`` accumulator, and the slice's float32 ``dw`` gains ``x_chunk.T @ delta``. The
slice is then written once, in ``w``'s dtype. Temporaries: ``4NH`` bytes of ``dx`` (none when ``x``
is float32: the accumulator is the gradient) plus one ``dw`` slice and one tile, whatever ``V``.
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
from ce_xla import tiles
from ce_xla.chunking import ChunkPlan
from ce_xla.loops import chunk_start, loop
from ce_xla.tiles import CONTRACT_COLS, CONTRACT_ROWS


def row_stats_grads(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    stats: RowStats,
    cotangent: RowStats,
    spec: StatsSpec,
    plan: ChunkPlan,
) -> tuple[jax.Array, jax.Array]:
    """``dx`` (dtype of ``x``) and ``dw`` (dtype of ``w``) for cotangents of the row statistics."""
    n, v, h = x.shape[0], w.shape[1], w.shape[0]
    rows, width = plan.grad_token_chunk, plan.grad_chunk
    dtype = jnp.promote_types(x.dtype, w.dtype)
    product_dtype = tiles.grad_dtype(dtype)
    cap = spec.logit_soft_cap

    def vocab_slice(j, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        dx, dw = carry
        start, first_new = chunk_start(j, width, v)
        cols = tiles.column_ids(start, width)
        cols_owned = tiles.column_mask(cols, first_new)
        w_slice = w if width == v else jax.lax.dynamic_slice_in_dim(w, start, width, axis=1)
        w_product = w_slice.astype(product_dtype)

        def token_chunk(i, inner: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            dx, dw_slice = inner
            row_start, first_row = chunk_start(i, rows, n)
            piece = lambda a: jax.lax.dynamic_slice_in_dim(a, row_start, rows)  # noqa: E731
            x_chunk = piece(x)
            z = tiles.logits(x_chunk, w_slice, cap, dtype)
            owned = _owned(cols_owned, row_start, first_row, rows)
            delta = tiles.logit_cotangent(z, jax.tree.map(piece, stats), jax.tree.map(piece, cotangent),
                                          piece(labels), cols, owned, cap).astype(product_dtype)
            dx_rows = piece(dx) + jax.lax.dot_general(delta, w_product, CONTRACT_COLS,
                                                      preferred_element_type=jnp.float32)
            dw_slice = dw_slice + jax.lax.dot_general(x_chunk.astype(product_dtype), delta, CONTRACT_ROWS,
                                                      preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(dx, dx_rows, row_start, 0), dw_slice

        dw_slice = vary_like(jnp.zeros((h, width), jnp.float32), x, w_slice, dx)
        dx, dw_slice = loop(plan.grad_token_chunks, token_chunk, (dx, dw_slice))
        dw_slice = dw_slice.astype(w.dtype)
        if width == v:
            return dx, dw_slice
        if cols_owned is not None:  # columns the previous slice owns keep its values
            dw_slice = jnp.where(cols_owned, dw_slice, jax.lax.dynamic_slice_in_dim(dw, start, width, axis=1))
        return dx, jax.lax.dynamic_update_slice_in_dim(dw, dw_slice, start, axis=1)

    initial = vary_like((jnp.zeros(x.shape, jnp.float32), jnp.zeros(w.shape, w.dtype)), x, w, labels, stats, cotangent)
    dx, dw = loop(plan.grad_chunks, vocab_slice, initial)
    return dx.astype(x.dtype), dw


def _owned(cols_owned: jax.Array | None, row_start: jax.Array | int, first_row: jax.Array | int | None,
           rows: int) -> jax.Array | None:
    """Mask of the tile entries no earlier tile covered (``None``: all of them, statically)."""
    if first_row is None:
        return cols_owned
    rows_owned = (jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) + row_start) >= first_row
    return rows_owned if cols_owned is None else rows_owned & cols_owned
