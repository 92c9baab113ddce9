"""A pair of heads (contract version 5: a dense distillation teacher) over token chunks of whole rows.

Each chunk forms both heads' ``[rows, V]`` logits and takes the contract's elementwise formulas
(:mod:`ce_core.contract.pair`) on them. A chunk holds whole rows, so its statistics are final where it
stands, and when the divergence's cotangent is known in advance (a scalar loss) its ``delta``, its ``dx`` rows
and its share of ``dw`` (float32 across chunks) come from the same logits: ``2N(Hs + Ht)V + 4N Hs V`` of
products, what a step that materialises both heads runs. The backward of a per-token loss recomputes both
heads (``2N(Hs + Ht)V`` more). ``rows`` keeps one float32 ``[rows, V]`` tile within ``tile_bytes``. With ``live``
(the rows ce_core needs), the live rows are gathered to the front and only the chunks that hold them run
(:class:`ce_xla.loops.TokenRows`), so ignored tokens (a prompt, padding) cost no product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ce_core.extend import PairSpec, PairStats, pair_delta, pair_logits, pair_stats_of, vary_like
from ce_xla import head
from ce_xla.backward import owned_rows
from ce_xla.loops import TokenRows, chunk_start, loop

#: One float32 ``[rows, V]`` logits tile of a chunk (a chunk holds several: both heads, ``p``, ``delta``).
TILE_BYTES = 32 * 2**20
#: On CPU, one float32 ``[H, columns]`` product added into ``dw`` at a time: the whole ``[H, V]`` product would be
#: a second float32 ``dw`` (XLA's CPU backend does not accumulate a product into its operand in place). TPU and GPU
#: fuse the sum into the product's output, and there the sliced loop held more (v6e: 1,135 against 824 MB).
DW_SLICE_BYTES = 8 * 2**20


def chunk_rows(n: int, vocab: int, tile_bytes: int = TILE_BYTES) -> int:
    """Token rows per chunk: as many as keep one float32 ``[rows, V]`` tile within ``tile_bytes`` (8 at least)."""
    return max(1, min(n, max(8, tile_bytes // (4 * vocab))))



def pair_row_stats(x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array, spec: PairSpec,
                   row_scale: jax.Array, lse: tuple[jax.Array, jax.Array] | None, rows: int,
                   live: jax.Array | None = None) -> PairStats:
    """:class:`PairStats` of every (live) row, a chunk of ``rows`` at a time (0 at rows no chunk ran)."""
    n = x.shape[0]
    token_rows = TokenRows.of(n, live, most_rows=rows)

    def chunk(i, stats: PairStats) -> PairStats:
        start, _ = chunk_start(i, rows, n)
        piece = lambda values: token_rows.take(values, start, rows)  # noqa: E731
        a, b, _ = pair_logits(token_rows.take_rows(x, start, rows), w, token_rows.take_rows(teacher_x, start, rows),
                                teacher_w, spec, piece(row_scale))
        part = pair_stats_of(a, b, spec, None if lse is None else (piece(lse[0]), piece(lse[1])))
        return jax.tree.map(lambda full, p: token_rows.put(full, p, start), stats, part)

    initial = vary_like(_empty_stats(n, spec), x, w, teacher_x, teacher_w, row_scale, lse, token_rows.order)
    return loop(token_rows.chunks(rows), chunk, initial)


def pair_grads(x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array, spec: PairSpec,
               row_scale: jax.Array, g: jax.Array, rows: int, stats: PairStats | None = None,
               sliced_dw: bool = False, live: jax.Array | None = None) -> tuple[PairStats, jax.Array, jax.Array]:
    """Statistics, ``dx`` and ``dw`` of ``sum(g * divergence)``. ``stats`` given (the whole rows'): the backward
    of a per-token loss, the logits recomputed; ``None``: each chunk's own statistics (whole rows), one pass.
    ``sliced_dw``: add each chunk's ``dw`` a slice of columns at a time (CPU: :data:`DW_SLICE_BYTES`). Dead rows
    (``live`` false) must have ``g = 0``: their ``dx`` rows stay 0."""
    n = x.shape[0]
    dtype = jnp.promote_types(x.dtype, w.dtype)
    token_rows = TokenRows.of(n, live, most_rows=rows)

    def chunk(i, carry: tuple[PairStats, jax.Array, jax.Array]) -> tuple[PairStats, jax.Array, jax.Array]:
        all_stats, dx, dw = carry
        start, first_new = chunk_start(i, rows, n)
        piece = lambda values: token_rows.take(values, start, rows)  # noqa: E731
        x_chunk, scale, g_chunk = token_rows.take_rows(x, start, rows), piece(row_scale), piece(g)
        a, b, slope = pair_logits(x_chunk, w, token_rows.take_rows(teacher_x, start, rows), teacher_w, spec, scale)
        part = pair_stats_of(a, b, spec) if stats is None else jax.tree.map(piece, stats)
        owned = owned_rows(start, first_new, rows)
        if owned is not None:  # rows an earlier chunk covered add nothing more to dw
            g_chunk = jnp.where(owned, g_chunk, 0.0)
        delta = pair_delta(a, b, slope, scale, part, g_chunk, spec).astype(dtype)
        dw = _add_dw(dw, x_chunk, delta, spec.w_layout, sliced_dw)
        put = lambda full, p: token_rows.put(full, p, start)  # noqa: E731
        dx_chunk = head.dx_product(delta, w, spec.w_layout).astype(x.dtype)
        dx_chunk = dx_chunk if owned is None else jnp.where(owned[:, None], dx_chunk, piece(dx))
        return jax.tree.map(put, all_stats, part), put(dx, dx_chunk), dw

    initial = (_empty_stats(n, spec), jnp.zeros(x.shape, x.dtype), jnp.zeros(w.shape, jnp.float32))
    initial = vary_like(initial, x, w, teacher_x, teacher_w, row_scale, g, stats, token_rows.order)
    with head.precision_scope(spec.precision):
        all_stats, dx, dw = loop(token_rows.chunks(rows), chunk, initial)
    return all_stats, dx, dw.astype(w.dtype)


def _add_dw(dw: jax.Array, x_chunk: jax.Array, delta: jax.Array, layout: str, sliced: bool) -> jax.Array:
    """``dw`` plus ``x_chunk.T @ delta`` (in ``dw``'s layout), ``sliced``: a slice of columns at a time."""
    h, v = x_chunk.shape[1], delta.shape[1]
    width = max(128, DW_SLICE_BYTES // (4 * h) // 128 * 128)
    if not sliced or width >= v:
        return dw + head.dw_product(x_chunk, delta, layout)

    def columns(j, dw: jax.Array) -> jax.Array:
        start, first_new = chunk_start(j, width, v)
        part = jax.lax.dynamic_slice_in_dim(delta, start, width, axis=1)
        if first_new is not None:  # the last slice overlaps the one before: its shared columns are added once
            part = jnp.where(jnp.arange(width) + start >= first_new, part, jnp.zeros((), part.dtype))
        added = head.vocab_slice(dw, start, width, layout) + head.dw_product(x_chunk, part, layout)
        return head.update_slice(dw, added, start, layout)

    return loop(-(-v // width), columns, dw)


def _empty_stats(n: int, spec: PairSpec) -> PairStats:
    zeros = jnp.zeros((n,), jnp.float32)
    return PairStats(zeros, zeros, zeros, zeros if spec.divergence == "jsd" else None)
