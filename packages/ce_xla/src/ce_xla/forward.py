"""Forward pass: row statistics of ``cap(x @ w)``, streamed over token chunks (and vocab chunks).

Only one float32 logits chunk is alive at a time; the outputs are the three ``[N]`` statistics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ce_core import RowStats, StatsSpec
from ce_core.extend import vary_like
from ce_xla import tiles
from ce_xla.chunking import ChunkPlan
from ce_xla.loops import chunk_start, loop


def chunk_row_stats(
    x_chunk: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, plan: ChunkPlan, dtype: jnp.dtype
) -> tuple[RowStats, jax.Array | None]:
    """Statistics of one token chunk's rows, and, in full-row mode, its float32 logits.

    Full-row mode computes the ``[rows, V]`` logits with one product and returns them so the fused
    gradient pass can reuse them; vocab-chunked mode keeps an online logsumexp over vocab tiles and
    returns ``None`` for the logits (the gradient pass recomputes them tile by tile).
    """
    cap = spec.logit_soft_cap
    if plan.full_rows:
        z = tiles.logits(x_chunk, w, cap, dtype)
        stats = tiles.tile_stats(z, labels, 0, None, spec.with_sum, spec.with_expected)
        return tiles.finish(stats), z

    width = plan.vocab_chunk

    def tile(j, state: tiles.TileStats) -> tiles.TileStats:
        start, first_new = chunk_start(j, width, plan.v)
        z = tiles.logits(x_chunk, jax.lax.dynamic_slice_in_dim(w, start, width, axis=1), cap, dtype)
        return tiles.merge(state, tiles.tile_stats(z, labels, start, first_new, spec.with_sum, spec.with_expected))

    initial = vary_like(tiles.empty_stats(x_chunk.shape[0], spec.with_sum, spec.with_expected), x_chunk, w, labels)
    return tiles.finish(loop(plan.vocab_chunks, tile, initial)), None


def row_stats(x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, plan: ChunkPlan) -> RowStats:
    """``RowStats`` of every row of ``x`` (``[N, H]``) against ``w`` (``[H, V]``), float32 ``[N]`` each."""
    n, rows = x.shape[0], plan.token_chunk
    dtype = jnp.promote_types(x.dtype, w.dtype)

    def chunk(i, out: RowStats) -> RowStats:
        start, _ = chunk_start(i, rows, n)  # rows of an overlapping last chunk are rewritten, equal
        x_chunk = jax.lax.dynamic_slice_in_dim(x, start, rows)
        labels_chunk = jax.lax.dynamic_slice_in_dim(labels, start, rows)
        stats, _ = chunk_row_stats(x_chunk, w, labels_chunk, spec, plan, dtype)
        return jax.tree.map(lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, start, 0), out, stats)

    zeros = jnp.zeros((n,), jnp.float32)
    initial = vary_like(RowStats(zeros, zeros, zeros if spec.with_sum else None, zeros if spec.with_expected else None),
                        x, w, labels)
    return loop(plan.token_chunks, chunk, initial)
