"""The ``xla`` backend's differentiable row statistics: a custom VJP over the chunked loops.

Residuals are ``x``, ``w``, the labels and the ``[N]`` statistics (O(N) beyond the inputs); the
backward pass recomputes the logits chunk by chunk (8NHV in all). The same role as
``ce_pallas_tpu.ops``, around the Pallas kernels.
"""

from __future__ import annotations

import functools

import jax

from ce_core import RowStats, StatsSpec
from ce_xla import backward, forward
from ce_xla.tiling import ChunkPlan


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def row_stats(x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, plan: ChunkPlan) -> RowStats:
    return forward.row_stats(x, w, labels, spec, plan)


def _row_stats_fwd(x, w, labels, spec, plan):
    stats = forward.row_stats(x, w, labels, spec, plan)
    return stats, (x, w, labels, stats)


def _row_stats_bwd(spec, plan, residuals, cotangent):
    x, w, labels, stats = residuals
    dx, dw = backward.row_stats_grads(x, w, labels, stats, cotangent, spec, plan)
    return dx, dw, None


row_stats.defvjp(_row_stats_fwd, _row_stats_bwd)
