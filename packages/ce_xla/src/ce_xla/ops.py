"""The ``xla`` backend's differentiable row statistics: a custom VJP over the chunked loops.

Residuals are ``x``, ``w``, the labels and the ``[N]`` statistics (O(N) beyond the inputs); the
backward pass recomputes the logits chunk by chunk (8NHV in all). The same role as
``ce_pallas_tpu.ops``, around the Pallas kernels.
"""

from __future__ import annotations

import functools

import jax

from ce_core import RowStats, StatsSpec
from ce_xla import backward, forward, head
from ce_xla.tiling import ChunkPlan


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def row_stats(x: jax.Array, w: jax.Array, labels: jax.Array, row_scale: jax.Array | None, spec: StatsSpec,
              plan: ChunkPlan) -> RowStats:
    """Row statistics of ``s cap(x . w)``; ``row_scale`` (``None`` unless asked) is not differentiated."""
    with head.precision_scope(spec.precision):
        return forward.row_stats(x, w, labels, spec, plan, row_scale)


def _row_stats_fwd(x, w, labels, row_scale, spec, plan):
    with head.precision_scope(spec.precision):
        stats = forward.row_stats(x, w, labels, spec, plan, row_scale)
    return stats, (x, w, labels, row_scale, stats)


def _row_stats_bwd(spec, plan, residuals, cotangent):
    x, w, labels, row_scale, stats = residuals
    with head.precision_scope(spec.precision):
        dx, dw = backward.row_stats_grads(x, w, labels, stats, cotangent, spec, plan, row_scale)
    return dx, dw, None, None


row_stats.defvjp(_row_stats_fwd, _row_stats_bwd)
