"""The ``xla`` backend: chunked statistics with a custom VJP, and the fused 6NHV path.

``row_stats`` is a ``jax.custom_vjp`` whose residuals are ``x``, ``w``, the labels and the ``[N]``
statistics (O(N) beyond the inputs); its backward pass recomputes the logits chunk by chunk (8NHV in all).
``row_stats_and_grads``, used by ``ce_core`` when the loss is reduced to a scalar, forms ``dx`` and
``dw`` in the same pass as the statistics (6NHV) when the plan's gradient order is tokens outer.
Every entry point takes its gradient order from the plan (:mod:`ce_xla.tiling`), so none holds a
float32 ``[H, V]`` accumulator for a bf16 ``w`` beyond the keep-logits budget. Contract version 4: a ``[V, H]`` head
(:mod:`ce_xla.head`), ``max``/``argmax``, a per-token ``row_scale``, and the ``live`` rows: every token loop
runs over the live rows only (gathered to the front, :class:`ce_xla.loops.TokenRows`), on every path.
Version 5: a pair of heads (a dense distillation teacher), token chunks of whole rows (:mod:`ce_xla.pair`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ce_core import Backend, BlockSizes, CotangentFn, PassTiles, Problem, RowStats, StatsSpec, TileReport
from ce_core.extend import PairSpec, PairStats
from ce_xla import backward, fused, head, ops, pair, target
from ce_xla.target import target_platform
from ce_xla.tiling import GRADIENT_ORDERS, ChunkPlan, GradientOrder, check_block_sizes, plan_chunks, resolve_order


class XlaBackend(Backend):
    """Streams over token chunks (and vocab chunks) with ``lax.fori_loop``; runs wherever XLA runs.

    ``budget_bytes`` bounds one float32 logits chunk and ``grad_budget_bytes`` one tokens-outer
    ``dw`` update (``None``: the platform's default). ``keep_logits_budget_bytes`` is the most extra
    memory the tokens-outer (keep-logits, 6NHV) path may hold beyond vocab outer (``None``:
    ``min(4 GiB, device memory / 8)``, resolved per platform when a call is traced; 0 keeps every
    bf16 ``w`` with ``V > N`` vocab outer). ``gradient_order`` forces a gradient loop order on every
    call (``None``: ``StatsSpec.keep_logits``, else the rule); see :mod:`ce_xla.tiling`.
    """

    name = "xla"
    contract_version = 5
    #: The default wherever XLA runs, after a platform's own kernels.
    default_priority = MappingProxyType({"*": 10})

    def __init__(
        self,
        budget_bytes: int | None = None,
        grad_budget_bytes: int | None = None,
        gradient_order: GradientOrder | None = None,
        keep_logits_budget_bytes: int | None = None,
    ) -> None:
        for name, value in (("budget_bytes", budget_bytes), ("grad_budget_bytes", grad_budget_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        value = keep_logits_budget_bytes
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"keep_logits_budget_bytes must be an int >= 0 or None, got {value!r}")
        if gradient_order is not None and gradient_order not in GRADIENT_ORDERS:
            raise ValueError(f"gradient_order must be None or one of {GRADIENT_ORDERS}, got {gradient_order!r}")
        self.budget_bytes = budget_bytes
        self.grad_budget_bytes = grad_budget_bytes
        self.gradient_order: GradientOrder | None = gradient_order
        self.keep_logits_budget_bytes = keep_logits_budget_bytes

    def check(self, problem: Problem) -> None:
        """Explicit block sizes this backend cannot use, and a ``keep_logits`` that contradicts the backend's
        ``gradient_order``, are a ``ValueError`` naming them."""
        check_block_sizes(problem.spec.block_sizes, problem.h)
        resolve_order(self.gradient_order, problem.spec.keep_logits)

    def keep_logits_budget(self, platform: str | None = None) -> int:
        """The keep-logits budget on ``platform`` (``None``: the one being compiled for): the backend's
        ``keep_logits_budget_bytes``, else ``min(4 GiB, device memory / 8)`` (:mod:`ce_xla.target`)."""
        if self.keep_logits_budget_bytes is not None:
            return self.keep_logits_budget_bytes
        return target.device_keep_logits_budget(platform or target_platform())

    def plan(self, n: int, h: int, v: int, spec: StatsSpec, x_dtype: Any = np.float32,
             w_dtype: Any = np.float32, live_rows: bool = True) -> ChunkPlan:
        """The chunk plan used for ``x: [n, h]`` of ``x_dtype``, ``w: [h, v]`` of ``w_dtype``; ``live_rows``: when
        ce_core marks the live rows (every call but ``return_lse``), so chunks of dead rows can be skipped."""
        platform = target_platform()
        return plan_chunks(n, h, v, spec.block_sizes, x_dtype=x_dtype, w_dtype=w_dtype, order=self.gradient_order,
                           budget_bytes=self.budget_bytes, grad_budget_bytes=self.grad_budget_bytes,
                           platform=platform, keep_logits=spec.keep_logits,
                           keep_logits_budget_bytes=self.keep_logits_budget(platform), live_rows=live_rows)

    def block_sizes_for(self, problem: Problem) -> TileReport:
        """The chunk plan for ``problem`` on the platform being compiled for, as a call with live rows (every
        call but ``return_lse``) runs it: its statistics and gradient tiles, and the gradient order
        (``details["gradient_order"]``)."""
        plan = self.plan(problem.n, problem.h, problem.v, problem.spec, problem.x_dtype, problem.w_dtype)
        explicit = problem.spec.block_sizes is not None and any(
            size is not None for size in (problem.spec.block_sizes.b_block_size, problem.spec.block_sizes.v_block_size))
        return TileReport(
            passes=(
                PassTiles("statistics", BlockSizes(plan.token_chunk, None, plan.vocab_chunk),
                          (plan.token_chunks, plan.vocab_chunks)),
                PassTiles("gradients", BlockSizes(plan.grad_token_chunk, None, plan.grad_chunk),
                          (plan.grad_token_chunks, plan.grad_chunks)),
            ),
            source=("explicit, rest by the rule" if explicit else "rule") + f" for {target_platform()}",
            details={"gradient_order": plan.gradient_order},
        )

    def _plan_for(self, x: jax.Array, w: jax.Array, spec: StatsSpec, live: jax.Array | None) -> ChunkPlan:
        h, v = head.dims(w, spec.w_layout)
        return self.plan(x.shape[0], h, v, spec, x.dtype, w.dtype, live_rows=live is not None)

    def row_stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, *,
                  row_scale: jax.Array | None = None, live: jax.Array | None = None) -> RowStats:
        plan = self._plan_for(x, w, spec, live)
        return ops.row_stats(x, w, labels, _scale(spec, row_scale), _live(live), spec, plan)

    def row_stats_vjp(
        self,
        x: jax.Array,
        w: jax.Array,
        labels: jax.Array,
        stats: RowStats,
        cotangent: RowStats,
        spec: StatsSpec,
        *,
        row_scale: jax.Array | None = None,
        live: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        plan = self._plan_for(x, w, spec, live)
        with head.precision_scope(spec.precision):
            return backward.row_stats_grads(x, w, labels, stats, cotangent, spec, plan, _scale(spec, row_scale),
                                            ops.token_rows(x, _live(live), plan))

    def row_stats_and_grads(
        self,
        x: jax.Array,
        w: jax.Array,
        labels: jax.Array,
        spec: StatsSpec,
        cotangent_fn: CotangentFn,
        token_params: Any,
        *,
        row_scale: jax.Array | None = None,
        live: jax.Array | None = None,
    ) -> tuple[RowStats, jax.Array, jax.Array]:
        plan = self._plan_for(x, w, spec, live)
        with head.precision_scope(spec.precision):
            return fused.row_stats_and_grads(x, w, labels, spec, plan, cotangent_fn, token_params,
                                             _scale(spec, row_scale), ops.token_rows(x, _live(live), plan))

    def _pair_rows(self, x: jax.Array, w: jax.Array, spec: PairSpec) -> int:
        vocab = head.dims(w, spec.w_layout)[1]
        return pair.chunk_rows(x.shape[0], vocab, self.budget_bytes or pair.TILE_BYTES)

    def pair_row_stats(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                       spec: PairSpec, *, row_scale: jax.Array, lse: tuple[jax.Array, jax.Array] | None = None,
                       live: jax.Array | None = None) -> PairStats:
        with head.precision_scope(spec.precision):
            return pair.pair_row_stats(x, w, teacher_x, teacher_w, spec, row_scale, lse,
                                       self._pair_rows(x, w, spec), _live(live))

    def pair_row_stats_vjp(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                           stats: PairStats, g: jax.Array, spec: PairSpec, *, row_scale: jax.Array,
                           live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        _, dx, dw = pair.pair_grads(x, w, teacher_x, teacher_w, spec, row_scale, g, self._pair_rows(x, w, spec),
                                    stats, sliced_dw=target_platform() == "cpu", live=_live(live))
        return dx, dw

    def pair_row_stats_and_grads(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                                 spec: PairSpec, g: jax.Array, *, row_scale: jax.Array,
                                 live: jax.Array | None = None) -> tuple[PairStats, jax.Array, jax.Array]:
        return pair.pair_grads(x, w, teacher_x, teacher_w, spec, row_scale, g, self._pair_rows(x, w, spec),
                               sliced_dw=target_platform() == "cpu", live=_live(live))

    def __repr__(self) -> str:
        return (f"XlaBackend(budget_bytes={self.budget_bytes}, grad_budget_bytes={self.grad_budget_bytes}, "
                f"gradient_order={self.gradient_order!r}, keep_logits_budget_bytes={self.keep_logits_budget_bytes})")

def _scale(spec: StatsSpec, row_scale: jax.Array | None) -> jax.Array | None:
    """The float32 ``[N]`` row scale when ``spec`` asks for one (required then), else ``None``."""
    if not spec.with_row_scale:
        return None
    if row_scale is None:
        raise ValueError("xla backend: StatsSpec.with_row_scale needs the row_scale argument")
    return jax.lax.stop_gradient(jnp.asarray(row_scale, jnp.float32))


def _live(live: jax.Array | None) -> jax.Array | None:
    """The bool ``[N]`` live-row mask (never differentiated), or ``None``: every row."""
    return None if live is None else jax.lax.stop_gradient(jnp.asarray(live, bool))


def make_backend() -> XlaBackend:
    """Entry-point factory (group ``ce_core.backends``, name ``xla``)."""
    return XlaBackend()
