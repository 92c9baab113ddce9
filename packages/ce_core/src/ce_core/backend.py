"""The backend contract: row statistics of the logits ``z = cap(x @ w)`` and their VJP.

A backend never sees the loss. For each token row ``z_i`` it computes

    lse_i    = logsumexp_j z_ij
    label_i  = z_{i, y_i}          (0 when y_i is outside [0, V): a label owned by another vocab shard)
    sum_i    = sum_j z_ij          (only when ``StatsSpec.with_sum``)

and differentiates them: for cotangents ``(g_lse, g_label, g_sum)`` the logit cotangent is
``delta_ij = g_lse_i * softmax_ij + g_label_i * [j == y_i] + g_sum_i``, times ``cap'(z)`` when the
logits are capped; ``dx = delta @ w.T`` and ``dw = x.T @ delta``. Every loss feature is built from
these statistics in :mod:`ce_core.loss`, once, for every backend.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ce_core.block_sizes import BlockSizes
from ce_core.varying import vary_like

#: Bumped whenever the contract below changes incompatibly. A backend declares the version it was
#: written against; the registry refuses a backend whose version differs.
CONTRACT_VERSION = 1


class RowStats(NamedTuple):
    """Per-token statistics of the logit rows, each float32 of shape ``[N]``."""

    lse: jax.Array
    label: jax.Array
    sum: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class StatsSpec:
    """Static options of a row-statistics computation (hashable, so usable as a jit static)."""

    logit_soft_cap: float | None = None
    with_sum: bool = False
    block_sizes: BlockSizes | None = None
    #: MXU precision of the products, as jax names it: ``None`` (the backend's default),
    #: ``"default"`` (bf16 operands, float32 accumulation), ``"high"`` or ``"highest"``.
    precision: str | None = None


#: How a call is run over devices, as :attr:`Problem.placement` tells a backend:
#: ``"local"``: one device, or one shard inside the caller's own ``shard_map``;
#: ``"shard_map"``: ce_core splits the call with ``jax.shard_map`` (explicit sharding, or the
#: ``sharded_linear_cross_entropy`` wrapper), so the backend runs on each device's shard;
#: ``"partitioned"``: automatic sharding (GSPMD/Shardy); the backend runs on each device's shard
#: inside ``jax.experimental.custom_partitioning``, whose lowering cannot hold ordered effects.
PLACEMENTS = ("local", "shard_map", "partitioned")


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a backend is asked to do, for :meth:`Backend.check` (shapes and dtypes only).

    ``n`` and ``v`` are what one device computes when that is known at trace time (the shard
    sizes under ``"shard_map"``), else the global sizes.
    """

    n: int
    h: int
    v: int
    x_dtype: jnp.dtype
    w_dtype: jnp.dtype
    spec: StatsSpec
    placement: str = "local"


#: ``cotangent_fn(stats_chunk, token_params_chunk) -> RowStats`` of cotangents. It is elementwise
#: over tokens, so a backend may call it on any chunk of rows, slicing ``token_params`` (a pytree of
#: ``[N]`` arrays) the same way as ``x`` and ``labels``.
CotangentFn = Callable[[RowStats, Any], RowStats]


class Backend(abc.ABC):
    """Base class of every backend.

    Subclasses set ``name``, declare the ``contract_version`` they were written against (the value
    of :data:`CONTRACT_VERSION` then, spelled out, not imported, so that a later ce_core can tell an
    old backend apart) and implement :meth:`row_stats`.
    """

    name: str = ""
    contract_version: int | None = None

    def is_available(self) -> bool:
        """Whether this backend can run on the current platform at all."""
        return True

    def check(self, problem: Problem) -> None:
        """Raise :class:`~ce_core.UnsupportedError` (with the reason) if this call cannot run."""

    def block_sizes_for(self, problem: Problem) -> object | None:
        """The tile or chunk sizes this backend would use for ``problem``, for reports; ``None`` if it has none."""
        return None

    @abc.abstractmethod
    def row_stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec) -> RowStats:
        """Row statistics of ``cap(x @ w)``, differentiable with respect to ``x`` and ``w``.

        ``x`` is ``[N, H]`` with ``N >= 1`` (ce_core answers empty batches itself), ``w`` is ``[H, V]``,
        ``labels`` is int32 ``[N]``.
        """

    def row_stats_vjp(
        self,
        x: jax.Array,
        w: jax.Array,
        labels: jax.Array,
        lse: jax.Array,
        cotangent: RowStats,
        spec: StatsSpec,
    ) -> tuple[jax.Array, jax.Array]:
        """``dx, dw`` for cotangents of the statistics, given each row's ``lse``.

        ``lse`` may be the logsumexp over a larger vocabulary than this ``w`` holds (``w`` is then
        one vocab shard), so the softmax term is ``cotangent.lse * exp(z - lse)``: the shard's
        share of the global softmax. A backend whose backward pass starts from the lse overrides
        this to skip recomputing the statistics; this default differentiates :meth:`row_stats`,
        rescaling the lse cotangent from the given lse to this ``w``'s own.
        """
        local, vjp = jax.vjp(lambda x_, w_: self.row_stats(x_, w_, labels, spec), x, w)
        return vjp(vary_like(localize_cotangent(cotangent, local.lse, lse), local))

    def row_stats_and_grads(
        self,
        x: jax.Array,
        w: jax.Array,
        labels: jax.Array,
        spec: StatsSpec,
        cotangent_fn: CotangentFn,
        token_params: Any,
    ) -> tuple[RowStats, jax.Array, jax.Array]:
        """Statistics plus ``dx, dw`` for cotangents that ``cotangent_fn`` derives from them.

        Used when the loss is reduced to a scalar: every per-token cotangent is then known at
        forward time, so a backend can form dx and dw in the same pass over each token chunk
        (three matmul passes instead of four). This default differentiates :meth:`row_stats`.
        """
        stats, vjp = jax.vjp(lambda x_, w_: self.row_stats(x_, w_, labels, spec), x, w)
        dx, dw = vjp(cotangent_fn(stats, token_params))
        return stats, dx, dw


def localize_cotangent(cotangent: RowStats, local_lse: jax.Array, lse: jax.Array) -> RowStats:
    """The cotangent of statistics over a vocab slice, from that of statistics over the whole vocab.

    ``lse = log sum_k exp(local_lse_k)`` over the slices, so ``d lse / d local_lse_k`` is
    ``exp(local_lse_k - lse)``; the label logit and logit sum are plain sums over the slices, so
    their cotangents pass through. With one slice (``local_lse == lse``) this is the identity.
    """
    return cotangent._replace(lse=cotangent.lse * jnp.exp(local_lse - lse))
