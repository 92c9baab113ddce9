"""Varying mesh axes inside ``shard_map``: read them, and make values agree on them.

Inside ``jax.shard_map`` (with its default ``check_vma=True``) every value's type records the
mesh axes over which it differs between shards. Operands that meet in one custom VJP, loop carry
or ``pallas_call`` must vary over the same axes, and a cotangent must vary exactly like its
primal. Outside ``shard_map`` nothing varies and these helpers return their arguments unchanged.
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(value: Any) -> frozenset[str]:
    """Mesh axes over which ``value`` differs between shards (empty outside ``shard_map``)."""
    aval = jax.typeof(value)
    manual = getattr(aval, "mat", None)  # jax >= 0.12 names it the manual axis type
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def varying_axes_of(*values: Any) -> frozenset[str]:
    """Mesh axes over which any of ``values`` (arrays or pytrees of them; ``None`` is skipped) varies."""
    return frozenset[str]().union(*(varying_axes(leaf) for leaf in jax.tree.leaves(values)))


def vary(value: jax.Array, axes: frozenset[str]) -> jax.Array:
    """``value`` marked as varying over ``axes`` too (a no-op for axes it already varies over)."""
    missing = tuple(sorted(axes - varying_axes(value)))
    return jax.lax.pcast(value, missing, to="varying") if missing else value


def vary_like[Tree](tree: Tree, *refs: Any) -> Tree:
    """``tree``'s arrays made to vary over every axis that any array in ``refs`` varies over.

    For values made inside a shard (zeros of a loop carry, a cotangent) that must meet values
    derived from the sharded inputs.
    """
    axes = varying_axes_of(*refs)
    if not axes:
        return tree
    return jax.tree.map(lambda value: vary(value, axes), tree)


def align_varying(*values: Any) -> tuple[Any, ...]:
    """Every value (an array, a pytree of arrays or ``None``) made to vary over the union of all.

    The cotangent of this cast is a ``psum`` over the added axes, which is what sums the shards'
    partial gradients of a replicated operand (``w`` under data parallelism, ``x`` under vocab
    parallelism) when the caller differentiates through it.
    """
    return tuple(vary_like(value, *values) for value in values)


def psum_to(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """``grad`` summed over the axes it varies over but ``primal`` does not: a cotangent for ``primal``."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad
