"""The ``xla`` backend's differentiable row statistics: a custom VJP over the chunked loops.

Residuals are ``x``, ``w``, the labels, the ``[N]`` statistics and the live rows (O(N) beyond the
inputs); the backward pass recomputes the logits chunk by chunk (8NHV in all). The same role as
``ce_pallas_tpu.ops``, around the Pallas kernels.
"""

from __future__ import annotations

import functools

import jax

from ce_core import RowStats, StatsSpec
from ce_core.extend import inert_dead_rows
from ce_xla import backward, forward, head
from ce_xla.loops import TokenRows
from ce_xla.tiling import ChunkPlan


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def row_stats(x: jax.Array, w: jax.Array, labels: jax.Array, row_scale: jax.Array | None, live: jax.Array | None,
              spec: StatsSpec, plan: ChunkPlan) -> RowStats:
    """Row statistics of ``s cap(x . w)``; ``row_scale`` (``None`` unless asked) is not differentiated, and
    neither is ``live`` (``None``, or the rows that count: the others are skipped where a chunk holds none)."""
    with head.precision_scope(spec.precision):
        return forward.row_stats(x, w, labels, spec, plan, row_scale, token_rows(x, live, plan))


def _row_stats_fwd(x, w, labels, row_scale, live, spec, plan):
    rows = token_rows(x, live, plan)
    with head.precision_scope(spec.precision):
        stats = forward.row_stats(x, w, labels, spec, plan, row_scale, rows)
    return stats, (x, w, labels, row_scale, rows, stats)


def _row_stats_bwd(spec, plan, residuals, cotangent):
    x, w, labels, row_scale, rows, stats = residuals
    stats, cotangent = inert_dead_rows(stats, cotangent, rows.mask)
    with head.precision_scope(spec.precision):
        dx, dw = backward.row_stats_grads(x, w, labels, stats, cotangent, spec, plan, row_scale, rows)
    return dx, dw, None, None, None


row_stats.defvjp(_row_stats_fwd, _row_stats_bwd)


def token_rows(x: jax.Array, live: jax.Array | None, plan: ChunkPlan) -> TokenRows:
    """The rows the passes of ``plan`` visit: every row, or the ``live`` ones first (:class:`TokenRows`)."""
    return TokenRows.of(x.shape[0], live, max(plan.token_chunk, plan.grad_token_chunk))
