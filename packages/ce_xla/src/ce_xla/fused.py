"""The 6NHV path: statistics, ``dx`` and ``dw`` in one pass over each token chunk.

When the loss is reduced to a scalar, ``ce_core`` hands the backend ``cotangent_fn``, which turns a
chunk's statistics (and its slice of ``token_params``) into the cotangents of those statistics. So
once a token chunk's logits and statistics are known, its ``delta`` and its share of ``dx`` and
``dw`` can be formed right away from the same logits: three matmul passes (logits, dx, dw) like the
materialised reference, instead of four for forward-then-recompute. In vocab-chunked mode the
logits of a chunk are not all held at once, so they are recomputed tile by tile (8NHV).

That needs the gradient order ``"tokens_outer"`` (``dw`` accumulated in float32 across token
chunks). When the plan says ``"vocab_outer"`` (a bf16 ``w`` whose float32 ``dw`` does not fit the
keep-logits budget, or ``keep_logits=False``: see :mod:`ce_xla.tiling`), the statistics come first
and the gradients follow with the vocabulary outer (8NHV, no ``[H, V]`` float32 accumulator).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ce_core import CotangentFn, RowStats, StatsSpec
from ce_core.extend import vary_like
from ce_xla import tile_stats, vocab_outer
from ce_xla.backward import chunk_grads, dw_dtype, owned_rows
from ce_xla.forward import chunk_row_stats, empty_row_stats, row_stats
from ce_xla.loops import TokenRows, chunk_start, loop
from ce_xla.tiling import ChunkPlan


def row_stats_and_grads(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    spec: StatsSpec,
    plan: ChunkPlan,
    cotangent_fn: CotangentFn,
    token_params: Any,
    row_scale: jax.Array | None = None,
    token_rows: TokenRows | None = None,
) -> tuple[RowStats, jax.Array, jax.Array]:
    """Statistics (``max``/``argmax`` too when asked), ``dx`` (dtype of ``x``) and ``dw`` (dtype and
    layout of ``w``) for ``cotangent_fn``'s cotangents; with ``token_rows`` marking live rows, chunks of
    dead rows only are skipped (their statistics and ``dx`` rows stay 0)."""
    n, rows = x.shape[0], plan.token_chunk
    token_rows = token_rows or TokenRows(n)
    if not plan.fused:
        stats = row_stats(x, w, labels, spec, plan, row_scale, token_rows)
        dx, dw = vocab_outer.row_stats_grads(x, w, labels, stats, cotangent_fn(stats, token_params), spec, plan,
                                             row_scale, token_rows)
        return stats, dx, dw
    dtype = jnp.promote_types(x.dtype, w.dtype)

    def chunk(i, carry: tuple[RowStats, jax.Array, jax.Array]) -> tuple[RowStats, jax.Array, jax.Array]:
        stats, dx, dw = carry
        start, first_new = chunk_start(i, rows, n)
        piece = lambda a: token_rows.take(a, start, rows)  # noqa: E731
        x_chunk, labels_chunk = token_rows.take_rows(x, start, rows), piece(labels)
        scale = None if row_scale is None else piece(row_scale)
        stats_chunk, z = chunk_row_stats(x_chunk, w, labels_chunk, spec, plan, dtype, scale)
        cotangent = tile_stats.differentiable(cotangent_fn(stats_chunk, jax.tree.map(piece, token_params)))
        dx_chunk, dw = chunk_grads(x_chunk, w, labels_chunk, tile_stats.differentiable(stats_chunk), cotangent,
                                   spec, plan, dtype, dw, owned_rows(start, first_new, rows), z, scale)
        put = lambda full, part: token_rows.put(full, part, start)  # noqa: E731
        return jax.tree.map(put, stats, stats_chunk), put(dx, dx_chunk.astype(x.dtype)), dw

    dw = jnp.zeros(w.shape, dw_dtype(plan.token_chunks, w))  # float32 unless one token chunk
    initial = (empty_row_stats(n, spec), jnp.zeros(x.shape, x.dtype), dw)
    initial = vary_like(initial, x, w, labels, token_params, row_scale, token_rows.order)
    stats, dx, dw = loop(token_rows.chunks(rows), chunk, initial)
    return stats, dx, dw.astype(w.dtype)
