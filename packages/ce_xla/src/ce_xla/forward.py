"""Forward pass: row statistics of ``s cap(x . w)``, streamed over token chunks (and vocab chunks).

Only one float32 logits chunk is alive at a time; the outputs are the ``[N]`` statistics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ce_core import RowStats, StatsSpec
from ce_core.extend import vary_like
from ce_xla import head, tile_stats
from ce_xla.loops import TokenRows, chunk_start, loop
from ce_xla.tiling import ChunkPlan


def chunk_row_stats(
    x_chunk: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, plan: ChunkPlan, dtype: jnp.dtype,
    scale: jax.Array | None = None,
) -> tuple[RowStats, jax.Array | None]:
    """Statistics of one token chunk's rows, and, in full-row mode, its float32 logits.

    Full-row mode computes the ``[rows, V]`` logits with one product and returns them so the fused
    gradient pass can reuse them; vocab-chunked mode keeps an online logsumexp over vocab tiles and
    returns ``None`` for the logits (the gradient pass recomputes them tile by tile). ``scale`` is
    the chunk's row scale (``None`` unless ``spec.with_row_scale``).
    """
    cap, layout = spec.logit_soft_cap, spec.w_layout
    flags = (spec.with_sum, spec.with_expected, spec.with_argmax)
    if plan.full_rows:
        z = tile_stats.logits(x_chunk, w, cap, dtype, layout, scale)
        return tile_stats.finish(tile_stats.tile_stats(z, labels, 0, None, *flags)), z

    width = plan.vocab_chunk

    def tile(j, state: tile_stats.TileStats) -> tile_stats.TileStats:
        start, first_new = chunk_start(j, width, plan.v)
        z = tile_stats.logits(x_chunk, head.vocab_slice(w, start, width, layout), cap, dtype, layout, scale)
        return tile_stats.merge(state, tile_stats.tile_stats(z, labels, start, first_new, *flags))

    initial = vary_like(tile_stats.empty_stats(x_chunk.shape[0], *flags), x_chunk, w, labels, scale)
    return tile_stats.finish(loop(plan.vocab_chunks, tile, initial)), None


def empty_row_stats(n: int, spec: StatsSpec) -> RowStats:
    """Zeros of every statistic ``spec`` asks for, ``[n]`` each (an output buffer to fill chunk by chunk)."""
    zeros = jnp.zeros((n,), jnp.float32)
    return RowStats(zeros, zeros, zeros if spec.with_sum else None, zeros if spec.with_expected else None,
                    zeros if spec.with_argmax else None, jnp.zeros((n,), jnp.int32) if spec.with_argmax else None)


def row_stats(x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, plan: ChunkPlan,
              row_scale: jax.Array | None = None, token_rows: TokenRows | None = None) -> RowStats:
    """``RowStats`` of every row of ``x`` (``[N, H]``) against ``w`` (``[H, V]`` or ``[V, H]``), ``[N]`` each.

    With ``token_rows`` marking live rows, only chunks holding live rows run; the other rows' statistics stay 0.
    """
    n, rows = x.shape[0], plan.token_chunk
    token_rows = token_rows or TokenRows(n)
    dtype = jnp.promote_types(x.dtype, w.dtype)

    def chunk(i, out: RowStats) -> RowStats:
        start, _ = chunk_start(i, rows, n)  # rows of an overlapping last chunk are rewritten, equal
        piece = lambda a: token_rows.take(a, start, rows)  # noqa: E731
        scale = None if row_scale is None else piece(row_scale)
        stats, _ = chunk_row_stats(token_rows.take_rows(x, start, rows), w, piece(labels), spec, plan, dtype, scale)
        return jax.tree.map(lambda full, part: token_rows.put(full, part, start), out, stats)

    initial = vary_like(empty_row_stats(n, spec), x, w, labels, row_scale, token_rows.order)
    return loop(token_rows.chunks(rows), chunk, initial)
