"""Gradient pass: ``dx = delta @ w.T`` and ``dw = x.T @ delta`` from the logit cotangent ``delta``.

(For a ``[V, H]`` head, ``dx = delta @ w`` and ``dw = delta.T @ x``: :mod:`ce_xla.head`.)

``delta`` exists one ``[rows, grad_chunk]`` tile at a time. :func:`row_stats_grads` is the VJP of
:func:`ce_xla.forward.row_stats`, which recomputes the logits from ``x`` and ``w`` (8NHV in all),
in the plan's gradient order: here with token chunks outer (a float32 ``dw`` accumulator), or in
:mod:`ce_xla.vocab_outer`. :func:`chunk_grads` handles one token chunk tokens outer (used by both
the fused path and the recompute path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ce_core import RowStats, StatsSpec
from ce_core.extend import vary_like
from ce_xla import head, tile_stats, vocab_outer
from ce_xla.loops import TokenRows, chunk_start, loop
from ce_xla.tiling import ChunkPlan


def chunk_grads(
    x_chunk: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    stats: RowStats,
    cotangent: RowStats,
    spec: StatsSpec,
    plan: ChunkPlan,
    dtype: jnp.dtype,
    dw: jax.Array,
    rows_owned: jax.Array | None,
    z: jax.Array | None = None,
    scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(dx_chunk, dw)``: this chunk's float32 ``dx`` rows, and ``dw`` plus this chunk's share (in ``dw``'s
    dtype: float32 across token chunks, or ``w``'s when there is one chunk, whose share is then final).

    ``stats`` are the chunk's rows' statistics over the whole vocabulary (lse, and the expected
    logit when its cotangent is given).

    ``z`` is the chunk's float32 logits when the forward pass kept them (full-row mode); otherwise
    each tile's logits are recomputed. ``rows_owned`` masks rows an overlapping last token chunk
    shares with the previous chunk, which must not add to ``dw`` a second time. ``scale`` is the
    chunk's row scale (``None`` unless ``spec.with_row_scale``).
    """
    cap, width, layout = spec.logit_soft_cap, plan.grad_chunk, spec.w_layout
    product_dtype = tile_stats.grad_dtype(dtype)
    x_for_dw = x_chunk if rows_owned is None else jnp.where(rows_owned[:, None], x_chunk, 0)
    x_for_dw = x_for_dw.astype(product_dtype)

    def tile(j, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        dx, dw = carry
        start, first_new = chunk_start(j, width, plan.v)
        cols = tile_stats.column_ids(start, width)
        w_tile = head.vocab_slice(w, start, width, layout)
        if z is None:
            z_tile = tile_stats.logits(x_chunk, w_tile, cap, dtype, layout, scale)
        else:
            z_tile = z if width == plan.v else jax.lax.dynamic_slice_in_dim(z, start, width, axis=1)
        owned = tile_stats.column_mask(cols, first_new)
        delta = tile_stats.logit_cotangent(z_tile, stats, cotangent, labels, cols, owned, cap, scale)
        delta = delta.astype(product_dtype)
        dx = dx + head.dx_product(delta, w_tile.astype(product_dtype), layout)
        dw_tile = head.dw_product(x_for_dw, delta, layout)
        if width == plan.v:
            return dx, (dw + dw_tile).astype(dw.dtype)
        dw_tile = (head.vocab_slice(dw, start, width, layout) + dw_tile).astype(dw.dtype)
        return dx, head.update_slice(dw, dw_tile, start, layout)

    dx = vary_like(jnp.zeros((x_chunk.shape[0], plan.h), jnp.float32), x_chunk, w, dw, scale)
    return loop(plan.grad_chunks, tile, (dx, dw))


def dw_dtype(token_chunks: int, w: jax.Array) -> jnp.dtype:
    """Tokens outer, the dtype ``dw`` accumulates in: float32 across several token chunks; ``w``'s own when
    there is one (its one share per column is rounded once either way), so no float32 ``[H, V]`` buffer
    is zeroed, updated and converted: at N=128 H=4096 V=128256 bf16 on CPU that cost more time than
    the 6NHV pass saved."""
    return jnp.dtype(w.dtype) if token_chunks == 1 else jnp.dtype(jnp.float32)


def owned_rows(start: jax.Array | int, first_new: jax.Array | int | None, rows: int) -> jax.Array | None:
    """Rows of a token chunk that no earlier chunk covered (``None``: all, statically)."""
    if first_new is None:
        return None
    return jnp.arange(rows, dtype=jnp.int32) + start >= first_new


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
    (with ``token_rows`` marking live rows, chunks of dead rows only are skipped: their ``dx`` rows stay 0)."""
    stats, cotangent = tile_stats.differentiable(stats), tile_stats.differentiable(cotangent)
    n, rows = x.shape[0], plan.grad_token_chunk  # not tied to the statistics rows: nothing is reused here
    token_rows = token_rows or TokenRows(n)
    if plan.gradient_order == "vocab_outer":
        return vocab_outer.row_stats_grads(x, w, labels, stats, cotangent, spec, plan, row_scale, token_rows)
    dtype = jnp.promote_types(x.dtype, w.dtype)

    def chunk(i, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        dx, dw = carry
        start, first_new = chunk_start(i, rows, n)
        piece = lambda a: token_rows.take(a, start, rows)  # noqa: E731
        dx_chunk, dw = chunk_grads(token_rows.take_rows(x, start, rows), w, piece(labels), jax.tree.map(piece, stats),
                                   jax.tree.map(piece, cotangent), spec, plan, dtype, dw,
                                   owned_rows(start, first_new, rows), None,
                                   None if row_scale is None else piece(row_scale))
        return token_rows.put(dx, dx_chunk.astype(x.dtype), start), dw

    initial = vary_like((jnp.zeros(x.shape, x.dtype), jnp.zeros(w.shape, dw_dtype(plan.grad_token_chunks, w))), x, w,
                        labels, stats, cotangent, row_scale, token_rows.order)
    dx, dw = loop(token_rows.chunks(rows), chunk, initial)
    return dx, dw.astype(w.dtype)
