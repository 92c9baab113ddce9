"""The backend contract: row statistics of the logits ``z_ij = s_i * cap(x_i . w_j)`` and their VJP.

``w_j`` is vocab entry ``j`` of the head: column ``j`` of ``w [H, V]`` (``StatsSpec.w_layout == "hv"``,
the default) or row ``j`` of ``w [V, H]`` (``"vh"``: a head tied to the input embedding, or stored
the torch way). ``s_i`` is a positive per-token scale, 1 unless ``StatsSpec.with_row_scale`` (then
the ``row_scale`` argument, float32 ``[N]``: ce_core passes ``1 / T_i`` for per-token temperatures
under a soft cap, which cannot be folded into ``x``). A backend never sees the loss. For each token
row ``z_i`` it computes

    lse_i      = logsumexp_j z_ij
    label_i    = z_{i, y_i}          (0 when y_i is outside [0, V): a label owned by another vocab shard)
    sum_i      = sum_j z_ij          (only when ``StatsSpec.with_sum``)
    expected_i = sum_j p_ij z_ij     (only when ``StatsSpec.with_expected``; p = softmax(z_i))
    max_i      = max_j z_ij          (only when ``StatsSpec.with_argmax``)
    argmax_i   = min {j : z_ij == max_i}   (int32, the lowest index of the maximum, as ``jnp.argmax``)

and differentiates them: for cotangents ``(g_lse, g_label, g_sum, g_expected)`` the logit cotangent is
``delta_ij = g_lse_i p_ij + g_label_i [j == y_i] + g_sum_i + g_expected_i p_ij (1 + z_ij - expected_i)``,
times ``s_i cap'(x_i . w_j)``; ``dx = delta @ w.T`` and ``dw = x.T @ delta`` (for ``"hv"``; ``delta.T @ x``,
``[V, H]``, for ``"vh"``: ``dw`` always has the layout of ``w``). ``max`` and ``argmax`` are not
differentiated (their cotangents are ``None``). Every loss feature (and the entropy,
``lse - expected``) is built from these statistics in ce_core, once, for every backend.

**Dead rows** (contract version 4). Ignored tokens (prompts, padding) count for nothing, so ce_core
passes a backend written against version 4 a ``live`` mask (bool ``[N]``) where the outputs at
the other rows are not needed. A backend may then skip dead rows entirely or compute them like any
other; either way their statistics are not read (ce_core sets them to 0), their ``dx`` rows must be 0
and they must add nothing to ``dw``. Their cotangents are 0, and :meth:`Backend.row_stats_vjp` gets
them with ``lse = +inf`` and every other statistic 0 (:func:`inert_dead_rows`), so a dead row that a
backend computes anyway has ``p = 0`` and ``delta = 0`` exactly, whatever its logits.
``live=None``: every row counts. ce_core never passes ``live`` to an older backend.

**Pairs of heads** (contract version 5, :mod:`ce_core.contract.pair`): a distillation loss against a dense
teacher streams the student's and the teacher's logits together (:meth:`Backend.pair_row_stats`,
:meth:`Backend.pair_row_stats_vjp`, :meth:`Backend.pair_row_stats_and_grads`).

Contract versions: 1 had ``lse``, ``label`` and ``sum``; 2 adds ``expected`` and
:meth:`Backend.row_stats_vjp`; 3 adds ``StatsSpec.w_layout``, ``max``/``argmax`` and ``row_scale``;
4 adds ``live``; 5 adds the pair statistics. An older backend still runs every call that needs nothing its
version lacks.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from ce_core.contract.block_sizes import BlockSizes
from ce_core.contract.errors import UnsupportedError
from ce_core.contract.pair import PAIR_VERSION, PairSpec, PairStats
from ce_core.contract.tile_report import TileReport
from ce_core.contract.varying import vary_like

#: Bumped whenever the contract below changes. A backend declares the version it was written
#: against; the registry accepts the versions in :data:`SUPPORTED_CONTRACT_VERSIONS` and refuses a
#: backend for a call that needs something its version lacks (so a fallback chain moves on).
CONTRACT_VERSION = 5
SUPPORTED_CONTRACT_VERSIONS = (1, 2, 3, 4, 5)

#: The first contract version whose backends take the ``live`` mask of dead rows.
LIVE_ROWS_VERSION = 4

#: The layouts of the head ``w``: ``"hv"`` is ``[H, V]``, ``"vh"`` is ``[V, H]`` (vocab entries as rows).
W_LAYOUTS = ("hv", "vh")


class RowStats(NamedTuple):
    """Per-token statistics of the logit rows, each of shape ``[N]``: float32, ``argmax`` int32."""

    lse: jax.Array
    label: jax.Array
    sum: jax.Array | None = None
    expected: jax.Array | None = None
    max: jax.Array | None = None
    argmax: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class StatsSpec:
    """Static options of a row-statistics computation (hashable, so usable as a jit static).

    ``with_sum``, ``with_expected`` and ``with_argmax`` ask for the optional statistics (the last
    for both ``max`` and ``argmax``); a backend must return them exactly when asked (``None``
    otherwise), so a plain loss pays for none of them.
    """

    logit_soft_cap: float | None = None
    with_sum: bool = False
    block_sizes: BlockSizes | None = None
    with_expected: bool = False
    #: MXU precision of the products, as jax names it: ``None`` (the backend's default),
    #: ``"default"`` (bf16 operands, float32 accumulation), ``"high"`` or ``"highest"``.
    precision: str | None = None
    #: The layout of ``w``, one of :data:`W_LAYOUTS` (contract version 3 for ``"vh"``).
    w_layout: str = "hv"
    with_argmax: bool = False
    #: The logits carry a per-token scale ``s_i`` (the ``row_scale`` argument; contract version 3).
    with_row_scale: bool = False
    #: How :meth:`Backend.row_stats_and_grads` forms the gradient: ``True`` keeps each token chunk's
    #: logits for it (no recompute), ``False`` recomputes them, ``None`` lets the backend's plan choose
    #: (a hint: a backend without a no-recompute path ignores it).
    keep_logits: bool | None = None

    @property
    def n_stats(self) -> int:
        """How many statistics a row has under this spec (lse and label, plus the optional ones)."""
        return 2 + self.with_sum + self.with_expected + 2 * self.with_argmax

    @property
    def needs_version(self) -> int:
        """The lowest contract version that has every statistic and input this spec asks for."""
        if self.w_layout != "hv" or self.with_argmax or self.with_row_scale:
            return 3
        return 2 if self.with_expected else 1


#: How a call is run over devices, as :attr:`Problem.placement` tells a backend:
#: ``"local"``: one device, or one shard inside the caller's own ``shard_map``;
#: ``"shard_map"``: ce_core splits the call with ``jax.shard_map`` (explicit or automatic sharding,
#: or the ``sharded_linear_cross_entropy`` wrapper), so the backend runs on each device's shard.
PLACEMENTS = ("local", "shard_map")


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
    #: A pair of heads (contract version 5): the student's options are ``spec``'s, the pair's are these.
    pair: PairSpec | None = None


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
    #: Platforms (``jax.default_backend()`` names, or ``"*"`` for any) on which this backend joins the
    #: default chain of ``implementation=None``, with its priority there: higher is tried first.
    default_priority: ClassVar[Mapping[str, int]] = MappingProxyType({})
    #: Whether ``jax.vmap`` can batch this backend's functions itself. ``False`` (kernels Pallas cannot
    #: batch): ce_core runs a mapped call with the batch folded into the tokens, or example by example
    #: where each needs its own ``dw`` (:mod:`ce_core.sharded.batching`).
    batchable: ClassVar[bool] = True

    def is_available(self) -> bool:
        """Whether this backend can run on the current platform at all."""
        return True

    def check(self, problem: Problem) -> None:
        """Raise :class:`~ce_core.UnsupportedError` (with the reason) if this call cannot run."""
        del problem  # the base class accepts every problem

    def block_sizes_for(self, problem: Problem) -> TileReport | None:
        """The tiles this backend would use for ``problem``, for reports; ``None`` if it has none."""
        del problem  # the base class has no tiles
        return None

    @property
    def takes_live_rows(self) -> bool:
        """Whether ce_core passes this backend the ``live`` mask (contract version 4 and later)."""
        return (self.contract_version or 0) >= LIVE_ROWS_VERSION

    @abc.abstractmethod
    def row_stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, *,
                  row_scale: jax.Array | None = None, live: jax.Array | None = None) -> RowStats:
        """Row statistics of ``cap(x @ w)``, differentiable with respect to ``x`` and ``w``.

        ``x`` is ``[N, H]`` with ``N >= 1`` (ce_core answers empty batches itself), ``w`` is ``[H, V]``
        or ``[V, H]`` as ``spec.w_layout`` says, ``labels`` is int32 ``[N]``; ``row_scale`` is float32
        ``[N]`` when ``spec.with_row_scale`` (never differentiated), else ``None``; ``live`` (version 4)
        is ``None`` or the bool ``[N]`` mask of the rows whose outputs are needed (see "Dead rows").
        """

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
        """``dx, dw`` for cotangents of the statistics, given the statistics of the whole rows.

        ``stats`` may cover a larger vocabulary than this ``w`` holds (``w`` is then one vocab shard):
        its ``lse`` (and ``expected``) are over the whole row, so ``p = exp(z - stats.lse)`` is the
        shard's part of the global softmax and the formula in the module docstring gives the shard's
        part of ``delta`` as it stands. A backend whose backward pass starts from these statistics
        overrides this to skip recomputing them; this default differentiates :meth:`row_stats`,
        converting the cotangent to one of this ``w``'s own statistics (:func:`localize_cotangent`).
        """
        def local_stats(x_: jax.Array, w_: jax.Array) -> RowStats:
            return _undifferentiated(self._stats(x_, w_, labels, spec, row_scale, live))

        local, vjp = jax.vjp(local_stats, x, w)
        return vjp(vary_like(localize_cotangent(cotangent, local, stats), local))

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
        """Statistics plus ``dx, dw`` for cotangents that ``cotangent_fn`` derives from them.

        Used when the loss is reduced to a scalar: every per-token cotangent is then known at
        forward time, so a backend can form dx and dw in the same pass over each token chunk
        (three matmul passes instead of four). This default differentiates :meth:`row_stats`.

        ``cotangent_fn`` may run collectives over the caller's mesh axes (under a vocab-parallel
        placement it combines the shards' statistics first): call it on every shard alike, once per
        token chunk, with the chunk's statistics and ``token_params``'s rows of it.
        """
        def differentiable(x_: jax.Array, w_: jax.Array):
            return _split_undifferentiated(self._stats(x_, w_, labels, spec, row_scale, live))

        stats, vjp, extra = jax.vjp(differentiable, x, w, has_aux=True)
        dx, dw = vjp(cotangent_fn(stats, token_params))
        return stats._replace(max=extra[0], argmax=extra[1]), dx, dw

    def pair_row_stats(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                       spec: PairSpec, *, row_scale: jax.Array, lse: tuple[jax.Array, jax.Array] | None = None,
                       live: jax.Array | None = None) -> PairStats:
        """:class:`PairStats` of the student ``s * cap_s(x @ w)`` and the teacher ``s * cap_t(teacher_x @ teacher_w)``.

        ``x [N, Hs]``, ``teacher_x [N, Ht]``, both heads over the same ``V`` columns in their own layouts,
        ``row_scale`` float32 ``[N]``; ``lse``: the whole rows' ``(lse, teacher_lse)`` when the heads are one vocab
        shard (the sums are then the shard's part). ``live`` (bool ``[N]`` or None): the rows whose outputs are
        needed, as in "Dead rows": ce_core hands the others in as zero rows with ``g = 0`` (so computing them is
        harmless) and never reads their statistics; a backend may skip them, leaving their ``dx`` rows 0. Not
        differentiated: ce_core calls :meth:`pair_row_stats_vjp`. Backends before version 5 are refused for these
        calls; this default says so.
        """
        del x, w, teacher_x, teacher_w, spec, row_scale, lse, live
        raise UnsupportedError(f"backend {self.name!r} implements contract version {self.contract_version}, "
                               f"which lacks the pair statistics of a dense distillation teacher "
                               f"(version {PAIR_VERSION})")

    def pair_row_stats_vjp(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                           stats: PairStats, g: jax.Array, spec: PairSpec, *, row_scale: jax.Array,
                           live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The student's ``dx, dw`` for a cotangent ``g`` (float32 ``[N]``) of ``stats.divergence``, given the whole
        rows' statistics (the teacher takes no gradient); ``live`` as for :meth:`pair_row_stats`."""
        del x, w, teacher_x, teacher_w, stats, g, spec, row_scale, live
        raise UnsupportedError(f"backend {self.name!r} lacks pair statistics (contract version {PAIR_VERSION})")

    def pair_row_stats_and_grads(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                                 spec: PairSpec, g: jax.Array, *, row_scale: jax.Array,
                                 live: jax.Array | None = None) -> tuple[PairStats, jax.Array, jax.Array]:
        """Statistics and the ``dx, dw`` of ``sum(g * divergence)``, ``g`` known in advance (a scalar loss): a
        backend holding each token chunk's whole rows forms the gradient in the same pass. This default runs
        :meth:`pair_row_stats` then :meth:`pair_row_stats_vjp` (the logits recomputed)."""
        stats = self.pair_row_stats(x, w, teacher_x, teacher_w, spec, row_scale=row_scale, live=live)
        dx, dw = self.pair_row_stats_vjp(x, w, teacher_x, teacher_w, stats, g, spec, row_scale=row_scale, live=live)
        return stats, dx, dw

    def _stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec,
               row_scale: jax.Array | None, live: jax.Array | None = None) -> RowStats:
        """:meth:`row_stats`, passing ``row_scale`` and ``live`` only when given (older backends do not take them)."""
        keywords: dict[str, jax.Array | None] = {}
        if spec.with_row_scale:
            keywords["row_scale"] = row_scale
        if live is not None:
            keywords["live"] = live
        return self.row_stats(x, w, labels, spec, **keywords)


