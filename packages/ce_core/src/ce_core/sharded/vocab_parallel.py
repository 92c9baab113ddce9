"""Row statistics over a vocabulary split across devices (``w`` sharded on V).

Each shard computes the statistics of its slice of the logits, with labels shifted by the shard's
first vocab id (a label owned by another shard contributes 0 locally). The global statistics are a
stable logsumexp of the shards' lse values and plain sums of the rest; the max is the largest
shard max, and the argmax the lowest *global* index among the shards that reach it (as ``jnp.argmax``
over the whole row). The vocab axes may be
several mesh axes; shards are then numbered row-major over them, as JAX lays out a dimension
sharded over a tuple of axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ce_core.contract.backend import RowStats


def vocab_shards(axes: tuple[str, ...]) -> int:
    """Number of vocab shards: the product of the sizes of ``axes`` (1 for none).

    A ``ValueError`` when an axis is not bound here (called outside a ``shard_map`` over it).
    """
    try:
        return math.prod(int(jax.lax.axis_size(axis)) for axis in axes)
    except NameError as error:
        raise ValueError(
            f"vocab_axis_name={', '.join(map(repr, axes))} is not a mesh axis bound here; call "
            f"linear_cross_entropy inside a shard_map over a mesh with that axis ({error})"
        ) from None


def vocab_offset(axes: tuple[str, ...], local_vocab: int) -> jax.Array | int:
    """Global vocab id of this shard's first column (0 without vocab axes)."""
    if not axes:
        return 0
    return jax.lax.axis_index(axes) * local_vocab


def combine_vocab_shards(local: RowStats, axes: tuple[str, ...], local_vocab: int = 0) -> RowStats:
    """Global row statistics from every vocab shard's local ones (``local`` itself without axes).

    ``local_vocab``: each shard's vocab size, which places a local argmax in the global vocabulary.
    """
    if not axes:
        return local
    # The max only stabilises the exponentials; its value cancels, so it carries no gradient.
    peak = jax.lax.pmax(jax.lax.stop_gradient(local.lse), axes)
    lse = peak + jnp.log(jax.lax.psum(jnp.exp(local.lse - peak), axes))
    label = jax.lax.psum(local.label, axes)
    total = None if local.sum is None else jax.lax.psum(local.sum, axes)
    # Each shard's expected logit is under its own softmax; the row's weighs them by each shard's
    # share of the probability mass, exp(lse_k - lse).
    expected = None
    if local.expected is not None:
        expected = jax.lax.psum(jnp.exp(local.lse - lse) * local.expected, axes)
    top = index = None
    if local.max is not None and local.argmax is not None:
        top = jax.lax.pmax(local.max, axes)
        mine = local.argmax.astype(jnp.int32) + vocab_offset(axes, local_vocab)
        never = jnp.iinfo(jnp.int32).max
        index = jax.lax.pmin(jnp.where(local.max == top, mine, never), axes)
    return RowStats(lse, label, total, expected, top, index)
