"""Loop plumbing shared by the forward and gradient passes: chunk offsets and loops.

A dimension of ``size`` is covered by ``ceil(size / chunk)`` chunks of exactly ``chunk`` elements;
the last one starts at ``size - chunk`` instead of being padded, so it may overlap the one before.
Its elements below ``index * chunk`` were already handled and must be masked where counting them
twice would be wrong (sums and accumulated gradients; per-row results are simply rewritten).
"""

from __future__ import annotations

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


def loop[Carry](count: int, body: Callable[[Any, Carry], Carry], carry: Carry) -> Carry:
    """``fori_loop(0, count, body, carry)``, or a plain call with index 0 when there is one chunk."""
    if count == 1:
        return body(0, carry)
    return jax.lax.fori_loop(0, count, body, carry)
