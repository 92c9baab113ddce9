"""The ``pallas_tpu`` backend: availability, what it can serve, and its row statistics."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

from ce_core import Backend, CotangentFn, Problem, RowStats, StatsSpec, TileReport, UnsupportedError
from ce_pallas_tpu import kept_logits, ops, target
from ce_pallas_tpu.common import PLAIN_INTERPRETER_UNDER_SHARD_MAP

#: Input dtypes the kernels take (the MXU has no float16 path on v4/v5).
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


class PallasTpuBackend(Backend):
    """Streaming forward and core-grid backward Pallas TPU kernels (interpretable on CPU)."""

    name = "pallas_tpu"
    contract_version = 3
    #: First on TPU.
    default_priority = MappingProxyType({"tpu": 20})
    #: Pallas cannot batch the kernels; under ``vmap`` ce_core folds the batch into the tokens instead.
    batchable = False

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

    def block_sizes_for(self, problem: Problem) -> TileReport:
        """The forward and backward tiles and grids for ``problem`` on the current target, and their source."""
        return ops.make_plan(problem.n, problem.h, problem.v, problem.x_dtype, problem.w_dtype, problem.spec).report()

    def row_stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, *,
                  row_scale: jax.Array | None = None) -> RowStats:
        return ops.row_stats(x, w, labels, spec, row_scale=row_scale)

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
    ) -> tuple[jax.Array, jax.Array]:
        return ops.row_stats_vjp(x, w, labels, stats, cotangent, spec, row_scale=row_scale)

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
    ) -> tuple[RowStats, jax.Array, jax.Array]:
        """With ``spec.keep_logits`` the logits kept between the passes (:mod:`ce_pallas_tpu.kept_logits`,
        6NHV); otherwise (``None`` included, until the schedule shows where keeping pays) the forward
        kernel, then the backward kernel recomputing them (8NHV)."""
        if spec.keep_logits:
            return kept_logits.row_stats_and_grads(x, w, labels, spec, cotangent_fn, token_params,
                                                   row_scale=row_scale)
        return super().row_stats_and_grads(x, w, labels, spec, cotangent_fn, token_params, row_scale=row_scale)


def make_backend() -> PallasTpuBackend:
    """Entry-point factory (group ``ce_core.backends``, name ``pallas_tpu``)."""
    return PallasTpuBackend()
