"""A ``vmap`` rule for per-shard functions, from the kinds of their arrays.

A backend whose kernels Pallas cannot batch (``Backend.batchable = False``) gets this rule, on every
placement. It knows what the arrays mean (:class:`ce_core.sharded.shard_ops.ShardFn` declares each one's kind):

- outputs all per token, ``w`` not mapped: the mapped axis is one more token dimension (arrays keep
  their leading token dimensions), so the op runs once on the folded batch;
- a ``dw`` output, or a mapped ``w``: every example has its own, so the examples run one after another
  (``lax.map``), each a whole call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

if TYPE_CHECKING:
    from ce_core.sharded.shard_ops import ShardFn

Op = Callable[..., tuple[jax.Array, ...]]


def batched_by_kinds(fn: ShardFn, op: Op) -> Op:
    """``op`` (computing ``fn`` on arrays with any number of leading token dimensions) with the ``vmap`` rule above."""
    batched_op = custom_vmap(op)

    @batched_op.def_vmap
    def rule(axis_size: int, in_batched: list[bool], *args: jax.Array):
        outputs_batched = (True,) * len(fn.out_kinds)
        if "w" not in fn.out_kinds and not in_batched[fn.in_kinds.index("w")]:
            leading = [a if b or k == "w" else jnp.broadcast_to(a, (axis_size, *a.shape))
                       for a, b, k in zip(args, in_batched, fn.in_kinds, strict=True)]
            return batched_op(*leading), outputs_batched
        mapped = [a for a, b in zip(args, in_batched, strict=True) if b]

        def one(example: list[jax.Array]) -> tuple[jax.Array, ...]:
            values = iter(example)
            return batched_op(*(next(values) if b else a for a, b in zip(args, in_batched, strict=True)))

        return jax.lax.map(one, mapped), outputs_batched

    return batched_op
