"""Loop plumbing shared by the forward and gradient passes: chunk offsets, loops, and live rows.

A dimension of ``size`` is covered by ``ceil(size / chunk)`` chunks of exactly ``chunk`` elements;
the last one starts at ``size - chunk`` instead of being padded, so it may overlap the one before.
Its elements below ``index * chunk`` were already handled and must be masked where counting them
twice would be wrong (sums and accumulated gradients; per-row results are simply rewritten).

Token loops go through :class:`TokenRows`: every row in order, or, when ``ce_core`` marks the rows
that count (the ``live`` mask of contract version 4), the live rows first (a stable partition) and
only as many chunks as they fill, so ignored tokens cost no matmul.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def chunk_start(index: jax.Array | int, chunk: int, size: int) -> tuple[jax.Array | int, jax.Array | int | None]:
    """``(start, first_new)`` of chunk ``index``: where it starts, and the first element it owns.

    ``first_new`` is ``None`` when chunks tile ``size`` exactly (no overlap is possible).
    """
    if size % chunk == 0:
        return index * chunk, None
    first_new = index * chunk
    return jnp.minimum(first_new, size - chunk), first_new


def loop[Carry](count: int | jax.Array, body: Callable[[Any, Carry], Carry], carry: Carry) -> Carry:
    """``fori_loop(0, count, body, carry)``, or a plain call with index 0 when there is one chunk.

    ``count`` may be traced (live chunks only): the loop then runs that many times, never differentiated.
    """
    if isinstance(count, int) and count == 1:
        return body(0, carry)
    return jax.lax.fori_loop(0, count, body, carry)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["order", "live", "mask"], meta_fields=["n"])
@dataclasses.dataclass(frozen=True)
class TokenRows:
    """The token rows a pass visits, and how a chunk of them is read and written.

    ``order is None``: rows ``0..n-1`` in place (contiguous slices; with a ``mask``, one chunk of
    all of them, dead rows zeroed when read). Otherwise ``order`` lists the
    live rows first, in their original order, then the dead ones, and ``live`` counts the live
    ones (``mask`` marks them): a chunk at ``start`` holds rows ``order[start:start + rows]``, gathered,
    and its results are scattered back to those rows. Chunks past the live rows are never run; the last live chunk
    may hold dead rows, which are computed like the others (their cotangents are zero).
    """

    n: int
    order: jax.Array | None = None
    live: jax.Array | None = None
    mask: jax.Array | None = None

    @classmethod
    def of(cls, n: int, live_mask: jax.Array | None, most_rows: int | None = None) -> TokenRows:
        """All ``n`` rows, or the rows where ``live_mask`` (bool ``[n]``) is set, first.

        ``most_rows``: the largest token chunk the passes use. When it covers all ``n`` rows there is
        one chunk, which always runs: the rows stay in place (no partition, no gathers), only masked.
        """
        if live_mask is None:
            return cls(n)
        live_mask = live_mask.astype(bool)
        if most_rows is not None and most_rows >= n:
            return cls(n, mask=live_mask)
        live_count = jnp.sum(live_mask, dtype=jnp.int32)
        # A stable partition in O(n): live rows take slots 0.., dead rows slots live_count.. .
        slot = jnp.where(live_mask, jnp.cumsum(live_mask, dtype=jnp.int32) - 1,
                         live_count + jnp.cumsum(~live_mask, dtype=jnp.int32) - 1)
        order = jnp.zeros((n,), jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
        return cls(n, order, live_count, live_mask)

    def chunks(self, rows: int) -> int | jax.Array:
        """How many chunks of ``rows`` rows a pass runs: all of them, or those holding live rows.

        One chunk always runs (a static count of 1): a loop with a traced trip count would carry the
        ``dw`` buffer through a ``while``, a copy of the head's size, to save work only when no row is live.
        """
        chunks = -(-self.n // rows)
        if self.live is None or chunks == 1:
            return chunks
        return (self.live + rows - 1) // rows

    def take(self, values: jax.Array, start: jax.Array | int, rows: int) -> jax.Array:
        """The chunk's rows of a per-token array (``[n, ...]``)."""
        if self.order is None:
            return jax.lax.dynamic_slice_in_dim(values, start, rows)
        return jnp.asarray(values).at[self.indices(start, rows)].get(unique_indices=True, mode="promise_in_bounds")

    def take_rows(self, x: jax.Array, start: jax.Array | int, rows: int) -> jax.Array:
        """The chunk's rows of ``x`` (``[n, H]``), dead rows as zeros: a dead row a live chunk computes
        then has finite logits whatever ``x`` holds there (padding may be garbage), so with its zero
        cotangent it adds exactly nothing to ``dw``."""
        part = self.take(x, start, rows)
        if self.mask is None:
            return part
        return jnp.where(self.take(self.mask, start, rows)[:, None], part, jnp.zeros((), part.dtype))

    def put(self, values: jax.Array, part: jax.Array, start: jax.Array | int) -> jax.Array:
        """``values`` with the chunk's rows set to ``part``."""
        if self.order is None:
            return jax.lax.dynamic_update_slice_in_dim(values, part, start, 0)
        index = self.indices(start, part.shape[0])
        return values.at[index].set(part, unique_indices=True, mode="promise_in_bounds")

    def indices(self, start: jax.Array | int, rows: int) -> jax.Array:
        """The original row numbers of the chunk at ``start`` (``order`` given)."""
        assert self.order is not None
        return jax.lax.dynamic_slice_in_dim(self.order, start, rows)