def _undifferentiated(stats: RowStats) -> RowStats:
    """The differentiable statistics (``max`` and ``argmax`` dropped)."""
    return stats._replace(max=None, argmax=None)


def _split_undifferentiated(stats: RowStats) -> tuple[RowStats, tuple[jax.Array | None, jax.Array | None]]:
    """The differentiable statistics, and ``(max, argmax)`` apart (an auxiliary output of a VJP)."""
    return _undifferentiated(stats), (stats.max, stats.argmax)


def inert_dead_rows(stats: RowStats, cotangent: RowStats, live: jax.Array | None) -> tuple[RowStats, RowStats]:
    """``stats`` and ``cotangent`` with every dead row (``live`` false) made inert for a gradient pass:
    ``lse = +inf`` (so ``p = 0``), the other statistics and every cotangent 0, so ``delta = 0`` there exactly."""
    if live is None:
        return stats, cotangent

    def zeroed(value: jax.Array) -> jax.Array:
        return jnp.where(live, value, jnp.zeros((), value.dtype))

    stats = jax.tree.map(zeroed, stats)._replace(lse=jnp.where(live, stats.lse, jnp.inf))
    return stats, jax.tree.map(zeroed, cotangent)


def localize_cotangent(cotangent: RowStats, local: RowStats, whole: RowStats) -> RowStats:
    """The cotangent of a vocab slice's statistics, from that of the whole rows' statistics.

    Over slices k, ``lse = log sum_k exp(lse_k)`` and ``expected = sum_k a_k expected_k`` with
    ``a_k = exp(lse_k - lse)``, so ``d lse / d lse_k = a_k``, ``d expected / d expected_k = a_k`` and
    ``d expected / d lse_k = a_k (expected_k - expected)``; the label logit and the logit sum are plain
    sums over the slices, so their cotangents pass through. With one slice this is the identity.
    """
    share = jnp.exp(local.lse - whole.lse)
    g_lse = cotangent.lse
    g_expected = None
    if cotangent.expected is not None:
        if local.expected is None or whole.expected is None:
            raise ValueError("a cotangent of the expected logit needs the expected logit of the slice and the rows")
        g_lse = g_lse + cotangent.expected * (local.expected - whole.expected)
        g_expected = share * cotangent.expected
    return cotangent._replace(lse=share * g_lse, expected=g_expected)
