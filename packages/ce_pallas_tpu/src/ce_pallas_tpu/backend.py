"""The ``pallas_tpu`` backend: availability, what it can serve, and its row statistics."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

from ce_core import Backend, CotangentFn, Problem, RowStats, StatsSpec, TileReport, UnsupportedError
from ce_core.extend import PairSpec, PairStats
from ce_pallas_tpu import kept_logits, ops, pair, target
from ce_pallas_tpu.common import PLAIN_INTERPRETER_UNDER_SHARD_MAP

#: Input dtypes the kernels take (the MXU has no float16 path on v4/v5).
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


class PallasTpuBackend(Backend):
    """Streaming forward and core-grid backward Pallas TPU kernels (interpretable on CPU).

    ``keep_logits_budget_bytes`` is the most extra HBM the default (``keep_logits=None``) lets a scalar
    loss's gradient spend on kept logits and a float32 ``dw`` (``None``: ``min(4 GiB, HBM / 8)`` of the
    chip compiled for; 0 always recomputes); see :mod:`ce_pallas_tpu.kept_logits`.
    """

    name = "pallas_tpu"
    contract_version = 5
    #: First on TPU.
    default_priority = MappingProxyType({"tpu": 20})
    #: Pallas cannot batch the kernels; under ``vmap`` ce_core folds the batch into the tokens instead.
    batchable = False

    def __init__(self, keep_logits_budget_bytes: int | None = None) -> None:
        value = keep_logits_budget_bytes
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"keep_logits_budget_bytes must be an int >= 0 or None, got {value!r}")
        self.keep_logits_budget_bytes = keep_logits_budget_bytes

    def is_available(self) -> bool:
        """A TPU default device, ``CE_PALLAS_TPU_INTERPRET=1`` or ``CE_PALLAS_TPU_TARGET`` (read now)."""
        return target.is_available()

    def check(self, problem: Problem) -> None:
        for name, dtype in (("x", problem.x_dtype), ("w", problem.w_dtype)):
            if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
                raise UnsupportedError(
                    f"pallas_tpu: {name} has dtype {jnp.dtype(dtype).name}; the kernels take bfloat16 "
                    "or float32 (TPU MXUs have no float16 path on v4/v5)"
                )
        try:
            current = target.current_target()
        except RuntimeError as error:
            raise UnsupportedError(f"pallas_tpu: {error}") from None
        if problem.placement == "shard_map" and current.interpret == "plain":
            raise UnsupportedError(PLAIN_INTERPRETER_UNDER_SHARD_MAP)
        # Resolving the plan validates explicit block sizes (ValueError) and raises
        # UnsupportedError when no tiles fit this generation's VMEM.
        if problem.n > 0:
            ops.make_plan(problem.n, problem.h, problem.v, problem.x_dtype, problem.w_dtype, problem.spec,
                          current)
        if problem.n > 0 and problem.spec.keep_logits:  # UnsupportedError where no kept chunk fits VMEM
            kept_logits.plan_chunks(problem.n, problem.h, problem.v, problem.x_dtype, problem.w_dtype,
                                    problem.spec, current)

    def block_sizes_for(self, problem: Problem) -> TileReport:
        """The forward and backward tiles and grids for ``problem`` on the current target, and their source;
        ``details["keep_logits"]`` says how a scalar loss's gradient runs (kept chunks or the recompute)."""
        report = ops.make_plan(problem.n, problem.h, problem.v, problem.x_dtype, problem.w_dtype,
                               problem.spec).report()
        kept = self.kept_plan(problem.n, problem.h, problem.v, problem.x_dtype, problem.w_dtype, problem.spec)
        said = "recompute"
        if kept is not None:
            pieces = f" (backward in pieces of {', '.join(map(str, kept.pieces))} rows)" if kept.pieces else ""
            said = f"{kept.chunk}-token chunks{pieces}, {kept.extra_bytes} bytes extra"
        return dataclasses.replace(report, details={**report.details, "keep_logits": said})

    def kept_plan(self, n: int, h: int, v: int, x_dtype: Any, w_dtype: Any,
                  spec: StatsSpec) -> kept_logits.KeptPlan | None:
        """The kept-logits plan a scalar loss's gradient takes on the current target, or ``None`` where
        it recomputes: ``spec.keep_logits`` forces either; ``None`` is :func:`kept_logits.choose`'s call
        within this backend's budget."""
        if spec.keep_logits is False or n == 0:
            return None
        if spec.keep_logits:
            return kept_logits.plan_chunks(n, h, v, x_dtype, w_dtype, spec)
        return kept_logits.choose(n, h, v, x_dtype, w_dtype, spec, budget_bytes=self.keep_logits_budget_bytes)

    # ``live`` (contract version 4): both kernels walk only the token blocks that hold a live row
    # (:class:`ce_pallas_tpu.common.LiveBlocks`); a dead block does no DMA and no matmul.
    def row_stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, *,
                  row_scale: jax.Array | None = None, live: jax.Array | None = None) -> RowStats:
        return ops.row_stats(x, w, labels, spec, row_scale=row_scale, live=live)

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
        return ops.row_stats_vjp(x, w, labels, stats, cotangent, spec, row_scale=row_scale, live=live)

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
        """Where :meth:`kept_plan` gives a plan, the logits kept between the passes
        (:mod:`ce_pallas_tpu.kept_logits`, 6NHV); otherwise the forward kernel, then the backward kernel
        recomputing them (8NHV)."""
        v = ops.vocab_size(w, spec)
        plan = self.kept_plan(x.shape[0], x.shape[1], v, x.dtype, w.dtype, spec)
        if plan is not None:
            return kept_logits.row_stats_and_grads(x, w, labels, spec, cotangent_fn, token_params,
                                                   row_scale=row_scale, live=live, plan=plan)
        return super().row_stats_and_grads(x, w, labels, spec, cotangent_fn, token_params, row_scale=row_scale,
                                           live=live)

    # Pairs of heads (contract version 5): both heads' tiles in one grid step (:mod:`ce_pallas_tpu.pair`); the
    # gradient recomputes both (``2N(Hs + Ht)V + 4N Hs V`` after the statistics' ``2N(Hs + Ht)V``).
    def pair_row_stats(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                       spec: PairSpec, *, row_scale: jax.Array, lse: tuple[jax.Array, jax.Array] | None = None,
                       live: jax.Array | None = None) -> PairStats:
        return pair.pair_row_stats(x, w, teacher_x, teacher_w, spec, row_scale=row_scale, lse=lse, live=live)

    def pair_row_stats_vjp(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                           stats: PairStats, g: jax.Array, spec: PairSpec, *, row_scale: jax.Array,
                           live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        return pair.pair_grads(x, w, teacher_x, teacher_w, stats, g, spec, row_scale=row_scale, live=live)


def make_backend() -> PallasTpuBackend:
    """Entry-point factory (group ``ce_core.backends``, name ``pallas_tpu``)."""
    return PallasTpuBackend()
