"""Tokens flattened to one dimension and padded to a multiple of the token shards.

A layout that splits every token over a mesh's axes (the Auto-axes default, the sharded wrapper)
cannot split ``x``'s leading dimensions as they come: ``[B, S]`` need not divide over the shards.
Flattened to ``N = B * S`` tokens and padded with ignored ones (zero rows of ``x``, label
``ignore_index``, weight 0), they always do. Padded tokens count for nothing: no loss, no weight in
the mean, no gradient (their rows of ``x`` are zero and their cotangents are zero). Per-token
outputs are cut back to ``N`` and reshaped to the labels' shape.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class FlatTokens:
    """How the tokens of one call are flattened and padded (``shape``: the labels' shape)."""

    shape: tuple[int, ...]
    padded: int

    @classmethod
    def over(cls, shape: tuple[int, ...], shards: int) -> FlatTokens:
        """``shape``'s tokens padded to a multiple of ``shards``."""
        n = math.prod(shape)
        return cls(tuple(shape), -(-n // shards) * shards)

    @property
    def n(self) -> int:
        return math.prod(self.shape)

    def rows(self, x: jax.Array) -> jax.Array:
        """``x`` as ``[padded, H]``, padding rows zero."""
        return _pad(x.reshape(self.n, x.shape[-1]), self.padded, 0)

    def tokens(self, values: jax.Array, fill: float | int) -> jax.Array:
        """A per-token array as ``[padded]``, padded with ``fill``."""
        return _pad(values.reshape(self.n), self.padded, fill)

    def restore(self, values: jax.Array) -> jax.Array:
        """A ``[padded]`` per-token result back in the labels' shape."""
        return values[: self.n].reshape(self.shape)


def _pad(values: jax.Array, length: int, fill: float | int) -> jax.Array:
    missing = length - values.shape[0]
    if missing == 0:
        return values
    padding = jnp.full((missing, *values.shape[1:]), fill, values.dtype)
    return jnp.concatenate([values, padding])
